//! Gradient hooks: an identity autodiff op whose backward hands parameter gradients to a
//! callback the moment they are final (see docs/ARCHITECTURE.md, Trainer, and
//! [`ForwardHook`]).

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::Mutex;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use ember_backend_ext::FusedOps;
use ember_data::Batch;
use ember_model::{BertForPreTraining, ForwardHook};

/// Gradients delivered by one hook: `(parameter, gradient)` pairs, each gradient a tensor of
/// the inner (non-autodiff) backend in the parameter's shape, where backward left it (on the
/// device: delivering it reads nothing; Note [Bucket storage] in `buckets.rs`).
pub type HookGradients<B> = Vec<(ParamId, FloatTensor<B>)>;

/// What a hook calls in backward: `(group, gradients)`.
pub struct GradCallback<B: Backend>(pub Arc<dyn Fn(usize, HookGradients<B>) + Send + Sync>);

impl<B: Backend> Clone for GradCallback<B> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<B: Backend> std::fmt::Debug for GradCallback<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GradCallback")
    }
}

/// An autodiff backend on which a gradient hook can be placed, and that (like its inner
/// backend) has the fused ops of `ember-backend-ext`.
pub trait GradHookBackend: AutodiffBackend<InnerBackend: FusedOps> + FusedOps {
    /// Returns `x` unchanged. In backward, passes the gradient through to `x` and then calls
    /// `callback(group, grads)` with the current gradient of each of `params` (those that
    /// have one).
    fn grad_hook(
        x: FloatTensor<Self>,
        group: usize,
        params: Vec<(ParamId, FloatTensor<Self>)>,
        callback: GradCallback<Self::InnerBackend>,
    ) -> FloatTensor<Self>;

    /// Returns `weight` (`[V, H]`) transposed, `[H, V]`: the MLM decoder's matrix. In
    /// backward, calls `callback(0, [(decoder, g)])` with the decoder's share `g` (`[V, H]`) of
    /// the tied weight's gradient and passes nothing on to `weight` (Note [Tied embedding
    /// split]). `after` (the MLM transform's output) is a parent only for the order of
    /// backward: the op runs right after the decoder's matmul.
    fn decoder_hook(
        weight: FloatTensor<Self>,
        after: FloatTensor<Self>,
        decoder: ParamId,
        callback: GradCallback<Self::InnerBackend>,
    ) -> FloatTensor<Self>;
}

/// The decoder op of Note [Tied embedding split].
struct DecoderBackward<C>(PhantomData<C>);

impl<C> std::fmt::Debug for DecoderBackward<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DecoderBackward")
    }
}

struct DecoderState<B: Backend> {
    decoder: ParamId,
    callback: GradCallback<B>,
}

impl<B: Backend> Clone for DecoderState<B> {
    fn clone(&self) -> Self {
        Self {
            decoder: self.decoder,
            callback: self.callback.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for DecoderState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecoderState")
            .field("decoder", &self.decoder)
            .finish()
    }
}

impl<B: Backend, C: CheckpointStrategy> Backward<B, 2> for DecoderBackward<C> {
    type State = DecoderState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node); // [H, V]
        let share = B::float_swap_dims(grad, 0, 1); // [V, H]
        (ops.state.callback.0)(0, vec![(ops.state.decoder, share)]);
    }
}

/// The hook op; `C` only names the autodiff tensor type (`FloatTensor<Autodiff<B, C>>`).
struct HookBackward<C>(PhantomData<C>);

impl<C> std::fmt::Debug for HookBackward<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HookBackward")
    }
}

struct HookState<B: Backend, C: CheckpointStrategy> {
    group: usize,
    params: Vec<(ParamId, FloatTensor<Autodiff<B, C>>)>,
    callback: GradCallback<B>,
}

impl<B: Backend, C: CheckpointStrategy> Clone for HookState<B, C> {
    fn clone(&self) -> Self {
        Self {
            group: self.group,
            params: self.params.clone(),
            callback: self.callback.clone(),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> std::fmt::Debug for HookState<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookState")
            .field("group", &self.group)
            .field("params", &self.params.len())
            .finish()
    }
}

impl<B: Backend, C: CheckpointStrategy> Backward<B, 1> for HookBackward<C> {
    type State = HookState<B, C>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            grads.register::<B>(parent.id, grad);
        }
        let HookState {
            group,
            params,
            callback,
        } = ops.state;
        let delivered = params
            .iter()
            .filter_map(|(id, tensor)| grads.get::<B>(tensor).map(|g| (*id, g)))
            .collect();
        (callback.0)(group, delivered);
    }
}

impl<B: FusedOps, C: CheckpointStrategy> GradHookBackend for Autodiff<B, C> {
    fn grad_hook(
        x: FloatTensor<Self>,
        group: usize,
        params: Vec<(ParamId, FloatTensor<Self>)>,
        callback: GradCallback<B>,
    ) -> FloatTensor<Self> {
        match HookBackward::<C>(PhantomData)
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                HookState {
                    group,
                    params,
                    callback,
                },
                x.primitive,
            ),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        }
    }

    fn decoder_hook(
        weight: FloatTensor<Self>,
        after: FloatTensor<Self>,
        decoder: ParamId,
        callback: GradCallback<B>,
    ) -> FloatTensor<Self> {
        let transposed = B::float_swap_dims(weight.primitive, 0, 1);
        match DecoderBackward::<C>(PhantomData)
            .prepare::<C>([weight.node.clone(), after.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(DecoderState { decoder, callback }, transposed),
            OpsKind::UnTracked(prep) => prep.finish(transposed),
        }
    }
}

/// Which hook group a parameter path belongs to, in the order groups become final in
/// backward: 0 = pooler and heads, then encoder layers from the last (1) to the first
/// (`num_layers`), then `num_layers + 1` = the embeddings, final only when backward returns
/// (the word embedding is also the MLM decoder, used at both ends of the graph).
pub fn hook_group(path: &str, num_layers: usize) -> usize {
    if let Some(rest) = path.strip_prefix("bert.encoder.layer.") {
        let layer: usize = rest
            .split('.')
            .next()
            .and_then(|s| s.parse().ok())
            .expect("encoder parameter paths are bert.encoder.layer.<i>.…");
        num_layers - layer
    } else if path.starts_with("bert.pooler.") || path.starts_with("cls.") {
        0
    } else {
        num_layers + 1
    }
}

/// The [`ForwardHook`] that puts a gradient hook at every layer boundary of a
/// [`BertForPreTraining`], with the parameters of the layer (or of the heads) behind it.
///
/// Note [Late gradients]: Burn 0.21 runs backward by graph depth (a node's depth is its
/// deepest parent's plus one), not by reverse creation order. A parameter that reaches its
/// layer through a reshape (LayerNorm's gamma and beta, `unsqueeze`d, where the LayerNorm is
/// composed of Burn ops: the embeddings', the MLM transform's and the encoder's under
/// `Kernels::Reference` or with `layer_norm` among `model.reference_ops`, which the fused
/// ops replace with one op taking gamma and beta as
/// direct parents; the MLM output bias until the decoder became one `FusedOps::dense`
/// op with the bias as a direct parent) sits
/// behind a depth-1 node, whose backward runs at the very end: at the layer's hook its
/// gradient does not exist yet. So did, until the model held each layer's parameters
/// ordered after the layer's input (Note [Parameters ordered after their layer's input] in
/// `ember_model`'s `weight_casts.rs`), every parameter under a half precision (behind its
/// cast) and the packed Q, K and V weights (behind their concatenation). [`ready_order`] finds out which parameters a hook can
/// deliver by running one backward and comparing every hooked gradient with the final one;
/// the rest are delivered after backward, with the embeddings (PyTorch DDP likewise rebuilds
/// its buckets from the order gradients became ready in the first iteration).
pub struct GradHooks<B: GradHookBackend> {
    /// Parameters of each group (see [`hook_group`]), as the current autodiff tensors.
    groups: Vec<Vec<(ParamId, FloatTensor<B>)>>,
    num_layers: usize,
    callback: GradCallback<B::InnerBackend>,
    /// The decoder's share of the tied gradient goes to this id (Note [Tied embedding split]).
    decoder: Option<ParamId>,
}

impl<B: GradHookBackend> GradHooks<B> {
    /// Hooks for `model`'s current parameters, calling `callback` from backward with the
    /// gradients of the parameters in `deliver` (all of them when `None`).
    pub fn new(
        model: &BertForPreTraining<B>,
        callback: GradCallback<B::InnerBackend>,
        deliver: Option<&HashSet<ParamId>>,
    ) -> Self
    where
        BertForPreTraining<B>: AutodiffModule<B>,
    {
        let num_layers = model.bert.encoder.layer.len();
        struct Collect<'a, B: Backend> {
            stack: Vec<String>,
            groups: Vec<Vec<(ParamId, FloatTensor<B>)>>,
            num_layers: usize,
            deliver: Option<&'a HashSet<ParamId>>,
        }
        impl<B: Backend> ModuleVisitor<B> for Collect<'_, B> {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.stack.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.stack.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.deliver.is_some_and(|d| !d.contains(&param.id)) {
                    return;
                }
                let group = hook_group(&self.stack.join("."), self.num_layers);
                self.groups[group].push((param.id, param.val().into_primitive().tensor()));
            }
        }
        let mut collect = Collect {
            stack: Vec::new(),
            groups: vec![Vec::new(); num_layers + 2],
            num_layers,
            deliver,
        };
        model.visit(&mut collect);
        Self {
            groups: collect.groups,
            num_layers,
            callback,
            decoder: None,
        }
    }

    /// Splits the tied word embedding's gradient (Note [Tied embedding split]): the decoder's
    /// share is delivered in backward as the gradient of `decoder`, when `Some`.
    pub fn with_decoder(mut self, decoder: Option<ParamId>) -> Self {
        self.decoder = decoder;
        self
    }

    fn hook(&self, x: Tensor<B, 3>, group: usize) -> Tensor<B, 3> {
        let out = B::grad_hook(
            x.into_primitive().tensor(),
            group,
            self.groups[group].clone(),
            self.callback.clone(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

impl<B: GradHookBackend> ForwardHook<B> for GradHooks<B> {
    fn layer_input(&self, layer: usize, hidden_states: Tensor<B, 3>) -> Tensor<B, 3> {
        self.hook(hidden_states, self.num_layers - layer)
    }

    fn heads_input(&self, sequence_output: Tensor<B, 3>) -> Tensor<B, 3> {
        self.hook(sequence_output, 0)
    }

    fn decoder_weight(
        &self,
        word_embeddings: Tensor<B, 2>,
        transformed: &Tensor<B, 2>,
    ) -> Tensor<B, 2> {
        let Some(decoder) = self.decoder else {
            return ember_backend_ext::tied_decoder_weight(word_embeddings, transformed);
        };
        let out = B::decoder_hook(
            word_embeddings.into_primitive().tensor(),
            transformed.clone().into_primitive().tensor(),
            decoder,
            self.callback.clone(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }
}

/// The order in which a model's gradients become final in backward (see
/// Note [Late gradients]).
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyOrder {
    /// `(hook group, parameters)` in the order the hooks fired; each parameter's gradient was
    /// final when its hook fired.
    pub hooked: Vec<(usize, Vec<ParamId>)>,
    /// Parameters whose gradients are final only when backward returns, in reverse model
    /// order.
    pub late: Vec<ParamId>,
}

impl ReadyOrder {
    /// Every parameter, hooked ones first in firing order, then the late ones.
    pub fn params(&self) -> Vec<ParamId> {
        self.hooked
            .iter()
            .flat_map(|(_, ids)| ids.iter().copied())
            .chain(self.late.iter().copied())
            .collect()
    }

    /// The parameters a hook delivers.
    pub fn hooked_set(&self) -> HashSet<ParamId> {
        self.hooked
            .iter()
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect()
    }
}

/// Runs one forward and backward of `model` on `batch` with hooks that record what they
/// deliver, and compares each delivered gradient with the final one: equal means the hook
/// saw it final. With `decoder`, the tied word embedding's gradient is split (Note [Tied
/// embedding split]): `decoder` is delivered by the decoder op, final by construction.
/// Backward does not change the model.
pub fn ready_order<B: GradHookBackend>(
    model: &BertForPreTraining<B>,
    batch: Batch<B>,
    decoder: Option<ParamId>,
) -> ReadyOrder
where
    BertForPreTraining<B>: AutodiffModule<B>,
{
    let fired: Arc<Mutex<Vec<(usize, HookGradients<B::InnerBackend>)>>> = Arc::default();
    let record = fired.clone();
    let callback = GradCallback(Arc::new(move |group, grads| {
        record.lock().unwrap().push((group, grads));
    }));
    let hooks = GradHooks::new(model, callback, None).with_decoder(decoder);
    let (_, loss) = crate::eval::forward_loss_hooked(model, batch, &hooks);
    let grads = GradientsParams::from_grads(loss.total.backward(), model);
    drop(hooks);
    let final_grads: HashMap<ParamId, TensorData> = {
        let ids: Vec<ParamId> = crate::grads::named_params::<B, _>(model)
            .into_iter()
            .map(|(_, id)| id)
            .collect();
        let mut grads = grads;
        crate::grads::take_grads(model, &mut grads, &ids)
            .into_iter()
            .map(|(id, g)| (id, host_data::<B::InnerBackend>(g)))
            .collect()
    };
    let fired = std::mem::take(&mut *fired.lock().unwrap());
    let mut hooked = Vec::new();
    let mut on_time = HashSet::new();
    for (group, grads) in fired {
        // Within a group, reverse model order (the group lists them in model order).
        let ids: Vec<ParamId> = grads
            .into_iter()
            .rev()
            .filter(|(id, grad)| {
                Some(*id) == decoder
                    || final_grads.get(id) == Some(&host_data::<B::InnerBackend>(grad.clone()))
            })
            .map(|(id, _)| id)
            .collect();
        on_time.extend(ids.iter().copied());
        hooked.push((group, ids));
    }
    let late = crate::grads::named_params::<B, _>(model)
        .into_iter()
        .rev()
        .map(|(_, id)| id)
        .filter(|id| !on_time.contains(id))
        .collect();
    ReadyOrder { hooked, late }
}

/// A gradient's values on the host, as f32 in its shape (for the start-up probe).
fn host_data<B: Backend>(grad: FloatTensor<B>) -> TensorData {
    let shape = grad.shape();
    let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
        grad,
        Shape::new([shape.num_elements()]),
    )))
    .into_data()
    .convert::<f32>();
    TensorData::new(data.into_vec::<f32>().expect("f32 after convert"), shape)
}
