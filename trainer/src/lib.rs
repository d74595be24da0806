//! BERT pre-training: the loop, its optimizers, schedule, gradient clipping, evaluation,
//! metrics and checkpoints.
//!
//! One process, one rank for now. The loop lives in [`train()`]; a configuration is a
//! [`TrainConfig`] read from TOML.

pub mod config;
mod error;
pub mod eval;
pub mod grads;
pub mod optim;
pub mod schedule;
mod train;

pub use config::{OptimizerKind, TrainConfig};
pub use error::TrainError;
pub use eval::EvalResult;
pub use train::{PreparedData, RunOptions, TrainSummary, prepare_data, train};
