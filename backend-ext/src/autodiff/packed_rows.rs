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

/// [`PackedRowOps::gather_rows`]: parent `x`; state the row map both ways. Backward:
/// [`PackedRowOps::scatter_rows`] of the gradient.
#[derive(Debug)]
struct GatherRowsBackward;

impl<B: FusedOps> Backward<B, 1> for GatherRowsBackward {
    type State = (IntTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rows, slots) = ops.state;
        if let Some(node) = node_x {
            register_sum!(grads, &node, B::scatter_rows(grad, rows, slots));
        }
    }
}

/// [`PackedRowOps::scatter_rows`]: parent `x`; state the row map both ways. Backward:
/// [`PackedRowOps::gather_rows`] of the gradient.
#[derive(Debug)]
struct ScatterRowsBackward;

impl<B: FusedOps> Backward<B, 1> for ScatterRowsBackward {
    type State = (IntTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (rows, slots) = ops.state;
        if let Some(node) = node_x {
            register_sum!(grads, &node, B::gather_rows(grad, rows, slots));
        }
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

    fn gather_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match GatherRowsBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::gather_rows(x.primitive, rows.clone(), slots.clone());
                prep.finish((rows, slots), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gather_rows(x.primitive, rows, slots)),
        }
    }

    fn scatter_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match ScatterRowsBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::scatter_rows(x.primitive, rows.clone(), slots.clone());
                prep.finish((rows, slots), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::scatter_rows(x.primitive, rows, slots)),
        }
    }
}
