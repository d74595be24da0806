//! The `[model]` section: which model to build and how its ops run.

use ember_model::{Kernels, Preset};
use serde::{Deserialize, Serialize};

/// Which model to build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Model size. Default: tiny.
    pub preset: Preset,
    /// Overrides the preset's `hidden_dropout_prob` (0.1) when set.
    pub hidden_dropout_prob: Option<f64>,
    /// Overrides the preset's `attention_probs_dropout_prob` (0.1) when set.
    pub attention_probs_dropout_prob: Option<f64>,
    /// Encoder implementation: `auto` (fused where the backend has kernels), `fused` or
    /// `reference` (see `ember_model::Kernels`). Default: auto.
    pub kernels: Kernels,
    /// Whose threads run the dense layers' GEMMs on the CPU (NdArray with OpenBLAS): `rayon`
    /// (each GEMM split over rayon's pool, which also runs the fused ops, OpenBLAS at one
    /// thread per call) or `blas` (OpenBLAS's own threads); see `crate::blas::GemmThreads`.
    /// Other backends ignore it. Default: rayon.
    pub gemm_threads: crate::blas::GemmThreads,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            preset: Preset::Tiny,
            hidden_dropout_prob: None,
            attention_probs_dropout_prob: None,
            kernels: Kernels::Auto,
            gemm_threads: crate::blas::GemmThreads::Rayon,
        }
    }
}
