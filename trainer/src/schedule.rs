//! Learning-rate schedule: linear warmup, then polynomial decay. Two references differ in what
//! the decay measures its progress from ([`DecayFrom`]):
//!
//! - [`DecayFrom::WarmupEnd`] (default): Hugging Face's
//!   `get_polynomial_decay_schedule_with_warmup` (`transformers/optimization.py`): after warmup
//!   the rate falls from the peak over the `total − warmup` remaining steps, continuously.
//! - [`DecayFrom::Start`]: Google's BERT `optimization.py` (`tf.train.polynomial_decay` over
//!   the whole run, overridden by warmup while it lasts) and NVIDIA's MLPerf BERT
//!   `schedulers.py` (`LinearWarmupPolyDecayScheduler`, which Samsung's v1.1 code uses): the
//!   decay's progress is `step / total` from step 0, so the rate drops at the end of warmup
//!   (to `(1 − warmup_end / total)^power` of the peak). ember reproduces that drop (it is how
//!   the MLPerf hyper-parameters were tuned); choose `warmup-end` to avoid it.
//!
//! Warmup starts at `start_warmup_step` (MLPerf's `--start_warmup_step`): negative starts the
//! run part-way into warmup; positive keeps the rate at 0 until then.

use serde::{Deserialize, Serialize};

use crate::config::ScheduleConfig;

/// Where the polynomial decay measures its progress from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecayFrom {
    /// From the end of warmup over `total − warmup` steps (Hugging Face).
    #[default]
    WarmupEnd,
    /// From step 0 over `total` steps (Google's BERT, NVIDIA's and Samsung's MLPerf code).
    Start,
}

impl std::str::FromStr for DecayFrom {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "warmup-end" => Ok(Self::WarmupEnd),
            "start" => Ok(Self::Start),
            other => Err(format!(
                "unknown decay start `{other}` (expected warmup-end or start)"
            )),
        }
    }
}

/// Warmup then polynomial decay, as a function of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupPolyDecay {
    /// Learning rate at the end of warmup.
    pub peak_lr: f64,
    /// Learning rate at `total_steps` and after.
    pub end_lr: f64,
    /// Steps of linear warmup from 0 to `peak_lr`.
    pub warmup_steps: u64,
    /// Steps of the run; the decay reaches `end_lr` here.
    pub total_steps: u64,
    /// Exponent of the decay (1.0: linear).
    pub power: f64,
    /// Step at which warmup starts (negative: the run starts part-way into warmup).
    pub start_warmup_step: i64,
    /// Where the decay measures its progress from.
    pub decay_from: DecayFrom,
}

impl WarmupPolyDecay {
    /// The schedule of a configuration.
    pub fn new(peak_lr: f64, warmup_steps: u64, total_steps: u64, config: &ScheduleConfig) -> Self {
        Self {
            peak_lr,
            end_lr: config.end_lr,
            warmup_steps,
            total_steps,
            power: config.power,
            start_warmup_step: config.start_warmup_step,
            decay_from: config.decay_from,
        }
    }

    /// The learning rate of step `step` (0-based: the first update uses `lr(0)`).
    ///
    /// With `s = step − start_warmup_step` and `W = warmup_steps`:
    /// - `s < 0`: 0 (warmup has not started);
    /// - `s < W`: `peak · s / W`;
    /// - then `(peak − end) · f^power + end`, with `f = (total − step) / (total − end of
    ///   warmup)` ([`DecayFrom::WarmupEnd`], at most 1) or `f = (total − step) / total`
    ///   ([`DecayFrom::Start`]); `f = 0` from `total` on.
    ///
    /// Never NaN: `W = 0` has no warmup (the rate is 0 before `start_warmup_step` and decays
    /// from the peak after it), and a zero-length decay is at its end.
    pub fn lr(&self, step: u64) -> f64 {
        let warmup_step = step as i64 - self.start_warmup_step;
        if warmup_step < 0 {
            return 0.0;
        }
        if warmup_step < self.warmup_steps as i64 {
            return self.peak_lr * warmup_step as f64 / self.warmup_steps as f64;
        }
        let remaining = self.total_steps.saturating_sub(step) as f64;
        let horizon = match self.decay_from {
            DecayFrom::WarmupEnd => {
                let warmup_end = (self.start_warmup_step + self.warmup_steps as i64).max(0) as u64;
                self.total_steps.saturating_sub(warmup_end)
            }
            DecayFrom::Start => self.total_steps,
        };
        let fraction = if horizon == 0 {
            0.0
        } else {
            (remaining / horizon as f64).min(1.0)
        };
        (self.peak_lr - self.end_lr) * fraction.powf(self.power) + self.end_lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(power: f64, start_warmup_step: i64) -> WarmupPolyDecay {
        WarmupPolyDecay {
            peak_lr: 1.0,
            end_lr: 0.0,
            warmup_steps: 10,
            total_steps: 110,
            power,
            start_warmup_step,
            decay_from: DecayFrom::WarmupEnd,
        }
    }

    #[test]
    fn warms_up_linearly_then_decays_to_end() {
        let s = schedule(1.0, 0);
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(5) - 0.5).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.5).abs() < 1e-12);
        assert_eq!(s.lr(110), 0.0);
        assert_eq!(s.lr(500), 0.0);
        let quadratic = schedule(2.0, 0);
        assert!((quadratic.lr(60) - 0.25).abs() < 1e-12);
    }

    #[test]
    fn negative_start_warmup_step_starts_part_way() {
        let s = schedule(1.0, -5);
        assert!((s.lr(0) - 0.5).abs() < 1e-12);
        assert!((s.lr(4) - 0.9).abs() < 1e-12);
        // Warmup ends at step 5; the decay runs from there to 110, continuously.
        assert!((s.lr(5) - 1.0).abs() < 1e-12);
        assert!((s.lr(5 + 105 / 2) - (1.0 - 52.0 / 105.0)).abs() < 1e-12);
    }

    #[test]
    fn positive_start_and_no_warmup_are_never_nan() {
        // The 0/0 of `warmup_steps = 0` with `start_warmup_step > 0`.
        let s = WarmupPolyDecay {
            warmup_steps: 0,
            ..schedule(1.0, 20)
        };
        assert_eq!(s.lr(0), 0.0);
        assert_eq!(s.lr(19), 0.0);
        assert!((s.lr(20) - 1.0).abs() < 1e-12);
        assert!((s.lr(65) - 0.5).abs() < 1e-12);
        let delayed = schedule(1.0, 20);
        assert_eq!(delayed.lr(10), 0.0);
        assert!((delayed.lr(25) - 0.5).abs() < 1e-12);
        assert!((delayed.lr(30) - 1.0).abs() < 1e-12);
        // A run no longer than its warmup: no decay to measure.
        let short = WarmupPolyDecay {
            total_steps: 5,
            ..schedule(1.0, 0)
        };
        for step in 0..20 {
            assert!(short.lr(step).is_finite());
        }
        let none = WarmupPolyDecay {
            warmup_steps: 0,
            total_steps: 0,
            ..schedule(1.0, 0)
        };
        assert_eq!(none.lr(0), 0.0);
    }

    /// Samsung's 1,024-GPU settings (`../shared/REFERENCES.md`: 82 warmup steps from −16,
    /// decay horizon 179): NVIDIA's MLPerf scheduler warms up to step 65, then decays from
    /// step 0's point of view, so the rate drops from 81/82 of the peak to 1 − 66/179.
    #[test]
    fn mlperf_decay_measures_from_step_zero() {
        let s = WarmupPolyDecay {
            peak_lr: 3.9299e-4,
            end_lr: 4.9455e-5,
            warmup_steps: 82,
            total_steps: 179,
            power: 1.0,
            start_warmup_step: -16,
            decay_from: DecayFrom::Start,
        };
        assert!((s.lr(0) - 3.9299e-4 * 16.0 / 82.0).abs() < 1e-15);
        assert!((s.lr(65) - 3.9299e-4 * 81.0 / 82.0).abs() < 1e-15);
        let decayed = (3.9299e-4 - 4.9455e-5) * (1.0 - 66.0 / 179.0) + 4.9455e-5;
        assert!((s.lr(66) - decayed).abs() < 1e-15);
        assert!((s.lr(179) - 4.9455e-5).abs() < 1e-15);
        assert!((s.lr(299) - 4.9455e-5).abs() < 1e-15);
    }
}
