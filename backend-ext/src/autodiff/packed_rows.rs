//! [`PackedRowOps`] for `Autodiff<B>`: each op one node whose backward is the inner backend's
//! op of the other direction (the dropout of packed rows its own), so that a gather and a
//! scatter each take one launch forward and one backward on CubeCL backends (Burn's `select`
//! backward is a zero fill and a `select_assign`).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::{DropoutSpec, FusedOps, PackedRowOps};

/// [`PackedRowOps::dropout_rows`]: parent `x`; state the spec and the row map. Backward: the
/// same op on the gradient.
#[derive(Debug)]
struct DropoutRowsBackward;

impl<B: FusedOps> Backward<B, 1> for DropoutRowsBackward {
    type State = (DropoutSpec, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (dropout, rows) = ops.state;
        if let Some(node) = node_x {
            register_sum!(grads, &node, B::dropout_rows(grad, dropout, rows));
        }
    }
}

/// [`PackedRowOps::gather_rows`] (`gathered`) or [`PackedRowOps::scatter_rows`]: parent `x`;
/// state the row map both ways and the direction. Backward: the other direction on the
/// gradient.
#[derive(Debug)]
struct MovedRowsBackward;

impl<B: FusedOps> Backward<B, 1> for MovedRowsBackward {
    type State = (IntTensor<B>, IntTensor<B>, bool);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rows, slots, gathered) = ops.state;
        if let Some(node) = node_x {
            let moved = if gathered {
                B::scatter_rows(grad, rows, slots)
            } else {
                B::gather_rows(grad, rows, slots)
            };
            register_sum!(grads, &node, moved);
        }
    }
}

/// The rows of `x` gathered (`gathered`) or scattered by the inner backend, tracked as one
/// node.
fn move_rows<B: FusedOps, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    rows: IntTensor<B>,
    slots: IntTensor<B>,
    gathered: bool,
) -> FloatTensor<Autodiff<B, C>> {
    let inner = |x, rows, slots| {
        if gathered {
            B::gather_rows(x, rows, slots)
        } else {
            B::scatter_rows(x, rows, slots)
        }
    };
    match MovedRowsBackward
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let output = inner(x.primitive, rows.clone(), slots.clone());
            prep.finish((rows, slots, gathered), output)
        }
        OpsKind::UnTracked(prep) => prep.finish(inner(x.primitive, rows, slots)),
    }
}

impl<B: FusedOps, C: CheckpointStrategy> PackedRowOps for Autodiff<B, C> {
    fn dropout_rows(
        x: FloatTensor<Self>,
        dropout: DropoutSpec,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match DropoutRowsBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::dropout_rows(x.primitive, dropout, rows.clone());
                prep.finish((dropout, rows), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::dropout_rows(x.primitive, dropout, rows)),
        }
    }

    fn slots_of_rows(rows: IntTensor<Self>, padded_rows: usize) -> IntTensor<Self> {
        B::slots_of_rows(rows, padded_rows)
    }

    fn gather_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        move_rows::<B, C>(x, rows, slots, true)
    }

    fn scatter_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        move_rows::<B, C>(x, rows, slots, false)
    }
}
