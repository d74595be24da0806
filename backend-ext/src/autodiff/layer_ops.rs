//! The fused layer ops with parameters under autodiff: bias + GELU and bias + dropout +
//! residual + LayerNorm, each one node whose parameter parents are either the tensors the
//! kernel reads ([`FusedOps::bias_gelu`], [`FusedOps::bias_dropout_add_layer_norm`]) or the
//! f32 masters of the half copies it reads ([`MasterOps`]), and whose backward writes the
//! parameters' gradients (column sums) in the parents' dtype (Note [Parameter gradients in
//! f32] in `masters.rs`). Also [`MasterOps`] for `Autodiff<B>`.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, TensorMetadata};

use super::{dense, untracked};
use crate::{DropoutSpec, FusedOps, Gelu, LayerNormForward, MasterOps};

/// `GELU(x + bias)`: parents x, the bias (or its master); state x, the bias the kernel read,
/// the dtype of the bias gradient and the GELU's form.
#[derive(Debug)]
struct BiasGeluBackward;

impl<B: FusedOps> Backward<B, 2> for BiasGeluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatDType, Gelu);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, bias, dtype, gelu) = ops.state;
        let grad_z = B::bias_gelu_backward(x, bias, grad, gelu);
        if let Some(node) = node_bias {
            let sum = if grad_z.dtype() == DType::from(dtype) {
                B::sum_rows(grad_z.clone())
            } else {
                let mut sums = B::sum_rows_many_as(vec![grad_z.clone()], dtype);
                sums.pop().expect("one sum per matrix")
            };
            register_sum!(grads, &node, sum);
        }
        if let Some(node) = node_x {
            register_sum!(grads, &node, grad_z);
        }
    }
}

/// What the LayerNorm backward needs: pre-norm sum, mean, rstd, the γ the kernel read,
/// dropout and its padded rows, and the dtype of the bias's, γ's and β's gradients.
type LayerNormState<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    (DropoutSpec, Option<IntTensor<B>>),
    FloatDType,
);

/// `LayerNorm(residual + dropout(x + bias)) · γ + β`: parents x, the bias, the residual, γ,
/// β (the parameters or their masters).
#[derive(Debug)]
struct LayerNormBackwardOp;

impl<B: FusedOps> Backward<B, 5> for LayerNormBackwardOp {
    type State = LayerNormState<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_bias, node_residual, node_gamma, node_beta] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (pre_norm, mean, rstd, gamma, (dropout, dropout_rows), dtype) = ops.state;
        let back = B::bias_dropout_add_layer_norm_backward(
            grad.clone(),
            pre_norm,
            mean,
            rstd,
            gamma,
            dropout,
            dropout_rows,
        );
        // β's, γ's and the bias's gradients: column sums of the same rows, taken together
        // (MasterOps::sum_rows_many_as: two launches for the three on CubeCL), written in the
        // parameters' dtype.
        let mut sums = Vec::new();
        let mut sum_nodes = Vec::new();
        for (node, rows) in [
            (node_beta, grad),
            (node_gamma, back.grad_x_hat),
            (node_bias, back.grad_x.clone()),
        ] {
            if let Some(node) = node {
                sum_nodes.push(node);
                sums.push(rows);
            }
        }
        let sums = if sums
            .first()
            .is_some_and(|s| s.dtype() == DType::from(dtype))
        {
            B::sum_rows_many(sums)
        } else {
            B::sum_rows_many_as(sums, dtype)
        };
        for (node, sum) in sum_nodes.into_iter().zip(sums) {
            register_sum!(grads, &node, sum);
        }
        if let Some(node) = node_x {
            register_sum!(grads, &node, back.grad_x);
        }
        if let Some(node) = node_residual {
            register_sum!(grads, &node, back.grad_pre_norm);
        }
    }
}

/// `GELU(x + used)` with the bias gradient going to `bias` (paired with the inner tensor the
/// kernel reads: itself, or its half copy), written in `bias`'s dtype.
pub(super) fn bias_gelu<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    (bias, used): (FloatTensor<Autodiff<B, C>>, FloatTensor<B>),
    gelu: Gelu,
) -> FloatTensor<Autodiff<B, C>> {
    let dtype = FloatDType::from(bias.primitive.dtype());
    match BiasGeluBackward
        .prepare::<C>([x.node.clone(), bias.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = B::bias_gelu(x.primitive.clone(), used.clone(), gelu);
            prep.finish((x.primitive, used, dtype, gelu), output)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::bias_gelu(x.primitive, used, gelu)),
    }
}

/// The fused LayerNorm of the kernel's `copies` (bias, γ, β), with their gradients going to
/// `params` (the same tensors, or their masters), written in the dtype of `params`; dropout
/// keyed through `dropout_rows` where given (packed rows).
pub(super) fn layer_norm<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    residual: FloatTensor<Autodiff<B, C>>,
    params: [FloatTensor<Autodiff<B, C>>; 3],
    copies: [FloatTensor<B>; 3],
    (dropout, dropout_rows): (DropoutSpec, Option<IntTensor<B>>),
    eps: f64,
) -> LayerNormForward<Autodiff<B, C>> {
    let [bias, gamma, beta] = params;
    let dtype = FloatDType::from(gamma.primitive.dtype());
    let prepared = LayerNormBackwardOp
        .prepare::<C>([
            x.node.clone(),
            bias.node.clone(),
            residual.node.clone(),
            gamma.node.clone(),
            beta.node.clone(),
        ])
        .compute_bound()
        .stateful();
    let [used_bias, used_gamma, used_beta] = copies;
    let forward = B::bias_dropout_add_layer_norm(
        x.primitive,
        used_bias,
        residual.primitive,
        used_gamma.clone(),
        used_beta,
        dropout,
        dropout_rows.clone(),
        eps,
    );
    let output = match prepared {
        OpsKind::Tracked(prep) => {
            let state = (
                forward.pre_norm.clone(),
                forward.mean.clone(),
                forward.rstd.clone(),
                used_gamma,
                (dropout, dropout_rows),
                dtype,
            );
            prep.finish(state, forward.output)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward.output),
    };
    LayerNormForward {
        output,
        pre_norm: untracked::<B, C>(forward.pre_norm),
        mean: untracked::<B, C>(forward.mean),
        rstd: untracked::<B, C>(forward.rstd),
    }
}

impl<B: FusedOps, C: CheckpointStrategy> MasterOps for Autodiff<B, C> {
    fn dense_of_masters(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        weight_half: FloatTensor<Self>,
        bias: Option<(FloatTensor<Self>, FloatTensor<Self>)>,
    ) -> FloatTensor<Self> {
        dense::dense::<B, C>(
            x,
            (weight, weight_half.primitive),
            bias.map(|(b, half)| (b, half.primitive)),
        )
    }

    fn bias_gelu_of_master(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        bias_half: FloatTensor<Self>,
        gelu: Gelu,
    ) -> FloatTensor<Self> {
        bias_gelu::<B, C>(x, (bias, bias_half.primitive), gelu)
    }

    fn bias_dropout_add_layer_norm_of_masters(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        masters: [FloatTensor<Self>; 3],
        copies: [FloatTensor<Self>; 3],
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
        eps: f64,
    ) -> LayerNormForward<Self> {
        layer_norm::<B, C>(
            x,
            residual,
            masters,
            copies.map(|t| t.primitive),
            (dropout, dropout_rows),
            eps,
        )
    }
}
