//! The compositions of Burn ops that stand in for fused ops: what the fused path runs for an op
//! among `model.reference_ops`, and what `bench kernels` times each fused op against (Note
//! [Fused where it pays] in `ember-backend-ext`'s `reference_ops.rs`). Each is the reference
//! path's computation (Hugging Face's module by module, with Note [Autocast]'s f32 softmax,
//! LayerNorm and loss) with the fused path's dropout op: one kernel on CubeCL backends, keyed
//! by sample and position as the fused ops' masks (Burn's `Dropout` draws a Bernoulli mask on
//! the device instead). Differentiated by Burn's autodiff; the dropout op has its own
//! backward.
//!
//! The GELU after a dense layer needs none: it is [`crate::hidden_act`] of the dense layer's
//! output with its bias.

use burn::nn::LayerNorm;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOps};

use crate::precision::{cast_to, layer_norm_f32, softmax_f32};

/// `dropout(softmax(Q·Kᵀ·scale + mask_bias))·V`, the softmax in f32 and its result in the
/// inputs' dtype: `BertSelfAttention`'s core with the dropout op.
///
/// # Shapes
/// `q`, `k`, `v` `[B, nh, S, hd]`, `mask_bias` `[B, S]` (0 for real keys, a large negative
/// number for padded ones) → `[B, nh, S, hd]`
pub fn attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_bias: Tensor<B, 2>,
    scale: f64,
    dropout: DropoutSpec,
) -> Tensor<B, 4> {
    let [batch, seq_len] = mask_bias.dims();
    let scores = q.matmul(k.swap_dims(2, 3)) * scale; // [B, nh, S, S]
    let probs = softmax_f32(scores + mask_bias.reshape([batch, 1, 1, seq_len]), 3);
    ember_backend_ext::dropout(probs, dropout).matmul(v)
}

/// `LayerNorm(residual + dropout(x))` with Burn's `LayerNorm` (its γ, β and ε) in f32, the
/// result in `x`'s dtype: `BertSelfOutput`'s and `BertOutput`'s tail with the dropout op; `x`
/// is the dense layer's output with its bias. `norm`'s γ and β must be f32, as the model's
/// parameters are (Burn's CubeCL element-wise ops read the right operand in the left one's
/// type).
///
/// # Shapes
/// `x`, `residual` `[B, S, H]` → `[B, S, H]`
pub fn dropout_add_layer_norm<B: FusedOps>(
    x: Tensor<B, 3>,
    residual: Tensor<B, 3>,
    norm: &LayerNorm<B>,
    dropout: DropoutSpec,
) -> Tensor<B, 3> {
    layer_norm_f32(norm, ember_backend_ext::dropout(x, dropout) + residual)
}

/// Mean cross-entropy of logits against class labels, `mean_i(logsumexp(x_i) − x_i[label_i])`:
/// `log_softmax` in f32, the labels' entries (`gather`) and the negated mean, as
/// `torch.nn.functional.cross_entropy` under autocast computes it; what
/// [`crate::cross_entropy`] fuses.
///
/// # Shapes
/// - `logits`: `[N, C]`
/// - `labels`: `[N]`, values in `0..C`
/// - output: `[1]`, f32
pub fn cross_entropy<B: Backend>(logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    let log_probs = burn::tensor::activation::log_softmax(cast_to(logits, DType::F32), 1);
    log_probs.gather(1, labels.reshape([n, 1])).mean().neg()
}
