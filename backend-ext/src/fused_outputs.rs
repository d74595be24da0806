//! What the [`FusedOps`](crate::FusedOps) methods return.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

#[cfg(doc)]
use crate::FusedOps;

/// What [`FusedOps::bias_dropout_add_layer_norm`] returns: the output and what backward needs.
#[derive(Debug, Clone)]
pub struct LayerNormForward<B: Backend> {
    /// `LayerNorm(residual + dropout(x + bias))`, `[R, N]`.
    pub output: FloatTensor<B>,
    /// `residual + dropout(x + bias)`, the LayerNorm input, `[R, N]`.
    pub pre_norm: FloatTensor<B>,
    /// Mean of each row of `pre_norm`, `[R]`: f32 on CubeCL backends whatever the input's
    /// type (Note [LayerNorm statistics in f32] in `cube/mod.rs`), the input's elsewhere.
    pub mean: FloatTensor<B>,
    /// `1 / sqrt(var + eps)` of each row (biased variance), `[R]`, in `mean`'s type.
    pub rstd: FloatTensor<B>,
}

/// What [`FusedOps::bias_dropout_add_layer_norm_backward`] returns.
#[derive(Debug, Clone)]
pub struct LayerNormBackward<B: Backend> {
    /// Gradient of the LayerNorm input (= of `residual`), `[R, N]`.
    pub grad_pre_norm: FloatTensor<B>,
    /// Gradient of `x` (and, summed over rows, of `bias`): `grad_pre_norm` through the dropout
    /// mask, `[R, N]`.
    pub grad_x: FloatTensor<B>,
    /// `grad · x̂` per element; summed over rows it is the gradient of `gamma`, `[R, N]`.
    pub grad_x_hat: FloatTensor<B>,
}

/// What [`FusedOps::masked_softmax_dropout`] returns.
#[derive(Debug, Clone)]
pub struct SoftmaxForward<B: Backend> {
    /// `softmax(scores · scale + mask_bias)` over the last dim, `[B, nh, S, S]`.
    pub probs: FloatTensor<B>,
    /// `probs` after dropout (kept values scaled by `1 / (1 − p)`), `[B, nh, S, S]`.
    pub dropped: FloatTensor<B>,
}

/// [`FusedOps::dense_backward`]'s gradients: `(dx, dweight, dbias)`, `dbias` when asked for.
pub type DenseGrads<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

/// A primitive float tensor as a `Tensor` of rank `D`.
pub(crate) fn float<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// A `Tensor`'s float primitive.
pub(crate) fn prim<B: Backend, const D: usize>(x: Tensor<B, D>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}
