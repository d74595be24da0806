//! The attention core under autodiff: one node whose backward runs the products and the
//! softmax backward of [`FusedOps`] (the kernels on CubeCL), for Q, K and V given apart
//! ([`FusedOps::attention_core`]: three parents) or packed side by side in one tensor
//! ([`FusedOps::attention_qkv_core`]: one parent, whose gradient is packed the same way;
//! Note [Packed QKV] in `qkv.rs`).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use crate::{DropoutSpec, FusedOps};

/// What the attention backward needs: q, k, v (contiguous), softmax probs, dropped probs,
/// scale, dropout.
pub(super) type AttentionState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    f64,
    DropoutSpec,
);

/// The forward of the inner backend: Q, K and V (`[B, nh, S, hd]`, usually head-strided
/// views) made contiguous once (FusedOps::contiguous), since backward's products read them
/// again; the output and what backward needs.
pub(super) fn forward<B: FusedOps>(
    [q, k, v]: [FloatTensor<B>; 3],
    mask_bias: FloatTensor<B>,
    scale: f64,
    dropout: DropoutSpec,
) -> (FloatTensor<B>, AttentionState<B>) {
    let (q, k, v) = (B::contiguous(q), B::contiguous(k), B::contiguous(v));
    let scores = B::batched_matmul(q.clone(), B::float_swap_dims(k.clone(), 2, 3));
    let softmax = B::masked_softmax_dropout(scores, mask_bias, scale, dropout);
    let output = B::batched_matmul(softmax.dropped.clone(), v.clone());
    let state = (q, k, v, softmax.probs, softmax.dropped, scale, dropout);
    (output, state)
}

/// The gradients of Q, K and V that `wants` asks for, from the output's gradient `grad`
/// (`[B, nh, S, hd]`, usually a head-strided view of the merged context's gradient: made
/// contiguous once for its two products).
fn gradients<B: FusedOps>(
    grad: FloatTensor<B>,
    state: AttentionState<B>,
    [want_q, want_k, want_v]: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let grad = B::contiguous(grad);
    let (q, k, v, probs, dropped, scale, dropout) = state;
    // context = dropped · V  ⇒  dV = droppedᵀ · grad, d(dropped) = grad · Vᵀ: a pair of
    // products where both are needed (one window of host waits on cuBLASLt).
    let wants_scores = want_q || want_k;
    let (grad_v, grad_dropped) = match (want_v, wants_scores) {
        (true, true) => {
            let (grad_v, grad_dropped) = B::batched_matmul_pair(
                B::float_swap_dims(dropped, 2, 3),
                grad.clone(),
                grad,
                B::float_swap_dims(v, 2, 3),
            );
            (Some(grad_v), grad_dropped)
        }
        (true, false) => {
            let grad_v = B::batched_matmul(B::float_swap_dims(dropped, 2, 3), grad);
            return [None, None, Some(grad_v)];
        }
        (false, true) => (None, B::batched_matmul(grad, B::float_swap_dims(v, 2, 3))),
        (false, false) => return [None, None, None],
    };
    let grad_scores = B::masked_softmax_dropout_backward(grad_dropped, probs, scale, dropout);
    // scores = Q · Kᵀ  ⇒  dQ = dS · K, dK = dSᵀ · Q
    let (grad_q, grad_k) = match (want_q, want_k) {
        (true, true) => {
            let (grad_q, grad_k) = B::batched_matmul_pair(
                grad_scores.clone(),
                k,
                B::float_swap_dims(grad_scores, 2, 3),
                q,
            );
            (Some(grad_q), Some(grad_k))
        }
        (true, false) => (Some(B::batched_matmul(grad_scores, k)), None),
        (false, true) => {
            let grad_k = B::batched_matmul(B::float_swap_dims(grad_scores, 2, 3), q);
            (None, Some(grad_k))
        }
        (false, false) => (None, None),
    };
    [grad_q, grad_k, grad_v]
}

/// [`FusedOps::attention_core`]: parents Q, K and V.
#[derive(Debug)]
pub(super) struct AttentionBackward;

impl<B: FusedOps> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let wants = [0, 1, 2].map(|i| ops.parents[i].is_some());
        let computed = gradients::<B>(grad, ops.state, wants);
        for (node, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (node, grad) {
                register_sum!(grads, &node, grad);
            }
        }
    }
}

/// [`FusedOps::attention_qkv_core`]: parent the packed `[B, S, 3·nh·hd]` projections; its
/// gradient is dQ, dK and dV packed the same way by [`FusedOps::merge_qkv_heads`].
#[derive(Debug)]
pub(super) struct AttentionQkvBackward;

impl<B: FusedOps> Backward<B, 1> for AttentionQkvBackward {
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(node) = node else {
            return;
        };
        let [grad_q, grad_k, grad_v] = gradients::<B>(grad, ops.state, [true; 3])
            .map(|grad| grad.expect("the packed attention's backward computes dQ, dK and dV"));
        register_sum!(grads, &node, B::merge_qkv_heads([grad_q, grad_k, grad_v]));
    }
}
