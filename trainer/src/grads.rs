//! Whole-model operations on gradients: global L2 norm, scaling (clipping), and splitting into
//! parameter groups. Burn's `GradientsParams` is keyed by parameter id and typed by rank, so
//! each operation is a module visitor that knows every parameter's rank.

use std::collections::HashSet;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor};

struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    sum: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let sq = grad.square().sum();
            self.sum = Some(match self.sum.take() {
                Some(sum) => sum + sq,
                None => sq,
            });
        }
    }
}

/// The L2 norm of all gradients of `module` taken together, `sqrt(Σ_p Σ_i g_pi²)`.
pub fn global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> f64 {
    let mut visitor = SquaredNorm::<B> { grads, sum: None };
    module.visit(&mut visitor);
    visitor
        .sum
        .map_or(0.0, |s| f64::from(s.into_scalar().elem::<f32>()).sqrt())
}

struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register(param.id, grad.mul_scalar(self.factor));
        }
    }
}

/// Multiplies every gradient of `module` by `factor`.
pub fn scale<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: f64,
) {
    module.visit(&mut Scale { grads, factor });
}

/// Clips by global norm (Pascanu et al. 2013; `torch.nn.utils.clip_grad_norm_`): if the norm
/// exceeds `max_norm`, every gradient is scaled by `max_norm / norm`. Returns the norm before
/// clipping. `max_norm` 0 only measures.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    let norm = global_norm(module, grads);
    if max_norm > 0.0 && norm > max_norm {
        // PyTorch adds 1e-6 to the norm so that the clipped norm lands just below max_norm.
        scale(module, grads, max_norm / (norm + 1e-6));
    }
    norm
}

struct Split<'a> {
    from: &'a mut GradientsParams,
    to: GradientsParams,
    ids: &'a HashSet<ParamId>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Split<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.ids.contains(&param.id) {
            if let Some(grad) = self.from.remove::<B::InnerBackend, D>(param.id) {
                self.to.register(param.id, grad);
            }
        }
    }
}

/// Moves the gradients of the parameters in `ids` out of `grads` into a new set.
pub fn split_off<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    ids: &HashSet<ParamId>,
) -> GradientsParams {
    let mut visitor = Split {
        from: grads,
        to: GradientsParams::new(),
        ids,
    };
    module.visit(&mut visitor);
    visitor.to
}

/// Every float parameter of a module with its dotted path (`bert.encoder.layer.0...`).
pub fn named_params<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    module: &M,
) -> Vec<(String, ParamId)> {
    struct Names {
        stack: Vec<String>,
        out: Vec<(String, ParamId)>,
    }
    impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Names {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.out.push((self.stack.join("."), param.id));
        }
    }
    let mut names = Names {
        stack: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut names);
    names.out
}

/// Every float parameter's gradient with its dotted path, copied to the host (parameters
/// without a gradient are left out): for tests, debugging and gradient dumps.
pub fn named_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
) -> Vec<(String, burn::tensor::TensorData)> {
    let ids: std::collections::HashMap<ParamId, String> = named_params::<B, M>(module)
        .into_iter()
        .map(|(path, id)| (id, path))
        .collect();
    struct Collect<'a> {
        grads: &'a GradientsParams,
        ids: &'a std::collections::HashMap<ParamId, String>,
        out: Vec<(String, burn::tensor::TensorData)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                self.out
                    .push((self.ids[&param.id].clone(), grad.into_data()));
            }
        }
    }
    let mut collect = Collect {
        grads,
        ids: &ids,
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}

/// Moves the gradients of the parameters in `ids` out of `grads` to the host, as
/// `(parameter, f32 data in the parameter's shape)`: how gradients that no hook delivered
/// reach the reducer.
pub fn take_host_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
) -> Vec<(ParamId, burn::tensor::TensorData)> {
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        ids: &'a [ParamId],
        out: Vec<(ParamId, burn::tensor::TensorData)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.ids.contains(&param.id) {
                if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    self.out.push((param.id, grad.into_data().convert::<f32>()));
                }
            }
        }
    }
    let mut take = Take {
        grads,
        ids,
        out: Vec::new(),
    };
    module.visit(&mut take);
    take.out
}
