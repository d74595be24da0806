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
//! The reducer divides each flattened bucket by the scale, once per micro-batch (Note
//! [Unscaled per bucket] in `parallel/buckets.rs`), and the check reads the **averaged** buckets: the sum of the ranks'
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct LossScaleConfig {
    /// Loss scaling: `auto` (dynamic in fp16), `none` or `dynamic` (PyTorch `GradScaler`'s
    /// rule: a step whose gradients overflow is skipped on every rank and the scale halves).
    /// Default: auto.

    #[arg(long = "loss-scale")]
    pub mode: LossScaleMode,
    /// The first step's scale (at most f32's 3.4e38; this and the other scaling settings are
    /// refused when the loss is not scaled). Default: 65536 (2¹⁶, PyTorch's `init_scale`).

    #[arg(long = "init-loss-scale")]
    pub init_scale: f64,
    /// Factor after `growth_interval` clean steps. Default: 2.
    #[arg(long = "loss-scale-growth-factor")]
    pub growth_factor: f64,
    /// Factor after an overflow. Default: 0.5.
    #[arg(long = "loss-scale-backoff-factor")]
    pub backoff_factor: f64,
    /// Consecutive clean steps before the scale grows. Default: 2000.
    #[arg(long = "loss-scale-growth-interval")]
    pub growth_interval: u64,
    /// The scale never goes below this. Default: 1 (DeepSpeed's `min_scale`).
    #[arg(long = "min-loss-scale")]
    pub min_scale: f64,
    /// Consecutive skipped steps after which the run stops with an error. Default: 20.
    #[arg(long)]
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
    /// Checks the settings, for a model computing in `precision`.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming the field: a scale that is not a positive f32
    /// (the scale multiplies an f32 loss: PyTorch keeps it in an f32 tensor),
    /// `init_scale < min_scale`, a growth factor ≤ 1, a backoff factor outside (0, 1), an
    /// interval or a skip limit of 0, and any of these set away from its default while the
    /// loss is not scaled (it would be ignored).
    pub fn validate(&self, precision: Option<ember_model::Precision>) -> Result<(), TrainError> {
        let invalid =
            |field: &'static str, reason: String| Err(TrainError::InvalidSetting { field, reason });
        let default = Self::default();
        if !self.enabled(precision) {
            let changed = [
                (
                    "loss_scale.init_scale",
                    self.init_scale != default.init_scale,
                ),
                (
                    "loss_scale.growth_factor",
                    self.growth_factor != default.growth_factor,
                ),
                (
                    "loss_scale.backoff_factor",
                    self.backoff_factor != default.backoff_factor,
                ),
                (
                    "loss_scale.growth_interval",
                    self.growth_interval != default.growth_interval,
                ),
                ("loss_scale.min_scale", self.min_scale != default.min_scale),
                (
                    "loss_scale.max_skipped_steps",
                    self.max_skipped_steps != default.max_skipped_steps,
                ),
            ];
            if let Some((field, _)) = changed.iter().find(|(_, c)| *c) {
                return invalid(
                    field,
                    format!(
                        "applies when the loss is scaled (loss_scale.mode = \"dynamic\", or \
                         \"auto\" with train.precision = \"fp16\"); mode is {}",
                        self.mode
                    ),
                );
            }
        }
        let f32_positive = |x: f64| x > 0.0 && x <= f64::from(f32::MAX);
        if !f32_positive(self.init_scale) {
            return invalid(
                "loss_scale.init_scale",
                format!(
                    "must be positive and at most f32's largest value (3.4e38), got {}",
                    fmt_scale(self.init_scale)
                ),
            );
        }
        if !f32_positive(self.min_scale) {
            return invalid(
                "loss_scale.min_scale",
                format!(
                    "must be positive and at most f32's largest value (3.4e38), got {}",
                    fmt_scale(self.min_scale)
                ),
            );
        }
        if self.init_scale < self.min_scale {
            return invalid(
                "loss_scale.init_scale",
                format!(
                    "{} is below loss_scale.min_scale ({}): raise it, or lower min_scale in \
                     the [loss_scale] section (--min-loss-scale)",
                    fmt_scale(self.init_scale),
                    fmt_scale(self.min_scale)
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
    /// The scale of the last skipped step (for the error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_skipped_scale: Option<f64>,
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
                last_skipped_scale: None,
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

    /// Continues from a saved state (PyTorch's `GradScaler.load_state_dict`: the saved scale
    /// goes on, `init_scale` is for fresh runs), raised to this run's `min_scale` if below it.
    pub fn restore(&mut self, state: LossScalerState) {
        self.state = state;
        self.state.scale = self.state.scale.max(self.config.min_scale);
    }

    /// Updates the scale after a step whose averaged gradient was (`found_inf`) or was not
    /// finite, and returns whether the step must be skipped.
    pub fn update(&mut self, found_inf: bool) -> bool {
        let s = &mut self.state;
        if found_inf {
            s.last_skipped_scale = Some(s.scale);
            s.scale = (s.scale * self.config.backoff_factor).max(self.config.min_scale);
            s.growth_tracker = 0;
            s.consecutive_skips += 1;
            s.skipped_steps += 1;
            return true;
        }
        s.consecutive_skips = 0;
        s.growth_tracker += 1;
        if s.growth_tracker == self.config.growth_interval {
            // Not taken when it leaves f32's range (PyTorch's scale is an f32 tensor).
            let grown = s.scale * self.config.growth_factor;
            if (grown as f32).is_finite() {
                s.scale = grown;
            }
            s.growth_tracker = 0;
        }
        false
    }

    /// After a skipped step (logged by then): the error once `max_skipped_steps` steps in a
    /// row have overflowed. `step` is the 1-based optimizer step the batches were for.
    ///
    /// # Errors
    /// [`TrainError::LossScaleCollapsed`] naming the step, the count and the last scale.
    pub fn check_collapse(&self, step: u64) -> Result<(), TrainError> {
        let s = &self.state;
        if s.consecutive_skips < self.config.max_skipped_steps {
            return Ok(());
        }
        Err(TrainError::LossScaleCollapsed {
            step,
            scale: fmt_scale(s.last_skipped_scale.unwrap_or(s.scale)),
            skipped: s.consecutive_skips,
        })
    }
}

/// A loss scale for messages: plain up to a million (65536), in exponent form beyond or below
/// a thousandth (1.7e38, 1e-300).
pub fn fmt_scale(scale: f64) -> String {
    if scale != 0.0 && !(1e-3..1e6).contains(&scale.abs()) {
        format!("{scale:e}")
    } else {
        format!("{scale}")
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
        assert!(s.update(true), "an overflow skips");
        assert_eq!(s.scale(), 4.0);
        // Two clean steps: not yet; the third doubles (PyTorch: growth_tracker reaches the
        // interval), and the count starts again.
        assert!(!s.update(false));
        assert!(!s.update(false));
        assert_eq!(s.scale(), 4.0);
        assert!(!s.update(false));
        assert_eq!(s.scale(), 8.0);
        assert_eq!(s.state().growth_tracker, 0);
        // An overflow resets the count of clean steps.
        s.update(false);
        s.update(true);
        assert_eq!(s.state().growth_tracker, 0);
        // The floor: 4 → 2 → 2.
        for _ in 0..3 {
            s.update(true);
        }
        assert_eq!(s.scale(), 2.0);
        assert_eq!(s.state().skipped_steps, 5);
        assert_eq!(s.state().consecutive_skips, 4);
    }

    #[test]
    fn consecutive_skips_stop_the_run_with_the_step_and_scale() {
        let mut s = scaler(2000, 3);
        s.update(true);
        s.update(false);
        s.check_collapse(10).unwrap();
        s.update(true);
        s.update(true);
        s.check_collapse(11).unwrap();
        s.update(true);
        let error = s.check_collapse(11).unwrap_err().to_string();
        assert!(
            error.contains("step 11") && error.contains("scale 2") && error.contains("3 "),
            "{error}"
        );
    }

    #[test]
    fn a_scale_that_would_leave_f32_is_not_taken() {
        let max = f64::from(f32::MAX);
        let mut s = LossScaler::new(
            &LossScaleConfig {
                mode: LossScaleMode::Dynamic,
                init_scale: max / 1.5,
                growth_interval: 1,
                ..LossScaleConfig::default()
            },
            None,
        )
        .unwrap();
        s.update(false);
        assert_eq!(s.scale(), max / 1.5);
        // A resumed run's floor applies to the saved scale.
        let mut t = scaler(10, 10); // min_scale 2.0
        t.restore(LossScalerState {
            scale: 0.5,
            ..s.state()
        });
        assert_eq!(t.scale(), 2.0);
        assert_eq!(fmt_scale(65536.0), "65536");
        assert_eq!(fmt_scale(1.7e38), "1.7e38");
    }

    #[test]
    fn bad_settings_name_the_field() {
        let refused = |edit: &dyn Fn(&mut LossScaleConfig)| {
            let mut c = LossScaleConfig {
                mode: LossScaleMode::Dynamic,
                ..LossScaleConfig::default()
            };
            edit(&mut c);
            c.validate(None).unwrap_err().to_string()
        };
        assert!(refused(&|c| c.init_scale = 0.0).contains("loss_scale.init_scale"));
        assert!(refused(&|c| c.init_scale = f64::INFINITY).contains("loss_scale.init_scale"));
        assert!(refused(&|c| c.init_scale = 1e300).contains("3.4e38), got 1e300"));
        assert!(refused(&|c| c.init_scale = f64::NAN).contains("loss_scale.init_scale"));
        let below = refused(&|c| c.init_scale = 0.5);
        assert!(
            below.contains("loss_scale.init_scale") && below.contains("--min-loss-scale"),
            "{below}"
        );
        assert!(refused(&|c| c.min_scale = 0.0).contains("loss_scale.min_scale"));
        assert!(refused(&|c| c.growth_factor = 1.0).contains("loss_scale.growth_factor"));
        assert!(refused(&|c| c.backoff_factor = 1.0).contains("loss_scale.backoff_factor"));
        assert!(refused(&|c| c.growth_interval = 0).contains("loss_scale.growth_interval"));
        assert!(refused(&|c| c.max_skipped_steps = 0).contains("loss_scale.max_skipped_steps"));
        LossScaleConfig::default().validate(None).unwrap();
        // Settings of a scaler that does not run are refused, not ignored.
        let ignored = LossScaleConfig {
            init_scale: 1024.0,
            ..LossScaleConfig::default()
        };
        let error = ignored.validate(None).unwrap_err().to_string();
        assert!(
            error.contains("loss_scale.init_scale") && error.contains("applies when"),
            "{error}"
        );
        ignored
            .validate(Some(ember_model::Precision::Fp16))
            .unwrap();
        assert!(LossScaleConfig::default().enabled(Some(ember_model::Precision::Fp16)));
        assert!(!LossScaleConfig::default().enabled(Some(ember_model::Precision::Bf16)));
    }
}
