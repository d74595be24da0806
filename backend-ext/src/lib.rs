//! Fused BERT ops as a Burn backend extension (Burn 0.21's `custom-cubecl-kernel` pattern).
//!
//! [`FusedOps`] adds to a Burn [`Backend`] the ops BERT spends its time in, each as one kernel
//! where NVIDIA's MLPerf BERT uses apex or hand-written CUDA:
//!
//! | op | what it computes | apex / NVIDIA counterpart |
//! |---|---|---|
//! | [`bias_gelu`] | `GELU(x + bias)`, erf or tanh form ([`Gelu`]) | `bias_gelu` (tanh) in `model/layers/activations.py` (fused by nvFuser) |
//! | [`bias_dropout_add_layer_norm`] | `LayerNorm(residual + dropout(x + bias))` | `FastLayerNorm` + `bias_dropout_add` |
//! | [`attention`] | `dropout(softmax(Q·Kᵀ·scale + mask)) · V` | `FastUnpadBertSelfAttention`, fmha |
//! | [`attention_qkv`] | the same of Q, K, V packed in one `[B, S, 3·H]` tensor (fused QKV) | fmha's packed `qkv` |
//! | [`dropout()`] | `x · mask` | `torch.nn.functional.dropout` (Philox masks) |
//!
//! Every op has three implementations:
//! - the **reference composition** (module [`reference`]): Burn tensor ops, the default body of
//!   each trait method, used by NdArray and every backend without kernels, and the oracle of the
//!   tests;
//! - **CubeCL kernels** for `CubeBackend<R, F, I, BT>` (feature `cube`; one source for
//!   `CudaRuntime` and `WgpuRuntime`);
//! - an **`Autodiff<B>`** implementation whose backward calls the backend's backward op
//!   ([`FusedOps::bias_gelu_backward`], ...), i.e. the backward kernels on CubeCL backends,
//!   instead of differentiating the composition.
//!
//! Dropout masks are a pure function of `(key, sample, position, column)` (see
//! [`DropoutSpec`]), so the kernels, the reference composition and the backward pass agree on
//! the mask without storing it, and a sample's mask does not depend on its batch or padding.
//!
//! The tensor-level functions ([`bias_gelu`], ...) flatten leading dimensions into rows, the
//! trait methods work on rows: the letters in `# Shapes` are R rows, N the row length (hidden or
//! intermediate size), B batch, nh heads, S sequence, hd head dim.

mod adam;
mod autodiff;
mod bucket_ops;
mod columns;
mod cross_entropy;
#[cfg(feature = "cube")]
mod cube;
mod dropout;
mod functions;
mod fused_ops;
mod fused_outputs;
mod gelu;
mod gemm;
pub mod gemm_layout;
mod host;
mod host_adam;
mod host_embedding;
mod host_gemm;
mod host_layer;
#[macro_use]
mod host_math;
mod host_matmul;
pub mod host_norm;
mod host_sum;
mod kernels_choice;
mod linear;
mod masters;
mod packed_rows;
mod qkv;
pub mod reference;
mod reference_ops;

#[cfg(feature = "cube")]
pub use cube::counting::{CountingRuntime, HostSyncs, KernelLaunches};
#[cfg(feature = "cuda")]
pub use cube::cublaslt;
#[cfg(feature = "cube")]
pub use cube::gemm_window;
#[cfg(feature = "cube")]
pub use cube::kernel_cache::{KERNEL_CACHE_VAR, KernelCache, build_fingerprint, set_kernel_cache};
/// CubeCL's CUDA runtime (the `R` of [`gemm_window::WindowFlags`] on Burn's CUDA backend).
#[cfg(feature = "cuda")]
pub use cubecl::cuda::CudaRuntime;
/// CubeCL's wgpu runtime (the `R` of [`gemm_window::WindowFlags`] on Burn's wgpu backend).
#[cfg(feature = "wgpu")]
pub use cubecl::wgpu::WgpuRuntime;

/// Burn's CUDA backend (`burn::backend::Cuda`) with its host synchronisations counted
/// ([`CountingRuntime`], [`HostSyncs`]).
#[cfg(feature = "cuda")]
pub type CountingCuda<F = f32, I = i32> =
    burn_cubecl::CubeBackend<CountingRuntime<cubecl::cuda::CudaRuntime>, F, I, u8>;

/// Burn's wgpu backend (`burn::backend::wgpu::CubeBackend<WgpuRuntime, ..>`) with its host
/// synchronisations counted ([`CountingRuntime`], [`HostSyncs`]).
#[cfg(feature = "wgpu")]
pub type CountingWgpu<F = f32, I = i32> =
    burn_cubecl::CubeBackend<CountingRuntime<cubecl::wgpu::WgpuRuntime>, F, I, u32>;
pub use adam::{AdamHyper, AdamKind, AdamOutput, AdamTensors};
pub use bucket_ops::{BucketOps, clip_coefficient};
pub use cross_entropy::CrossEntropyForward;
pub use dropout::{DropoutScope, DropoutSpec, keep_mask, reseed_dropout};
pub use functions::{
    attention, attention_qkv, bias_dropout_add_layer_norm, bias_dropout_add_layer_norm_of_masters,
    bias_dropout_add_layer_norm_of_packed_rows, bias_gelu, bias_gelu_of_master, concat_columns,
    cross_entropy, dense, dense_module, dense_of_masters, dropout, dropout_rows, embedding,
    lamb_multi_tensor, ordered_after, reshape, sum_ordered, sum_squares, tied_decoder_weight,
};
pub use fused_ops::FusedOps;
pub use fused_outputs::{DenseGrads, LayerNormBackward, LayerNormForward, SoftmaxForward};
use fused_outputs::{float, prim};
pub use gelu::{GELU_TANH_CLAMP, GELU_TANH_CUBIC, Gelu, SQRT_2_OVER_PI};
pub use gemm::{
    AUTOTUNE_BUILT, CUBLASLT_BUILT, CublasltSync, Gemm, GemmPrecision, cublaslt_sync, gpu_gemm,
    set_cublaslt_sync, set_gpu_gemm,
};
pub use host_gemm::{gemm_parts, set_gemm_parts};
pub use kernels_choice::{
    Kernels, QkvProjections, RowReductions, row_reductions, set_row_reductions,
};
pub use masters::MasterOps;
pub use packed_rows::{PackedRowOps, gather_rows, scatter_rows, slots_of_rows};
pub use reference_ops::{FusedOp, ReferenceOps};
