//! The `[schedule]` section: the learning rate's warmup and decay.

use serde::{Deserialize, Serialize};

/// Learning-rate schedule: linear warmup, then polynomial decay to `end_lr` at the last step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Steps of linear warmup; when unset, `warmup_proportion` of the steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Fraction of the steps spent in warmup when `warmup_steps` is unset (NVIDIA's
    /// `--warmup_proportion`). Default: 0.1.
    #[arg(long)]
    pub warmup_proportion: f64,
    /// Exponent of the decay; 1.0 is linear. Default: 1.0.
    #[arg(long = "decay-power")]
    pub power: f64,
    /// Learning rate at the end of the decay. Default: 0.
    #[arg(long)]
    pub end_lr: f64,
    /// The step at which the decay reaches `end_lr` (NVIDIA's and Samsung's
    /// `--lr_max_steps`, which may differ from the run's steps); unset: `train.steps`.
    /// Default: unset.
    #[arg(long)]
    pub decay_steps: Option<u64>,
    /// Step at which warmup starts; negative values start the run part-way into warmup, as
    /// MLPerf's `start_warmup_step`; positive values keep the rate at 0 until then.
    /// Default: 0.
    #[arg(long)]
    pub start_warmup_step: i64,
    /// What the decay measures its progress from: `warmup-end` (Hugging Face's
    /// `get_polynomial_decay_schedule_with_warmup`) or `start` (Google's BERT and NVIDIA's
    /// MLPerf `LinearWarmupPolyDecayScheduler`: the rate drops at the end of warmup).
    /// Default: warmup-end.

    #[arg(long)]
    pub decay_from: crate::schedule::DecayFrom,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self {
            warmup_steps: None,
            warmup_proportion: 0.1,
            power: 1.0,
            end_lr: 0.0,
            decay_steps: None,
            start_warmup_step: 0,
            decay_from: crate::schedule::DecayFrom::WarmupEnd,
        }
    }
}
