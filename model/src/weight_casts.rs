//! Note [Weights cast together]: under a half precision every dense layer's weight and bias is
//! cast to the activations' dtype where it is used (Note [Autocast] in `precision.rs`), one
//! cast launch each: 16 per encoder layer (Q, K, V, the attention output, the FFN's two
//! layers, weight and bias; the fused LayerNorms' γ and β, which that kernel takes in its
//! input's type), 384 per BERT-large forward, each a kernel the GPU waits its turn for. Each
//! encoder layer casts its parameters first, in one [`FusedOps::cast_multi_tensor`] (on
//! CubeCL up to 32 tensors a launch: apex's `multi_tensor_scale`, which is how apex O2
//! refreshes its half copy of the model), and so do the pooler and the pre-training heads;
//! the layers take their copy from this scope ([`param_pair`], used by `dense_as` and the
//! fused layer's biases, γ and β) instead of casting again. The values are the same bits: the
//! kernel rounds as Burn's cast. The copies get no gradient: the ops take the f32 parameter
//! beside its copy and write its gradient in f32, the GEMM the weights', the column sums the
//! biases', γ's and β's (Note [Parameter gradients in f32] in `ember-backend-ext`'s
//! `masters.rs`), where a cast node per copy had cast each gradient back, a launch each.
//!
//! Where ember differs from NVIDIA's recipe: apex O2 (and the GPU-speed issue's item 3) keeps
//! the half copy between steps, written by the optimizer beside the f32 master. ember casts at
//! every forward, from the weights as they are then: nothing can go stale whatever changes the
//! weights (the optimizers, 1-bit's host path, a checkpoint load, a user's edit), at the cost
//! of reading the f32 weights once per micro-batch (1.3 GB for BERT-large; a few percent of a
//! step's traffic). [`BertModel::set_cast_weights_together`](crate::BertModel) turns it off
//! (a cast where each weight is used, as before).
//!
//! Note [Parameters ordered after their layer's input]: Burn runs backward by graph depth
//! (Note [Late gradients] in `ember_trainer`'s `parallel/hooks.rs`). A cast of a parameter,
//! or the packed QKV weight's concatenation (Note [Packed QKV]), is a node of depth 1 or 2,
//! whose backward runs at the very end of backward: the parameter's gradient reached it only
//! then, after every gradient hook had fired. Under a half precision that made every
//! parameter's gradient late (the data-parallel buckets' allreduce waited for the end of
//! backward, overlapping nothing), and in f32 the packed Q, K and V weights' (a quarter of an
//! encoder layer's weights). The scope therefore holds each parameter through
//! [`ember_backend_ext::ordered_after`] with the layer's (hooked) input as `after`: the same
//! values, no kernel, and a depth one more than the input's, so that the casts and the
//! concatenation run in backward right after the layer's own ops and before the hook at its
//! input. `fp16_hooks_deliver_the_parameters_f32_hooks_do` (tests) checks that a
//! half-precision model's hooks deliver the parameters an f32 model's do, final, every encoder
//! layer's included. The price: a multi-tensor cast launch per layer (26 for BERT-large,
//! each with 12 to 16 of its 32 slots used) where one scope for the whole model took 10.
//!
//! The scope is a stack per thread (a rank's forward runs on one thread), pushed by
//! [`layer_scope`] and popped when its guard drops; copies are keyed by [`ParamId`] and by
//! backend type, so a model of another backend (`valid()`'s inner one) never sees them.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Param, ParamId};
use burn::nn::{LayerNorm, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use crate::precision::cast_to;

thread_local! {
    /// The copies of the scopes open on this thread, innermost last.
    static SCOPES: RefCell<Vec<HashMap<ParamId, Box<dyn Any>>>> = const { RefCell::new(Vec::new()) };
}

/// While alive, the parameters [`layer_scope`] holds are what [`param_pair`] starts from.
pub(crate) struct CastScope;

impl Drop for CastScope {
    fn drop(&mut self) {
        SCOPES.with(|scopes| scopes.borrow_mut().pop());
    }
}

/// The parameters of a layer: its matrices (dense weights) and vectors (biases, γ, β).
pub(crate) struct LayerParams<'a, B: Backend> {
    matrices: Vec<&'a Param<Tensor<B, 2>>>,
    vectors: Vec<&'a Param<Tensor<B, 1>>>,
}

impl<'a, B: Backend> LayerParams<'a, B> {
    /// The weights and biases of `linears` and the γ and β of `norms`.
    pub(crate) fn of(linears: &[&'a Linear<B>], norms: &[&'a LayerNorm<B>]) -> Self {
        let mut params = LayerParams {
            matrices: Vec::new(),
            vectors: Vec::new(),
        };
        for linear in linears {
            params.matrices.push(&linear.weight);
            params.vectors.extend(&linear.bias);
        }
        for norm in norms {
            params.vectors.push(&norm.gamma);
            params.vectors.extend(&norm.beta);
        }
        params
    }

    /// These and `vector` (a bias of its own, as the MLM output bias).
    pub(crate) fn and_vector(mut self, vector: &'a Param<Tensor<B, 1>>) -> Self {
        self.vectors.push(vector);
        self
    }
}

/// Opens a scope in which [`param_pair`] takes `params` as this layer's forward uses them: each
/// through [`ember_backend_ext::ordered_after`] `after` (the layer's hooked input; Note
/// [Parameters ordered after their layer's input]) and, in a half `dtype` with `together`,
/// cast to it in one [`FusedOps::cast_multi_tensor`] (Note [Weights cast together]); without
/// `together`, [`param_pair`] casts each where it is used.
pub(crate) fn layer_scope<B: FusedOps, const D: usize>(
    params: LayerParams<'_, B>,
    after: &Tensor<B, D>,
    dtype: DType,
    together: bool,
) -> CastScope {
    let ids: Vec<ParamId> = params
        .matrices
        .iter()
        .map(|p| p.id)
        .chain(params.vectors.iter().map(|p| p.id))
        .collect();
    let primitives: Vec<_> = params
        .matrices
        .iter()
        .map(|p| {
            ember_backend_ext::ordered_after(p.val(), after)
                .into_primitive()
                .tensor()
        })
        .chain(params.vectors.iter().map(|p| {
            ember_backend_ext::ordered_after(p.val(), after)
                .into_primitive()
                .tensor()
        }))
        .collect();
    let casts: Vec<Option<_>> = if together && dtype != DType::F32 {
        B::cast_multi_tensor(primitives.clone(), FloatDType::from(dtype))
            .into_iter()
            .map(Some)
            .collect()
    } else {
        primitives.iter().map(|_| None).collect()
    };
    let matrices = params.matrices.len();
    let mut copies: HashMap<ParamId, Box<dyn Any>> = HashMap::new();
    for (i, ((id, ordered), cast)) in ids.into_iter().zip(primitives).zip(casts).enumerate() {
        let copy: Box<dyn Any> = if i < matrices {
            Box::new(Held::<B, 2>::new(ordered, cast))
        } else {
            Box::new(Held::<B, 1>::new(ordered, cast))
        };
        copies.insert(id, copy);
    }
    SCOPES.with(|scopes| scopes.borrow_mut().push(copies));
    CastScope
}

/// A parameter as a scope holds it: ordered after the layer's input, in its own dtype, and
/// its copy in the scope's half dtype where the scope cast it.
struct Held<B: Backend, const D: usize> {
    ordered: Tensor<B, D>,
    cast: Option<Tensor<B, D>>,
}

impl<B: Backend, const D: usize> Held<B, D> {
    fn new(ordered: FloatTensor<B>, cast: Option<FloatTensor<B>>) -> Self {
        let tensor = |x| Tensor::from_primitive(TensorPrimitive::Float(x));
        Held {
            ordered: tensor(ordered),
            cast: cast.map(tensor),
        }
    }

    /// The value in `dtype`: the scope's copy where it has that dtype, else a cast of the
    /// ordered parameter (never a cast of the copy: an f32 read inside a half scope gets the
    /// f32 values, not the copy's rounded ones).
    fn as_dtype(&self, dtype: DType) -> Tensor<B, D> {
        match &self.cast {
            Some(cast) if cast.dtype() == dtype => cast.clone(),
            _ => cast_to(self.ordered.clone(), dtype),
        }
    }
}

/// `param` as this forward uses it (ordered after the layer's input where [`layer_scope`]
/// holds it, else its value) and its copy in `dtype` (the same tensor where `param` is in
/// `dtype`): what [`ember_backend_ext::dense_of_masters`] takes (Note [Weight gradients in
/// f32] in `ember-backend-ext`'s `linear.rs`).
pub(crate) fn param_pair<B: Backend, const D: usize>(
    param: &Param<Tensor<B, D>>,
    dtype: DType,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let held = SCOPES.with(|scopes| {
        scopes
            .borrow()
            .last()
            .and_then(|copies| copies.get(&param.id))
            .and_then(|copy| copy.downcast_ref::<Held<B, D>>())
            .map(|held| (held.ordered.clone(), held.as_dtype(dtype)))
    });
    held.unwrap_or_else(|| {
        let value = param.val();
        (value.clone(), cast_to(value, dtype))
    })
}

/// The bias of `linear` (zeros without one) and its copy in `dtype` ([`param_pair`]).
pub(crate) fn bias_pair<B: Backend>(
    linear: &Linear<B>,
    dtype: DType,
) -> (Tensor<B, 1>, Tensor<B, 1>) {
    match &linear.bias {
        Some(bias) => param_pair(bias, dtype),
        None => {
            let zeros = Tensor::zeros([linear.weight.dims()[1]], &linear.weight.device());
            (zeros.clone(), cast_to(zeros, dtype))
        }
    }
}

/// A vector parameter as the forward holds it, and its copy in the compute dtype.
pub(crate) type VectorPair<B> = (Tensor<B, 1>, Tensor<B, 1>);

/// γ and β of `norm` (β zeros without one; the fused LayerNorm takes them in its input's
/// storage type and accumulates in f32), each with its copy in `dtype` ([`param_pair`]):
/// what [`ember_backend_ext::bias_dropout_add_layer_norm_of_masters`] takes (Note [Parameter
/// gradients in f32] in `ember-backend-ext`'s `masters.rs`).
pub(crate) fn gamma_beta_pairs<B: Backend>(
    norm: &LayerNorm<B>,
    dtype: DType,
) -> (VectorPair<B>, VectorPair<B>) {
    let gamma = param_pair(&norm.gamma, dtype);
    let beta = match &norm.beta {
        Some(beta) => param_pair(beta, dtype),
        None => (gamma.0.zeros_like(), gamma.1.zeros_like()),
    };
    (gamma, beta)
}
