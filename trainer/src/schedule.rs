//! Learning-rate schedule: linear warmup, then polynomial decay (BERT's `optimization.py`,
//! NVIDIA's `PolyWarmUpScheduler`, Hugging Face's `get_polynomial_decay_schedule_with_warmup`).

use crate::config::ScheduleConfig;

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
        }
    }

    /// The learning rate of step `step` (0-based: the first update uses `lr(0)`).
    ///
    /// - warmup, `s = step − start_warmup_step < warmup_steps`: `peak · s / warmup_steps`
    /// - then: `(peak − end) · ((total − step) / (total − warmup))^power + end`
    pub fn lr(&self, step: u64) -> f64 {
        let warmup_step = step as i64 - self.start_warmup_step;
        if warmup_step < self.warmup_steps as i64 {
            return self.peak_lr * warmup_step.max(0) as f64 / self.warmup_steps as f64;
        }
        let decay_steps = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let remaining = self.total_steps.saturating_sub(step) as f64;
        let fraction = (remaining / decay_steps).min(1.0);
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
        assert!((s.lr(5) - 1.0).abs() < 1e-12);
    }
}
