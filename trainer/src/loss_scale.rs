//! Dynamic loss scaling: the loss is multiplied by a scale before backward so that small
//! half-precision gradients do not flush to zero, the gradients are divided by it again in the
//! reducer, and a step whose averaged gradient holds inf or NaN is skipped on every rank.
//!
//! The rule is PyTorch's `torch.amp.GradScaler` (`_amp_update_scale_`,
//! `aten/src/ATen/native/cuda/AmpKernels.cu`): the scale starts at `init_scale` (2¹⁶), is
//! multiplied by `backoff_factor` (0.5) on an overflow and by `growth_factor` (2) after
//! `growth_interval` (2000) consecutive clean steps; a grown scale that is not finite is not
//! taken. Two additions where PyTorch has none, from DeepSpeed's `DynamicLossScaler`
//! (`deepspeed/runtime/fp16/loss_scaler.py`, `min_scale`, `raise_error_at_min_scale`) and
//! apex's `min_loss_scale`: the scale never goes below `min_scale` (1), and after
//! `max_skipped_steps` (20) consecutive skipped steps the run stops with an error naming the
//! step and the scale ([`TrainError::LossScaleCollapsed`]) instead of training on, or dividing
//! by, a scale that collapsed to 0 (NVIDIA DeepLearningExamples issues #252, #543, #1135).
//!
//! Note [Agreeing on an overflow]: every rank must skip the same steps, or their weights part.
//! The reducer divides each gradient by the scale as it arrives (fused with nothing: one
//! multiply per gradient) and the check reads the **averaged** buckets: the sum of the ranks'
//! buckets is inf or NaN on every rank as soon as it is on one (IEEE: inf + x = inf,
//! inf − inf = NaN, NaN + x = NaN; bucket clipping by an infinite norm multiplies by 0, which
//! gives NaN), so the non-finite values are themselves the flag, allreduced with the data,
//! and no extra collective is needed. The check is the squared norm of the averaged buckets,
//! computed per bucket on the device (the multi-tensor norm kernel) and read once per step
//! after the wait for the buckets, as `GradScaler.step` reads `found_inf` (`.item()`) before
//! it decides to call the optimizer. 1-bit Adam/LAMB's compression stage averages compressed
//! momenta, in which signs and scales do not carry an inf: loss scaling is refused with it.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// Whether the loss is scaled (`loss_scale.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossScaleMode {
    /// Dynamic with `train.precision = "fp16"`, none otherwise (bf16 has f32's range).
    #[default]
    Auto,
    /// The loss as it is, no overflow check.
    None,
    /// PyTorch's `GradScaler` rule (see the module docs).
    Dynamic,
}

impl std::fmt::Display for LossScaleMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossScaleMode::Auto => "auto",
            LossScaleMode::None => "none",
            LossScaleMode::Dynamic => "dynamic",
        })
    }
}

impl std::str::FromStr for LossScaleMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(LossScaleMode::Auto),
            "none" => Ok(LossScaleMode::None),
            "dynamic" => Ok(LossScaleMode::Dynamic),
            other => Err(format!(
                "unknown loss scale mode {other:?}: expected auto, none or dynamic"
            )),
        }
    }
}

/// `[loss_scale]`: dynamic loss scaling (PyTorch `GradScaler`'s arguments, DeepSpeed's
/// `min_scale`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossScaleConfig {
    /// `auto` (dynamic in fp16), `none` or `dynamic`. Default: auto.
    pub mode: LossScaleMode,
    /// The first step's scale. Default: 65536 (2¹⁶, PyTorch's `init_scale`).
    pub init_scale: f64,
    /// Factor after `growth_interval` clean steps. Default: 2.
    pub growth_factor: f64,
    /// Factor after an overflow. Default: 0.5.
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows. Default: 2000.
    pub growth_interval: u64,
    /// The scale never goes below this. Default: 1 (DeepSpeed's `min_scale`).
    pub min_scale: f64,
    /// Consecutive skipped steps after which the run stops with an error. Default: 20.
    pub max_skipped_steps: u64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        Self {
            mode: LossScaleMode::Auto,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
            max_skipped_steps: 20,
        }
    }
}

impl LossScaleConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming the field: a scale that is not finite and
    /// positive, `min_scale > init_scale`, a growth factor ≤ 1, a backoff factor outside
    /// (0, 1), an interval or a skip limit of 0.
    pub fn validate(&self) -> Result<(), TrainError> {
        let invalid =
            |field: &'static str, reason: String| Err(TrainError::InvalidSetting { field, reason });
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.init_scale) {
            return invalid(
                "loss_scale.init_scale",
                format!("must be finite and positive, got {}", self.init_scale),
            );
        }
        if !positive(self.min_scale) || self.min_scale > self.init_scale {
            return invalid(
                "loss_scale.min_scale",
                format!(
                    "must be positive and at most init_scale ({}), got {}",
                    self.init_scale, self.min_scale
                ),
            );
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return invalid(
                "loss_scale.growth_factor",
                format!("must be above 1, got {}", self.growth_factor),
            );
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return invalid(
                "loss_scale.backoff_factor",
                format!("must lie in (0, 1), got {}", self.backoff_factor),
            );
        }
        if self.growth_interval == 0 {
            return invalid("loss_scale.growth_interval", "must be at least 1".into());
        }
        if self.max_skipped_steps == 0 {
            return invalid("loss_scale.max_skipped_steps", "must be at least 1".into());
        }
        Ok(())
    }

    /// Whether the loss is scaled when the model computes in `precision`.
    pub fn enabled(&self, precision: Option<ember_model::Precision>) -> bool {
        match self.mode {
            LossScaleMode::Auto => precision == Some(ember_model::Precision::Fp16),
            LossScaleMode::None => false,
            LossScaleMode::Dynamic => true,
        }
    }
}

/// What the scaler carries from step to step (saved in checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    /// The scale of the next step.
    pub scale: f64,
    /// Clean steps since the scale last changed (PyTorch's `growth_tracker`).
    pub growth_tracker: u64,
    /// Skipped steps in a row, up to the last step.
    pub consecutive_skips: u64,
    /// Skipped steps in the whole run.
    pub skipped_steps: u64,
}

/// The dynamic loss scaler of one rank (every rank takes the same decisions: Note [Agreeing
/// on an overflow]).
#[derive(Debug, Clone)]
pub struct LossScaler {
    config: LossScaleConfig,
    state: LossScalerState,
}

impl LossScaler {
    /// A scaler for `config` when the model computes in `precision`; `None` when the loss is
    /// not scaled ([`LossScaleConfig::enabled`]).
    pub fn new(
        config: &LossScaleConfig,
        precision: Option<ember_model::Precision>,
    ) -> Option<Self> {
        config.enabled(precision).then(|| Self {
            config: config.clone(),
            state: LossScalerState {
                scale: config.init_scale,
                growth_tracker: 0,
                consecutive_skips: 0,
                skipped_steps: 0,
            },
        })
    }

    /// The scale the next step's loss is multiplied by.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// The state to save.
    pub fn state(&self) -> LossScalerState {
        self.state
    }

    /// Continues from a saved state.
    pub fn restore(&mut self, state: LossScalerState) {
        self.state = state;
    }

    /// Updates the scale after a step whose averaged gradient was (`found_inf`) or was not
    /// finite, and returns whether the step must be skipped. `step` is the 1-based optimizer
    /// step the batch would have been, for the error.
    ///
    /// # Errors
    /// [`TrainError::LossScaleCollapsed`] on the `max_skipped_steps`-th consecutive skip.
    pub fn update(&mut self, found_inf: bool, step: u64) -> Result<bool, TrainError> {
        let s = &mut self.state;
        if found_inf {
            let scale = s.scale;
            s.scale = (s.scale * self.config.backoff_factor).max(self.config.min_scale);
            s.growth_tracker = 0;
            s.consecutive_skips += 1;
            s.skipped_steps += 1;
            if s.consecutive_skips >= self.config.max_skipped_steps {
                return Err(TrainError::LossScaleCollapsed {
                    step,
                    scale,
                    skipped: s.consecutive_skips,
                });
            }
            return Ok(true);
        }
        s.consecutive_skips = 0;
        s.growth_tracker += 1;
        if s.growth_tracker == self.config.growth_interval {
            let grown = s.scale * self.config.growth_factor;
            if grown.is_finite() {
                s.scale = grown;
            }
            s.growth_tracker = 0;
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(interval: u64, max_skipped: u64) -> LossScaler {
        LossScaler::new(
            &LossScaleConfig {
                mode: LossScaleMode::Dynamic,
                init_scale: 8.0,
                growth_interval: interval,
                min_scale: 2.0,
                max_skipped_steps: max_skipped,
                ..LossScaleConfig::default()
            },
            None,
        )
        .unwrap()
    }

    #[test]
    fn the_scale_backs_off_grows_after_the_interval_and_stops_at_the_floor() {
        let mut s = scaler(3, 10);
        assert!(s.update(true, 1).unwrap(), "an overflow skips");
        assert_eq!(s.scale(), 4.0);
        // Two clean steps: not yet; the third doubles (PyTorch: growth_tracker reaches the
        // interval), and the count starts again.
        assert!(!s.update(false, 1).unwrap());
        assert!(!s.update(false, 2).unwrap());
        assert_eq!(s.scale(), 4.0);
        assert!(!s.update(false, 3).unwrap());
        assert_eq!(s.scale(), 8.0);
        assert_eq!(s.state().growth_tracker, 0);
        // An overflow resets the count of clean steps.
        s.update(false, 4).unwrap();
        s.update(true, 5).unwrap();
        assert_eq!(s.state().growth_tracker, 0);
        // The floor: 4 → 2 → 2.
        for step in 5..8 {
            s.update(true, step).unwrap();
        }
        assert_eq!(s.scale(), 2.0);
        assert_eq!(s.state().skipped_steps, 5);
        assert_eq!(s.state().consecutive_skips, 4);
    }

    #[test]
    fn consecutive_skips_stop_the_run_with_the_step_and_scale() {
        let mut s = scaler(2000, 3);
        s.update(true, 10).unwrap();
        s.update(false, 10).unwrap();
        s.update(true, 11).unwrap();
        s.update(true, 11).unwrap();
        let error = s.update(true, 11).unwrap_err().to_string();
        assert!(
            error.contains("step 11") && error.contains("scale 2") && error.contains("3 "),
            "{error}"
        );
    }

    #[test]
    fn a_scale_that_would_overflow_is_not_taken() {
        let mut s = LossScaler::new(
            &LossScaleConfig {
                mode: LossScaleMode::Dynamic,
                init_scale: f64::MAX,
                min_scale: 1.0,
                growth_interval: 1,
                ..LossScaleConfig::default()
            },
            None,
        )
        .unwrap();
        s.update(false, 1).unwrap();
        assert_eq!(s.scale(), f64::MAX);
    }

    #[test]
    fn bad_settings_name_the_field() {
        let refused = |edit: &dyn Fn(&mut LossScaleConfig)| {
            let mut c = LossScaleConfig::default();
            edit(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(refused(&|c| c.init_scale = 0.0).contains("loss_scale.init_scale"));
        assert!(refused(&|c| c.init_scale = f64::INFINITY).contains("loss_scale.init_scale"));
        assert!(refused(&|c| c.min_scale = 1e9).contains("loss_scale.min_scale"));
        assert!(refused(&|c| c.growth_factor = 1.0).contains("loss_scale.growth_factor"));
        assert!(refused(&|c| c.backoff_factor = 1.0).contains("loss_scale.backoff_factor"));
        assert!(refused(&|c| c.growth_interval = 0).contains("loss_scale.growth_interval"));
        assert!(refused(&|c| c.max_skipped_steps = 0).contains("loss_scale.max_skipped_steps"));
        LossScaleConfig::default().validate().unwrap();
    }
}
