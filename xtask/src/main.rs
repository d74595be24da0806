//! `cargo xtask`: see the library's docs.

fn main() -> std::process::ExitCode {
    xtask::cli_main()
}
