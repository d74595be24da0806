//! MLPerf Training's log: `:::MLLOG` lines in mlperf-logging's format (`mlperf_logging.mllog`:
//! `namespace`, `time_ms`, `event_type`, `key`, `value`, `metadata` with `file` and `lineno`),
//! with the keys the BERT rules require (`training_5.0.0` of the compliance checker; 5.0.0 is
//! the last ruleset with BERT), written by rank 0 only.
//!
//! A run logs, in order: `cache_clear`, `init_start`, the submission keys
//! (`submission_benchmark` = bert, `submission_division` before `init_stop`, `submission_org`,
//! `submission_platform`, `submission_status`), the hyper-parameters (`seed`,
//! `global_batch_size`, `gradient_accumulation_steps`, `max_sequence_length`, the optimizer's
//! `opt_*` keys, `num_warmup_steps`, `start_warmup_step`), `eval_samples`, `init_stop`,
//! `run_start`; per evaluation interval `block_start`/`block_stop` (metadata
//! `first_epoch_num`, `epoch_count`, `samples_count`) and `eval_start`/`eval_accuracy`/
//! `eval_stop` with `epoch_num` = training samples so far; then `train_samples` and `run_stop`
//! (status `success` when the target was reached, else `aborted`).
//!
//! Optimizer keys: LAMB logs `opt_lamb_*` as MLPerf's reference; AdamW logs `opt_adam_*`
//! (Samsung's v1.1 log used the LAMB names for Adam; the checker reads neither in the open
//! division). A resumed run writes a new log of the part it runs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::config::OptimizerKind;
use crate::{TrainConfig, TrainError};

/// MLPerf's division: `closed` runs follow the reference's hyper-parameter rules, `open` runs
/// may change them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Division {
    #[default]
    Open,
    Closed,
}

impl std::str::FromStr for Division {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "open" => Ok(Self::Open),
            "closed" => Ok(Self::Closed),
            other => Err(format!(
                "unknown division `{other}` (expected open or closed)"
            )),
        }
    }
}

/// The `[mllog]` section: where to write the MLPerf log and what it says about the submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct MllogConfig {
    /// The log file (rank 0 writes it); unset: no MLPerf log. Default: unset.
    #[arg(long = "mllog", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// `submission_division`. Default: open (ember's runs change the reference's
    /// hyper-parameter rules unless configured as it).
    #[arg(long = "mllog-division")]
    pub division: Division,
    /// `submission_org`. Default: "ember".
    #[arg(long = "mllog-org")]
    pub org: String,
    /// `submission_platform`. Default: the host name, else "unknown".
    #[arg(long = "mllog-platform")]
    pub platform: String,
    /// `submission_status`: onprem, cloud or research. Default: onprem.
    #[arg(long = "mllog-status")]
    pub status: String,
}

impl Default for MllogConfig {
    fn default() -> Self {
        Self {
            file: None,
            division: Division::Open,
            org: "ember".into(),
            platform: String::new(),
            status: "onprem".into(),
        }
    }
}

/// The run's MLPerf log; every call is a no-op on ranks other than 0 or without a file.
pub struct MlLog {
    out: Option<(PathBuf, BufWriter<File>)>,
}

impl MlLog {
    /// Creates (truncates) `config.mllog.file` on rank 0; a resumed run appends to it, with a
    /// warning: an MLPerf result is one uninterrupted run, and the checker refuses a log with
    /// two `run_start`s, as it should.
    ///
    /// # Errors
    /// [`TrainError::InvalidSetting`] naming `mllog.file` when it cannot be created.
    pub fn create(config: &TrainConfig, rank: usize) -> Result<Self, TrainError> {
        let out = match (&config.mllog.file, rank) {
            (Some(path), 0) => {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|e| output_error(path, e))?;
                }
                let resumed = config.checkpoint.resume.is_some();
                if resumed {
                    tracing::warn!(
                        "{}: a resumed run appends to the MLPerf log; an MLPerf result is one \
                         uninterrupted run, and the compliance checker refuses this log",
                        path.display()
                    );
                }
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(resumed)
                    .truncate(!resumed)
                    .open(path)
                    .map_err(|e| output_error(path, e))?;
                Some((path.clone(), BufWriter::new(file)))
            }
            _ => None,
        };
        Ok(Self { out })
    }

    /// Whether lines are written.
    pub fn enabled(&self) -> bool {
        self.out.is_some()
    }

    /// A `POINT_IN_TIME` line.
    ///
    /// # Errors
    /// [`TrainError::Output`] when the line cannot be written.
    #[track_caller]
    pub fn event(&mut self, key: &str, value: Value, metadata: Value) -> Result<(), TrainError> {
        self.line("POINT_IN_TIME", key, value, metadata)
    }

    /// An `INTERVAL_START` line (`*_start` keys).
    ///
    /// # Errors
    /// As [`MlLog::event`].
    #[track_caller]
    pub fn start(&mut self, key: &str, value: Value, metadata: Value) -> Result<(), TrainError> {
        self.line("INTERVAL_START", key, value, metadata)
    }

    /// An `INTERVAL_END` line (`*_stop` keys).
    ///
    /// # Errors
    /// As [`MlLog::event`].
    #[track_caller]
    pub fn end(&mut self, key: &str, value: Value, metadata: Value) -> Result<(), TrainError> {
        self.line("INTERVAL_END", key, value, metadata)
    }

    #[track_caller]
    fn line(
        &mut self,
        event_type: &str,
        key: &str,
        value: Value,
        metadata: Value,
    ) -> Result<(), TrainError> {
        let Some((path, out)) = self.out.as_mut() else {
            return Ok(());
        };
        let caller = std::panic::Location::caller();
        let mut meta = json!({ "file": caller.file(), "lineno": caller.line() });
        if let (Some(meta), Value::Object(extra)) = (meta.as_object_mut(), metadata) {
            meta.extend(extra);
        }
        let time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let line = json!({
            "namespace": "", "time_ms": time_ms, "event_type": event_type, "key": key,
            "value": value, "metadata": meta,
        });
        writeln!(out, ":::MLLOG {line}")
            .and_then(|()| out.flush())
            .map_err(|e| output_error(path, e))
    }

    /// `cache_clear` and `init_start`: what the run logs first.
    ///
    /// # Errors
    /// As [`MlLog::event`].
    pub fn init_start(&mut self) -> Result<(), TrainError> {
        self.event("cache_clear", json!(true), Value::Null)?;
        self.start("init_start", Value::Null, Value::Null)
    }

    /// Every key of the run's settings (before `init_stop`).
    ///
    /// # Errors
    /// As [`MlLog::event`].
    pub fn settings(
        &mut self,
        config: &TrainConfig,
        global_batch_size: usize,
        eval_samples: usize,
    ) -> Result<(), TrainError> {
        if !self.enabled() {
            return Ok(());
        }
        let none = Value::Null;
        let m = &config.mllog;
        let platform = if m.platform.is_empty() {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
        } else {
            m.platform.clone()
        };
        let o = &config.optimizer;
        let prefix = match o.name.exact() {
            OptimizerKind::Lamb => "opt_lamb",
            _ => "opt_adam",
        };
        let settings: Vec<(String, Value)> = vec![
            ("submission_benchmark".into(), json!("bert")),
            (
                "submission_division".into(),
                json!(match m.division {
                    Division::Open => "open",
                    Division::Closed => "closed",
                }),
            ),
            ("submission_org".into(), json!(m.org)),
            ("submission_platform".into(), json!(platform)),
            ("submission_status".into(), json!(m.status)),
            ("seed".into(), json!(config.train.seed)),
            ("global_batch_size".into(), json!(global_batch_size)),
            (
                "gradient_accumulation_steps".into(),
                json!(config.parallel.grad_accum),
            ),
            (
                "max_sequence_length".into(),
                json!(config.instances.max_seq_length),
            ),
            ("opt_base_learning_rate".into(), json!(o.lr)),
            (format!("{prefix}_epsilon"), json!(o.epsilon)),
            (format!("{prefix}_beta_1"), json!(o.beta1)),
            (format!("{prefix}_beta_2"), json!(o.beta2)),
            (format!("{prefix}_weight_decay_rate"), json!(o.weight_decay)),
            (
                format!("{prefix}_learning_rate_decay_poly_power"),
                json!(config.schedule.power),
            ),
            (
                "opt_learning_rate_training_steps".into(),
                json!(config.schedule.decay_steps.unwrap_or(config.train.steps)),
            ),
            (
                "opt_learning_rate_warmup_steps".into(),
                json!(config.warmup_steps()),
            ),
            ("num_warmup_steps".into(), json!(config.warmup_steps())),
            (
                "start_warmup_step".into(),
                json!(config.schedule.start_warmup_step),
            ),
            ("eval_samples".into(), json!(eval_samples)),
        ];
        for (key, value) in settings {
            self.event(&key, value, none.clone())?;
        }
        Ok(())
    }
}

fn output_error(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::InvalidSetting {
        field: "mllog.file",
        reason: format!("{}: {e}", path.display()),
    }
}
