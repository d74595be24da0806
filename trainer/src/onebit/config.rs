//! The settings of 1-bit Adam and 1-bit LAMB (`[optimizer.onebit]`).

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Settings of 1-bit Adam and 1-bit LAMB (`[optimizer.onebit]`); the defaults are DeepSpeed's
/// (`deepspeed/runtime/fp16/onebit/lamb.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct OnebitConfig {
    /// Steps of exact AdamW/LAMB before compression starts (DeepSpeed's `freeze_step`).
    /// Default: unset, 20% of `train.steps` (DeepSpeed's BERT examples freeze at 15–25%).
    #[arg(long)]
    pub freeze_step: Option<u64>,
    /// 1-bit LAMB: the warm-up's trust ratios are clipped to `[min_coeff, max_coeff]` before
    /// they are averaged. Defaults: 0.01 and 10.
    #[arg(long = "onebit-min-coeff")]
    pub min_coeff: f32,
    /// 1-bit LAMB: the upper clip of the warm-up's trust ratios (see `min_coeff`).
    /// Default: 10.
    #[arg(long = "onebit-max-coeff")]
    pub max_coeff: f32,
    /// 1-bit LAMB: the averaging factor of the warm-up's trust ratios. Default: 0.9.
    #[arg(long = "onebit-coeff-beta")]
    pub coeff_beta: f32,
    /// 1-bit LAMB: bounds of the compression stage's scaling factor. Defaults: 0.5 and 4.
    #[arg(long = "onebit-factor-min")]
    pub factor_min: f32,
    /// 1-bit LAMB: the upper bound of the compression stage's scaling factor (see
    /// `factor_min`). Default: 4.
    #[arg(long = "onebit-factor-max")]
    pub factor_max: f32,
    /// 1-bit LAMB: the most the factor changes from one step to the next, as a fraction.
    /// Default: 0.1.
    #[arg(long = "onebit-factor-threshold")]
    pub factor_threshold: f32,
    /// Masks the momentum of the elements whose variance is exactly 0 at the freeze (they
    /// never had a gradient, as position embeddings past the sequence length): 1-bit
    /// compression cannot send a 0, and their update divides by ε. DeepSpeed asks the user
    /// for this mask (`exp_avg_mask`). Default: true.
    #[arg(long = "onebit-mask-unused")]
    pub mask_unused: bool,
    /// Elements per scale in the compressed allreduce (a multiple of 8): each block of a
    /// chunk is sent as its signs and its own RMS. 0 is DeepSpeed's granularity, one scale
    /// per buffer (per tensor for 1-bit Adam, for all momenta for 1-bit LAMB), which ruins
    /// the elements whose momentum is far below the buffer's RMS while their variance is small
    /// (rare tokens' embedding rows with small batches: docs/parallel.md). Default: 128.
    #[arg(long = "onebit-scale-block")]
    pub scale_block: usize,
    /// The denominator of the compression stage's update: `frozen` (the papers' and
    /// DeepSpeed's: the variance at the freeze), `frozen-or-fresh` (element by element the
    /// larger of the frozen variance and a fresh one rebuilt from the averaged momenta, as
    /// 1-bit LAMB rebuilds it: no communication) or `frozen-bounded` (the frozen variance,
    /// each element's |m̂|/√v̂ bounded by 1). A frozen variance is wrong for what had no
    /// gradient in the warm-up: a rare token first seen after the freeze gets an update
    /// divided by the variance of its near-zero gradients (docs/parallel.md's run: embedding entries
    /// of 21, accuracy at the baseline). Default (unset): `frozen-bounded` for 1-bit Adam,
    /// `frozen-or-fresh` for 1-bit LAMB, the best of the three measured on the embedded corpus
    /// (docs/parallel.md, 1-bit Adam and 1-bit LAMB).
    #[arg(long = "onebit-variance", value_parser = crate::config::parse_enum::<OnebitVariance>)]
    pub variance: Option<OnebitVariance>,
    /// 1-bit LAMB's per-tensor scaling in the compression stage: `frozen-factor` (DeepSpeed's:
    /// the warm-up's averaged trust ratio times a factor from the fresh variance, clamped and
    /// moved at most `factor_threshold` per step) or `computed` (each step's trust ratio
    /// ‖w‖/‖u‖ of the update u computed from the averaged momenta, as exact LAMB computes
    /// it; the same on every rank, no communication). Default: `computed` (measured better
    /// on the embedded corpus: docs/parallel.md).

    #[arg(long = "onebit-lamb-coeff", value_parser = crate::config::parse_enum::<OnebitLambCoeff>)]
    pub lamb_coeff: OnebitLambCoeff,
}

/// 1-bit LAMB's scaling coefficients after the freeze (`optimizer.onebit.lamb_coeff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnebitLambCoeff {
    /// The warm-up's averaged trust ratio times the fresh-variance factor (Li et al. 2022;
    /// DeepSpeed).
    FrozenFactor,
    /// Each step's trust ratio of the compression stage's update.
    Computed,
}

/// The variance the compression stage divides by (`optimizer.onebit.variance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnebitVariance {
    /// The variance at the freeze (Tang et al. 2021; DeepSpeed).
    Frozen,
    /// max(frozen, fresh) element by element, the fresh variance rebuilt from the averaged
    /// momenta.
    FrozenOrFresh,
    /// The frozen variance, with each element's Adam ratio |m̂|/√v̂ bounded by 1: the
    /// denominator is max(√v̂, |m̂|) + ε, so an element whose variance froze near zero moves by
    /// at most the learning rate per step.
    FrozenBounded,
}

impl Default for OnebitConfig {
    fn default() -> Self {
        Self {
            freeze_step: None,
            min_coeff: 0.01,
            max_coeff: 10.0,
            coeff_beta: 0.9,
            factor_min: 0.5,
            factor_max: 4.0,
            factor_threshold: 0.1,
            mask_unused: true,
            scale_block: 128,
            variance: None,
            lamb_coeff: OnebitLambCoeff::Computed,
        }
    }
}

impl OnebitConfig {
    /// The variance setting 1-bit Adam (`lamb` false) or 1-bit LAMB runs with: the one given,
    /// else the optimizer's default (see [`OnebitConfig::variance`]).
    pub fn variance_for(&self, lamb: bool) -> OnebitVariance {
        self.variance.unwrap_or(if lamb {
            OnebitVariance::FrozenOrFresh
        } else {
            OnebitVariance::FrozenBounded
        })
    }

    /// Checks the settings, with `freeze_step` the resolved warm-up length, for 1-bit LAMB
    /// (`lamb`) or 1-bit Adam. A setting that changes nothing with the others given is
    /// refused, naming both: the trust-ratio settings (`min_coeff`, `max_coeff`,
    /// `coeff_beta`, `factor_*`, `lamb_coeff`) with 1-bit Adam, and all but `lamb_coeff` with
    /// `lamb_coeff = "computed"`, which uses each step's trust ratio.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming the setting.
    pub fn validate(&self, freeze_step: u64, lamb: bool) -> Result<(), TrainError> {
        let invalid =
            |field: &'static str, reason: String| Err(TrainError::InvalidSetting { field, reason });
        let default = Self::default();
        let frozen_factor_only = [
            (
                "optimizer.onebit.min_coeff",
                self.min_coeff != default.min_coeff,
            ),
            (
                "optimizer.onebit.max_coeff",
                self.max_coeff != default.max_coeff,
            ),
            (
                "optimizer.onebit.coeff_beta",
                self.coeff_beta != default.coeff_beta,
            ),
            (
                "optimizer.onebit.factor_min",
                self.factor_min != default.factor_min,
            ),
            (
                "optimizer.onebit.factor_max",
                self.factor_max != default.factor_max,
            ),
            (
                "optimizer.onebit.factor_threshold",
                self.factor_threshold != default.factor_threshold,
            ),
        ];
        for (field, set) in frozen_factor_only {
            if !set {
                continue;
            }
            if !lamb {
                return invalid(
                    field,
                    "applies to onebit-lamb's trust ratios; onebit-adam has none".into(),
                );
            }
            if self.lamb_coeff == OnebitLambCoeff::Computed {
                return invalid(
                    field,
                    "shapes optimizer.onebit.lamb_coeff = \"frozen-factor\" only and has no \
                     effect with lamb_coeff = \"computed\" (each step's trust ratio): set \
                     lamb_coeff = \"frozen-factor\", or leave this setting out"
                        .into(),
                );
            }
        }
        if !lamb && self.lamb_coeff != default.lamb_coeff {
            return invalid(
                "optimizer.onebit.lamb_coeff",
                "applies to onebit-lamb; onebit-adam has no trust ratio".into(),
            );
        }
        if freeze_step == 0 {
            return invalid(
                "optimizer.onebit.freeze_step",
                "must be at least 1: the compression stage divides by the variance the warm-up estimates".into(),
            );
        }
        if !(self.min_coeff > 0.0 && self.min_coeff <= self.max_coeff) {
            return invalid(
                "optimizer.onebit.min_coeff/max_coeff",
                format!(
                    "need 0 < min_coeff ≤ max_coeff, got {} and {}",
                    self.min_coeff, self.max_coeff
                ),
            );
        }
        if !(self.factor_min > 0.0 && self.factor_min <= self.factor_max) {
            return invalid(
                "optimizer.onebit.factor_min/factor_max",
                format!(
                    "need 0 < factor_min ≤ factor_max, got {} and {}",
                    self.factor_min, self.factor_max
                ),
            );
        }
        if !(0.0..1.0).contains(&self.coeff_beta) || !(0.0..1.0).contains(&self.factor_threshold) {
            return invalid(
                "optimizer.onebit.coeff_beta/factor_threshold",
                format!(
                    "must be in [0, 1), got {} and {}",
                    self.coeff_beta, self.factor_threshold
                ),
            );
        }
        if !self.scale_block.is_multiple_of(8) {
            return invalid(
                "optimizer.onebit.scale_block",
                format!(
                    "{} is not a multiple of 8 (each block's signs pack into whole bytes)",
                    self.scale_block
                ),
            );
        }
        Ok(())
    }
}
