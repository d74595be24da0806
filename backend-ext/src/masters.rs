//! The [`MasterOps`] trait: the fused ops of autocast's parameters, each parameter given as
//! its f32 master and the copy in the compute dtype that the kernel reads.
//!
//! Note [Parameter gradients in f32]: under autocast (Note [Autocast] in `ember_model`'s
//! `precision.rs`) a layer reads half copies of its f32 parameters. Had the copies been the
//! ops' parents, each parameter's gradient would come out of backward in the half type and be
//! cast back by the copy's cast node: a launch per parameter (16 per BERT encoder layer: 6
//! weights, 6 biases, two γ and two β), the gradient rounded to 8 (bf16) or 11 (fp16) significant bits
//! on its way to the f32 buckets. Here the masters are the autodiff parents and the backward
//! writes their gradients in the masters' dtype where it computes them: the weight-gradient
//! GEMM from its f32 accumulator (Note [Weight gradients in f32] in `linear.rs`), the column
//! sums of the biases, γ and β from theirs ([`MasterOps::sum_rows_many_as`]). The copies'
//! cast nodes are never reached in backward. Megatron-LM does the same for weights
//! (`gradient_accumulation_fusion`, accumulating into a kept f32 `main_grad`), and apex's
//! `MixedFusedLayerNorm` (Megatron's `fused_mix_prec_layer_norm_cuda`) for γ and β: a half
//! input, f32 γ and β, their gradients written in f32. A deliberate difference from
//! `torch.autocast`, whose parameter gradients are rounded to the half type: ember's are more
//! precise, not equal. The copies are still cast nodes of the graph, never run in backward:
//! bookkeeping only.
//!
//! Without autodiff there are no gradients: the default bodies run the plain op on the
//! copies. Given the same tensor as master and copy, each op is the plain one.

use burn::tensor::FloatDType;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::{DenseGrads, DropoutSpec, FusedOps, Gelu, LayerNormForward, linear};

/// Ops whose parameters come as f32 masters and their half copies (Note [Parameter gradients
/// in f32]); part of [`FusedOps`], whose supertrait it is.
pub trait MasterOps: Backend {
    /// [`FusedOps::dense`] of `weight_half` and `bias_half`, the half copies of the f32
    /// masters `weight` and `bias`: the same output; under autodiff the masters get the
    /// gradients, in their dtype ([`MasterOps::dense_backward_as`]), and the copies none (Note
    /// [Weight gradients in f32] in `linear.rs`).
    ///
    /// # Shapes
    /// `x` `[.., I]`, `weight` and `weight_half` `[I, O]`, `bias` pair `[O]` → `[.., O]`
    fn dense_of_masters(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        weight_half: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
    ) -> FloatTensor<Self>
    where
        Self: FusedOps,
    {
        let _ = weight;
        Self::dense(x, weight_half, bias.map(|(_, half)| half))
    }

    /// [`FusedOps::dense_backward`] with `dweight` and `dbias` in `dtype`, `dx` in `x`'s. The
    /// default casts the products; CubeCL's GEMMs write `dweight` in `dtype` and its column
    /// sums `dbias`.
    ///
    /// # Shapes
    /// as [`FusedOps::dense_backward`]
    fn dense_backward_as(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        with_bias: bool,
        dtype: FloatDType,
    ) -> DenseGrads<Self>
    where
        Self: FusedOps,
    {
        linear::grads_as::<Self>(Self::dense_backward(x, weight, grad, with_bias), dtype)
    }

    /// [`FusedOps::bias_gelu`] of `bias_half`, the copy in `x`'s dtype of the master `bias`:
    /// the same output; under autodiff `bias` is the parent, and its gradient (the column sum
    /// of the pre-activation's gradient) is written in `bias`'s dtype.
    ///
    /// # Shapes
    /// `x` `[R, N]`, `bias` and `bias_half` `[N]` → `[R, N]`
    fn bias_gelu_of_master(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        bias_half: FloatTensor<Self>,
        gelu: Gelu,
    ) -> FloatTensor<Self>
    where
        Self: FusedOps,
    {
        let _ = bias;
        Self::bias_gelu(x, bias_half, gelu)
    }

    /// [`FusedOps::bias_dropout_add_layer_norm`] of `copies` (the bias, γ and β in `x`'s
    /// dtype) of `masters` (the same three in their own): the same output; under autodiff the
    /// masters are the parents, and their gradients (column sums) are written in the masters'
    /// dtype.
    ///
    /// `dropout_rows`: the padded row of each packed row, as
    /// [`FusedOps::bias_dropout_add_layer_norm`] takes it.
    ///
    /// # Shapes
    /// `x`, `residual` `[R, N]`; each of `masters` and `copies` `[N]`; `dropout_rows` `[R]` →
    /// [`LayerNormForward`]
    ///
    /// # Panics
    /// As [`FusedOps::bias_dropout_add_layer_norm`], with `dropout_rows` and dropout on.
    #[allow(clippy::too_many_arguments)]
    fn bias_dropout_add_layer_norm_of_masters(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        masters: [FloatTensor<Self>; 3],
        copies: [FloatTensor<Self>; 3],
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
        eps: f64,
    ) -> LayerNormForward<Self>
    where
        Self: FusedOps,
    {
        let _ = masters;
        let [bias, gamma, beta] = copies;
        Self::bias_dropout_add_layer_norm(
            x,
            bias,
            residual,
            gamma,
            beta,
            dropout,
            dropout_rows,
            eps,
        )
    }

    /// [`FusedOps::sum_rows_many`] written in `dtype`: the masters' gradients of the column
    /// sums that the fused ops' backward takes. The default casts the sums where their dtype
    /// differs; CubeCL's second pass writes `dtype` from its f32 partial sums (no launch more
    /// than the sums in the inputs' dtype).
    ///
    /// # Shapes
    /// each of `xs` `[R, N]` → one `[N]` per matrix, in order, in `dtype`
    fn sum_rows_many_as(xs: Vec<FloatTensor<Self>>, dtype: FloatDType) -> Vec<FloatTensor<Self>>
    where
        Self: FusedOps,
    {
        Self::sum_rows_many(xs)
            .into_iter()
            .map(|sum| linear::cast_to::<Self>(sum, dtype))
            .collect()
    }
}
