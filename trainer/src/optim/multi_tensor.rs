//! [`MultiTensorOptimizer`]: AdamW or LAMB over whole parameter groups through
//! `ember-backend-ext`'s multi-tensor ops, with the parameters owned by the step.

use std::collections::{HashMap, HashSet};

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Shape, Tensor, TensorPrimitive};
use ember_backend_ext::{AdamKind, AdamTensors, FusedOps, lamb_multi_tensor};

use super::{adam_hyper, no_decay_ids};
use crate::config::{OptimizerConfig, OptimizerKind};

/// AdamW (Burn's formula, PyTorch's) or LAMB (as [`Lamb`](super::Lamb)) over whole parameter groups
/// through `ember-backend-ext`'s multi-tensor ops, as apex's `FusedAdam` / `FusedLAMB` run on
/// `multi_tensor_apply`: one launch updates up to 32 tensors (AdamW: one launch per 32
/// tensors; LAMB: update, both norms, and the trust-ratio step, three launches per 32 tensors
/// and the norms' final sum). On backends without kernels the ops are the reference
/// compositions, tensor by tensor.
///
/// Weight decay follows [`uses_weight_decay`](super::uses_weight_decay); moments are kept per parameter, flat `[n]`.
pub struct MultiTensorOptimizer<B: AutodiffBackend<InnerBackend: FusedOps>> {
    lamb: bool,
    /// LAMB: adapt the group without weight decay too ([`OptimizerConfig::nvlamb`]).
    nvlamb: bool,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    no_decay_ids: HashSet<ParamId>,
    /// `(m, v, t)` of each parameter stepped so far.
    pub(crate) state: HashMap<
        ParamId,
        (
            FloatTensor<B::InnerBackend>,
            FloatTensor<B::InnerBackend>,
            usize,
        ),
    >,
}

/// A parameter with a gradient, flattened for the multi-tensor ops.
struct Flat<B: AutodiffBackend> {
    id: ParamId,
    shape: Shape,
    require_grad: bool,
    param: FloatTensor<B::InnerBackend>,
    grad: FloatTensor<B::InnerBackend>,
}

impl<B: AutodiffBackend<InnerBackend: FusedOps>> MultiTensorOptimizer<B> {
    pub(super) fn new<M: AutodiffModule<B>>(config: &OptimizerConfig, module: &M) -> Self {
        Self {
            lamb: config.name.exact() == OptimizerKind::Lamb,
            nvlamb: config.nvlamb,
            beta_1: config.beta1,
            beta_2: config.beta2,
            epsilon: config.epsilon,
            weight_decay: config.weight_decay,
            no_decay_ids: no_decay_ids::<B, M>(module),
            state: HashMap::new(),
        }
    }

    /// One update of every parameter of `module` that has a gradient in `grads`.
    pub fn step<M: AutodiffModule<B>>(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> M {
        // Each parameter with a gradient is moved out of the module (a zero-size stand-in
        // holds its place until `Replace` below): the step then holds the parameter's only
        // reference, and NdArray's AdamW writes into its buffer instead of copying it
        // (`FusedOps::adam_multi_tensor`, copy-on-write). A parameter that something else
        // still holds (a caller's clone of the module) is copied, as before.
        struct Take<'a, B: AutodiffBackend> {
            grads: &'a mut GradientsParams,
            out: Vec<Flat<B>>,
        }
        impl<B: AutodiffBackend> ModuleMapper<B> for Take<'_, B> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
                    return param;
                };
                let (id, tensor, mapper) = param.consume();
                let require_grad = tensor.is_require_grad();
                let device = tensor.device();
                let value = tensor.inner();
                self.out.push(Flat {
                    id,
                    shape: value.shape(),
                    require_grad,
                    param: value.into_primitive().tensor(),
                    grad: grad.into_primitive().tensor(),
                });
                Param::from_mapped_value(id, Tensor::empty([0; D], &device), mapper)
            }
        }
        let mut collect = Take::<B> {
            grads: &mut grads,
            out: Vec::new(),
        };
        let module = module.map(&mut collect);
        // Flat `[n]` views (NdArray: without copies).
        for flat in collect.out.iter_mut() {
            let n = Shape::new([flat.shape.num_elements()]);
            flat.param = B::InnerBackend::reshape_contiguous(flat.param.clone(), n.clone());
            flat.grad = B::InnerBackend::reshape_contiguous(flat.grad.clone(), n);
        }

        // One multi-tensor call per (weight decay, step count): normally two groups.
        let mut groups: Vec<((bool, usize), Vec<Flat<B>>)> = Vec::new();
        for flat in collect.out {
            let decay = !self.no_decay_ids.contains(&flat.id);
            let time = self.state.get(&flat.id).map_or(0, |s| s.2) + 1;
            match groups.iter_mut().find(|(key, _)| *key == (decay, time)) {
                Some((_, group)) => group.push(flat),
                None => groups.push(((decay, time), vec![flat])),
            }
        }
        let mut updated = HashMap::new();
        for ((decay, time), group) in groups {
            let hyper = adam_hyper(
                lr,
                [
                    self.beta_1,
                    self.beta_2,
                    self.epsilon,
                    if decay { self.weight_decay } else { 0.0 },
                ],
                time,
            );
            let (group, tensors): (Vec<_>, Vec<_>) = group
                .into_iter()
                .map(|flat| {
                    let (moment_1, moment_2) = match self.state.remove(&flat.id) {
                        Some((m, v, _)) => (m, v),
                        None => {
                            let zeros = || {
                                Tensor::<B::InnerBackend, 1>::zeros(
                                    [flat.shape.num_elements()],
                                    &B::InnerBackend::float_device(&flat.param),
                                )
                                .into_primitive()
                                .tensor()
                            };
                            (zeros(), zeros())
                        }
                    };
                    let tensors = AdamTensors {
                        param: flat.param,
                        grad: flat.grad,
                        moment_1,
                        moment_2,
                    };
                    ((flat.id, flat.shape, flat.require_grad), tensors)
                })
                .unzip();
            // LAMB without layer adaptation, λ = 0: `w − lr·m̂/(√v̂ + ε)`, AdamW's step.
            let outputs = if self.lamb && (decay || self.nvlamb) {
                lamb_multi_tensor::<B::InnerBackend>(tensors, hyper)
            } else {
                B::InnerBackend::adam_multi_tensor(tensors, hyper, AdamKind::AdamW)
            };
            for ((id, shape, require_grad), out) in group.into_iter().zip(outputs) {
                self.state.insert(id, (out.moment_1, out.moment_2, time));
                let param = B::InnerBackend::reshape_contiguous(out.param, shape);
                updated.insert(id, (param, require_grad));
            }
        }

        struct Replace<B: AutodiffBackend> {
            updated: HashMap<ParamId, (FloatTensor<B::InnerBackend>, bool)>,
        }
        impl<B: AutodiffBackend> ModuleMapper<B> for Replace<B> {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<B, D>>,
            ) -> Param<Tensor<B, D>> {
                let (id, tensor, mapper) = param.consume();
                let tensor = match self.updated.remove(&id) {
                    Some((value, require_grad)) => {
                        // Already in the parameter's shape; `tensor` is `Take`'s stand-in.
                        let inner = Tensor::<B::InnerBackend, D>::from_primitive(
                            TensorPrimitive::Float(value),
                        );
                        let new = Tensor::from_inner(inner);
                        if require_grad {
                            new.require_grad()
                        } else {
                            new
                        }
                    }
                    None => tensor,
                };
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
        module.map(&mut Replace::<B> { updated })
    }
}
