//! `cargo xtask comm-check`: the host collectives of a launched job (MPI), timed, and the
//! timeout that ends a job whose rank stalls.

use anyhow::{Result, bail};
use clap::Args;

/// Flags of `comm-check`.
#[derive(Args, Debug)]
pub struct CommCheckArgs {
    /// Seconds a collective waits for the other ranks before the job is aborted (as
    /// parallel.timeout_s)
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// MiB of f32 in the timed allreduce
    #[arg(long, default_value_t = 25.0)]
    mb: f64,
    /// Rounds of each collective
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Hold this rank back before its first allgather (with --stall-s): the other ranks must
    /// end the job with a timeout error naming the allgather
    #[arg(long)]
    stall_rank: Option<usize>,
    /// Seconds --stall-rank is held back
    #[arg(long, default_value_t = 0.0)]
    stall_s: f64,
}

#[cfg(feature = "mpi")]
pub fn run(args: CommCheckArgs) -> Result<()> {
    use std::time::{Duration, Instant};

    use ember_trainer::parallel::{Collective, ReduceOp};
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!(
            "--timeout {} must be a positive number of seconds",
            args.timeout
        );
    }
    let mut comm = ember_trainer::parallel::mpi::Mpi::init(Duration::from_secs_f64(args.timeout))?;
    let (rank, world) = (comm.rank(), comm.world_size());
    if args.stall_rank == Some(rank) {
        eprintln!(
            "rank {rank}: held back {:.1} s before the allgather",
            args.stall_s
        );
        std::thread::sleep(Duration::from_secs_f64(args.stall_s));
    }
    let n = ((args.mb * 1024.0 * 1024.0 / 4.0) as usize).max(1);
    let mut data = vec![rank as f32; n];
    let mut rows = Vec::new();
    for op in ["allgather", "barrier", "allreduce"] {
        let mut best = f64::INFINITY;
        for _ in 0..args.rounds.max(1) {
            let started = Instant::now();
            match op {
                "allgather" => {
                    let names = comm.allgather(format!("rank {rank}").as_bytes())?;
                    if names.len() != world {
                        bail!("allgather returned {} parts for {world} ranks", names.len());
                    }
                }
                "barrier" => comm.barrier()?,
                _ => {
                    data.fill(rank as f32);
                    comm.allreduce(&mut data, ReduceOp::Sum)?;
                    let expected = (world * (world - 1) / 2) as f32;
                    if data[0] != expected || data[n - 1] != expected {
                        bail!("allreduce gave {} where {expected} was due", data[0]);
                    }
                }
            }
            best = best.min(started.elapsed().as_secs_f64());
        }
        rows.push((op, best));
    }
    if rank == 0 {
        println!(
            "| collective ({world} ranks, MPI) | best of {} ms |",
            args.rounds
        );
        println!("|---|---:|");
        for (op, best) in rows {
            let what = if op == "allreduce" {
                format!("allreduce {:.1} MiB", args.mb)
            } else {
                op.to_string()
            };
            println!("| {what} | {:.3} |", best * 1e3);
        }
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
pub fn run(_args: CommCheckArgs) -> Result<()> {
    bail!(
        "comm-check needs the `mpi` feature: `cargo run --release -p xtask --features mpi -- \
         launch --nproc 2 -- comm-check` (Debian packages: libopenmpi-dev openmpi-bin \
         libclang-dev)"
    )
}
