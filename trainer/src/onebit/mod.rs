//! 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
//! Adam's Convergence Speed", ICML 2021) and 1-bit LAMB (Li et al., "1-bit LAMB:
//! Communication Efficient Large-Scale Large-Batch Training with LAMB's Convergence Speed",
//! HiPC 2022), following DeepSpeed's implementation (`deepspeed/runtime/fp16/onebit/`,
//! `deepspeed/runtime/comm/nccl.py`): compression with error feedback ([`compress`]), the
//! compressed allreduce ([`allreduce`]) and the two-stage optimizers ([`optimizer`]).

pub mod allreduce;
pub mod compress;
pub mod config;
pub mod optimizer;
pub mod state;
mod step;
#[cfg(test)]
mod tests;

pub use allreduce::{BytesSent, CompressedAllreduce, padded_len, ring_allreduce_bytes};
pub use config::{OnebitConfig, OnebitLambCoeff, OnebitVariance};
pub use optimizer::{OnebitKind, OnebitOptimizer, OnebitStep};
pub use state::onebit_rank_file;
