//! The `ember` and `xtask` binaries look for shared libraries in `lib/` beside themselves
//! first (an ELF `DT_RPATH` of `$ORIGIN/lib`; `--disable-new-dtags` so that it also serves the
//! libraries those libraries need, as HDF5's libcurl): a binary copied to a machine without
//! HDF5 or OpenBLAS runs with those libraries in a `lib/` folder beside it
//! (`scripts/gpu-check.sh build` packs one), without `LD_LIBRARY_PATH`. Where no such folder
//! exists the entry costs nothing.

fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-arg-bins=-Wl,--disable-new-dtags,-rpath,$ORIGIN/lib");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
