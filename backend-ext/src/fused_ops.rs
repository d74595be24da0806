//! The [`FusedOps`] trait (the crate's docs say what it adds to a Burn backend); what its
//! methods return is in `fused_outputs.rs`, the ops of autocast's f32 masters and half copies
//! in `masters.rs` (its supertrait [`MasterOps`]), the flat buckets' in `bucket_ops.rs` (its
//! supertrait [`BucketOps`]), the packed rows' of `model.unpad` in `packed_rows.rs` (its
//! supertrait [`PackedRowOps`]).

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, TensorMetadata};

use crate::*;

/// The fused ops of BERT, added to a Burn backend. Every method has a default body, the
/// [`reference`] composition; backends with kernels override them.
///
/// Inputs may have any strides; outputs are contiguous. Float inputs are f32 or bf16
/// (kernels accumulate in f32).
pub trait FusedOps: MasterOps + BucketOps + PackedRowOps {
    /// Whether this backend implements the ops with its own kernels (what [`Kernels::Auto`]
    /// picks).
    const HAS_KERNELS: bool = false;

    /// Whether [`FusedOps::adam_multi_tensor`] is this backend's own (kernels, or NdArray's
    /// fused host loop) rather than the reference composition.
    const HAS_MULTI_TENSOR: bool = Self::HAS_KERNELS;

    /// Whether [`Kernels::Auto`] runs the fused ops on this backend: where it has kernels, and
    /// on NdArray, whose fused ops are host loops on views (`host_layer.rs`, `linear.rs`).
    const FUSED_BY_DEFAULT: bool = Self::HAS_KERNELS;

    /// `x · weight + bias`, Burn's `Linear` (what Burn's `ModuleOps::linear` computes).
    /// NdArray runs it as one GEMM on views, without the copies of Burn's NdArray matmul
    /// (see `linear.rs`); other backends run Burn's op.
    ///
    /// # Shapes
    /// `x` `[.., I]`, `weight` `[I, O]` (any strides: a transposed view is not copied on
    /// NdArray), `bias` `[O]` → `[.., O]`
    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        linear::reference_linear::<Self>(x, weight, bias)
    }

    /// Mean cross-entropy `mean_i(lse_i − logits[i, label_i])` with `lse_i = log Σ_j
    /// exp(logits[i, j])` (`torch.nn.functional.cross_entropy`), and the log-sum-exp for the
    /// backward. The reference is max-shifted; NdArray runs one fused pass per row; CubeCL one
    /// row kernel (Note [Cross-entropy in one pass] in `cube/cross_entropy.rs`). Half logits
    /// are read as they are and computed on in f32 (`torch.autocast` runs `cross_entropy` in
    /// f32): the loss and the log-sum-exp are f32 whatever the logits' dtype.
    ///
    /// # Shapes
    /// `logits` `[N, C]`, `labels` `[N]` (values in `0..C`) → loss `[1]`, log-sum-exp `[N]`
    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
    ) -> CrossEntropyForward<Self> {
        cross_entropy::reference_forward::<Self>(logits, labels)
    }

    /// Gradient of [`FusedOps::cross_entropy`]'s loss for the logits, `(exp(logits − lse) −
    /// onehot(labels)) · grad / N`, from the forward's log-sum-exp and the loss's gradient
    /// (both f32), in the logits' dtype.
    ///
    /// # Shapes
    /// `logits` `[N, C]`, `labels` `[N]`, `log_sum_exp` `[N]`, `grad` `[1]` → `[N, C]`
    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        log_sum_exp: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cross_entropy::reference_backward::<Self>(logits, labels, log_sum_exp, grad)
    }

    /// `x` reshaped to `shape` (same number of elements), Burn's `float_reshape`. NdArray
    /// reshapes a contiguous array without copying it (Burn 0.21's NdArray copies on every
    /// reshape): the multi-tensor optimizer flattens every parameter and gradient through it.
    fn reshape_contiguous(x: FloatTensor<Self>, shape: burn::tensor::Shape) -> FloatTensor<Self> {
        Self::float_reshape(x, shape)
    }

    /// Gradients of [`FusedOps::dense`] from the output's gradient `grad` `[.., O]`:
    /// `(dx = grad · weightᵀ` `[.., I]`, `dweight = xᵀ · grad` `[I, O]` (summed over every
    /// leading dimension), `dbias = Σ grad` `[O]` when `with_bias)`.
    ///
    /// The default body multiplies the rows flattened, `x` `[R, I]` and `grad` `[R, O]` with
    /// R the product of the leading dimensions, as PyTorch's `linear` backward does (one
    /// `mm` per gradient): one GEMM for `dweight` and one reduction for `dbias`, where Burn's
    /// `linear_weight_backward` multiplies per sample and sums the `[B, I, O]` products
    /// (an intermediate of B weights) and `linear_bias_backward` sums over each leading
    /// dimension in turn. NdArray multiplies views (`linear.rs`).
    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        with_bias: bool,
    ) -> DenseGrads<Self> {
        linear::flattened_linear_backward::<Self>(x, weight, grad, with_bias, |g, wt, xt, _| {
            (
                Self::float_matmul(g.clone(), wt),
                Self::float_matmul(xt, g),
                None,
            )
        })
    }

    /// The precision this backend's GEMMs give f32 operands on `device`: exact f32 on NdArray
    /// and wherever the GPU has no TF32, TF32 on NVIDIA tensor cores (Note [GPU GEMMs] in
    /// `gemm.rs`). Tests derive their tolerances from it; benchmarks print it.
    fn f32_gemm_precision(_device: &Self::Device) -> GemmPrecision {
        GemmPrecision::F32
    }

    /// Device memory this backend's allocator holds on `device`, in bytes: CubeCL's reserved
    /// pages (`MemoryUsage::bytes_reserved`; the counterpart of PyTorch's
    /// `torch.cuda.memory_reserved`), which its pools keep for reuse rather than return, so
    /// that a reading after a step's peak still includes it. `None` where device memory is
    /// the process's heap (NdArray: see the peak resident set size instead).
    fn memory_reserved(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// `GELU(x + bias)` of the chosen form (Note [Two GELUs] in `gelu.rs`): the exact erf
    /// GELU (Hendrycks & Gimpel 2016; Hugging Face's `"gelu"`) or the tanh approximation
    /// (Google's and NVIDIA's MLPerf BERT; Hugging Face's `"gelu_new"`).
    ///
    /// # Shapes
    /// `x` `[R, N]`, `bias` `[N]` → `[R, N]`
    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, gelu: Gelu) -> FloatTensor<Self> {
        prim(reference::bias_gelu::<Self, 2>(float(x), float(bias), gelu))
    }

    /// Gradient of [`FusedOps::bias_gelu`] with respect to `x` (and, summed over rows, `bias`):
    /// `grad · GELU'(z)`, `z = x + bias`, the exact derivative of the chosen form (erf:
    /// `Φ(z) + z·φ(z)`, not Burn 0.21's tanh derivative of its erf GELU).
    ///
    /// # Shapes
    /// `x`, `grad` `[R, N]`, `bias` `[N]` → `[R, N]`
    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        gelu: Gelu,
    ) -> FloatTensor<Self> {
        prim(reference::bias_gelu_backward::<Self, 2>(
            float(x),
            float(bias),
            float(grad),
            gelu,
        ))
    }

    /// `LayerNorm(residual + dropout(x + bias)) · gamma + beta` over the last dim, as BERT's
    /// `BertSelfOutput` / `BertOutput` (dense bias, dropout, residual add, post-LN).
    ///
    /// `dropout_rows`: for packed rows (`model.unpad`, Note [Padding removed] in
    /// `ember-model`'s `unpad.rs`), the padded row `b·S + s` of each row, so that row `t`'s
    /// dropout mask is the one [`PackedRowOps::dropout_rows`] gives it (keyed as row
    /// `dropout_rows[t]` of `[B·S, N]` rows, `dropout.seq_len` = S per sample); `None`: rows
    /// keyed as themselves.
    ///
    /// # Shapes
    /// `x`, `residual` `[R, N]`; `bias`, `gamma`, `beta` `[N]`; `dropout_rows` `[R]` →
    /// [`LayerNormForward`]
    ///
    /// # Panics
    /// With `dropout_rows` and dropout on: if `dropout.seq_len` is 0, or `dropout_rows` does
    /// not hold R rows.
    #[allow(clippy::too_many_arguments)]
    fn bias_dropout_add_layer_norm(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
        eps: f64,
    ) -> LayerNormForward<Self> {
        reference::bias_dropout_add_layer_norm_forward::<Self>(
            float(x),
            float(bias),
            float(residual),
            float(gamma),
            float(beta),
            dropout,
            dropout_rows,
            eps,
        )
    }

    /// Backward of [`FusedOps::bias_dropout_add_layer_norm`] from what its forward saved:
    /// `dy = rstd · (g − mean(g) − x̂ · mean(g·x̂))` with `g = grad · gamma`, `x̂ = (y − mean) ·
    /// rstd` (Ba et al. 2016; apex's `cuComputeGradInput`).
    ///
    /// # Shapes
    /// `grad`, `pre_norm` `[R, N]`; `mean`, `rstd` `[R]` (as the forward gave them: f32 on
    /// CubeCL backends, Note [LayerNorm statistics in f32]; the default body takes them in
    /// `pre_norm`'s dtype); `gamma` `[N]`; `dropout_rows` `[R]` as the forward's →
    /// [`LayerNormBackward`]
    ///
    /// # Panics
    /// As the forward, with `dropout_rows` and dropout on.
    #[allow(clippy::too_many_arguments)]
    fn bias_dropout_add_layer_norm_backward(
        grad: FloatTensor<Self>,
        pre_norm: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
    ) -> LayerNormBackward<Self> {
        reference::bias_dropout_add_layer_norm_backward::<Self>(
            float(grad),
            float(pre_norm),
            float(mean),
            float(rstd),
            float(gamma),
            dropout,
            dropout_rows,
        )
    }

    /// Masked softmax with dropout: `softmax(scores · scale + mask_bias)` over the last dim,
    /// then dropout. `mask_bias` is additive (0 for real keys, −10000 for padded ones, Google's
    /// `modeling.py`), so a fully padded row comes out uniform, not NaN.
    ///
    /// # Shapes
    /// `scores` `[B, nh, S, S]`, `mask_bias` `[B, S]` → [`SoftmaxForward`]
    fn masked_softmax_dropout(
        scores: FloatTensor<Self>,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> SoftmaxForward<Self> {
        reference::masked_softmax_dropout_forward::<Self>(
            float(scores),
            float(mask_bias),
            scale,
            dropout,
        )
    }

    /// Gradient of the raw `scores` of [`FusedOps::masked_softmax_dropout`] from the gradient
    /// of its dropped output: `scale · P · (dP − Σ dP·P)`, `dP = dropout_backward(grad)`.
    ///
    /// # Shapes
    /// `grad_dropped`, `probs` `[B, nh, S, S]` → `[B, nh, S, S]`
    fn masked_softmax_dropout_backward(
        grad_dropped: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        prim(reference::masked_softmax_dropout_backward::<Self>(
            float(grad_dropped),
            float(probs),
            scale,
            dropout,
        ))
    }

    /// Dropout: `x · mask`, the scaled keep mask of `dropout` (kept elements × `1/(1−p)`, the
    /// rest 0), keyed per sample and position (see [`DropoutSpec`]). Its own backward: the
    /// gradient through the same mask is `dropout(grad)`.
    ///
    /// # Shapes
    /// `x` `[B, S, N]` (or `[B, nh, S, S]`, or `[R, N]` rows with `dropout.seq_len`) → the
    /// shape of `x`
    fn dropout(x: FloatTensor<Self>, dropout: DropoutSpec) -> FloatTensor<Self> {
        reference::dropout_primitive::<Self>(x, dropout)
    }

    /// One Adam-family step of many tensors, apex's `multi_tensor_adam`/`multi_tensor_lamb`
    /// (stage 1): moments `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`, then, per `kind`,
    /// the new parameter (AdamW) or LAMB's update. Kernels update up to 32 tensors per launch
    /// (fewer where the device has fewer bindings); the reference steps tensor by tensor.
    ///
    /// # Shapes
    /// each of `tensors` flat `[n_i]` → one [`AdamOutput`] per tensor, in order
    fn adam_multi_tensor(
        tensors: Vec<AdamTensors<Self>>,
        hyper: AdamHyper,
        kind: AdamKind,
    ) -> Vec<AdamOutput<Self>> {
        tensors
            .into_iter()
            .map(|t| reference::adam_tensors::<Self>(t, hyper, kind))
            .collect()
    }

    /// `Σ x²` of each tensor (squared L2 norms), accumulated in f32 on the device: LAMB's
    /// norms and the global gradient norm of clipping (apex's `multi_tensor_l2norm`), in a
    /// fixed order (the same bits in every process for the same input, as
    /// [`FusedOps::sum_ordered`]).
    ///
    /// # Shapes
    /// `xs` (not empty), each flat `[n_i]` → `[xs.len()]`
    ///
    /// # Panics
    /// If `xs` is empty.
    fn sum_squares_multi_tensor(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        reference::sum_squares_multi_tensor::<Self>(xs)
    }

    /// Bucket-wise clipping: `x` clipped by its own squared norm `s = Σx²` (taken in
    /// [`FusedOps::sum_squares_multi_tensor`]'s fixed order), times `min(1, max_norm / (√s +
    /// 1e-6))`; returns the clipped tensor and `s` (for the logged gradient norm). Samsung's
    /// MLPerf BERT clips each bucket so as it becomes ready, before its allreduce. The
    /// default body is [`FusedOps::sum_squares_multi_tensor`] and
    /// [`BucketOps::clip_multi_tensor`]; CubeCL backends finish the norm inside the clip's
    /// launch, the same bits (Note [Clipped by its own norm] in `bucket_ops.rs`).
    ///
    /// # Shapes
    /// `x` `[n]` → (`[n]`, `[1]`), both in `x`'s dtype
    fn clip_by_own_norm(
        x: FloatTensor<Self>,
        max_norm: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let sq_norm = Self::sum_squares_multi_tensor(vec![x.clone()]);
        let clipped = Self::clip_multi_tensor(vec![x], sq_norm.clone(), max_norm)
            .pop()
            .expect("one tensor in, one out");
        (clipped, sq_norm)
    }

    /// Tensors side by side along their last dimension (`torch.cat(xs, dim=-1)`): the packed
    /// QKV weight and bias (Note [Packed QKV] in `qkv.rs`). The default is Burn's `cat`; CubeCL
    /// writes up to 32 parts in one launch (Burn's `cat` launches a slice assignment per
    /// part); under autodiff the backward is [`FusedOps::split_columns`].
    ///
    /// # Shapes
    /// `xs` `[.., w_t]` (the same leading dimensions) → `[.., Σ w_t]`
    ///
    /// # Panics
    /// If `xs` is empty, mixes dtypes or the leading dimensions differ.
    fn concat_columns(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        columns::reference_concat_columns::<Self>(xs)
    }

    /// The parts of `x`'s last dimension, of widths `widths` (the gradient of
    /// [`FusedOps::concat_columns`]). The default returns views (Burn's `slice`); CubeCL
    /// writes contiguous parts, up to 32 in one launch, so that the bucket flattening and the
    /// optimizer read them without a copy each.
    ///
    /// # Shapes
    /// `x` `[.., Σ w_t]` → `[.., w_t]` for each of `widths`
    ///
    /// # Panics
    /// If `widths` do not add up to `x`'s last dimension.
    fn split_columns(x: FloatTensor<Self>, widths: &[usize]) -> Vec<FloatTensor<Self>> {
        columns::reference_split_columns::<Self>(x, widths)
    }

    /// `Σ x` of a flat tensor in a fixed order: the same bits on every run and in every
    /// process for the same input (Note [Ranks stay one model] in ember-trainer's
    /// `parallel/consistency.rs`: what ranks compute from the same averaged gradient must be
    /// equal, which an autotuned or atomic reduction does not promise). The default body is
    /// Burn's `sum` (NdArray adds in order); CubeCL backends add strided partials per unit,
    /// then a fixed tree, in f32.
    ///
    /// # Shapes
    /// `x` `[n]` → `[1]`
    fn sum_ordered(x: FloatTensor<Self>) -> FloatTensor<Self> {
        prim(float::<Self, 1>(x).sum())
    }

    /// The second half of a LAMB step for many tensors: `w_i ← w_i − lr · r_i · u_i` with the
    /// trust ratio `r_i = ‖w_i‖ / ‖u_i‖` (1 if either norm is 0) from the squared norms on
    /// the device (no host round trip).
    ///
    /// # Shapes
    /// `params`, `updates` flat `[n_i]`; `param_sq`, `update_sq` `[params.len()]` → one `[n_i]`
    /// per tensor
    fn lamb_apply_multi_tensor(
        params: Vec<FloatTensor<Self>>,
        updates: Vec<FloatTensor<Self>>,
        param_sq: FloatTensor<Self>,
        update_sq: FloatTensor<Self>,
        lr: f64,
    ) -> Vec<FloatTensor<Self>> {
        reference::lamb_apply_multi_tensor::<Self>(params, updates, param_sq, update_sq, lr)
    }

    /// Rows of the table `weights` at `indices` (Burn's `ModuleOps::embedding`, the default
    /// body), with [`FusedOps::embedding_lookup_backward`] as its backward under autodiff.
    ///
    /// # Shapes
    /// `weights` `[V, H]`, `indices` `[B, S]` (values in `0..V`) → `[B, S, H]`
    fn embedding_lookup(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ModuleOps<Self>>::embedding(weights, indices)
    }

    /// Gradient of the table of [`FusedOps::embedding_lookup`]: zeros with each row of `grad`
    /// added at its index (Burn's `ModuleOps::embedding_backward`, the default body; NdArray's
    /// builds the zeros as one buffer, `host_embedding.rs`).
    ///
    /// # Shapes
    /// `weights` `[V, H]` (for its shape), `grad` `[B, S, H]`, `indices` `[B, S]` → `[V, H]`
    fn embedding_lookup_backward(
        weights: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ModuleOps<Self>>::embedding_backward(weights, grad, indices)
    }

    /// `sum` plus the table gradient of [`FusedOps::embedding_lookup`] (what
    /// [`FusedOps::embedding_lookup_backward`] returns): the lookup's share of a tied table's
    /// gradient added into the share already there (the MLM decoder's, see
    /// [`FusedOps::tied_decoder_weight`]). The default body adds the two tables
    /// ([`FusedOps::accumulate`]); NdArray adds each looked-up row into `sum` in place, the
    /// rows of one index summed first in index order as the default's table holds them
    /// (`host_embedding.rs`), so that the result is the default's.
    ///
    /// # Shapes
    /// `sum` `[V, H]`, `grad` `[B, S, H]`, `indices` `[B, S]` → `[V, H]`
    fn embedding_lookup_backward_into(
        sum: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let rows = Self::embedding_lookup_backward(sum.clone(), grad, indices);
        Self::accumulate(sum, rows)
    }

    /// A second gradient of one tensor added to the first, `sum + value` (Burn's
    /// `Gradients::register` adds them with `float_add`, the default body, into a new tensor on
    /// one thread). NdArray adds in `sum`'s buffer when nothing else holds it (copy-on-write
    /// otherwise), on rayon's threads (`host_sum.rs`); the sum is elementwise, so the result
    /// is the default's.
    ///
    /// # Shapes
    /// `sum`, `value` of one shape → that shape
    fn accumulate(sum: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_add(sum, value)
    }

    /// `Σ_r x[r, ..]`: the gradient of a bias broadcast over rows (Burn's `sum_dim(0)`, the
    /// default body). NdArray sums blocks of columns on rayon's threads, each row by row in
    /// row order (`sum_dim`'s order on NdArray, so the same result; `host_sum.rs`).
    ///
    /// # Shapes
    /// `x` `[R, N]` → `[N]`
    fn sum_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        reference::sum_rows::<Self>(x)
    }

    /// Each of `xs` in `dtype` (Burn's cast of each, the default body; a tensor already in
    /// `dtype` is returned as it is): autocast's weights, cast together at the start of a
    /// forward (Note [Weights cast together] in `ember-model`'s `weight_casts.rs`). CubeCL
    /// converts up to 32 tensors per launch (apex's `multi_tensor_scale`) where a cast per
    /// weight is a launch each. Under autodiff each result is a graph node of its own, whose
    /// backward casts the gradient back to its input's dtype (as Burn's cast).
    ///
    /// # Shapes
    /// each of `xs` any → the same, in `dtype`
    fn cast_multi_tensor(xs: Vec<FloatTensor<Self>>, dtype: FloatDType) -> Vec<FloatTensor<Self>> {
        xs.into_iter()
            .map(|x| {
                if x.dtype() == DType::from(dtype) {
                    x
                } else {
                    Self::float_cast(x, dtype)
                }
            })
            .collect()
    }

    /// [`FusedOps::sum_rows`] of each of `xs`, several `[R, N]` matrices of one shape: the
    /// column sums LayerNorm's backward takes of the same rows (β's, γ's and the preceding
    /// bias's gradients). CubeCL sums them all in two launches, in a fixed order (partial sums
    /// per chunk of 256 rows, then their sum: `multi_column_partial_sums_kernel`,
    /// `multi_column_sums_finish_kernel`), where the default body launches Burn's reduction
    /// for each.
    ///
    /// # Shapes
    /// each of `xs` `[R, N]` → one `[N]` per matrix, in order
    fn sum_rows_many(xs: Vec<FloatTensor<Self>>) -> Vec<FloatTensor<Self>> {
        xs.into_iter().map(Self::sum_rows).collect()
    }

    /// The MLM decoder's matrix: the word-embedding table `table` `[V, H]` (tied) transposed,
    /// `[H, V]` (Burn's `swap_dims`, a view; the default body). Under autodiff, its backward
    /// hands the table the decoder's share of its gradient right after the decoder's matmul:
    /// `after` (the MLM transform's output, `[N, H]`) is a parent only for that order (Burn
    /// runs backward by graph depth). The lookup's share, whose backward is the last of the
    /// step, is then added into it ([`FusedOps::embedding_lookup_backward_into`]) instead of
    /// the two shares being summed as whole tables (with Burn's `transpose`, the decoder's
    /// share came last and was added to the lookup's zero-filled `[V, H]` table).
    ///
    /// # Shapes
    /// `table` `[V, H]`, `after` any → `[H, V]`
    fn tied_decoder_weight(
        table: FloatTensor<Self>,
        after: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = after;
        Self::float_swap_dims(table, 0, 1)
    }

    /// `x` itself; under autodiff an identity with `after` as a parent for the order of
    /// backward only ([`crate::ordered_after`] says why).
    fn ordered_after(x: FloatTensor<Self>, after: FloatTensor<Self>) -> FloatTensor<Self> {
        let _ = after;
        x
    }

    /// `x` in the row-major layout of its shape: a copy where `x` is a strided view, `x`
    /// itself where it is contiguous already. For an operand that several kernels read: the
    /// attention's Q, K, V (`[B, nh, S, hd]` views of `[B, S, H]` projections, heads strided)
    /// and the gradient of its output, each read by two batched matmuls, which on CubeCL copy
    /// such a view at every use (cubek's matmul takes batches strided no finer than rows).
    /// NdArray's batched matmul reads the views as they are: the default is `x` itself.
    ///
    /// # Shapes
    /// any → the same
    fn contiguous(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }

    /// The batched matrix product of the attention, `C[b, h] = A[b, h] · B[b, h]` (Burn's
    /// `float_matmul` of rank-4 tensors, which is the default body). NdArray multiplies each
    /// `[b, h]` pair of (possibly transposed, head-strided) views with one GEMM, the pairs split
    /// over rayon's threads (`host_matmul.rs`), without Burn 0.21 NdArray's copies of both
    /// operands and of the output.
    ///
    /// # Shapes
    /// `a` `[B, nh, M, K]`, `b` `[B, nh, K, N]` → `[B, nh, M, N]`
    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(a, b)
    }

    /// Two [`FusedOps::batched_matmul`]s that do not read each other's output (attention's
    /// backward: `dV` and `dP`, `dQ` and `dK`), `(a1 · b1, a2 · b2)`. CUDA under
    /// `model.gemm = "cublaslt"` runs both between one set of host waits (Note [cuBLASLt
    /// beside CubeCL]); the default is two calls.
    ///
    /// # Shapes
    /// as [`FusedOps::batched_matmul`], for each pair
    fn batched_matmul_pair(
        a1: FloatTensor<Self>,
        b1: FloatTensor<Self>,
        a2: FloatTensor<Self>,
        b2: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (Self::batched_matmul(a1, b1), Self::batched_matmul(a2, b2))
    }

    /// The attention core, `dropout(softmax(Q·Kᵀ·scale + mask_bias)) · V`: two batched
    /// matmuls around [`FusedOps::masked_softmax_dropout`] (Vaswani et al. 2017, eq. 1; BERT's
    /// `BertSelfAttention`).
    ///
    /// # Shapes
    /// `q`, `k`, `v` `[B, nh, S, hd]`, `mask_bias` `[B, S]` → `[B, nh, S, hd]`
    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        let scores = Self::batched_matmul(q, Self::float_swap_dims(k, 2, 3));
        let softmax = Self::masked_softmax_dropout(scores, mask_bias, scale, dropout);
        Self::batched_matmul(softmax.dropped, v)
    }

    /// [`FusedOps::attention_core`] of the packed projections of one dense layer, `[Q | K |
    /// V]` side by side (Note [Packed QKV] in `qkv.rs`: NVIDIA's and Samsung's MLPerf BERT's
    /// fused QKV). The default reads Q, K and V as head-strided views of `qkv` and calls
    /// [`FusedOps::attention_core`]; under autodiff the gradient of `qkv` comes packed the
    /// same way ([`FusedOps::merge_qkv_heads`]).
    ///
    /// # Shapes
    /// `qkv` `[B, S, 3·nh·hd]` (Q's columns, then K's, then V's; head h of each at
    /// `h·hd..(h+1)·hd`), `heads` nh, `mask_bias` `[B, S]` → `[B, nh, S, hd]`
    ///
    /// # Panics
    /// If `qkv` is not of rank 3 or its width not a multiple of `3 · heads`.
    fn attention_qkv_core(
        qkv: FloatTensor<Self>,
        heads: usize,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        let [q, k, v] = Self::unpack_qkv_heads(qkv, heads);
        Self::attention_core(q, k, v, mask_bias, scale, dropout)
    }

    /// Q, K and V of packed projections (the input of [`FusedOps::attention_qkv_core`]). The
    /// default returns head-strided views (no copy; NdArray's products read them as they are);
    /// CubeCL writes the three contiguous tensors its matmul needs in one launch.
    ///
    /// # Shapes
    /// `qkv` `[B, S, 3·nh·hd]`, `heads` nh → three `[B, nh, S, hd]`
    ///
    /// # Panics
    /// If `qkv` is not of rank 3 or its width not a multiple of `3 · heads`.
    fn unpack_qkv_heads(qkv: FloatTensor<Self>, heads: usize) -> [FloatTensor<Self>; 3] {
        crate::qkv::split_heads::<Self>(qkv, heads)
    }

    /// Q, K and V (or their gradients) packed as [`FusedOps::attention_qkv_core`] reads them:
    /// each part's heads merged and the three side by side. The default concatenates the
    /// merged views (Burn's `cat`: a slice assignment per part); CubeCL writes all three in
    /// one launch, NdArray in one pass on rayon's threads.
    ///
    /// # Shapes
    /// `parts` three `[B, nh, S, hd]` (any strides) → `[B, S, 3·nh·hd]`
    fn merge_qkv_heads(parts: [FloatTensor<Self>; 3]) -> FloatTensor<Self> {
        crate::qkv::reference_merge_heads::<Self>(parts)
    }
}
