//! BERT pre-training: the loop, its optimizers, schedule, gradient clipping, evaluation,
//! metrics and checkpoints.
//!
//! The loop lives in [`train_rank`]: one data-parallel rank, which is the whole job when
//! [`train()`] runs it alone, one of several threads under [`train_in_process`], or one of
//! several processes under MPI or NCCL. A configuration is a [`TrainConfig`] read from TOML;
//! [`parallel`] holds the collectives, gradient hooks and the bucketed reducer.

pub mod blas;
pub mod checkpoint;
pub mod config;
pub mod cuda;
mod error;
pub mod eval;
pub mod grads;
pub mod loss_scale;
pub mod mllog;
pub mod onebit;
pub mod optim;
pub mod parallel;
pub mod schedule;
mod train;

pub use config::{LossNormalization, OptimizerKind, ParallelConfig, TrainConfig};
pub use error::TrainError;
pub use eval::EvalResult;
pub use parallel::bucket_plan;
pub use train::{
    PreparedData, RunOptions, TrainSummary, initial_model, initialisation_lock, loss_weights,
    prepare_data, train, train_in_process, train_in_process_with_data, train_rank,
};
