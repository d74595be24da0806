//! The entry points of a run in this process: one rank ([`train`]) or `world_size` ranks as
//! threads ([`train_in_process`]), each a [`train_rank`] over local collectives.

use std::sync::Arc;
use std::time::Duration;

use ember_backend_ext::FusedOps;

use super::{PreparedData, RunOptions, TrainSummary, prepare_data, train_rank};
use crate::parallel::{CommError, Communicator, GradHookBackend, InProcess, SingleRank};
use crate::{TrainConfig, TrainError};

/// The communicator of in-process ranks (or of a one-rank job) for backend `B`: with device
/// collectives on the CubeCL backends, whose tensors live in device memory, or when
/// `parallel.buckets = "device"` asks for them; host collectives on NdArray, whose device is
/// the host (Note [Bucket storage]).
fn local_communicator<
    B: GradHookBackend,
    C: crate::parallel::DeviceCollective<B::InnerBackend> + 'static,
>(
    config: &TrainConfig,
    comm: C,
) -> Communicator<B::InnerBackend> {
    use crate::parallel::BucketStorage;
    let device = match config.parallel.buckets {
        BucketStorage::Auto => <B::InnerBackend as FusedOps>::HAS_KERNELS,
        BucketStorage::Host => false,
        BucketStorage::Device => true,
    };
    if device {
        Communicator::Device(Box::new(comm))
    } else {
        Communicator::Host(Box::new(comm))
    }
}

/// Pre-trains BERT as `config` says, on `device`, as a single process, and writes
/// `metrics.jsonl`, `model.safetensors`, `config.json` (Hugging Face) and `train_config.toml`
/// to `train.out`.
///
/// # Errors
/// Every bad input is reported before the first step: [`TrainError::InvalidSetting`],
/// [`TrainError::SeqLenTooLong`], [`TrainError::Output`] (folder not writable),
/// [`TrainError::Data`] (corpus, vocabulary, batch larger than the data). During the run:
/// [`TrainError::Diverged`] on a non-finite loss (checked when the step is logged),
/// [`TrainError::Output`] if a write fails.
pub fn train<B: GradHookBackend>(
    config: &TrainConfig,
    device: &B::Device,
    options: RunOptions,
) -> Result<TrainSummary, TrainError> {
    crate::blas::share_cores(1, config.model.gemm_threads);
    let comm = local_communicator::<B, _>(config, SingleRank);
    train_rank::<B>(config, device, options, comm, None)
}

/// Trains with `world_size` data-parallel ranks as threads of this process (each with its
/// own model replica on `device`, meeting through [`InProcess`] collectives), and returns
/// rank 0's summary. The result equals one rank with `world_size` times the batch.
///
/// # Errors
/// As [`train`]. When a rank fails, the others stop with [`TrainError::Comm`] naming it; the
/// error returned is the first rank's own failure, not the others' reaction to it.
pub fn train_in_process<B: GradHookBackend>(
    config: &TrainConfig,
    world_size: usize,
    device: &B::Device,
    options: RunOptions,
) -> Result<TrainSummary, TrainError> {
    train_in_process_with_data::<B>(config, world_size, device, options, None)
}

/// [`train_in_process`] on data prepared by the caller (`None`: prepared here), so that
/// several runs can share one [`prepare_data`].
///
/// # Errors
/// As [`train_in_process`].
pub fn train_in_process_with_data<B: GradHookBackend>(
    config: &TrainConfig,
    world_size: usize,
    device: &B::Device,
    options: RunOptions,
    data: Option<Arc<PreparedData>>,
) -> Result<TrainSummary, TrainError> {
    if world_size == 0 {
        return Err(TrainError::InvalidSetting {
            field: "nproc",
            reason: "must be at least 1".into(),
        });
    }
    config.validate()?;
    config.check_paths()?;
    let data = match data {
        Some(data) => data,
        None => Arc::new(prepare_data(config)?),
    };
    crate::blas::share_cores(world_size, config.model.gemm_threads);
    let timeout = Duration::from_secs_f64(config.parallel.timeout_s);
    let results: Vec<Result<TrainSummary, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = InProcess::group(world_size, timeout)
            .into_iter()
            .map(|comm| {
                let data = data.clone();
                let comm = local_communicator::<B, _>(config, comm);
                scope.spawn(move || train_rank::<B>(config, device, options, comm, Some(data)))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Comm(CommError::Backend {
                        backend: "in-process",
                        message: format!("rank {rank} panicked"),
                    }))
                })
            })
            .collect()
    });
    let mut errors = Vec::new();
    let mut summary = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(s) if rank == 0 => summary = Some(s),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    // A rank's own failure first; the others' communication errors are its echo.
    if let Some(i) = errors
        .iter()
        .position(|e| !matches!(e, TrainError::Comm(_)))
    {
        return Err(errors.swap_remove(i));
    }
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(summary.expect("rank 0 returned a summary")),
    }
}
