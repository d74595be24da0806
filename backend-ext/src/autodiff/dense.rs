//! The dense layer under autodiff: one node whose backward runs [`MasterOps::dense_backward_as`](crate::MasterOps::dense_backward_as)
//! (the flattened products on CubeCL, NdArray's GEMM on views), its weight and bias gradients
//! in the dtype of the parameters the node's parents hold: the weight itself for
//! [`FusedOps::dense`], the f32 masters of the half copies the forward multiplied for
//! [`MasterOps::dense_of_masters`](crate::MasterOps::dense_of_masters) (Note [Weight gradients in f32] in `linear.rs`).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, TensorMetadata};

use crate::FusedOps;

/// What the backward needs: x, the weight the forward multiplied, and the dtype of the
/// parameters' gradients.
type DenseState<B> = (FloatTensor<B>, FloatTensor<B>, FloatDType);

/// `x · weight + bias`: parents x, weight, bias.
#[derive(Debug)]
struct DenseBackward;

impl<B: FusedOps> Backward<B, 3> for DenseBackward {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, dtype) = ops.state;
        let (dx, dweight, dbias) =
            B::dense_backward_as(x, weight, grad, node_bias.is_some(), dtype);
        if let Some(node) = node_x {
            register_sum!(grads, &node, dx);
        }
        if let Some(node) = node_weight {
            register_sum!(grads, &node, dweight);
        }
        if let (Some(node), Some(dbias)) = (node_bias, dbias) {
            register_sum!(grads, &node, dbias);
        }
    }
}

/// `x · weight`: parents x, weight.
#[derive(Debug)]
struct DenseNoBiasBackward;

impl<B: FusedOps> Backward<B, 2> for DenseNoBiasBackward {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_weight] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, dtype) = ops.state;
        let (dx, dweight, _) = B::dense_backward_as(x, weight, grad, false, dtype);
        if let Some(node) = node_x {
            register_sum!(grads, &node, dx);
        }
        if let Some(node) = node_weight {
            register_sum!(grads, &node, dweight);
        }
    }
}

/// `x · used + used_bias` with the gradients going to the parameters `weight` and `bias`
/// (each paired with the inner tensor the forward uses: itself, or its half copy), written in
/// `weight`'s dtype.
pub(super) fn dense<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    (weight, used): (FloatTensor<Autodiff<B, C>>, FloatTensor<B>),
    bias: Option<(FloatTensor<Autodiff<B, C>>, FloatTensor<B>)>,
) -> FloatTensor<Autodiff<B, C>> {
    let dtype = FloatDType::from(weight.primitive.dtype());
    let Some((bias, used_bias)) = bias else {
        return match DenseNoBiasBackward
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::dense(x.primitive.clone(), used.clone(), None);
                prep.finish((x.primitive, used, dtype), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::dense(x.primitive, used, None)),
        };
    };
    match DenseBackward
        .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = B::dense(x.primitive.clone(), used.clone(), Some(used_bias));
            prep.finish((x.primitive, used, dtype), output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::dense(x.primitive, used, Some(used_bias))),
    }
}
