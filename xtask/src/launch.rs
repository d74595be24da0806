//! `cargo xtask launch` and the training of a rank started by a launcher.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_trainer::parallel::LaunchEnv;
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

/// Trains as the rank `launch` describes on GPU `local_rank`, with NCCL collectives on the
/// gradient buckets in GPU memory. NCCL's unique id travels from rank 0 over TCP at
/// `MASTER_ADDR:MASTER_PORT` (torchrun; srun with both exported), or by MPI under mpirun
/// (with the `mpi` feature). The communicator's rank and world size must equal the launcher's.
#[cfg(feature = "cuda")]
pub fn train_launched_cuda(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    use ember_trainer::parallel::{Collective, Communicator};
    // Before MPI and the rendezvous: it may start this process again.
    let gpu = crate::cuda::start(launch, true)?;
    let timeout = std::time::Duration::from_secs_f64(config.parallel.timeout_s);
    // MPI, when it carried the id, stays initialised until the run ends.
    let (nccl, _mpi) = join_nccl(launch, gpu, timeout)?;
    if (nccl.rank(), nccl.world_size()) != (launch.rank, launch.world_size) {
        bail!(
            "the {} says rank {} of {}, but the NCCL communicator is rank {} of {}",
            launch.source,
            launch.rank,
            launch.world_size,
            nccl.rank(),
            nccl.world_size()
        );
    }
    let device = burn::backend::cuda::CudaDevice::new(gpu);
    // Burn's CUDA backend with its host synchronisations and kernel launches counted (both
    // reported in the metrics).
    let options = RunOptions {
        host_sync_counter: Some(|| ember_backend_ext::HostSyncs::now().total()),
        launch_counter: Some(|| ember_backend_ext::HostSyncs::now().launches),
        ..options
    };
    Ok(ember_trainer::train_rank::<
        burn::backend::Autodiff<ember_backend_ext::CountingCuda>,
    >(
        config,
        &device,
        options,
        Communicator::Device(Box::new(nccl)),
        None,
    )?)
}

/// NCCL's communicator for the rank `launch` describes on CUDA device `gpu`, with what must
/// outlive it (MPI).
#[cfg(feature = "cuda")]
fn join_nccl(
    launch: &LaunchEnv,
    gpu: usize,
    timeout: std::time::Duration,
) -> Result<(
    ember_trainer::parallel::nccl::Nccl,
    Option<Box<dyn std::any::Any>>,
)> {
    use ember_trainer::parallel::nccl::{Nccl, new_unique_id};
    use ember_trainer::parallel::{LaunchSource, exchange_unique_id, rendezvous_name};
    let tcp = launch.master_addr.is_some() && launch.master_port.is_some();
    let use_mpi = cfg!(feature = "mpi") && (launch.source == LaunchSource::OpenMpi || !tcp);
    if use_mpi {
        #[cfg(feature = "mpi")]
        {
            use ember_trainer::parallel::Collective;
            let mut mpi = ember_trainer::parallel::mpi::Mpi::init(timeout)?;
            if (mpi.rank(), mpi.world_size()) != (launch.rank, launch.world_size) {
                bail!(
                    "the {} says rank {} of {}, but MPI says rank {} of {}: start with mpirun \
                     or srun, or set MASTER_ADDR and MASTER_PORT for the TCP rendezvous",
                    launch.source,
                    launch.rank,
                    launch.world_size,
                    mpi.rank(),
                    mpi.world_size()
                );
            }
            let nccl = Nccl::bootstrap(&mut mpi, gpu, timeout)?;
            return Ok((nccl, Some(Box::new(mpi))));
        }
    }
    tracing::info!(
        "rank {} of {}: NCCL's unique id through {}",
        launch.rank,
        launch.world_size,
        rendezvous_name(launch)
    );
    let id = exchange_unique_id(launch, timeout, || {
        new_unique_id().map_err(|e| e.to_string())
    })?;
    let nccl = Nccl::new(gpu, launch.rank, launch.world_size, &id, timeout)?;
    Ok((nccl, None))
}

/// Trains as the rank `launch` describes, through MPI.
#[cfg(feature = "mpi")]
pub fn train_launched(
    config: &TrainConfig,
    device: &burn::backend::ndarray::NdArrayDevice,
    options: RunOptions,
    launch: &LaunchEnv,
) -> Result<TrainSummary> {
    use ember_trainer::parallel::{Collective, Communicator};
    // Ranks of this machine share its cores (mpirun: OMPI_COMM_WORLD_LOCAL_SIZE; srun).
    ember_trainer::blas::share_cores(
        launch.local_world_size.unwrap_or(1),
        config.model.gemm_threads,
    );
    let comm = ember_trainer::parallel::mpi::Mpi::init(std::time::Duration::from_secs_f64(
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
    >(
        config,
        device,
        options,
        Communicator::Host(Box::new(comm)),
        None,
    )?)
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
