//! Data-parallel training, in the order a step uses it: the ranks' communicators
//! ([`collective`], [`in_process`], [`link`], [`mpi`], [`nccl`]) owned by a communication thread
//! ([`comm_thread`]); the bucket plan ([`plan`]); gradient hooks that hand over each layer's
//! gradients during backward ([`hooks`]); buckets on the device or the host ([`buckets`]),
//! clipped ([`clip`]) and allreduced by the reducer ([`reducer`], in f32 or [`bf16`]); the
//! check that the ranks still hold one model ([`consistency`]); and how a process finds its
//! rank and its peers ([`launch`], [`rendezvous`]). See docs/ARCHITECTURE.md, Trainer.

pub mod bf16;
pub mod buckets;
pub mod clip;
pub mod collective;
pub mod comm_thread;
pub mod consistency;
pub mod hooks;
pub mod in_process;
pub mod launch;
pub mod link;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod plan;
pub mod recheck;
pub mod reducer;
pub mod rendezvous;
pub mod tied;

pub use bf16::{AllreduceDtype, allreduce_bf16, allreduce_bytes};
pub use buckets::{BucketStorage, Buffer, Scalar};
pub use clip::{ClipMode, bucket_clip_cap, clip_coefficient, clip_coefficient_device};
pub use collective::{Collective, CommError, DeviceCollective, ReduceOp, SingleRank};
pub use comm_thread::{CommThread, Communicator};
pub use consistency::{check_parameters_agree, parameter_digests};
pub use hooks::{
    GradCallback, GradHookBackend, GradHooks, HookGradients, ReadyOrder, hook_group, ready_order,
};
pub use in_process::InProcess;
pub use launch::{LaunchEnv, LaunchError, LaunchSource, cuda_device_index};
pub use link::{Delayed, LinkModel};
pub use plan::{
    Bucket, BucketPlan, PlannedParam, TiedEmbedding, TiedSplit, bucket_plan, first_difference,
};
pub use recheck::DeliveryCheck;
pub use reducer::{ReducedStep, Reducer, StepTimings};
pub use rendezvous::{RendezvousError, exchange_unique_id, rendezvous_name};
pub use tied::{DECODER_WEIGHT, WORD_EMBEDDINGS};

use burn::tensor::backend::Backend;

use crate::TrainError;

/// Checks that every rank holds the same `text` (its configuration as TOML, its bucket plan),
/// so that ranks which would compute different things are refused at start-up instead of
/// hanging or silently diverging.
///
/// # Errors
/// [`TrainError::RankMismatch`] naming the first rank and line that differ from rank 0's;
/// [`TrainError::Comm`] if the allgather fails.
pub fn check_agreement<B: Backend>(
    comm: &CommThread<B>,
    what: &'static str,
    text: String,
) -> Result<(), TrainError> {
    let all = comm.call(move |c| c.allgather(text.as_bytes()))?;
    let reference = String::from_utf8_lossy(&all[0]).into_owned();
    for (rank, other) in all.iter().enumerate().skip(1) {
        let other = String::from_utf8_lossy(other);
        if let Some((line, theirs, ours)) = first_difference(&reference, &other) {
            return Err(TrainError::RankMismatch {
                what,
                rank,
                line,
                theirs,
                ours,
            });
        }
    }
    Ok(())
}
