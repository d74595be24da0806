//! `cargo xtask comm-check`: the host collectives of a launched job (MPI), timed, and the
//! timeout that ends a job whose rank stalls; with `--rendezvous`, the exchange that joins GPU
//! ranks started without MPI (torchrun, srun), with no GPU needed.

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
    /// Instead of the MPI collectives: hand a 128-byte blob from rank 0 to every rank as a GPU
    /// job hands over NCCL's unique id (torchrun's agent store, else ember's server on
    /// MASTER_ADDR:MASTER_PORT), without MPI or a GPU; every rank prints the blob's digest
    /// (`torchrun --nproc-per-node 2 --no-python ember comm-check --rendezvous`)
    #[arg(long)]
    rendezvous: bool,
}

/// `--rendezvous`: rank 0's random blob reaches every rank; each prints what it holds.
fn rendezvous(args: &CommCheckArgs) -> Result<()> {
    use std::hash::{BuildHasher, Hasher};
    use std::time::Duration;

    use ember_trainer::parallel::{LaunchEnv, exchange_unique_id, rendezvous_name};
    let launch = LaunchEnv::from_env(None)?;
    if let Some(note) = &launch.note {
        tracing::warn!("{note}");
    }
    let started = std::time::Instant::now();
    let blob = exchange_unique_id(&launch, Duration::from_secs_f64(args.timeout), || {
        // 128 bytes no other run repeats (std's randomly keyed hasher).
        let mut blob = Vec::with_capacity(128);
        while blob.len() < 128 {
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_usize(blob.len());
            blob.extend_from_slice(&hasher.finish().to_le_bytes());
        }
        Ok(blob)
    })?;
    let digest: String = blob
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
        .to_le_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!(
        "rank {} of {}: {} bytes from rank 0 through {} in {:.3} s, digest {digest}",
        launch.rank,
        launch.world_size,
        blob.len(),
        rendezvous_name(&launch),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn run(args: CommCheckArgs) -> Result<()> {
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!(
            "--timeout {} must be a positive number of seconds",
            args.timeout
        );
    }
    if args.rendezvous {
        return rendezvous(&args);
    }
    collectives(args)
}

#[cfg(feature = "mpi")]
fn collectives(args: CommCheckArgs) -> Result<()> {
    use std::time::{Duration, Instant};

    use ember_trainer::parallel::{Collective, ReduceOp};
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
fn collectives(_args: CommCheckArgs) -> Result<()> {
    bail!(
        "comm-check needs the `mpi` feature: `cargo run --release -p xtask --features mpi -- \
         launch --nproc 2 -- comm-check` (Debian packages: libopenmpi-dev openmpi-bin \
         libclang-dev)"
    )
}
