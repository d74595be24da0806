//! The `[train]` section: how long, how big, when to evaluate, and how micro-batches weigh
//! their losses.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The loop: how long, how big, when to evaluate and where to write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct LoopConfig {
    /// Optimizer steps. Default: 500.
    #[arg(long)]
    pub steps: u64,
    /// Samples per rank and micro-batch (the local batch size). The global batch size, the
    /// samples behind one optimizer step, is `batch_size × parallel.grad_accum × world_size`.
    /// Default: 32.
    #[arg(long)]
    pub batch_size: usize,
    /// Evaluate every this many steps (and after the last); not with
    /// `eval_interval_samples`. Default: unset, 100 steps when `eval_interval_samples` is
    /// unset too.
    #[arg(long, conflicts_with = "eval_interval_samples")]
    pub eval_every: Option<u64>,
    /// Evaluate every this many training samples instead of `eval_every` steps: after the
    /// first step at which the samples trained reach the next multiple (MLPerf's
    /// `eval_iter_samples`), and after the last step. A number, or `"mlperf"` for the BERT
    /// rule `FLOOR(0.05 × (230.23 × global batch size + 3,000,000), 25,000)`.
    /// Default: unset.
    #[arg(long)]
    pub eval_interval_samples: Option<EvalInterval>,
    /// Held-out instances evaluated each time (at most the number available; MLPerf: 10,000).
    /// Default: 1024.

    #[arg(long)]
    pub eval_samples: usize,
    /// Stop as soon as an evaluation reaches this masked-LM accuracy (0..1). Default: none.
    #[arg(long)]
    pub target_mlm_accuracy: Option<f64>,
    /// Write a metrics line every this many steps. Default: 10.
    #[arg(long)]
    pub log_every: u64,
    /// Seed of the model initialisation, dropout and batch order. Dropout masks are keyed by
    /// (seed, rank, step, layer, sample, position): ranks draw different masks and a run
    /// repeats bit for bit (`ember_backend_ext::DropoutScope`). On the command line, `--seed`
    /// also sets `instances.seed` unless `--instances-seed` is given. Default: 42.
    #[arg(long)]
    pub seed: u64,
    /// Output folder for metrics and the checkpoint. Default: `runs/latest`.
    #[arg(long)]
    pub out: PathBuf,
    /// How the losses of `parallel.grad_accum` micro-batches make the step's gradient:
    /// `micro-batch` (the mean of the micro-batches' mean losses) or `batch` (exactly the
    /// gradient of the whole local batch, as transformers' `num_items_in_batch`).
    /// Default: micro-batch (NVIDIA's and Samsung's MLPerf code).

    #[arg(long)]
    pub loss_normalization: LossNormalization,
    /// Forward and backward passes on a dummy batch of the run's shape before the timed run
    /// (MLPerf's `init_stop`/`run_start`), updating nothing: the first kernels, collectives
    /// and allocations happen there, as in Samsung's MLPerf v1.1 BERT, which runs 10 (Note
    /// [Init passes] in `trainer/src/train/init_passes.rs`). Default: 0.
    #[arg(long)]
    pub init_passes: u32,
    /// The dtype the model computes in: `f32`, `bf16` or `fp16`, with f32 weights and
    /// optimizer state (Note [Autocast] in `ember_model`'s `precision.rs`). fp16 turns on
    /// dynamic loss scaling unless `loss_scale.mode` says otherwise. Default: bf16 where the
    /// backend has it (CUDA), else f32 (NdArray, wgpu).
    #[arg(long)]
    pub precision: Option<ember_model::Precision>,
}

/// How often to evaluate, in training samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EvalInterval {
    /// Every this many samples.
    Samples(u64),
    /// MLPerf BERT's rule (`training_policies`, "eval_interval_samples").
    Rule(EvalRule),
}

/// A named evaluation interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalRule {
    /// `FLOOR(0.05 × (230.23 × GBS + 3,000,000), 25,000)` samples.
    Mlperf,
}

impl EvalInterval {
    /// The interval in samples for a global batch size (at least one sample).
    pub fn samples(self, global_batch_size: usize) -> u64 {
        match self {
            Self::Samples(n) => n.max(1),
            Self::Rule(EvalRule::Mlperf) => {
                let raw = 0.05 * (230.23 * global_batch_size as f64 + 3_000_000.0);
                (raw / 25_000.0).floor() as u64 * 25_000
            }
        }
    }
}

impl std::str::FromStr for EvalInterval {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mlperf" => Ok(Self::Rule(EvalRule::Mlperf)),
            n => n
                .parse()
                .map(Self::Samples)
                .map_err(|_| format!("`{n}` is neither a number of samples nor `mlperf`")),
        }
    }
}

/// How the K micro-batches of a step weigh their losses.
///
/// With K = 1 both give the same gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossNormalization {
    /// Each micro-batch's mean losses divided by K: the step's loss is the mean of the
    /// micro-batches' mean losses. What NVIDIA's MLPerf BERT (`run_pretraining.py`, `loss /
    /// gradient_accumulation_steps`) and Samsung's v1.1 code do, and the default so that
    /// ember's optimisation is the references'. With micro-batches of different sizes
    /// (`--padding grouped` sorts the local batch by length, so short samples share a
    /// micro-batch and have fewer masked tokens) a token of a short micro-batch weighs more
    /// than one of a long micro-batch.
    #[default]
    MicroBatch,
    /// The MLM loss summed over the micro-batch's masked tokens and divided by the local
    /// batch's masked-token count, the NSP loss summed over its samples and divided by the
    /// local batch's sample count: K micro-batches give exactly the gradient of one step on the
    /// whole local batch (Hugging Face transformers' gradient-accumulation fix of 2024,
    /// `num_items_in_batch`).
    Batch,
}

impl std::str::FromStr for LossNormalization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "micro-batch" => Ok(Self::MicroBatch),
            "batch" => Ok(Self::Batch),
            other => Err(format!(
                "unknown loss normalization `{other}` (expected micro-batch or batch)"
            )),
        }
    }
}

impl LoopConfig {
    /// The steps between evaluations when the cadence is in steps: `eval_every`, else 100.
    pub fn eval_every_steps(&self) -> u64 {
        self.eval_every.unwrap_or(100)
    }
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            steps: 500,
            batch_size: 32,
            eval_every: None,
            eval_interval_samples: None,
            eval_samples: 1024,
            target_mlm_accuracy: None,
            log_every: 10,
            seed: 42,
            out: PathBuf::from("runs/latest"),
            loss_normalization: LossNormalization::MicroBatch,
            precision: None,
            init_passes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Samsung's 1,024-GPU run (global batch 16,384) evaluated every 325,000 samples
    /// (`../shared/REFERENCES.md`); NVIDIA's 8-GPU configuration (global batch 448) every
    /// 150,000.
    #[test]
    fn mlperf_eval_interval_follows_the_rule() {
        let rule: EvalInterval = "mlperf".parse().unwrap();
        assert_eq!(rule.samples(16_384), 325_000);
        assert_eq!(rule.samples(448), 150_000);
        assert_eq!("40000".parse::<EvalInterval>().unwrap().samples(8), 40_000);
        assert!("often".parse::<EvalInterval>().is_err());
        let parsed: LoopConfig = toml::from_str("eval_interval_samples = \"mlperf\"").unwrap();
        assert_eq!(parsed.eval_interval_samples, Some(rule));
        let parsed: LoopConfig = toml::from_str("eval_interval_samples = 640").unwrap();
        assert_eq!(
            parsed.eval_interval_samples,
            Some(EvalInterval::Samples(640))
        );
    }
}
