//! Whole-model operations on gradients: global L2 norm, scaling (clipping), and splitting into
//! parameter groups. Burn's `GradientsParams` is keyed by parameter id and typed by rank, so
//! each operation is a module visitor that knows every parameter's rank.

use std::collections::{HashMap, HashSet};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{ElementConversion, Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

/// The L2 norm of all gradients of `module` taken together, `sqrt(Σ_p Σ_i g_pi²)`: the
/// per-tensor sums of squares in one multi-tensor op (apex's `multi_tensor_l2norm`: a launch
/// per 32 gradients on CubeCL backends), then one read back to the host.
pub fn global_norm<B, M>(module: &M, grads: &GradientsParams) -> f64
where
    B: AutodiffBackend<InnerBackend: FusedOps>,
    M: AutodiffModule<B>,
{
    struct Flat<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        out: Vec<FloatTensor<B::InnerBackend>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Flat<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                let n = grad.shape().num_elements();
                self.out.push(grad.reshape([n]).into_primitive().tensor());
            }
        }
    }
    let mut flat = Flat::<B> {
        grads,
        out: Vec::new(),
    };
    module.visit(&mut flat);
    if flat.out.is_empty() {
        return 0.0;
    }
    let sums = Tensor::<B::InnerBackend, 1>::from_primitive(TensorPrimitive::Float(
        B::InnerBackend::sum_squares_multi_tensor(flat.out),
    ));
    f64::from(sums.sum().into_scalar().elem::<f32>()).sqrt()
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
pub fn clip_global_norm<B: AutodiffBackend<InnerBackend: FusedOps>, M: AutodiffModule<B>>(
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

/// Moves the gradients of the parameters in `ids` out of `grads`, as `(parameter, gradient)`
/// with the gradient a tensor of the inner backend in the parameter's shape, where it lies (no
/// copy): how the gradients that no hook delivered reach the reducer.
pub fn take_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    ids: &[ParamId],
) -> Vec<(ParamId, FloatTensor<B::InnerBackend>)> {
    struct Take<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        ids: &'a [ParamId],
        out: Vec<(ParamId, FloatTensor<B::InnerBackend>)>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.ids.contains(&param.id) {
                if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                    self.out.push((param.id, grad.into_primitive().tensor()));
                }
            }
        }
    }
    let mut take = Take::<B> {
        grads,
        ids,
        out: Vec::new(),
    };
    module.visit(&mut take);
    take.out
}

/// The gradients of the parameters in `ids`, left in `grads` (the tensors are shared, nothing
/// is copied or read): the final gradients [`crate::parallel::DeliveryCheck`] compares with
/// what the hooks delivered.
pub fn peek_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &GradientsParams,
    ids: &HashSet<ParamId>,
) -> HashMap<ParamId, FloatTensor<B::InnerBackend>> {
    struct Peek<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        ids: &'a HashSet<ParamId>,
        out: HashMap<ParamId, FloatTensor<B::InnerBackend>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Peek<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.ids.contains(&param.id) {
                if let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) {
                    self.out.insert(param.id, grad.into_primitive().tensor());
                }
            }
        }
    }
    let mut peek = Peek::<B> {
        grads,
        ids,
        out: HashMap::new(),
    };
    module.visit(&mut peek);
    peek.out
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;
    use burn::tensor::backend::Backend;

    type B = Autodiff<NdArray>;

    fn model_and_grads() -> (Linear<B>, GradientsParams) {
        let device = Default::default();
        B::seed(&device, 11);
        let model: Linear<B> = LinearConfig::new(5, 3).init(&device);
        let x = Tensor::<B, 2>::from_data(
            TensorData::new((0..10).map(|i| i as f32 * 0.5 - 2.0).collect(), [2, 5]),
            &device,
        );
        let loss = model.forward(x).powf_scalar(2.0).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (model, grads)
    }

    /// The norm on the host, from the gradients copied out.
    fn host_norm(model: &Linear<B>, grads: &GradientsParams) -> f64 {
        named_grads::<B, _>(model, grads)
            .into_iter()
            .flat_map(|(_, data)| data.to_vec::<f32>().unwrap())
            .map(|g| f64::from(g) * f64::from(g))
            .sum::<f64>()
            .sqrt()
    }

    #[test]
    fn global_norm_is_the_norm_of_all_gradients_and_clipping_scales_to_max_norm() {
        let (model, mut grads) = model_and_grads();
        let expected = host_norm(&model, &grads);
        assert_eq!(
            named_grads::<B, _>(&model, &grads).len(),
            2,
            "weight and bias"
        );
        let norm = global_norm::<B, _>(&model, &grads);
        assert!(expected > 1.0, "{expected}");
        assert!(
            (norm - expected).abs() <= 1e-6 * expected,
            "{norm} vs {expected}"
        );

        // Clipping to half the norm returns the norm before and leaves max_norm after.
        let max_norm = expected / 2.0;
        let before = clip_global_norm::<B, _>(&model, &mut grads, max_norm);
        assert!((before - expected).abs() <= 1e-6 * expected);
        let after = host_norm(&model, &grads);
        assert!(
            (after - max_norm).abs() <= 1e-5 * max_norm,
            "{after} vs {max_norm}"
        );
        // Below max_norm nothing changes.
        let again = clip_global_norm::<B, _>(&model, &mut grads, expected);
        assert!((again - after).abs() <= 1e-6 * after, "{again} vs {after}");
        assert_eq!(host_norm(&model, &grads), after, "unchanged below max_norm");
    }
}
