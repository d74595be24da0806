//! The `[optimizer]` section: which optimizer, with its hyper-parameters.

use serde::{Deserialize, Serialize};

use crate::onebit::OnebitConfig;

/// The optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// Adam with decoupled weight decay (Loshchilov & Hutter 2019), PyTorch's `AdamW`.
    AdamW,
    /// Layer-wise adaptive moments (You et al. 2020), as MLPerf's BERT reference.
    Lamb,
    /// 1-bit Adam (Tang et al. 2021): AdamW for `onebit.freeze_step` steps, then momenta
    /// averaged by a 1-bit compressed allreduce with the variance frozen (`crate::onebit`).
    #[serde(rename = "onebit-adam")]
    OnebitAdam,
    /// 1-bit LAMB (Li et al. 2022): LAMB for `onebit.freeze_step` steps, then compressed
    /// momenta, the variance and the trust ratios frozen and adapted (`crate::onebit`).
    #[serde(rename = "onebit-lamb")]
    OnebitLamb,
}

impl OptimizerKind {
    /// The exact optimizer a 1-bit one runs in its warm-up (itself for AdamW and LAMB).
    pub fn exact(self) -> Self {
        match self {
            Self::OnebitAdam => Self::AdamW,
            Self::OnebitLamb => Self::Lamb,
            other => other,
        }
    }

    /// Whether this is 1-bit Adam or 1-bit LAMB.
    pub fn is_onebit(self) -> bool {
        matches!(self, Self::OnebitAdam | Self::OnebitLamb)
    }
}

/// Optimizer hyper-parameters. Weight decay never applies to biases and LayerNorm weights
/// (Google's `run_pretraining.py`, `exclude_from_weight_decay`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Which optimizer: adamw, lamb, onebit-adam or onebit-lamb (the 1-bit ones run AdamW or
    /// LAMB for `optimizer.onebit.freeze_step` steps, then average compressed momenta).
    /// Default: adamw.
    #[arg(long = "optimizer", value_parser = crate::config::parse_enum::<OptimizerKind>)]
    pub name: OptimizerKind,
    /// Peak learning rate, reached at the end of warmup. Default: 1e-3.
    #[arg(long)]
    pub lr: f64,
    /// Decay rate of the first moment (Adam's β₁). Default: 0.9.
    #[arg(long)]
    pub beta1: f32,
    /// Decay rate of the second moment (Adam's β₂). Default: 0.999.
    #[arg(long)]
    pub beta2: f32,
    /// Added to the second moment's square root (Adam's ε). Default: 1e-6, as BERT's
    /// `AdamWeightDecayOptimizer`.
    #[arg(long)]
    pub epsilon: f32,
    /// Decoupled weight decay, not applied to biases and LayerNorm weights. Default: 0.01.

    #[arg(long)]
    pub weight_decay: f32,
    /// Gradients are scaled so that their global L2 norm is at most this; 0 turns clipping off.
    /// Default: 1.0.
    #[arg(long)]
    pub max_grad_norm: f64,
    /// LAMB only. `false`: the parameters without weight decay (biases, LayerNorm) take the
    /// plain Adam step, trust ratio 1, as MLPerf's BERT reference
    /// (`exclude_from_layer_adaptation` defaults to `exclude_from_weight_decay`) and apex's
    /// `FusedLAMB(use_nvlamb=False)` (`multi_tensor_lamb.cu`: the ratio applies only where
    /// `decay != 0`); `true`: every tensor's step is scaled by its trust ratio (NVLAMB, and
    /// what 1-bit LAMB always does, as DeepSpeed's `OnebitLamb`). Default: false.
    #[arg(long)]
    pub nvlamb: bool,
    /// 1-bit Adam and LAMB (`name = "onebit-adam"` or `"onebit-lamb"`).
    #[command(
        flatten,
        next_help_heading = "1-bit Adam and 1-bit LAMB [optimizer.onebit]"
    )]
    pub onebit: OnebitConfig,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            name: OptimizerKind::AdamW,
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-6,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            nvlamb: false,
            onebit: OnebitConfig::default(),
        }
    }
}
