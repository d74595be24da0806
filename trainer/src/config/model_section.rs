//! The `[model]` section: which model to build and how its ops run.

use ember_model::{Kernels, Preset};
use serde::{Deserialize, Serialize};

/// Which model to build.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Model size: tiny (2 layers, hidden size 128), mini (4 × 256), small (4 × 512), base
    /// (12 × 768) or large (24 × 1024, MLPerf's). Default: tiny.

    #[arg(long)]
    pub preset: Preset,
    /// Overrides the preset's `hidden_dropout_prob` (0.1) when set.
    #[arg(long)]
    pub hidden_dropout_prob: Option<f64>,
    /// Overrides the preset's `attention_probs_dropout_prob` (0.1) when set.
    #[arg(long)]
    pub attention_probs_dropout_prob: Option<f64>,
    /// Overrides the preset's `hidden_act` (`gelu`, the exact erf GELU, as Hugging Face's
    /// BERT checkpoints) when set: `gelu_new` is the tanh approximation that Google's BERT,
    /// NVIDIA's and Samsung's MLPerf BERT train with (Hugging Face's name; `gelu_pytorch_tanh`
    /// and `gelu_fast` are read as the same). Every path computes it: the reference ops, the
    /// host loops and the kernels (Note [Two GELUs] in backend-ext/src/gelu.rs).
    #[arg(long)]
    pub hidden_act: Option<ember_model::Gelu>,
    /// Rounds the model's vocabulary up to a multiple of this (Megatron-LM's
    /// `--make-vocab-size-divisible-by`): the word embeddings (the tied MLM decoder) and the
    /// MLM output bias get rows no token id reaches, as NVIDIA's and Samsung's MLPerf BERT pad
    /// BERT's 30,522 tokens to 30,528 with 8, so that the decoder's GEMMs have aligned leading
    /// dimensions on tensor cores. The padding rows are softmax classes like any other
    /// (Note [Padded vocabulary] in model/src/vocab_padding.rs); weights of the unpadded
    /// vocabulary (`checkpoint.init_from`) load with zero rows there. Default: 1 (no
    /// padding: Hugging Face's model).
    #[arg(long)]
    pub make_vocab_size_divisible_by: usize,
    /// Encoder implementation: `fused` (ember-backend-ext's ops: CubeCL kernels on cuda and
    /// wgpu, host loops on the CPU), `reference` (Burn ops composed module by module) or
    /// `auto` (fused where the backend has them: cuda, wgpu and cpu). Default: auto.
    #[arg(long)]
    pub kernels: Kernels,
    /// Whose threads run the dense layers' GEMMs on the CPU (NdArray with OpenBLAS): `rayon`
    /// (each GEMM split over rayon's pool, which also runs the fused ops, OpenBLAS at one
    /// thread per call) or `blas` (OpenBLAS's own threads). Other backends ignore it.
    /// Default: rayon.

    #[arg(long)]
    pub gemm_threads: crate::blas::GemmThreads,
    /// Which matmul runs the GEMMs on cuda and wgpu (Note [GPU GEMMs] in
    /// backend-ext/src/gemm.rs): `autotune` (cubek times its kernels per shape on the device
    /// and keeps the fastest, cached on disk; builds with the `cuda` feature), `cmma` (one
    /// tensor-core kernel family for every shape), `cublaslt` (NVIDIA's cuBLASLt, cuda only:
    /// two host waits per GEMM, Note [cuBLASLt beside CubeCL]) or `auto` (autotune where
    /// built, else cmma). The CPU ignores it. Default: auto.
    #[arg(long)]
    pub gemm: ember_backend_ext::Gemm,
    /// How `gemm = "cublaslt"` orders its products with CubeCL's kernels (Note [Device-side
    /// GEMM windows] in backend-ext/src/cube/gemm_window.rs): `host` (two host waits per
    /// window of products) or `device` (flags in GPU memory: a one-unit kernel holds CubeCL's
    /// stream until cuBLASLt's stream releases it; no host wait, one more launch per window;
    /// host waits where the device refuses stream memory operations). Other GEMM choices
    /// ignore it. Default: host.
    #[arg(long)]
    pub cublaslt_sync: ember_backend_ext::CublasltSync,
    /// How the fused encoder runs each layer's query, key and value projections (Note
    /// [Packed QKV] in backend-ext/src/qkv.rs): `packed` (one dense layer, the three weights
    /// side by side: NVIDIA's and Samsung's MLPerf BERT's fused QKV; one GEMM forward instead
    /// of three, two backward instead of six, one bias add and one bias-gradient sum instead
    /// of three each), `separate` (three dense layers, as Hugging Face) or `auto` (packed on
    /// cuda and wgpu, separate on the CPU, where packing did not pay). The parameters and
    /// checkpoints are Hugging Face's either way; `kernels = "reference"` always runs three,
    /// and so does `attention` among `reference_ops`.
    /// Default: auto.
    #[arg(long)]
    pub qkv_projections: ember_model::QkvProjections,
    /// Fused ops the fused path runs as their reference composition instead, where the fused
    /// op does not pay on a device (Note [Fused where it pays] in
    /// backend-ext/src/reference_ops.rs; `bench kernels` ends with the list for its device):
    /// any of `bias_gelu`, `layer_norm` (bias + dropout + residual + LayerNorm), `attention`
    /// (the attention core), `cross_entropy` (the losses). TOML: a list of names; flag: names
    /// separated by commas, or `none`. The values are the same within rounding. Default: none.
    #[arg(long)]
    pub reference_ops: ember_model::ReferenceOps,
    /// Run the encoder layers on the batch's real tokens alone (NVIDIA's MLPerf BERT
    /// `--unpad`; Samsung's "padding removed"): the dense layers, LayerNorms and GELUs skip
    /// the padded rows, which with stratified batches are about half of them. The attention
    /// core still runs padded, and the hidden dropout keeps the padded model's masks (Note
    /// [Padding removed] in model/src/unpad.rs). The same values within rounding.
    /// Default: false.
    #[arg(long)]
    pub unpad: bool,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            preset: Preset::Tiny,
            hidden_dropout_prob: None,
            attention_probs_dropout_prob: None,
            hidden_act: None,
            make_vocab_size_divisible_by: 1,
            kernels: Kernels::Auto,
            gemm_threads: crate::blas::GemmThreads::Rayon,
            gemm: ember_backend_ext::Gemm::Auto,
            cublaslt_sync: ember_backend_ext::CublasltSync::Host,
            qkv_projections: ember_model::QkvProjections::Auto,
            reference_ops: ember_model::ReferenceOps::NONE,
            unpad: false,
        }
    }
}
