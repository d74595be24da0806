//! `cargo xtask launch` and the training of a rank started by a launcher.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_trainer::dist::LaunchEnv;
use ember_trainer::{RunOptions, TrainConfig, TrainSummary};

/// Flags of `launch`.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes (ranks) to start
    #[arg(long)]
    nproc: usize,
    /// OpenMPI hostfile for multi-node runs; without it all ranks run on this machine,
    /// oversubscribing its cores if need be
    #[arg(long)]
    hostfile: Option<PathBuf>,
    /// The command each rank runs, after `--` (e.g. `-- train --steps 100`)
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> Result<()> {
    if !cfg!(feature = "mpi") {
        bail!(
            "launch needs the `mpi` feature: `cargo run --release -p xtask --features mpi -- \
             launch ...` (Debian packages: libopenmpi-dev openmpi-bin libclang-dev)"
        );
    }
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut mpirun = Command::new("mpirun");
    mpirun.arg("-np").arg(args.nproc.to_string());
    match &args.hostfile {
        Some(hostfile) => {
            mpirun.arg("--hostfile").arg(hostfile);
        }
        None => {
            mpirun.arg("--oversubscribe");
        }
    }
    // OpenMPI refuses to start as root (containers, CI) without these.
    mpirun
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    mpirun.arg(&exe).args(&args.command);
    let status = mpirun
        .status()
        .context("starting mpirun (Debian package openmpi-bin)")?;
    if !status.success() {
        bail!("mpirun exited with {status}");
    }
    Ok(())
}

/// Trains as the rank `launch` describes on GPU `local_rank`, with NCCL collectives whose
/// unique id travels by MPI.
#[cfg(all(feature = "mpi", feature = "cuda"))]
pub fn train_launched_cuda(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    use ember_trainer::dist::nccl::Nccl;
    let timeout = std::time::Duration::from_secs_f64(config.parallel.timeout_s);
    // MPI stays initialised until the run ends (dropping it finalises MPI).
    let mut mpi = ember_trainer::dist::mpi::Mpi::init(timeout)?;
    let nccl = Nccl::bootstrap(&mut mpi, launch.local_rank, timeout)?;
    let device = burn::backend::cuda::CudaDevice::new(launch.local_rank);
    let summary = ember_trainer::train_rank::<burn::backend::Autodiff<burn::backend::Cuda>>(
        config,
        &device,
        options,
        Box::new(nccl),
        None,
    )?;
    drop(mpi);
    Ok(summary)
}

/// Without MPI there is no way yet to pass NCCL's unique id.
#[cfg(all(not(feature = "mpi"), feature = "cuda"))]
pub fn train_launched_cuda(
    _config: &TrainConfig,
    _options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    bail!(
        "rank {} of {}: multi-GPU runs pass NCCL's unique id through MPI; build with \
         `--features cuda,mpi` and start with mpirun or srun",
        launch.rank,
        launch.world_size
    )
}

/// Trains as the rank `launch` describes, through MPI.
#[cfg(feature = "mpi")]
pub fn train_launched(
    config: &TrainConfig,
    device: &burn::backend::ndarray::NdArrayDevice,
    options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    use ember_trainer::dist::Collective;
    let comm = ember_trainer::dist::mpi::Mpi::init(std::time::Duration::from_secs_f64(
        config.parallel.timeout_s,
    ))?;
    if (comm.rank(), comm.world_size()) != (launch.rank, launch.world_size) {
        bail!(
            "the {} says rank {} of {}, but MPI says rank {} of {}: start ember with mpirun \
             or srun (torchrun-style launches need the NCCL path)",
            launch.source,
            launch.rank,
            launch.world_size,
            comm.rank(),
            comm.world_size()
        );
    }
    Ok(ember_trainer::train_rank::<
        burn::backend::Autodiff<burn::backend::NdArray>,
    >(config, device, options, Box::new(comm), None)?)
}

/// Without MPI support, a launched rank cannot reach the others.
#[cfg(not(feature = "mpi"))]
pub fn train_launched(
    _config: &TrainConfig,
    _device: &burn::backend::ndarray::NdArrayDevice,
    _options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    bail!(
        "this process is rank {} of {} (from the {}), but ember was built without the `mpi` \
         feature: build with `--features mpi` (Debian packages: libopenmpi-dev libclang-dev)",
        launch.rank,
        launch.world_size,
        launch.source
    )
}
