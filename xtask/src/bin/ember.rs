//! `ember`: the same command line as `cargo xtask`, as a binary to hand to `mpirun` or `srun`
//! (`mpirun -np 4 target/release/ember train ...`).

fn main() -> std::process::ExitCode {
    xtask::cli_main()
}
