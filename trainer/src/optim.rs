//! Optimizers with BERT's two parameter groups: weights with weight decay, and biases and
//! LayerNorm parameters without (Google's `run_pretraining.py`: `exclude_from_weight_decay =
//! ["LayerNorm", "layer_norm", "bias"]`; Hugging Face's `no_decay` list likewise).
//!
//! AdamW is Burn's (`burn::optim::AdamW`, PyTorch's formula); LAMB is written here as a Burn
//! `SimpleOptimizer`, so both run through Burn's `OptimizerAdaptor`. Each group is one adaptor
//! holding the state of its own parameters.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, LearningRate, Optimizer, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Device, Tensor};
use ember_backend_ext::{AdamHyper, FusedOps};

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::onebit::{OnebitOptimizer, OnebitStep};
use crate::parallel::{CommError, CommThread};

mod multi_tensor;
mod state;
use crate::grads::{named_params, split_off};
pub use multi_tensor::MultiTensorOptimizer;
pub use state::{DeviceMoments, Moments, OptimizerState, ParamMoments};

/// Whether weight decay applies to the parameter at `path` (an ember module path): not to
/// biases, LayerNorm weights (`gamma`) and LayerNorm biases (`beta`).
pub fn uses_weight_decay(path: &str) -> bool {
    !(path.ends_with(".bias") || path.contains("layer_norm.") || path == "bias")
}

/// LAMB, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (You et al.
/// 2020), Algorithm 2, as MLPerf's BERT reference and NVIDIA's `FusedLAMB` compute it per
/// tensor:
///
/// ```text
/// m ← β1·m + (1−β1)·g          v ← β2·v + (1−β2)·g²
/// u ← (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + ε) + λ·w
/// r ← ‖w‖ / ‖u‖   (1 if either norm is 0, or if the tensor is not `adapt`ed)
/// w ← w − lr · r · u
/// ```
///
/// The group without weight decay is not adapted unless `optimizer.nvlamb` (see
/// [`OptimizerConfig::nvlamb`]).
#[derive(Debug, Clone)]
pub struct Lamb {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    /// λ, decoupled weight decay inside the update (before the trust ratio).
    pub weight_decay: f32,
    /// Whether the step is scaled by the trust ratio (layer adaptation).
    pub adapt: bool,
}

/// LAMB's state of one parameter tensor.
#[derive(Record, Clone)]
pub struct LambState<B: Backend, const D: usize> {
    /// First moment m.
    pub moment_1: Tensor<B, D>,
    /// Second moment v.
    pub moment_2: Tensor<B, D>,
    /// Steps taken, t.
    pub time: usize,
}

/// The multi-tensor ops' hyper-parameters from `[β1, β2, ε, λ]` and step t.
fn adam_hyper(
    lr: LearningRate,
    [beta_1, beta_2, epsilon, weight_decay]: [f32; 4],
    time: usize,
) -> AdamHyper {
    AdamHyper {
        lr,
        beta_1: beta_1 as f64,
        beta_2: beta_2 as f64,
        epsilon: epsilon as f64,
        weight_decay: weight_decay as f64,
        step: time as u32,
    }
}

impl<B: FusedOps> SimpleOptimizer<B> for Lamb {
    type State<const D: usize> = LambState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let (b1, b2) = (self.beta_1, self.beta_2);
        let (moment_1, moment_2, time) = match state {
            Some(s) => (
                s.moment_1 * b1 + grad.clone() * (1.0 - b1),
                s.moment_2 * b2 + grad.square() * (1.0 - b2),
                s.time + 1,
            ),
            None => (grad.clone() * (1.0 - b1), grad.square() * (1.0 - b2), 1),
        };
        let m_hat = moment_1.clone() / (1.0 - b1.powi(time as i32));
        let v_hat = moment_2.clone() / (1.0 - b2.powi(time as i32));
        let mut update = m_hat / v_hat.sqrt().add_scalar(self.epsilon);
        if self.weight_decay > 0.0 {
            update = update + tensor.clone() * self.weight_decay;
        }

        if !self.adapt {
            let step = update * lr;
            return (
                tensor - step,
                Some(LambState {
                    moment_1,
                    moment_2,
                    time,
                }),
            );
        }
        // Trust ratio kept on the device: no host round trip per tensor; the norms summed in a
        // fixed order, the same on every rank (Note [Ranks stay one model]).
        let w_norm = ember_backend_ext::sum_squares(tensor.clone()).sqrt(); // [1]
        let u_norm = ember_backend_ext::sum_squares(update.clone()).sqrt(); // [1]
        let ratio = (w_norm.clone() / u_norm.clone().clamp_min(f32::MIN_POSITIVE))
            .mask_fill(w_norm.lower_equal_elem(0.0), 1.0)
            .mask_fill(u_norm.lower_equal_elem(0.0), 1.0);
        let step = update * ratio.mul_scalar(lr).reshape([1; D]);
        (
            tensor - step,
            Some(LambState {
                moment_1,
                moment_2,
                time,
            }),
        )
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.moment_1 = state.moment_1.to_device(device);
        state.moment_2 = state.moment_2.to_device(device);
        state
    }
}

/// The parameters of `module` without weight decay ([`uses_weight_decay`]).
fn no_decay_ids<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> HashSet<ParamId> {
    named_params::<B, M>(module)
        .into_iter()
        .filter(|(path, _)| !uses_weight_decay(path))
        .map(|(_, id)| id)
        .collect()
}

/// One Burn optimizer per parameter group: `decay` for weight matrices and embeddings,
/// `no_decay` (weight decay 0) for biases and LayerNorm parameters.
pub struct GroupedOptimizer<
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
> {
    decay: OptimizerAdaptor<O, M, B>,
    no_decay: OptimizerAdaptor<O, M, B>,
    no_decay_ids: HashSet<ParamId>,
}

impl<O, M, B> GroupedOptimizer<O, M, B>
where
    O: SimpleOptimizer<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    fn new(decay: O, no_decay: O, module: &M) -> Self {
        Self {
            decay: OptimizerAdaptor::from(decay),
            no_decay: OptimizerAdaptor::from(no_decay),
            no_decay_ids: no_decay_ids::<B, M>(module),
        }
    }

    fn step(&mut self, lr: LearningRate, module: M, mut grads: GradientsParams) -> M {
        let no_decay_grads = split_off::<B, M>(&module, &mut grads, &self.no_decay_ids);
        let module = self.decay.step(lr, module, grads);
        self.no_decay.step(lr, module, no_decay_grads)
    }
}

/// The configured optimizer over a model.
pub enum PreTrainingOptimizer<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> {
    AdamW(GroupedOptimizer<AdamW, M, B>),
    Lamb(GroupedOptimizer<Lamb, M, B>),
    /// AdamW or LAMB through the multi-tensor ops.
    MultiTensor(MultiTensorOptimizer<B>),
    /// 1-bit Adam or 1-bit LAMB (`crate::onebit`).
    Onebit(Box<OnebitOptimizer<M, B>>),
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> PreTrainingOptimizer<M, B> {
    /// Builds the optimizer of `config` for `module` (whose parameter paths decide the groups);
    /// `fused` steps through `ember-backend-ext`'s multi-tensor ops
    /// ([`MultiTensorOptimizer`]), else Burn's `AdamW` or [`Lamb`] tensor by tensor.
    /// 1-bit kinds build [`OnebitOptimizer`] (one rank's until
    /// [`PreTrainingOptimizer::with_comm`]).
    pub fn new(config: &OptimizerConfig, module: &M, fused: bool) -> Self {
        match config.name {
            OptimizerKind::OnebitAdam | OptimizerKind::OnebitLamb => {
                Self::Onebit(Box::new(OnebitOptimizer::new(config, module, fused)))
            }
            _ if fused => Self::MultiTensor(MultiTensorOptimizer::new(config, module)),
            OptimizerKind::AdamW => {
                let adamw = |weight_decay| {
                    AdamWConfig::new()
                        .with_beta_1(config.beta1)
                        .with_beta_2(config.beta2)
                        .with_epsilon(config.epsilon)
                        .with_weight_decay(weight_decay)
                        .build()
                };
                Self::AdamW(GroupedOptimizer::new(
                    adamw(config.weight_decay),
                    adamw(0.0),
                    module,
                ))
            }
            OptimizerKind::Lamb => {
                let lamb = |weight_decay, adapt| Lamb {
                    beta_1: config.beta1,
                    beta_2: config.beta2,
                    epsilon: config.epsilon,
                    weight_decay,
                    adapt,
                };
                Self::Lamb(GroupedOptimizer::new(
                    lamb(config.weight_decay, true),
                    lamb(0.0, config.nvlamb),
                    module,
                ))
            }
        }
    }

    /// A 1-bit optimizer communicating through `comm`; other optimizers are unchanged.
    pub fn with_comm(self, comm: Arc<CommThread<B::InnerBackend>>) -> Self {
        match self {
            Self::Onebit(o) => Self::Onebit(Box::new(o.with_comm(comm))),
            other => other,
        }
    }

    /// The 1-bit optimizer, if this is one.
    pub fn onebit(&self) -> Option<&OnebitOptimizer<M, B>> {
        match self {
            Self::Onebit(o) => Some(o),
            _ => None,
        }
    }

    /// Whether the next step leaves the gradients local (a 1-bit optimizer's compression
    /// stage): the reducer must not allreduce them.
    pub fn compressing(&self) -> bool {
        self.onebit().is_some_and(OnebitOptimizer::compressing)
    }

    /// One update of every parameter that has a gradient in `grads`.
    ///
    /// # Panics
    /// When a 1-bit optimizer's compressed allreduce fails: use
    /// [`PreTrainingOptimizer::try_step`] there.
    pub fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        match self.try_step(lr, module, grads) {
            Ok((module, _)) => module,
            Err(e) => panic!("the compressed allreduce failed: {e}"),
        }
    }

    /// One update, with what a 1-bit optimizer communicated.
    ///
    /// # Errors
    /// [`CommError`] from a 1-bit optimizer's compressed allreduce (never for the others).
    pub fn try_step(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> Result<(M, OnebitStep), CommError> {
        let module = match self {
            Self::AdamW(o) => o.step(lr, module, grads),
            Self::Lamb(o) => o.step(lr, module, grads),
            Self::MultiTensor(o) => o.step(lr, module, grads),
            Self::Onebit(o) => return o.step(lr, module, grads),
        };
        Ok((module, OnebitStep::default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;

    #[test]
    fn weight_decay_excludes_bias_and_layer_norm() {
        assert!(uses_weight_decay(
            "bert.encoder.layer.0.attention.self_attention.query.weight"
        ));
        assert!(uses_weight_decay("bert.embeddings.word_embeddings.weight"));
        assert!(!uses_weight_decay("bert.encoder.layer.0.output.dense.bias"));
        assert!(!uses_weight_decay("bert.embeddings.layer_norm.gamma"));
        assert!(!uses_weight_decay(
            "cls.predictions.transform.layer_norm.beta"
        ));
        assert!(!uses_weight_decay("cls.predictions.bias"));
    }

    /// One LAMB step against the formula evaluated by hand.
    #[test]
    fn lamb_first_step_matches_formula() {
        let device = Default::default();
        let w = Tensor::<NdArray, 1>::from_data(TensorData::from([3.0f32, 4.0]), &device);
        let g = Tensor::<NdArray, 1>::from_data(TensorData::from([0.5f32, -1.0]), &device);
        let lamb = Lamb {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 0.0,
            weight_decay: 0.1,
            adapt: true,
        };
        let (new_w, state) = SimpleOptimizer::<NdArray>::step(&lamb, 0.01, w, g, None);
        // Step 1: m̂ = g, v̂ = g², so m̂/sqrt(v̂) = sign(g) = [1, -1]; u = [1, -1] + 0.1·[3, 4]
        // = [1.3, -0.6]; r = ‖w‖/‖u‖ = 5 / sqrt(1.69 + 0.36); w − 0.01·r·u.
        let r = 5.0 / (1.69f64 + 0.36).sqrt();
        let expected = [3.0 - 0.01 * r * 1.3, 4.0 + 0.01 * r * 0.6];
        let got = new_w.into_data().to_vec::<f32>().unwrap();
        for (g, e) in got.iter().zip(expected) {
            assert!((f64::from(*g) - e).abs() < 1e-6, "{got:?} vs {expected:?}");
        }
        assert_eq!(state.unwrap().time, 1);
    }

    /// Three steps of [`MultiTensorOptimizer`] (what fused kernels run; here the ops' reference
    /// bodies on NdArray, the kernels are compared with those in `ember-backend-ext`'s tests)
    /// equal Burn's `AdamW` and [`Lamb`] run tensor by tensor through Burn's adaptor, with
    /// both weight-decay groups (a `Linear`'s weight decays, its bias does not).
    #[test]
    fn multi_tensor_optimizer_equals_per_tensor_optimizers() {
        type B = Autodiff<NdArray>;
        let device = Default::default();
        for name in [OptimizerKind::AdamW, OptimizerKind::Lamb] {
            let config = OptimizerConfig {
                name,
                weight_decay: 0.1,
                ..Default::default()
            };
            B::seed(&device, 3);
            let model: Linear<B> = LinearConfig::new(4, 3).init(&device);
            // Burn initialises lazily: draw both parameters before the clone shares them.
            let initial = model.weight.val().into_data();
            let _ = model.bias.as_ref().unwrap().val();
            let mut per_tensor = PreTrainingOptimizer::new(&config, &model, false);
            let mut multi = PreTrainingOptimizer::new(&config, &model, true);
            assert!(matches!(multi, PreTrainingOptimizer::MultiTensor(_)));
            let (mut a, mut b) = (model.clone(), model);
            for step in 0..3 {
                let x = Tensor::<B, 2>::from_data(
                    TensorData::new(
                        (0..8)
                            .map(|i| ((i * 5 + step * 3) % 7) as f32 - 3.0)
                            .collect(),
                        [2, 4],
                    ),
                    &device,
                );
                let grads = |m: &Linear<B>| {
                    let loss = m.forward(x.clone()).powf_scalar(2.0).sum();
                    GradientsParams::from_grads(loss.backward(), m)
                };
                let (ga, gb) = (grads(&a), grads(&b));
                a = per_tensor.step(1e-2, a, ga);
                b = multi.step(1e-2, b, gb);
            }
            // The steps did something: lr 1e-2 for 3 steps moves weights by ~3e-2.
            let moved = a.weight.val().into_data().to_vec::<f32>().unwrap();
            let initial = initial.to_vec::<f32>().unwrap();
            let largest = moved
                .iter()
                .zip(&initial)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f32::max);
            assert!(largest > 1e-2, "{name:?}: weights moved by only {largest}");
            for (x, y) in [
                (a.weight.val().into_data(), b.weight.val().into_data()),
                (
                    a.bias.as_ref().unwrap().val().into_data(),
                    b.bias.as_ref().unwrap().val().into_data(),
                ),
            ] {
                let (x, y) = (x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
                for (p, q) in x.iter().zip(&y) {
                    assert!(
                        (p - q).abs() < 1e-6,
                        "{name:?}: per tensor {x:?} vs multi-tensor {y:?}"
                    );
                }
            }
        }
    }

    fn floats(v: &serde_json::Value) -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    }

    /// LAMB against the MLPerf reference's formula (apex `FusedLAMB`, `use_nvlamb=False` and
    /// `True`), three steps on a weight (decayed, adapted) and a bias (neither), goldens from
    /// `tests/fixtures/make_lamb_golden.py`. Both ember paths: Burn's adaptor tensor by tensor
    /// and the multi-tensor ops.
    #[test]
    fn lamb_equals_the_mlperf_reference() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/lamb_golden.json"
        );
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let device = Default::default();
        let hyper = |k: &str| golden[k].as_f64().unwrap();
        for fused in [false, true] {
            for (nvlamb, expected) in [(false, &golden["mlperf"]), (true, &golden["nvlamb"])] {
                let config = crate::config::OptimizerConfig {
                    name: crate::OptimizerKind::Lamb,
                    beta1: hyper("beta1") as f32,
                    beta2: hyper("beta2") as f32,
                    epsilon: hyper("epsilon") as f32,
                    weight_decay: hyper("weight_decay") as f32,
                    nvlamb,
                    ..Default::default()
                };
                let mut model: Linear<Autodiff<NdArray>> = LinearConfig::new(4, 3).init(&device);
                let initial = &golden["initial"];
                model.weight = burn::module::Param::from_tensor(Tensor::from_data(
                    TensorData::new(floats(&initial["weight"]), [4, 3]),
                    &device,
                ));
                model.bias = Some(burn::module::Param::from_tensor(Tensor::from_data(
                    TensorData::new(floats(&initial["bias"]), [3]),
                    &device,
                )));
                let mut optimizer = PreTrainingOptimizer::new(&config, &model, fused);
                for step in golden["grads"].as_array().unwrap() {
                    let mut grads = burn::optim::GradientsParams::new();
                    grads.register::<NdArray, 2>(
                        model.weight.id,
                        Tensor::from_data(
                            TensorData::new(floats(&step["weight"]), [4, 3]),
                            &device,
                        ),
                    );
                    grads.register::<NdArray, 1>(
                        model.bias.as_ref().unwrap().id,
                        Tensor::from_data(TensorData::new(floats(&step["bias"]), [3]), &device),
                    );
                    model = optimizer.step(hyper("lr"), model, grads);
                }
                let got_weight = model.weight.val().into_data().to_vec::<f32>().unwrap();
                let got_bias = model
                    .bias
                    .unwrap()
                    .val()
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap();
                for (name, got, want) in [
                    ("weight", got_weight, floats(&expected["weight"])),
                    ("bias", got_bias, floats(&expected["bias"])),
                ] {
                    for (g, w) in got.iter().zip(&want) {
                        // f32 arithmetic in another order: a few ulp of the step (lr = 1e-2).
                        assert!(
                            (g - w).abs() <= 2e-6,
                            "fused {fused}, nvlamb {nvlamb}, {name}: {got:?} vs {want:?}"
                        );
                    }
                }
            }
        }
    }
}
