//! The training configuration: one TOML file (`configs/*.toml`) with a section per concern
//! (each section's type in a file of its own under `config/`). Every field has a default,
//! unknown fields are errors (a typo must not be silently ignored), and the whole
//! configuration is saved next to every checkpoint.

use std::path::{Path, PathBuf};

use ember_data::{Padding, SamplerKind};
use ember_model::BertConfig;
use serde::{Deserialize, Serialize};

use crate::TrainError;

mod data_section;
mod flags;
mod loop_section;
mod model_section;
mod optimizer_section;
mod parallel_section;
mod schedule_section;

use crate::checkpoint::CheckpointConfig;
pub use crate::loss_scale::{LossScaleConfig, LossScaleMode};
pub use crate::onebit::OnebitConfig;
pub use crate::parallel::AllreduceDtype;
use crate::parallel::ClipMode;
pub use data_section::{DataSection, MAX_PREFETCH};
use ember_data::PretrainingConfig;
pub use ember_model::Precision;
pub use flags::{SettingFlags, setting_key};
pub use loop_section::{EvalInterval, EvalRule, LoopConfig, LossNormalization};
pub use model_section::ModelSection;
pub use optimizer_section::{OptimizerConfig, OptimizerKind};
pub use parallel_section::ParallelConfig;
pub use schedule_section::ScheduleConfig;

/// Everything a training run needs.
///
/// Every field of every section is also a flag of `ember train` (`clap::Args`, derived here:
/// the field's doc comment is the flag's help, the section its heading, and the flag is
/// normally the field's name); the command line's flags are applied over the file with
/// `clap::FromArgMatches::update_from_arg_matches`, which sets only the flags given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    #[command(flatten, next_help_heading = "Model [model]")]
    pub model: ModelSection,
    #[command(flatten, next_help_heading = "Data [data]")]
    pub data: DataSection,
    /// Instance creation, as `create_pretraining_data.py`'s flags (`max_seq_length`,
    /// `max_predictions_per_seq`, `masked_lm_prob`, `short_seq_prob`, `dupe_factor`, `seed`).
    #[command(flatten, next_help_heading = "Instance creation [instances]")]
    pub instances: PretrainingConfig,
    #[command(flatten, next_help_heading = "Optimizer [optimizer]")]
    pub optimizer: OptimizerConfig,
    #[command(flatten, next_help_heading = "Learning-rate schedule [schedule]")]
    pub schedule: ScheduleConfig,
    #[command(flatten, next_help_heading = "Training loop [train]")]
    pub train: LoopConfig,
    #[command(flatten, next_help_heading = "Data parallel [parallel]")]
    pub parallel: ParallelConfig,
    /// When to write checkpoints, and which run to resume.
    #[command(flatten, next_help_heading = "Checkpoints [checkpoint]")]
    pub checkpoint: CheckpointConfig,
    /// The MLPerf log (`:::MLLOG` lines) and its submission keys.
    #[command(flatten, next_help_heading = "MLPerf log [mllog]")]
    pub mllog: crate::mllog::MllogConfig,
    /// Dynamic loss scaling (`crate::loss_scale`).
    #[command(flatten, next_help_heading = "Loss scaling [loss_scale]")]
    pub loss_scale: LossScaleConfig,
}

/// Parses a flag's value as the TOML string serde reads for `T`: an enum's names as the
/// configuration file writes them (`onebit-adam`, `frozen-or-fresh`).
///
/// # Errors
/// serde's message naming the accepted values.
pub fn parse_enum<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, String> {
    T::deserialize(toml::Value::String(text.to_string())).map_err(|e| e.to_string())
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            checkpoint: CheckpointConfig::default(),
            mllog: crate::mllog::MllogConfig::default(),
            loss_scale: LossScaleConfig::default(),
            model: ModelSection::default(),
            data: DataSection::default(),
            instances: PretrainingConfig::default(),
            optimizer: OptimizerConfig::default(),
            schedule: ScheduleConfig::default(),
            train: LoopConfig::default(),
            parallel: ParallelConfig::default(),
        }
    }
}

impl TrainConfig {
    /// Reads a TOML configuration.
    ///
    /// # Errors
    /// [`TrainError::Config`] naming the file: unreadable, not TOML, an unknown field or a value
    /// of the wrong type (the TOML parser's message gives line and column).
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, path)
    }

    /// Parses TOML text; `origin` names it in errors (the file, or a shipped configuration).
    ///
    /// # Errors
    /// As [`TrainConfig::load`].
    pub fn parse(text: &str, origin: &Path) -> Result<Self, TrainError> {
        toml::from_str(text).map_err(|e| TrainError::Config {
            path: origin.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// The configuration as TOML text (saved with each checkpoint).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a TrainConfig always serialises")
    }

    /// The model configuration: the preset with the overrides, and `vocab_size` taken from the
    /// vocabulary actually used, rounded up to `model.make_vocab_size_divisible_by` (Note
    /// [Padded vocabulary] in `ember-model`'s `vocab_padding.rs`).
    pub fn bert_config(&self, vocab_size: usize) -> BertConfig {
        let mut config = BertConfig::preset(self.model.preset);
        config.vocab_size =
            ember_model::padded_vocab_size(vocab_size, self.model.make_vocab_size_divisible_by);
        if let Some(p) = self.model.hidden_dropout_prob {
            config.hidden_dropout_prob = p;
        }
        if let Some(p) = self.model.attention_probs_dropout_prob {
            config.attention_probs_dropout_prob = p;
        }
        if let Some(gelu) = self.model.hidden_act {
            config.hidden_act = gelu.hidden_act().to_string();
        }
        config
    }

    /// The corpus path; unset, the embedded corpus, written to ember's cache folder on first
    /// use (`ember_data::embedded`).
    ///
    /// # Errors
    /// When the embedded corpus cannot be written (the error names the file).
    pub fn corpus_path(&self) -> Result<PathBuf, ember_data::DataError> {
        match &self.data.corpus {
            Some(path) => Ok(path.clone()),
            None => ember_data::default_corpus_path(),
        }
    }

    /// The vocabulary path; unset, the shipped one, written as [`TrainConfig::corpus_path`].
    ///
    /// # Errors
    /// As [`TrainConfig::corpus_path`].
    pub fn vocab_path(&self) -> Result<PathBuf, ember_data::DataError> {
        match &self.data.vocab {
            Some(path) => Ok(path.clone()),
            None => ember_data::default_vocab_path(),
        }
    }

    /// Warmup steps: as configured, else `warmup_proportion` of the steps.
    pub fn warmup_steps(&self) -> u64 {
        self.schedule
            .warmup_steps
            .unwrap_or((self.schedule.warmup_proportion * self.train.steps as f64).round() as u64)
    }

    /// The last step of 1-bit Adam's or LAMB's warm-up: as configured, else 20% of the steps
    /// (at least 1).
    pub fn freeze_step(&self) -> u64 {
        self.optimizer
            .onebit
            .freeze_step
            .unwrap_or(((0.2 * self.train.steps as f64).round() as u64).max(1))
    }

    /// Checks that the files a run starts from exist (`checkpoint.init_from`,
    /// `checkpoint.resume`), before anything large is built.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming the setting and the path.
    pub fn check_paths(&self) -> Result<(), TrainError> {
        let c = &self.checkpoint;
        for (field, path) in [
            ("checkpoint.init_from", &c.init_from),
            ("checkpoint.resume", &c.resume),
        ] {
            if let Some(path) = path
                && !path.exists()
            {
                return Err(TrainError::InvalidSetting {
                    field,
                    reason: format!("{}: no such file or folder", path.display()),
                });
            }
        }
        Ok(())
    }

    /// Checks what can be checked before any file is read.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming the setting.
    pub fn validate(&self) -> Result<(), TrainError> {
        let invalid =
            |field: &'static str, reason: String| Err(TrainError::InvalidSetting { field, reason });
        let t = &self.train;
        if t.steps == 0 {
            return invalid("train.steps", "must be at least 1".into());
        }
        if t.batch_size == 0 {
            return invalid("train.batch_size", "must be at least 1".into());
        }
        if self.model.make_vocab_size_divisible_by == 0 {
            return invalid(
                "model.make_vocab_size_divisible_by",
                "must be at least 1 (1: no padding)".into(),
            );
        }
        if t.eval_every == Some(0) || t.log_every == 0 {
            return invalid("train.eval_every/log_every", "must be at least 1".into());
        }
        if let (Some(steps), Some(samples)) = (t.eval_every, t.eval_interval_samples) {
            return invalid(
                "train.eval_every",
                format!(
                    "{steps} steps has no effect beside train.eval_interval_samples = {}: \
                     evaluation follows the samples; set one of the two",
                    match samples {
                        EvalInterval::Samples(n) => n.to_string(),
                        EvalInterval::Rule(_) => "\"mlperf\"".into(),
                    }
                ),
            );
        }
        if let Some(target) = t.target_mlm_accuracy {
            if !(0.0..=1.0).contains(&target) {
                return invalid(
                    "train.target_mlm_accuracy",
                    format!("{target} is outside [0, 1]"),
                );
            }
        }
        if let Err(reason) = self.model.gemm.resolve() {
            return invalid("model.gemm", reason);
        }
        if self.model.cublaslt_sync != ember_backend_ext::CublasltSync::Host
            && self.model.gemm != ember_backend_ext::Gemm::Cublaslt
        {
            return invalid(
                "model.cublaslt_sync",
                format!(
                    "\"{}\" has no effect beside model.gemm = \"{}\": it orders cuBLASLt's \
                     products; set model.gemm = \"cublaslt\" or leave it out",
                    self.model.cublaslt_sync.name(),
                    self.model.gemm.name()
                ),
            );
        }
        let o = &self.optimizer;
        if !(o.lr.is_finite() && o.lr > 0.0) {
            return invalid(
                "optimizer.lr",
                format!("{} must be a positive number", o.lr),
            );
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return invalid("optimizer.beta1/beta2", "must be in [0, 1)".into());
        }
        if o.max_grad_norm < 0.0 || o.weight_decay < 0.0 {
            return invalid(
                "optimizer.max_grad_norm/weight_decay",
                "must not be negative".into(),
            );
        }
        if o.name.is_onebit() {
            o.onebit
                .validate(self.freeze_step(), o.name == OptimizerKind::OnebitLamb)?;
        } else if o.onebit != OnebitConfig::default() {
            return invalid(
                "optimizer.onebit",
                format!(
                    "applies to onebit-adam and onebit-lamb, not to {:?}",
                    o.name
                ),
            );
        }
        if o.nvlamb && o.name != OptimizerKind::Lamb {
            return invalid(
                "optimizer.nvlamb",
                format!(
                    "applies to lamb, not to {:?} (1-bit LAMB adapts every tensor; Adam has no \
                     trust ratio)",
                    o.name
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.schedule.warmup_proportion) {
            return invalid(
                "schedule.warmup_proportion",
                format!("{} is outside [0, 1]", self.schedule.warmup_proportion),
            );
        }
        if self.warmup_steps() > t.steps {
            return invalid(
                "schedule.warmup_steps",
                format!(
                    "{} is more than the {} steps of the run",
                    self.warmup_steps(),
                    t.steps
                ),
            );
        }
        let d = &self.data;
        if d.shards.is_none()
            && (d.sampler != SamplerKind::Random
                || d.padding != Padding::Dynamic
                || d.bin_quota.is_some())
        {
            return invalid(
                "data.sampler/padding/bin_quota",
                "apply to shards: set data.shards (--data) too".into(),
            );
        }
        if d.presort_group == 0 {
            return invalid("data.presort_group", "must be at least 1".into());
        }
        if d.bin_quota.is_some() && d.sampler == SamplerKind::Random {
            return invalid(
                "data.bin_quota",
                "applies to the stratified and presort samplers, not to random (--sampler)".into(),
            );
        }
        if d.prefetch > MAX_PREFETCH {
            return invalid(
                "data.prefetch",
                format!(
                    "{} local batches ahead is more than {MAX_PREFETCH} (each is held in memory)",
                    d.prefetch
                ),
            );
        }
        if t.eval_samples == 0 {
            return invalid("train.eval_samples", "must be at least 1".into());
        }
        if t.eval_interval_samples == Some(EvalInterval::Samples(0)) {
            return invalid("train.eval_interval_samples", "must be at least 1".into());
        }
        let p = &self.parallel;
        if !(p.bucket_cap_mb > 0.0 && p.first_bucket_mb > 0.0) {
            return invalid(
                "parallel.bucket_cap_mb/first_bucket_mb",
                "must be positive".into(),
            );
        }
        if p.grad_accum == 0 {
            return invalid("parallel.grad_accum", "must be at least 1".into());
        }
        if p.bucket_clip_count == Some(0) {
            return invalid("parallel.bucket_clip_count", "must be at least 1".into());
        }
        if p.bucket_clip_count.is_some() && p.clip != ClipMode::Bucket {
            return invalid(
                "parallel.bucket_clip_count",
                format!("applies to clip = \"bucket\" only (clip is {:?})", p.clip),
            );
        }
        if !(p.timeout_s.is_finite() && p.timeout_s > 0.0) {
            return invalid(
                "parallel.timeout_s",
                format!("{} must be a positive number", p.timeout_s),
            );
        }
        self.loss_scale.validate(self.train.precision)?;
        if self.loss_scale.enabled(self.train.precision) && self.optimizer.name.is_onebit() {
            return invalid(
                "loss_scale.mode",
                format!(
                    "loss scaling with {} is not supported: its compression stage averages \
                     compressed momenta, whose signs and scales cannot carry the overflow \
                     check (Note [Agreeing on an overflow])",
                    match self.optimizer.name {
                        OptimizerKind::OnebitAdam => "onebit-adam",
                        _ => "onebit-lamb",
                    }
                ),
            );
        }
        let max_positions = BertConfig::preset(self.model.preset).max_position_embeddings;
        let seq_len = self.instances.max_seq_length;
        if seq_len > max_positions {
            return Err(TrainError::SeqLenTooLong {
                seq_len,
                max_positions,
            });
        }
        self.bert_config(30522).validate()?;
        self.instances.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Settings that only make sense together, or within bounds, are refused naming them.
    #[test]
    fn validate_names_the_setting() {
        let refused = |edit: &dyn Fn(&mut TrainConfig)| {
            let mut c = TrainConfig::default();
            c.data.shards = Some("shards".into());
            edit(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(refused(&|c| c.data.bin_quota = Some(vec![16, 16])).contains("data.bin_quota"));
        assert!(refused(&|c| c.data.prefetch = 65).contains("data.prefetch"));
        assert!(
            refused(&|c| c.model.make_vocab_size_divisible_by = 0)
                .contains("model.make_vocab_size_divisible_by")
        );
        assert!(refused(&|c| c.train.eval_samples = 0).contains("train.eval_samples"));
        assert!(
            refused(&|c| c.train.eval_interval_samples = Some(EvalInterval::Samples(0)))
                .contains("train.eval_interval_samples")
        );
        let mut c = TrainConfig::default();
        c.checkpoint.init_from = Some("no/such/weights".into());
        let e = c.check_paths().unwrap_err().to_string();
        assert!(
            e.contains("checkpoint.init_from") && e.contains("no/such/weights"),
            "{e}"
        );
    }

    /// A setting that would change nothing beside the others is refused, naming both; the
    /// same setting where it acts passes.
    #[test]
    fn settings_without_effect_are_refused_naming_both() {
        let check = |edit: &dyn Fn(&mut TrainConfig)| {
            let mut c = TrainConfig::default();
            edit(&mut c);
            c.validate().map_err(|e| e.to_string())
        };
        let e = check(&|c| {
            c.train.eval_every = Some(50);
            c.train.eval_interval_samples = Some(EvalInterval::Samples(640));
        })
        .unwrap_err();
        assert!(
            e.contains("train.eval_every") && e.contains("eval_interval_samples = 640"),
            "{e}"
        );
        assert!(
            check(&|c| c.train.eval_interval_samples = Some(EvalInterval::Samples(640))).is_ok()
        );
        let e = check(&|c| c.model.cublaslt_sync = ember_backend_ext::CublasltSync::Device)
            .unwrap_err();
        assert!(
            e.contains("model.cublaslt_sync") && e.contains("model.gemm = \"auto\""),
            "{e}"
        );
        let with_cublaslt = check(&|c| {
            c.model.gemm = ember_backend_ext::Gemm::Cublaslt;
            c.model.cublaslt_sync = ember_backend_ext::CublasltSync::Device;
        });
        // Accepted where the build has cuBLASLt; elsewhere refused for the GEMM, not the sync.
        match with_cublaslt {
            Ok(()) => assert!(ember_backend_ext::CUBLASLT_BUILT),
            Err(e) => assert!(
                e.contains("model.gemm") && !e.contains("cublaslt_sync"),
                "{e}"
            ),
        }
        let e = check(&|c| c.optimizer.nvlamb = true).unwrap_err();
        assert!(e.contains("optimizer.nvlamb") && e.contains("AdamW"), "{e}");
        assert!(
            check(&|c| {
                c.optimizer.name = OptimizerKind::Lamb;
                c.optimizer.nvlamb = true;
            })
            .is_ok()
        );
        let onebit = |name, edit: &dyn Fn(&mut OnebitConfig)| {
            check(&|c| {
                c.optimizer.name = name;
                edit(&mut c.optimizer.onebit);
            })
        };
        let e = onebit(OptimizerKind::OnebitAdam, &|o| o.min_coeff = 0.1).unwrap_err();
        assert!(
            e.contains("optimizer.onebit.min_coeff") && e.contains("onebit-adam"),
            "{e}"
        );
        let e = onebit(OptimizerKind::OnebitAdam, &|o| {
            o.lamb_coeff = crate::onebit::OnebitLambCoeff::FrozenFactor
        })
        .unwrap_err();
        assert!(e.contains("optimizer.onebit.lamb_coeff"), "{e}");
        let e = onebit(OptimizerKind::OnebitLamb, &|o| o.factor_max = 2.0).unwrap_err();
        assert!(
            e.contains("optimizer.onebit.factor_max") && e.contains("computed"),
            "{e}"
        );
        assert!(
            onebit(OptimizerKind::OnebitLamb, &|o| {
                o.factor_max = 2.0;
                o.coeff_beta = 0.5;
                o.lamb_coeff = crate::onebit::OnebitLambCoeff::FrozenFactor;
            })
            .is_ok()
        );
    }

    /// Every shipped configuration loads, validates and round-trips; the MLPerf ones say what
    /// their sources say (`configs/mlperf-*.toml`, `../shared/REFERENCES.md`).
    #[test]
    fn shipped_configs_load_and_the_mlperf_ones_follow_their_sources() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let config = TrainConfig::load(&path).unwrap();
            config
                .validate()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let back: TrainConfig = toml::from_str(&config.to_toml()).unwrap();
            assert_eq!(back, config, "{}", path.display());
            names.push(path.file_name().unwrap().to_string_lossy().to_string());
        }
        names.sort();
        assert_eq!(
            names,
            [
                "mlperf-bert-large-adam.toml",
                "mlperf-bert-large-lamb.toml",
                "tiny-cpu.toml"
            ]
        );
        let adam = TrainConfig::load(&dir.join("mlperf-bert-large-adam.toml")).unwrap();
        let global_batch = adam.train.batch_size * adam.parallel.grad_accum * 8;
        assert_eq!(global_batch, 16_384);
        let interval = adam.train.eval_interval_samples.unwrap();
        assert_eq!(interval.samples(global_batch), 325_000);
        assert_eq!(adam.data.bin_quota, Some(vec![6, 3, 2, 5]));
        // Per micro-batch of 16; a step of 128 micro-batches draws 128 times it.
        assert_eq!(
            adam.data.local_bin_quota(16, 128),
            Some(vec![768, 384, 256, 640])
        );
        assert_eq!(adam.parallel.bucket_clip_count, Some(22));
        // Samsung's model path computes the tanh GELU (../shared/REFERENCES.md).
        assert_eq!(adam.model.hidden_act, Some(ember_model::Gelu::Tanh));
        assert_eq!(adam.bert_config(30_522).gelu(), ember_model::Gelu::Tanh);
        // Its vocabulary padded to a multiple of 8, as NVIDIA's code it runs on pads it.
        assert_eq!(adam.bert_config(30_522).vocab_size, 30_528);
        let schedule = crate::schedule::WarmupPolyDecay::new(
            adam.optimizer.lr,
            adam.warmup_steps(),
            adam.schedule.decay_steps.unwrap(),
            &adam.schedule,
        );
        assert!((schedule.lr(0) - 3.9299421615882676e-4 * 16.0 / 82.0).abs() < 1e-15);
        let lamb = TrainConfig::load(&dir.join("mlperf-bert-large-lamb.toml")).unwrap();
        assert_eq!(lamb.train.batch_size * 8, 448);
        assert_eq!(lamb.optimizer.name, OptimizerKind::Lamb);
        assert!(!lamb.optimizer.nvlamb);
        assert_eq!(lamb.bert_config(30_522).vocab_size, 30_528);
        // Unset, the vocabulary is the tokenizer's (Hugging Face's model).
        assert_eq!(
            TrainConfig::default().bert_config(30_522).vocab_size,
            30_522
        );
    }

    #[test]
    fn toml_round_trips_and_rejects_typos() {
        let config = TrainConfig::default();
        let back: TrainConfig = toml::from_str(&config.to_toml()).unwrap();
        assert_eq!(back, config);
        let partial: TrainConfig = toml::from_str(
            "[train]\nsteps = 7\n[instances]\nmax_seq_length = 64\n[optimizer]\nname = \"lamb\"",
        )
        .unwrap();
        assert_eq!(partial.train.steps, 7);
        assert_eq!(partial.instances.max_seq_length, 64);
        assert_eq!(partial.optimizer.name, OptimizerKind::Lamb);
        let typo = toml::from_str::<TrainConfig>("[train]\nstep = 7")
            .unwrap_err()
            .to_string();
        assert!(typo.contains("step"), "{typo}");
    }
}
