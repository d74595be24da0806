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
//! Note [Packed QKV cast once]: where the query, key and value projections run as one dense
//! layer (Note [Packed QKV] in `ember-backend-ext`'s `qkv.rs`), a half-precision forward needs
//! the packed f32 weight and bias (the parents whose gradient is split back to the three
//! projections) and their half copies (what the GEMM reads). Concatenating the masters and,
//! again, the scope's half copies took four launches per layer, and the copies of the
//! separate Q, K and V were read once, by the concatenation. The scope now concatenates the
//! ordered masters (two launches) and casts the two concatenations in its one multi-tensor
//! cast beside the layer's other parameters ([`LayerParams::and_packed_qkv`],
//! [`packed_qkv_pair`]): two launches per layer fewer, and the separate projections are not
//! cast at all. The copies are the same bits (a cast of a concatenation is the concatenation
//! of the casts). Only where the parameters take gradients: without autodiff (evaluation, the
//! embedding model) no f32 concatenation is needed, and `packed_qkv` concatenates the scope's
//! half copies alone, as before. NVIDIA's MLPerf BERT stores the packed weight and its half copy; ember packs
//! Hugging Face's three parameters at each forward (Note [Packed QKV]).
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
    /// The scopes open on this thread, innermost last.
    static SCOPES: RefCell<Vec<Scope>> = const { RefCell::new(Vec::new()) };
}

/// What a scope holds: each parameter by id (a `Held<B, D>`), and the packed Q, K, V weight
/// and bias.
struct Scope {
    params: HashMap<ParamId, Box<dyn Any>>,
    packed_qkv: Option<PackedHeld>,
}

/// The packed Q, K, V weight and bias as a scope holds them (a `Held<B, 2>` and a
/// `Held<B, 1>`), by the query weight's id.
type PackedHeld = (ParamId, Box<dyn Any>, Box<dyn Any>);

/// While alive, the parameters [`layer_scope`] holds are what [`param_pair`] starts from.
pub(crate) struct CastScope;

impl Drop for CastScope {
    fn drop(&mut self) {
        SCOPES.with(|scopes| scopes.borrow_mut().pop());
    }
}

/// The parameters of a layer: its matrices (dense weights) and vectors (biases, γ, β), and
/// the query, key and value projections where they are packed (Note [Packed QKV]).
pub(crate) struct LayerParams<'a, B: Backend> {
    matrices: Vec<&'a Param<Tensor<B, 2>>>,
    vectors: Vec<&'a Param<Tensor<B, 1>>>,
    packed_qkv: Option<[&'a Linear<B>; 3]>,
}

impl<'a, B: Backend> LayerParams<'a, B> {
    /// The weights and biases of `linears` and the γ and β of `norms`.
    pub(crate) fn of(linears: &[&'a Linear<B>], norms: &[&'a LayerNorm<B>]) -> Self {
        let mut params = LayerParams {
            matrices: Vec::new(),
            vectors: Vec::new(),
            packed_qkv: None,
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

    /// These and the query, key and value projections `qkv`, packed: the scope concatenates
    /// their weights and their biases and casts the two concatenations with the rest (Note
    /// [Packed QKV cast once]).
    pub(crate) fn and_packed_qkv(mut self, qkv: [&'a Linear<B>; 3]) -> Self {
        self.packed_qkv = Some(qkv);
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
    let mut primitives: Vec<_> = params
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
    // Note [Packed QKV cast once]: the f32 weights and biases concatenated, then cast below
    // with the layer's other parameters.
    let packed = params.packed_qkv.map(|qkv| {
        let weights = qkv
            .iter()
            .map(|l| ember_backend_ext::ordered_after(l.weight.val(), after))
            .collect();
        let biases = qkv
            .iter()
            .map(|l| match &l.bias {
                Some(bias) => ember_backend_ext::ordered_after(bias.val(), after),
                None => Tensor::zeros([l.weight.dims()[1]], &l.weight.device()),
            })
            .collect();
        let weight = ember_backend_ext::concat_columns(weights);
        let bias = ember_backend_ext::concat_columns::<B, 1>(biases);
        primitives.push(weight.clone().into_primitive().tensor());
        primitives.push(bias.clone().into_primitive().tensor());
        (qkv[0].weight.id, weight, bias)
    });
    let mut casts: Vec<Option<_>> = if together && dtype != DType::F32 {
        B::cast_multi_tensor(primitives.clone(), FloatDType::from(dtype))
            .into_iter()
            .map(Some)
            .collect()
    } else {
        primitives.iter().map(|_| None).collect()
    };
    let packed_qkv = packed.map(|(id, weight, bias)| {
        let bias_cast = casts.pop().expect("the packed bias's slot");
        let weight_cast = casts.pop().expect("the packed weight's slot");
        primitives.truncate(primitives.len() - 2);
        let weight: Box<dyn Any> = Box::new(Held::<B, 2>::new(
            weight.into_primitive().tensor(),
            weight_cast,
        ));
        let bias: Box<dyn Any> =
            Box::new(Held::<B, 1>::new(bias.into_primitive().tensor(), bias_cast));
        (id, weight, bias)
    });
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
    SCOPES.with(|scopes| {
        scopes.borrow_mut().push(Scope {
            params: copies,
            packed_qkv,
        })
    });
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
            .and_then(|scope| scope.params.get(&param.id))
            .and_then(|copy| copy.downcast_ref::<Held<B, D>>())
            .map(|held| (held.ordered.clone(), held.as_dtype(dtype)))
    });
    held.unwrap_or_else(|| {
        let value = param.val();
        (value.clone(), cast_to(value, dtype))
    })
}

/// The packed Q, K, V weight and bias of the innermost scope, where it packed the projections
/// whose query weight is `query` (Note [Packed QKV cast once]): each as the concatenation of
/// the ordered parameters and its copy in `dtype`.
#[allow(clippy::type_complexity)]
pub(crate) fn packed_qkv_pair<B: Backend>(
    query: ParamId,
    dtype: DType,
) -> Option<((Tensor<B, 2>, Tensor<B, 2>), (Tensor<B, 1>, Tensor<B, 1>))> {
    SCOPES.with(|scopes| {
        let scopes = scopes.borrow();
        let (id, weight, bias) = scopes.last()?.packed_qkv.as_ref()?;
        let weight = weight.downcast_ref::<Held<B, 2>>()?;
        let bias = bias.downcast_ref::<Held<B, 1>>()?;
        (*id == query).then(|| {
            (
                (weight.ordered.clone(), weight.as_dtype(dtype)),
                (bias.ordered.clone(), bias.as_dtype(dtype)),
            )
        })
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
