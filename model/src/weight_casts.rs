//! Note [Weights cast together]: under a half precision every dense layer's weight and bias is
//! cast to the activations' dtype where it is used (Note [Autocast] in `precision.rs`), one
//! cast launch each: 16 per encoder layer (Q, K, V, the attention output, the FFN's two
//! layers, weight and bias; the fused LayerNorms' γ and β, which that kernel takes in its
//! input's type), 384 per BERT-large forward, each a kernel the GPU waits its turn for. [`BertModel::forward`](crate::BertModel::forward) casts them all first, in one
//! [`FusedOps::cast_multi_tensor`] (on CubeCL up to 32 tensors a launch: apex's
//! `multi_tensor_scale`, which is how apex O2 refreshes its half copy of the model), and the
//! layers take their copy from this scope ([`param_as`], used by `dense_as` and the fused
//! layer's biases, γ and β) instead of casting again. The values are the same bits: the kernel rounds
//! as Burn's cast. Each copy's backward still casts its gradient back to f32, a launch per
//! weight, when the gradient arrives.
//!
//! Where ember differs from NVIDIA's recipe: apex O2 (and the GPU-speed issue's item 3) keeps
//! the half copy between steps, written by the optimizer beside the f32 master. ember casts at
//! every forward, from the weights as they are then: nothing can go stale whatever changes the
//! weights (the optimizers, 1-bit's host path, a checkpoint load, a user's edit), at the cost
//! of reading the f32 weights once per micro-batch (1.3 GB for BERT-large; a few percent of a
//! step's traffic). [`BertModel::set_cast_weights_together`](crate::BertModel) turns it off
//! (a cast where each weight is used, as before).
//!
//! The scope is a stack per thread (a rank's forward runs on one thread), pushed by
//! [`cast_together`] and popped when its guard drops; copies are keyed by [`ParamId`] and by
//! backend type, so a model of another backend (`valid()`'s inner one) never sees them.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;

use burn::module::{Param, ParamId};
use burn::nn::{LayerNorm, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use crate::precision::cast_to;

thread_local! {
    /// The copies of the scopes open on this thread, innermost last.
    static SCOPES: RefCell<Vec<HashMap<ParamId, Box<dyn Any>>>> = const { RefCell::new(Vec::new()) };
}

/// While alive, the weights cast by [`cast_together`] are what [`param_as`] returns.
pub(crate) struct CastScope {
    open: bool,
}

impl CastScope {
    /// An empty scope: every weight cast where it is used, even inside another model's scope
    /// (a nested forward of a clone, same ParamIds, must not take the outer copies).
    pub(crate) fn none() -> Self {
        SCOPES.with(|scopes| scopes.borrow_mut().push(HashMap::new()));
        CastScope { open: true }
    }
}

impl Drop for CastScope {
    fn drop(&mut self) {
        if self.open {
            SCOPES.with(|scopes| scopes.borrow_mut().pop());
        }
    }
}

/// Casts the weights and biases of `linears` and the γ and β of `norms` to `dtype` in one
/// [`FusedOps::cast_multi_tensor`] and opens a scope in which [`param_as`] returns them. In
/// f32 (nothing to cast) no scope opens.
pub(crate) fn cast_together<B: FusedOps>(
    linears: &[&Linear<B>],
    norms: &[&LayerNorm<B>],
    dtype: DType,
) -> CastScope {
    if dtype == DType::F32 {
        return CastScope { open: false };
    }
    let mut weights = Vec::new();
    let mut biases = Vec::new();
    for linear in linears {
        weights.push((linear.weight.id, linear.weight.val()));
        if let Some(bias) = &linear.bias {
            biases.push((bias.id, bias.val()));
        }
    }
    for norm in norms {
        biases.push((norm.gamma.id, norm.gamma.val()));
        if let Some(beta) = &norm.beta {
            biases.push((beta.id, beta.val()));
        }
    }
    let primitives = weights
        .iter()
        .map(|(_, w)| w.clone().into_primitive().tensor())
        .chain(
            biases
                .iter()
                .map(|(_, b)| b.clone().into_primitive().tensor()),
        )
        .collect();
    let mut cast = B::cast_multi_tensor(primitives, FloatDType::from(dtype)).into_iter();
    let mut copies: HashMap<ParamId, Box<dyn Any>> = HashMap::new();
    for (id, _) in weights {
        let w = cast.next().expect("a copy per weight");
        let w: Tensor<B, 2> = Tensor::from_primitive(TensorPrimitive::Float(w));
        copies.insert(id, Box::new(w));
    }
    for (id, _) in biases {
        let b = cast.next().expect("a copy per bias");
        let b: Tensor<B, 1> = Tensor::from_primitive(TensorPrimitive::Float(b));
        copies.insert(id, Box::new(b));
    }
    SCOPES.with(|scopes| scopes.borrow_mut().push(copies));
    CastScope { open: true }
}

/// `param`'s value in `dtype`: the copy [`cast_together`] made in the innermost open scope, or
/// else a cast of its own ([`cast_to`]: `param` itself in its own dtype).
pub(crate) fn param_as<B: Backend, const D: usize>(
    param: &Param<Tensor<B, D>>,
    dtype: DType,
) -> Tensor<B, D> {
    let copy = SCOPES.with(|scopes| {
        scopes
            .borrow()
            .last()
            .and_then(|copies| copies.get(&param.id))
            .and_then(|copy| copy.downcast_ref::<Tensor<B, D>>())
            .filter(|copy| copy.dtype() == dtype)
            .cloned()
    });
    copy.unwrap_or_else(|| cast_to(param.val(), dtype))
}
