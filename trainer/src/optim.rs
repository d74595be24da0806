//! Optimizers with BERT's two parameter groups: weights with weight decay, and biases and
//! LayerNorm parameters without (Google's `run_pretraining.py`: `exclude_from_weight_decay =
//! ["LayerNorm", "layer_norm", "bias"]`; Hugging Face's `no_decay` list likewise).
//!
//! AdamW is Burn's (`burn::optim::AdamW`, PyTorch's formula); LAMB is written here as a Burn
//! `SimpleOptimizer`, so both run through Burn's `OptimizerAdaptor`. Each group is one adaptor
//! holding the state of its own parameters.

use std::collections::HashSet;

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamW, AdamWConfig, GradientsParams, LearningRate, Optimizer, SimpleOptimizer};
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Device, Shape, Tensor, TensorPrimitive};
use ember_backend_ext::{AdamHyper, FusedOps};

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::grads::{named_params, split_off};

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
/// r ← ‖w‖ / ‖u‖   (1 if either norm is 0)
/// w ← w − lr · r · u
/// ```
#[derive(Debug, Clone)]
pub struct Lamb {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    /// λ, decoupled weight decay inside the update (before the trust ratio).
    pub weight_decay: f32,
    /// Step through `ember-backend-ext`'s fused ops (`lamb_update`, `sum_squares`,
    /// `lamb_apply`: four launches per tensor, the norms and trust ratio on the device) instead
    /// of the composition of Burn ops below.
    pub fused: bool,
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

/// Moments of a parameter as flat `[n]` primitives (zeros before the first step), and t.
fn flat_moments<B: FusedOps, const D: usize>(
    tensor: &Tensor<B, D>,
    state: Option<LambState<B, D>>,
) -> (FloatTensor<B>, FloatTensor<B>, usize) {
    let n = tensor.shape().num_elements();
    let flat = |t: Tensor<B, D>| t.reshape([n]).into_primitive().tensor();
    match state {
        Some(s) => (flat(s.moment_1), flat(s.moment_2), s.time + 1),
        None => {
            let zeros = Tensor::<B, 1>::zeros([n], &tensor.device());
            (
                zeros.clone().into_primitive().tensor(),
                zeros.into_primitive().tensor(),
                1,
            )
        }
    }
}

/// The fused ops' hyper-parameters from `[β1, β2, ε, λ]` and step t.
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

fn unflat<B: FusedOps, const D: usize>(x: FloatTensor<B>, shape: Shape) -> Tensor<B, D> {
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x)).reshape(shape)
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
        if self.fused {
            let shape = tensor.shape();
            let n = shape.num_elements();
            let (moment_1, moment_2, time) = flat_moments(&tensor, state);
            let param = tensor.reshape([n]).into_primitive().tensor();
            let hyper = adam_hyper(
                lr,
                [self.beta_1, self.beta_2, self.epsilon, self.weight_decay],
                time,
            );
            let out = B::lamb_update(
                param.clone(),
                grad.reshape([n]).into_primitive().tensor(),
                moment_1,
                moment_2,
                hyper,
            );
            let param_sq = B::sum_squares(param.clone());
            let update_sq = B::sum_squares(out.param.clone());
            let param = B::lamb_apply(param, out.param, param_sq, update_sq, lr);
            let state = LambState {
                moment_1: unflat(out.moment_1, shape.clone()),
                moment_2: unflat(out.moment_2, shape.clone()),
                time,
            };
            return (unflat(param, shape), Some(state));
        }
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

        // Trust ratio kept on the device: no host round trip per tensor.
        let w_norm = tensor.clone().square().sum().sqrt(); // [1]
        let u_norm = update.clone().square().sum().sqrt(); // [1]
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

/// AdamW with Burn's formula (`burn::optim::AdamW`, PyTorch's) in one kernel per tensor:
/// `ember-backend-ext`'s `adamw_step` reads parameter, gradient and both moments once and
/// writes the three results (Burn's composition takes about a dozen launches).
#[derive(Debug, Clone)]
pub struct FusedAdamW {
    pub beta_1: f32,
    pub beta_2: f32,
    pub epsilon: f32,
    /// λ, decoupled weight decay: `w ← w·(1 − lr·λ) − lr·m̂/(sqrt(v̂) + ε)`.
    pub weight_decay: f32,
}

impl<B: FusedOps> SimpleOptimizer<B> for FusedAdamW {
    type State<const D: usize> = LambState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let shape = tensor.shape();
        let n = shape.num_elements();
        let (moment_1, moment_2, time) = flat_moments(&tensor, state);
        let out = B::adamw_step(
            tensor.reshape([n]).into_primitive().tensor(),
            grad.reshape([n]).into_primitive().tensor(),
            moment_1,
            moment_2,
            adam_hyper(
                lr,
                [self.beta_1, self.beta_2, self.epsilon, self.weight_decay],
                time,
            ),
        );
        let state = LambState {
            moment_1: unflat(out.moment_1, shape.clone()),
            moment_2: unflat(out.moment_2, shape.clone()),
            time,
        };
        (unflat(out.param, shape), Some(state))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.moment_1 = state.moment_1.to_device(device);
        state.moment_2 = state.moment_2.to_device(device);
        state
    }
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
        let no_decay_ids = named_params::<B, M>(module)
            .into_iter()
            .filter(|(path, _)| !uses_weight_decay(path))
            .map(|(_, id)| id)
            .collect();
        Self {
            decay: OptimizerAdaptor::from(decay),
            no_decay: OptimizerAdaptor::from(no_decay),
            no_decay_ids,
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
    FusedAdamW(GroupedOptimizer<FusedAdamW, M, B>),
    Lamb(GroupedOptimizer<Lamb, M, B>),
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> PreTrainingOptimizer<M, B> {
    /// Builds the optimizer of `config` for `module` (whose parameter paths decide the groups);
    /// `fused` steps through `ember-backend-ext`'s optimizer ops ([`FusedAdamW`], fused
    /// [`Lamb`]).
    pub fn new(config: &OptimizerConfig, module: &M, fused: bool) -> Self {
        match config.name {
            OptimizerKind::AdamW if fused => {
                let adamw = |weight_decay| FusedAdamW {
                    beta_1: config.beta1,
                    beta_2: config.beta2,
                    epsilon: config.epsilon,
                    weight_decay,
                };
                Self::FusedAdamW(GroupedOptimizer::new(
                    adamw(config.weight_decay),
                    adamw(0.0),
                    module,
                ))
            }
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
                let lamb = |weight_decay| Lamb {
                    beta_1: config.beta1,
                    beta_2: config.beta2,
                    epsilon: config.epsilon,
                    weight_decay,
                    fused,
                };
                Self::Lamb(GroupedOptimizer::new(
                    lamb(config.weight_decay),
                    lamb(0.0),
                    module,
                ))
            }
        }
    }

    /// One update of every parameter that has a gradient in `grads`.
    pub fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        match self {
            Self::AdamW(o) => o.step(lr, module, grads),
            Self::FusedAdamW(o) => o.step(lr, module, grads),
            Self::Lamb(o) => o.step(lr, module, grads),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
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

    /// One LAMB step against the formula evaluated by hand, composed and fused.
    #[test]
    fn lamb_first_step_matches_formula() {
        lamb_first_step(false);
        lamb_first_step(true);
    }

    fn lamb_first_step(fused: bool) {
        let device = Default::default();
        let w = Tensor::<NdArray, 1>::from_data(TensorData::from([3.0f32, 4.0]), &device);
        let g = Tensor::<NdArray, 1>::from_data(TensorData::from([0.5f32, -1.0]), &device);
        let lamb = Lamb {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 0.0,
            weight_decay: 0.1,
            fused,
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

    /// Three steps of [`FusedAdamW`] equal Burn's `AdamW` (the formula it claims), state and
    /// all, on a 2-D parameter.
    #[test]
    fn fused_adamw_equals_burns_adamw() {
        let device = Default::default();
        let burn_adamw = AdamWConfig::new()
            .with_beta_1(0.9)
            .with_beta_2(0.98)
            .with_epsilon(1e-6)
            .with_weight_decay(0.01)
            .build();
        let fused = FusedAdamW {
            beta_1: 0.9,
            beta_2: 0.98,
            epsilon: 1e-6,
            weight_decay: 0.01,
        };
        let w0 = Tensor::<NdArray, 2>::from_data(
            TensorData::new((0..12).map(|i| i as f32 * 0.3 - 1.5).collect(), [3, 4]),
            &device,
        );
        let (mut a, mut b) = (w0.clone(), w0);
        let (mut state_a, mut state_b) = (None, None);
        for step in 0..3 {
            let g = Tensor::<NdArray, 2>::from_data(
                TensorData::new(
                    (0..12)
                        .map(|i| ((i * 7 + step * 3) % 5) as f32 - 2.0)
                        .collect(),
                    [3, 4],
                ),
                &device,
            );
            (a, state_a) =
                SimpleOptimizer::<NdArray>::step(&burn_adamw, 1e-2, a, g.clone(), state_a);
            (b, state_b) = SimpleOptimizer::<NdArray>::step(&fused, 1e-2, b, g, state_b);
        }
        let (a, b) = (
            a.into_data().to_vec::<f32>().unwrap(),
            b.into_data().to_vec::<f32>().unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-6, "Burn {a:?} vs fused {b:?}");
        }
        assert_eq!(state_b.unwrap().time, 3);
    }
}
