//! The two stages of 1-bit Adam and 1-bit LAMB.
//!
//! **Warm-up** (`freeze_step` steps): the exact optimizer ([`PreTrainingOptimizer`], AdamW or
//! LAMB), on gradients the reducer allreduces as usual; bit for bit the exact run. 1-bit LAMB
//! also tracks each tensor's trust ratio, clipped to `[min_coeff, max_coeff]`, in an
//! exponential average (`coeff_beta`), as DeepSpeed's `lamb_coeff_freeze`.
//!
//! **Compression** (after `freeze_step`): the reducer no longer allreduces gradients. Each rank
//! updates its momentum from its local gradient, the momenta are averaged by the compressed
//! allreduce ([`super::allreduce`]), and the update divides by the variance frozen at the end
//! of the warm-up:
//!
//! ```text
//! m ← β1·m + (1−β1)·g_local;   m ← compressed_average(m);   m ← m ⊙ mask
//! Adam:  w ← w − lr·( m̂ / D + λ·w )
//! LAMB:  u = m̂ / D + λ·w;   w ← w − lr · c · u
//! ```
//!
//! with D the denominator of `optimizer.onebit.variance`: DeepSpeed's `√v̂_frozen + ε`
//! (`frozen`), `max(√v̂_frozen, |m̂|) + ε` (`frozen-bounded`, 1-bit Adam's default) or
//! `√max(v̂_frozen, v̂_fresh) + ε` (`frozen-or-fresh`, 1-bit LAMB's default), the fresh
//! variance rebuilt from the averaged momenta (`g = (m − β1·m_prev)/(1−β1)`, `v_fresh ←
//! β2·v_fresh + (1−β2)·g²`). 1-bit LAMB's per-tensor scaling c is `optimizer.onebit.lamb_coeff`:
//! DeepSpeed's `c_freeze · f` (`frozen-factor`), where f = `max(D / denom_fresh)`, blended
//! towards 1 by the weight decay's share of the update, clipped to `[factor_min, factor_max]`
//! and to ±`factor_threshold` of the last step's f (DeepSpeed's `OnebitLamb.step`); or each
//! step's trust ratio `‖w‖/‖u‖` (`computed`, the default), which every rank computes alike
//! from the averaged momenta. 1-bit LAMB compresses all momenta as one buffer, each
//! tensor's momentum scaled by `united_scale / its_scale` first (the scales taken at the
//! freeze); 1-bit Adam compresses each tensor on its own (DeepSpeed's f32 path).
//!
//! Where ember differs from DeepSpeed (docs/ARCHITECTURE.md, 1-bit optimizers):
//! - **the denominator** is by default not the frozen variance alone (`frozen-bounded` for
//!   Adam, `frozen-or-fresh` for LAMB; `frozen` is DeepSpeed's): a variance frozen while an
//!   element had almost no gradient (a rare token) divides that element's later, real
//!   gradients by nearly zero;
//! - **1-bit LAMB's scaling** is by default each step's trust ratio (`lamb_coeff =
//!   computed`; `frozen-factor` is DeepSpeed's);
//! - **one scale per 128 elements** (`optimizer.onebit.scale_block`; 0 is DeepSpeed's one per
//!   buffer);
//! - **bias correction** continues through both stages (m̂ = m/(1−β1ᵗ), v̂ = v/(1−β2ᵀ) with T
//!   the freeze step), so that the warm-up is ember's exact AdamW/LAMB; DeepSpeed's 1-bit
//!   optimizers apply none in either stage;
//! - **the momentum mask** is found, not given: the elements whose variance is exactly 0 at
//!   the freeze (they never had a gradient, as the position embeddings past the sequence
//!   length) are masked (`optimizer.onebit.mask_unused`); DeepSpeed asks the user for
//!   `exp_avg_mask`;
//! - ember's warm-up LAMB does not clip its trust ratio (as ember's LAMB); the clipped ratio is
//!   only what `lamb_coeff_freeze` averages.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use ember_backend_ext::FusedOps;
use ember_model::checkpoint::read_unshared;

use super::allreduce::{BytesSent, CompressedAllreduce};
use crate::config::{OnebitConfig, OptimizerConfig, OptimizerKind};
use crate::grads::named_params;
use crate::onebit::OnebitVariance;
use crate::optim::{OptimizerState, ParamMoments, PreTrainingOptimizer, uses_weight_decay};
use crate::parallel::{CommError, CommThread};

/// Which 1-bit optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnebitKind {
    /// 1-bit Adam (Tang et al. 2021).
    Adam,
    /// 1-bit LAMB (Li et al. 2022).
    Lamb,
}

/// One parameter's state in the compression stage, on the host.
#[derive(Debug, Clone)]
pub(crate) struct CompressedParam {
    pub path: String,
    pub id: ParamId,
    pub shape: Vec<usize>,
    pub decay: bool,
    /// Momentum m (the compressed average after each step).
    pub m: Vec<f32>,
    /// Variance v, frozen at the freeze step.
    pub v: Vec<f32>,
    /// The parameter's value: only this optimizer changes it in the compression stage, so the
    /// host keeps it (read once; reading a shared Burn tensor back is slow).
    pub w: Vec<f32>,
    /// 1-bit LAMB: the fresh variance rebuilt from the averaged momenta.
    pub v_fresh: Vec<f32>,
    /// 1-bit LAMB: `united_scale / this tensor's momentum scale` at the freeze.
    pub scaling_coeff: f32,
    /// 1-bit LAMB: the warm-up's averaged trust ratio (`lamb_coeff_freeze`).
    pub coeff_freeze: f32,
    /// 1-bit LAMB: the last step's factor.
    pub last_factor: f32,
}

/// The compression stage's state.
#[derive(Debug, Clone)]
pub(crate) struct CompressionStage {
    pub params: Vec<CompressedParam>,
    /// Steps the moments have taken (t).
    pub time: usize,
    /// The step the variance was frozen at (T).
    pub frozen_time: usize,
    /// Error feedback; taken while an allreduce runs.
    pub allreduce: Option<CompressedAllreduce>,
    /// Elements masked (variance 0 at the freeze), per parameter, when masking.
    pub masks: Vec<Option<Vec<bool>>>,
}

/// What one step of a 1-bit optimizer did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OnebitStep {
    /// Whether the step was in the compression stage.
    pub compressed: bool,
    /// Bytes this rank sent for the momenta (compression stage; 0 in the warm-up, whose
    /// gradients the reducer allreduced).
    pub bytes: BytesSent,
}

/// 1-bit Adam or 1-bit LAMB over a module (see the module docs).
pub struct OnebitOptimizer<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> {
    pub(crate) kind: OnebitKind,
    pub(crate) hyper: OptimizerConfig,
    pub(crate) settings: OnebitConfig,
    pub(crate) freeze_step: u64,
    /// The warm-up's exact optimizer (also the source of the moments at the freeze).
    pub(crate) exact: PreTrainingOptimizer<M, B>,
    /// Steps taken.
    pub(crate) steps: u64,
    /// 1-bit LAMB's warm-up average of each tensor's clipped trust ratio, on the device.
    pub(crate) coeff_freeze: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
    pub(crate) stage: Option<CompressionStage>,
    pub(crate) comm: Option<Arc<CommThread<B::InnerBackend>>>,
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> OnebitOptimizer<M, B> {
    /// The 1-bit optimizer of `config` (`onebit-adam` or `onebit-lamb`) over `module`, the
    /// warm-up stepping as `PreTrainingOptimizer::new(config, module, fused)` with the exact
    /// optimizer. `onebit.freeze_step` unset means DeepSpeed's default, 100 000 steps
    /// (`train` sets it from `train.steps`). Without [`OnebitOptimizer::with_comm`] the
    /// optimizer is one rank's: the compression stage only freezes the variance.
    pub fn new(config: &OptimizerConfig, module: &M, fused: bool) -> Self {
        let kind = match config.name {
            OptimizerKind::OnebitLamb | OptimizerKind::Lamb => OnebitKind::Lamb,
            _ => OnebitKind::Adam,
        };
        // 1-bit LAMB adapts every tensor, as DeepSpeed's `OnebitLamb` (whose scaling
        // coefficients are per tensor, biases and LayerNorm included): its warm-up is NVLAMB.
        let exact_config = OptimizerConfig {
            name: config.name.exact(),
            nvlamb: config.nvlamb || kind == OnebitKind::Lamb,
            ..config.clone()
        };
        let mut settings = config.onebit.clone();
        settings.variance = Some(settings.variance_for(kind == OnebitKind::Lamb));
        Self {
            kind,
            hyper: config.clone(),
            settings,
            freeze_step: config.onebit.freeze_step.unwrap_or(100_000),
            exact: PreTrainingOptimizer::new(&exact_config, module, fused),
            steps: 0,
            coeff_freeze: HashMap::new(),
            stage: None,
            comm: None,
        }
    }

    /// Communicates the compression stage through `comm` (every rank's optimizer must have
    /// one of the same group).
    pub fn with_comm(mut self, comm: Arc<CommThread<B::InnerBackend>>) -> Self {
        self.comm = Some(comm);
        self
    }

    /// Which 1-bit optimizer this is.
    pub fn kind(&self) -> OnebitKind {
        self.kind
    }

    /// The last warm-up step (the variance freezes after it).
    pub fn freeze_step(&self) -> u64 {
        self.freeze_step
    }

    /// Whether the next step is in the compression stage: the reducer must then leave the
    /// gradients local.
    pub fn compressing(&self) -> bool {
        self.stage.is_some()
    }

    /// One step: the exact optimizer in the warm-up (on allreduced gradients), the
    /// compressed momentum update after it (on local gradients).
    ///
    /// # Errors
    /// [`CommError`] from the compressed allreduce.
    pub fn step(
        &mut self,
        lr: LearningRate,
        module: M,
        grads: GradientsParams,
    ) -> Result<(M, OnebitStep), CommError> {
        if self.stage.is_some() {
            return self.compressed_step(lr, module, grads);
        }
        let before = (self.kind == OnebitKind::Lamb).then(|| module.clone());
        let module = self.exact.step(lr, module, grads);
        self.steps += 1;
        if let Some(before) = before {
            self.track_trust_ratios(&before);
        }
        if self.steps >= self.freeze_step {
            self.freeze(&module);
        }
        Ok((module, OnebitStep::default()))
    }

    /// 1-bit LAMB's warm-up: each tensor's trust ratio `‖w‖/‖u‖` of the step just taken
    /// (w before it, u from the moments after it), clipped to `[min_coeff, max_coeff]` (1
    /// when a norm is 0), averaged as `c ← β·c + (1−β)·ratio` when it is not 1 (DeepSpeed's
    /// `lamb_coeff_freeze`). Device ops only.
    fn track_trust_ratios(&mut self, before: &M) {
        let moments = self.exact.device_moments(before);
        let (b1, b2, eps) = (
            f64::from(self.hyper.beta1),
            f64::from(self.hyper.beta2),
            self.hyper.epsilon,
        );
        let s = self.settings.clone();
        let mut visitor = WeightsById(HashMap::new());
        before.visit(&mut visitor);
        for (path, id) in named_params::<B, M>(before) {
            let (Some((m, v, t)), Some(w)) = (moments.get(&id), visitor.0.remove(&id)) else {
                continue;
            };
            let t = *t as i32;
            let m_hat = m.clone().div_scalar(1.0 - b1.powi(t));
            let v_hat = v.clone().div_scalar(1.0 - b2.powi(t));
            let mut update = m_hat / v_hat.sqrt().add_scalar(eps);
            let decay = if uses_weight_decay(&path) {
                self.hyper.weight_decay
            } else {
                0.0
            };
            if decay > 0.0 {
                update = update + w.clone().mul_scalar(decay);
            }
            // Note [Ranks stay one model]: norms in a fixed order, the same on every rank.
            let w_norm = ember_backend_ext::sum_squares(w).sqrt();
            let u_norm = ember_backend_ext::sum_squares(update).sqrt();
            let ratio = (w_norm.clone() / u_norm.clone().clamp_min(f32::MIN_POSITIVE))
                .clamp(s.min_coeff, s.max_coeff)
                .mask_fill(w_norm.lower_equal_elem(0.0), 1.0)
                .mask_fill(u_norm.lower_equal_elem(0.0), 1.0);
            let previous = self
                .coeff_freeze
                .remove(&id)
                .unwrap_or_else(|| ratio.zeros_like());
            let averaged = previous.clone().mul_scalar(s.coeff_beta)
                + ratio.clone().mul_scalar(1.0 - s.coeff_beta);
            let unchanged = ratio.equal_elem(1.0);
            self.coeff_freeze
                .insert(id, averaged.mask_where(unchanged, previous));
        }
    }

    /// Ends the warm-up: the moments move to the host, the variance freezes, the masks and
    /// (1-bit LAMB) the scaling coefficients are set, the error feedback starts at 0.
    fn freeze(&mut self, module: &M) {
        let state = self.exact.state(module);
        let ids: HashMap<String, ParamId> = named_params::<B, M>(module).into_iter().collect();
        let mut params = Vec::new();
        for (path, moments) in state {
            let id = ids[&path];
            let coeff = self.coeff_freeze.remove(&id).map_or(0.0, |c| {
                c.into_data().convert::<f32>().to_vec::<f32>().expect("f32")[0]
            });
            params.push(compressed_param(path, id, moments, coeff));
        }
        // Module order, the same on every rank.
        let module_order: HashMap<ParamId, usize> = named_params::<B, M>(module)
            .into_iter()
            .enumerate()
            .map(|(k, (_, id))| (id, k))
            .collect();
        params.sort_by_key(|p| module_order[&p.id]);
        let steps = self.steps as usize;
        self.stage = Some(self.stage_for(params, steps, steps));
    }

    /// Whether the compression stage rebuilds a fresh variance from the averaged momenta
    /// (1-bit LAMB, and `optimizer.onebit.variance = frozen-or-fresh`).
    pub(crate) fn tracks_fresh_variance(&self) -> bool {
        self.kind == OnebitKind::Lamb
            || self.settings.variance == Some(OnebitVariance::FrozenOrFresh)
    }

    /// The compression stage over `params` (moments at step `time`, the variance frozen at
    /// step `frozen_time`), with zero error feedback and (1-bit LAMB) the scaling coefficients
    /// of these momenta.
    pub(crate) fn stage_for(
        &self,
        mut params: Vec<CompressedParam>,
        time: usize,
        frozen_time: usize,
    ) -> CompressionStage {
        if self.kind == OnebitKind::Lamb {
            // DeepSpeed: scaling_coeff = united_scale / momentum_scale, the scales being each
            // momentum's RMS at the end of the warm-up; 1 for a momentum of zeros.
            let scales: Vec<f32> = params
                .iter()
                .map(|p| super::compress::rms_scale(&p.m))
                .collect();
            let united =
                scales.iter().map(|&s| f64::from(s)).sum::<f64>() / scales.len().max(1) as f64;
            for (p, scale) in params.iter_mut().zip(scales) {
                p.scaling_coeff = if scale > 0.0 {
                    (united / f64::from(scale)) as f32
                } else {
                    1.0
                };
            }
        }
        if self.tracks_fresh_variance() {
            for p in &mut params {
                p.v_fresh = p.v.clone();
            }
        }
        let masks = params
            .iter()
            .map(|p| {
                (self.settings.mask_unused && p.v.contains(&0.0))
                    .then(|| p.v.iter().map(|&v| v == 0.0).collect())
            })
            .collect();
        let (world_size, rank) = self
            .comm
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let lengths = match self.kind {
            OnebitKind::Adam => params.iter().map(|p| p.m.len()).collect(),
            OnebitKind::Lamb => vec![params.iter().map(|p| p.m.len()).sum()],
        };
        CompressionStage {
            allreduce: Some(CompressedAllreduce::new(
                lengths,
                world_size,
                rank,
                self.settings.scale_block,
            )),
            params,
            time,
            frozen_time,
            masks,
        }
    }
}

/// A parameter's compression-stage state from its moments at the freeze.
pub(crate) fn compressed_param(
    path: String,
    id: ParamId,
    moments: ParamMoments,
    coeff_freeze: f32,
) -> CompressedParam {
    let shape = moments.moment_1.shape.as_slice().to_vec();
    let decay = uses_weight_decay(&path);
    CompressedParam {
        m: moments
            .moment_1
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("converted to f32"),
        v: moments
            .moment_2
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("converted to f32"),
        v_fresh: Vec::new(),
        w: Vec::new(),
        scaling_coeff: 1.0,
        coeff_freeze,
        last_factor: 1.0,
        path,
        id,
        shape,
        decay,
    }
}

/// Each parameter's value, flat, on the device, by id.
struct WeightsById<B: AutodiffBackend>(HashMap<ParamId, Tensor<B::InnerBackend, 1>>);

impl<B: AutodiffBackend> ModuleVisitor<B> for WeightsById<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let value = param.val().inner();
        let n = value.shape().num_elements();
        self.0.insert(param.id, value.reshape([n]));
    }
}

/// A parameter's value (when read) and gradient (when it has one), flat, on the host.
pub(crate) type HostValues = (Option<Vec<f32>>, Option<Vec<f32>>);

/// Reads each parameter's gradient to the host (flat), and its value where `values` asks, by
/// id. Through `read_unshared` (Note [Reading shared tensors]): a copy of a shared NdArray
/// tensor is gathered element by element.
pub(crate) struct ReadHost<'a, B: AutodiffBackend> {
    pub grads: &'a mut GradientsParams,
    pub values: HashSet<ParamId>,
    pub out: HashMap<ParamId, HostValues>,
    pub backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for ReadHost<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let read = |t: Tensor<B::InnerBackend, D>| {
            read_unshared(t)
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 data")
        };
        let grad = self.grads.remove::<B::InnerBackend, D>(param.id).map(read);
        let value = self
            .values
            .contains(&param.id)
            .then(|| read(param.val().inner()));
        self.out.insert(param.id, (value, grad));
    }
}

/// Writes new values into the module's parameters, by id.
pub(crate) struct WriteHost(pub HashMap<ParamId, Vec<f32>>);

impl<B: AutodiffBackend> ModuleMapper<B> for WriteHost {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(values) = self.0.remove(&param.id) else {
            return param;
        };
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let new = Tensor::from_data(TensorData::new(values, shape), &tensor.device());
        let new = if tensor.is_require_grad() {
            new.require_grad()
        } else {
            new
        };
        Param::from_mapped_value(id, new, mapper)
    }
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> OnebitOptimizer<M, B> {
    /// The optimizer state for a checkpoint's `optimizer.safetensors`: the exact optimizer's
    /// in the warm-up; in the compression stage each parameter's momentum (the last compressed
    /// average), frozen variance and step count.
    pub fn state(&self, module: &M) -> OptimizerState {
        let Some(stage) = &self.stage else {
            return self.exact.state(module);
        };
        stage
            .params
            .iter()
            .map(|p| {
                let data = |v: &Vec<f32>| TensorData::new(v.clone(), p.shape.clone());
                (
                    p.path.clone(),
                    ParamMoments {
                        moment_1: data(&p.m),
                        moment_2: data(&p.v),
                        time: stage.time,
                    },
                )
            })
            .collect()
    }
}
