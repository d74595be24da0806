//! [`FusedOps`] for `Autodiff<B>`: each op runs the inner backend's forward op and registers a
//! custom backward that calls the inner backend's backward op (the backward kernels on CubeCL
//! backends), instead of letting autodiff differentiate the composition.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};

use crate::{CrossEntropyForward, DropoutSpec, FusedOps, Gelu, LayerNormForward};

/// Takes the gradient registered so far for the parent `$node` (a `NodeRef`) out of `$grads`,
/// if any. `Gradients` finds a gradient by autodiff tensor (or consumes it by node, panicking
/// where there is none), so the key is an untracked autodiff tensor of `$like` (a primitive
/// that is not read) given `$node`'s identity, dropped before this returns.
macro_rules! take_gradient {
    ($grads:expr, $node:expr, $like:expr) => {{
        let (grads, node): (&mut Gradients, _) = ($grads, $node);
        let mut key = <Autodiff<B> as AutodiffBackend>::from_inner($like);
        key.node = std::sync::Arc::clone(node);
        key.rc = std::sync::Arc::new(node.id);
        grads.remove::<B>(&key)
    }};
}

/// Registers `$value` as a gradient of the parent `$node`: summed into the gradient already
/// there through [`FusedOps::accumulate`] (NdArray: in place, on rayon's threads) rather than
/// by `Gradients::register` (a new tensor from `float_add`, on one thread).
macro_rules! register_sum {
    ($grads:expr, $node:expr, $value:expr) => {{
        let (grads, node, value): (&mut Gradients, _, FloatTensor<B>) = ($grads, $node, $value);
        // The key's primitive is `value` itself, dropped again before the sum.
        let value = match take_gradient!(&mut *grads, node, value.clone()) {
            Some(sum) => B::accumulate(sum, value),
            None => value,
        };
        grads.register::<B>(node.id, value);
    }};
}

mod attention;
mod dense;
mod layer_ops;
mod packed_rows;

/// A reshape: parent x; state x's shape. Both ways through [`FusedOps::reshape_contiguous`],
/// so that NdArray moves neither a contiguous activation nor its gradient (Burn's autodiff
/// reshape runs `float_reshape`, which copies on NdArray).
#[derive(Debug)]
struct ReshapeBackward;

impl<B: FusedOps> Backward<B, 1> for ReshapeBackward {
    type State = Shape;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            register_sum!(grads, &node, B::reshape_contiguous(grad, ops.state));
        }
    }
}

#[derive(Debug)]
struct DropoutBackward;

impl<B: FusedOps> Backward<B, 1> for DropoutBackward {
    type State = DropoutSpec;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            // y = x · mask  ⇒  dx = grad · mask: dropout with the same key.
            register_sum!(grads, &node, B::dropout(grad, ops.state));
        }
    }
}

/// [`FusedOps::concat_columns`] of three parts (the packed QKV weight or bias): parents the
/// parts; state their widths. Backward: [`FusedOps::split_columns`] of the gradient.
#[derive(Debug)]
struct ConcatColumnsBackward;

impl<B: FusedOps> Backward<B, 3> for ConcatColumnsBackward {
    type State = [usize; 3];

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if ops.parents.iter().all(Option::is_none) {
            return;
        }
        let parts = B::split_columns(grad, &ops.state);
        for (node, part) in ops.parents.into_iter().zip(parts) {
            if let Some(node) = node {
                register_sum!(grads, &node, part);
            }
        }
    }
}

/// A cast of [`FusedOps::cast_multi_tensor`]: parent the input; state its dtype, to which the
/// gradient is cast back (Burn's cast backward).
#[derive(Debug)]
struct CastBackward;

impl<B: FusedOps> Backward<B, 1> for CastBackward {
    type State = FloatDType;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            register_sum!(grads, &node, B::float_cast(grad, ops.state));
        }
    }
}

/// An autodiff tensor that does not take part in the graph (statistics returned by an op).
fn untracked<B: FusedOps, C: CheckpointStrategy>(x: FloatTensor<B>) -> FloatTensor<Autodiff<B, C>> {
    <Autodiff<B, C> as AutodiffBackend>::from_inner(x)
}

/// Rows of a table at indices: parent the table; state the table (for its shape) and the
/// indices.
#[derive(Debug)]
struct EmbeddingLookupBackward;

impl<B: FusedOps> Backward<B, 1> for EmbeddingLookupBackward {
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_weights] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (weights, indices) = ops.state;
        if let Some(node) = node_weights {
            // The decoder's share of a tied table is there already
            // (FusedOps::tied_decoder_weight): this share is added into it.
            let grad = match take_gradient!(&mut *grads, &node, weights.clone()) {
                Some(sum) => B::embedding_lookup_backward_into(sum, grad, indices),
                None => B::embedding_lookup_backward(weights, grad, indices),
            };
            grads.register::<B>(node.id, grad);
        }
    }
}

/// The tied MLM decoder's matrix (the table transposed): parents the table and the op's
/// `after` (a parent for the order of backward only: it gets no gradient).
#[derive(Debug)]
struct TiedDecoderBackward;

impl<B: FusedOps> Backward<B, 2> for TiedDecoderBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_table, _after] = ops.parents;
        let grad = grads.consume::<B>(&ops.node); // [H, V]
        if let Some(node) = node_table {
            register_sum!(grads, &node, B::float_swap_dims(grad, 0, 1));
        }
    }
}

/// [`FusedOps::ordered_after`]: parents `x` and `after` (a parent for the order of backward
/// only: it gets no gradient); the gradient passes to `x` unchanged.
#[derive(Debug)]
struct OrderedAfterBackward;

impl<B: FusedOps> Backward<B, 2> for OrderedAfterBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, _after] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node_x {
            register_sum!(grads, &node, grad);
        }
    }
}

/// Cross-entropy: parent the logits; state the logits, labels and log-sum-exp.
#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: FusedOps> Backward<B, 1> for CrossEntropyBackward {
    type State = (FloatTensor<B>, IntTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_logits] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (logits, labels, log_sum_exp) = ops.state;
        if let Some(node) = node_logits {
            let d_logits = B::cross_entropy_backward(logits, labels, log_sum_exp, grad);
            register_sum!(grads, &node, d_logits);
        }
    }
}

/// The default bodies (Burn's `cat` and `slice`, tracked as any other op). The trainer builds
/// and takes apart its buckets on the inner backend.
impl<B: FusedOps, C: CheckpointStrategy> crate::BucketOps for Autodiff<B, C> {
    fn writes_marker(x: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        B::writes_marker(&x.primitive)
            .map(<Self as burn::tensor::backend::AutodiffBackend>::from_inner)
    }

    fn await_marker(marker: FloatTensor<Self>) -> Result<(), String> {
        B::await_marker(marker.primitive)
    }
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    const HAS_KERNELS: bool = B::HAS_KERNELS;
    const HAS_MULTI_TENSOR: bool = B::HAS_MULTI_TENSOR;
    const FUSED_BY_DEFAULT: bool = B::FUSED_BY_DEFAULT;

    fn f32_gemm_precision(device: &Self::Device) -> crate::GemmPrecision {
        B::f32_gemm_precision(device)
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        B::memory_reserved(device)
    }

    fn cast_multi_tensor(xs: Vec<FloatTensor<Self>>, dtype: FloatDType) -> Vec<FloatTensor<Self>> {
        let target = DType::from(dtype);
        // The inner backend casts the ones not in `dtype` together; each result then gets
        // its own node.
        let inner = B::cast_multi_tensor(xs.iter().map(|x| x.primitive.clone()).collect(), dtype);
        xs.into_iter()
            .zip(inner)
            .map(|(x, cast)| {
                if x.primitive.dtype() == target {
                    return x;
                }
                let input_dtype = FloatDType::from(x.primitive.dtype());
                match CastBackward
                    .prepare::<C>([x.node.clone()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(input_dtype, cast),
                    OpsKind::UnTracked(prep) => prep.finish(cast),
                }
            })
            .collect()
    }

    fn reshape_contiguous(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        match ReshapeBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let input_shape = x.primitive.shape();
                prep.finish(input_shape, B::reshape_contiguous(x.primitive, shape))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::reshape_contiguous(x.primitive, shape)),
        }
    }

    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
    ) -> CrossEntropyForward<Self> {
        let prepared = CrossEntropyBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful();
        let forward = B::cross_entropy(logits.primitive.clone(), labels.clone());
        let loss = match prepared {
            OpsKind::Tracked(prep) => prep.finish(
                (logits.primitive, labels, forward.log_sum_exp.clone()),
                forward.loss,
            ),
            OpsKind::UnTracked(prep) => prep.finish(forward.loss),
        };
        CrossEntropyForward {
            loss,
            log_sum_exp: untracked::<B, C>(forward.log_sum_exp),
        }
    }

    fn embedding_lookup(weights: FloatTensor<Self>, indices: IntTensor<Self>) -> FloatTensor<Self> {
        match EmbeddingLookupBackward
            .prepare::<C>([weights.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::embedding_lookup(weights.primitive.clone(), indices.clone());
                prep.finish((weights.primitive, indices), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::embedding_lookup(weights.primitive, indices))
            }
        }
    }

    fn tied_decoder_weight(
        table: FloatTensor<Self>,
        after: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let transposed = B::float_swap_dims(table.primitive, 0, 1);
        match TiedDecoderBackward
            .prepare::<C>([table.node.clone(), after.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), transposed),
            OpsKind::UnTracked(prep) => prep.finish(transposed),
        }
    }

    fn ordered_after(x: FloatTensor<Self>, after: FloatTensor<Self>) -> FloatTensor<Self> {
        match OrderedAfterBackward
            .prepare::<C>([x.node.clone(), after.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), x.primitive),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let used = weight.primitive.clone();
        dense::dense::<B, C>(
            x,
            (weight, used),
            bias.map(|b| {
                let used = b.primitive.clone();
                (b, used)
            }),
        )
    }

    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, gelu: Gelu) -> FloatTensor<Self> {
        let used = bias.primitive.clone();
        layer_ops::bias_gelu::<B, C>(x, (bias, used), gelu)
    }

    fn dropout(x: FloatTensor<Self>, dropout: DropoutSpec) -> FloatTensor<Self> {
        match DropoutBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::dropout(x.primitive, dropout);
                prep.finish(dropout, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::dropout(x.primitive, dropout)),
        }
    }

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
        let copies = [&bias, &gamma, &beta].map(|t| t.primitive.clone());
        layer_ops::layer_norm::<B, C>(
            x,
            residual,
            [bias, gamma, beta],
            copies,
            (dropout, dropout_rows),
            eps,
        )
    }

    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        let prepared = attention::AttentionBackward
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful();
        let (output, state) = attention::forward::<B>(
            [q.primitive, k.primitive, v.primitive],
            mask_bias.primitive,
            scale,
            dropout,
        );
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn concat_columns(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        assert!(!xs.is_empty(), "concat_columns of no tensors");
        let xs: [FloatTensor<Self>; 3] = match xs.try_into() {
            Ok(three) => three,
            // Other counts: Burn's autodiff `cat` (its backward slices the gradient).
            Err(xs) => {
                let last = xs[0].primitive.shape().num_dims() - 1;
                return <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_cat(xs, last);
            }
        };
        let widths = xs.each_ref().map(|x| {
            let shape = x.primitive.shape();
            shape[shape.num_dims() - 1]
        });
        let prepared = ConcatColumnsBackward
            .prepare::<C>(xs.each_ref().map(|x| x.node.clone()))
            .compute_bound()
            .stateful();
        let output = B::concat_columns(xs.map(|x| x.primitive).into());
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(widths, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn attention_qkv_core(
        qkv: FloatTensor<Self>,
        heads: usize,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        let prepared = attention::AttentionQkvBackward
            .prepare::<C>([qkv.node.clone()])
            .compute_bound()
            .stateful();
        let (output, state) = attention::forward::<B>(
            B::unpack_qkv_heads(qkv.primitive, heads),
            mask_bias.primitive,
            scale,
            dropout,
        );
        match prepared {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }
}
