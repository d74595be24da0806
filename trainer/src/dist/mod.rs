//! Data-parallel training: collectives, gradient hooks, the bucketed reducer and rank
//! discovery. See ARCHITECTURE.md, Trainer.

pub mod collective;
pub mod hooks;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod reducer;

pub use collective::{Collective, CommError, Delayed, InProcess, LinkModel, ReduceOp, SingleRank};
pub use hooks::{
    GradCallback, GradHookBackend, GradHooks, HookGradients, ReadyOrder, hook_group, ready_order,
};
pub use launch::{LaunchEnv, LaunchError, LaunchSource};
pub use reducer::{
    Bucket, BucketPlan, ClipMode, CommThread, PlannedParam, ReducedStep, Reducer, StepTimings,
};

use crate::TrainError;

/// Checks that every rank holds the same `text` (its configuration as TOML, its bucket plan),
/// so that ranks which would compute different things are refused at start-up instead of
/// hanging or silently diverging.
///
/// # Errors
/// [`TrainError::RankMismatch`] naming the first rank and line that differ from rank 0's;
/// [`TrainError::Comm`] if the allgather fails.
pub fn check_agreement(
    comm: &CommThread,
    what: &'static str,
    text: String,
) -> Result<(), TrainError> {
    let all = comm.call(move |c| c.allgather(text.as_bytes()))?;
    let reference = String::from_utf8_lossy(&all[0]).into_owned();
    for (rank, other) in all.iter().enumerate().skip(1) {
        let other = String::from_utf8_lossy(other);
        if let Some((line, theirs, ours)) = reducer::first_difference(&reference, &other) {
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
