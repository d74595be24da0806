//! Data-parallel training: collectives, gradient hooks, the bucketed reducer and rank
//! discovery. See ARCHITECTURE.md, Trainer.

pub mod collective;
pub mod hooks;
pub mod launch;
pub mod reducer;

pub use collective::{Collective, CommError, Delayed, InProcess, LinkModel, ReduceOp, SingleRank};
pub use hooks::{GradCallback, GradHookBackend, GradHooks, HookGradients, hook_group};
pub use launch::{LaunchEnv, LaunchError, LaunchSource};
pub use reducer::{
    Bucket, BucketPlan, ClipMode, CommThread, PlannedParam, ReducedStep, Reducer, StepTimings,
};
