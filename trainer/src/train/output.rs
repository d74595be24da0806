//! What a run writes: the output folder, `metrics.jsonl`, the progress bar, and the final
//! checkpoint (Hugging Face layout), each file through a temporary name and a rename.
//!
//! Note [Reading at log time]: a step's losses and gradient norm stay on the device until the
//! step is logged (every `train.log_every` steps): reading them every step would make the host
//! wait for the device once per step. [`RunLog::record`] keeps the steps since the last log;
//! [`RunLog::flush`] reads all their losses in one read, averages them over the ranks, checks
//! them, and writes the logged step's record.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tracing::info;

use crate::checkpoint::RunState;
use crate::parallel::{CommThread, ReduceOp, Scalar};
use crate::{EvalResult, TrainConfig, TrainError};

/// Creates `dir` if needed and checks that a file can be written in it.
pub(crate) fn prepare_output_dir(dir: &Path) -> Result<(), TrainError> {
    let output_error = |path: &Path, e: std::io::Error| TrainError::Output {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| output_error(dir, e))?;
    let probe = dir.join(".ember-write-test");
    File::create(&probe).map_err(|e| output_error(dir, e))?;
    std::fs::remove_file(&probe).map_err(|e| output_error(&probe, e))
}

/// Writes `text` to `path` through a temporary file and a rename.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<(), TrainError> {
    let tmp = ember_model::checkpoint::temp_path(path);
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            TrainError::Output {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        })
}

/// One JSON object per line, flushed as written so a crashed run keeps its history.
pub(crate) struct MetricsWriter {
    file: BufWriter<File>,
    pub path: PathBuf,
}

impl MetricsWriter {
    pub(crate) fn create(path: PathBuf) -> Result<Self, TrainError> {
        Self::open(path, false)
    }

    /// Opens `path` to append to it.
    pub(crate) fn append(path: PathBuf) -> Result<Self, TrainError> {
        Self::open(path, true)
    }

    fn open(path: PathBuf, append: bool) -> Result<Self, TrainError> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(!append)
            .truncate(!append)
            .append(append)
            .open(&path)
            .map_err(|e| TrainError::Output {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            file: BufWriter::new(file),
            path,
        })
    }

    pub(crate) fn write(&mut self, record: serde_json::Value) -> Result<(), TrainError> {
        writeln!(self.file, "{record}")
            .and_then(|()| self.file.flush())
            .map_err(|e| TrainError::Output {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }
}

/// Host synchronisations of one step, from [`crate::RunOptions::host_sync_counter`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostSyncCounts {
    /// From the start of the first micro-batch's backward to the step's wait for its buckets
    /// ([`crate::parallel::Reducer::finalize_backward`]).
    pub backward: u64,
    /// The whole step: data, forward, backward, reduction, optimizer.
    pub step: u64,
}

/// One step, as the loop hands it to the log; the numbers stay where they were computed.
pub(crate) struct StepRecord<B: Backend> {
    /// Steps done, counting this one.
    pub step: u64,
    /// `[total, mlm, nsp]` losses, the mean over the step's micro-batches, on the device.
    pub losses: Tensor<B, 1>,
    pub grad_norm: Scalar<B>,
    pub lr: f64,
    /// Real tokens this rank processed in the step.
    pub tokens: usize,
    /// Wall-clock seconds of the step, and of its backward passes (device time only when
    /// [`crate::RunOptions::sync_backward`]).
    pub seconds: f64,
    pub backward_seconds: f64,
    /// Seconds the step waited for its buckets after backward.
    pub comm_wait_s: f64,
    pub host_syncs: Option<HostSyncCounts>,
    /// Kernels this rank launched in the step ([`crate::RunOptions::launch_counter`]).
    pub kernel_launches: Option<u64>,
    /// Bytes this rank sent for the step's gradients (a ring allreduce's 2(W−1)/W of the
    /// buckets) or, in 1-bit Adam/LAMB's compression stage, for its momenta.
    pub comm_bytes: u64,
    /// Whether the step was in 1-bit Adam/LAMB's compression stage.
    pub compressed: bool,
    /// Seconds the step waited for its batches (the shard reader's prefetch not ready, or
    /// the in-memory loader's collation).
    pub data_wait_s: f64,
    /// The loss scale of the step (dynamic loss scaling only).
    pub loss_scale: Option<f64>,
    /// Steps skipped for an overflow so far in the run (dynamic loss scaling only).
    pub skipped_steps: u64,
    /// The step's gradients overflowed: no update, the step is not counted.
    pub skipped: bool,
}

/// Metrics, progress and the losses of a run (rank 0 writes; every rank reads its losses).
pub(crate) struct RunLog<B: Backend> {
    metrics: Option<MetricsWriter>,
    progress: ProgressBar,
    pending: Vec<StepRecord<B>>,
    /// Every step's loss (`total`), averaged over ranks, in order.
    pub losses: Vec<f64>,
    /// Real tokens processed by all ranks.
    pub tokens: usize,
    world_size: usize,
    log_every: u64,
    steps: u64,
    pub started: Instant,
}

impl<B: Backend> RunLog<B> {
    /// Opens `metrics.jsonl` on rank 0 and writes `start`; draws a progress bar when asked.
    /// A resumed run (`resumed`: the checkpoint folder and its run state) starts from the
    /// checkpoint's metrics, losses, token count and step.
    pub(crate) fn start(
        config: &TrainConfig,
        comm: &CommThread<B>,
        progress: bool,
        start: serde_json::Value,
        resumed: Option<(&Path, &RunState)>,
    ) -> Result<Self, TrainError> {
        let main = comm.rank() == 0;
        let metrics = if main {
            let path = config.train.out.join("metrics.jsonl");
            let mut metrics = match resumed {
                // The checkpoint's metrics, to which this run appends: no step twice.
                Some((dir, _)) => {
                    let saved = dir.join("metrics.jsonl");
                    let text = std::fs::read(&saved).map_err(|e| TrainError::Checkpoint {
                        path: saved.clone(),
                        reason: e.to_string(),
                    })?;
                    crate::checkpoint::write_file(&path, &text)?;
                    MetricsWriter::append(path)?
                }
                None => MetricsWriter::create(path)?,
            };
            metrics.write(start)?;
            Some(metrics)
        } else {
            None
        };
        let progress = if progress && main {
            ProgressBar::new(config.train.steps)
        } else {
            ProgressBar::hidden()
        };
        progress.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise}<{eta_precise}]",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        let mut losses = Vec::with_capacity(config.train.steps as usize);
        let mut tokens = 0;
        if let Some((_, run)) = resumed {
            losses.extend_from_slice(&run.losses);
            tokens = run.tokens;
            progress.set_position(run.step);
        }
        Ok(Self {
            metrics,
            progress,
            pending: Vec::new(),
            losses,
            tokens,
            world_size: comm.world_size(),
            log_every: config.train.log_every,
            steps: config.train.steps,
            started: Instant::now(),
        })
    }

    /// Keeps a step; logs the steps kept so far when the step is a log step (every
    /// `log_every`, and the last).
    ///
    /// # Errors
    /// As [`RunLog::flush`].
    pub(crate) fn record(
        &mut self,
        record: StepRecord<B>,
        comm: &CommThread<B>,
    ) -> Result<(), TrainError> {
        let step = record.step;
        self.tokens += record.tokens * self.world_size;
        self.pending.push(record);
        self.progress.inc(1);
        if step.is_multiple_of(self.log_every) || step == self.steps {
            self.flush(comm)?;
        }
        Ok(())
    }

    /// Reads the kept steps' losses (one read, Note [Reading at log time]), averages them
    /// over the ranks, and writes the last kept step's `train` record. Every rank calls it at
    /// the same steps.
    ///
    /// # Errors
    /// [`TrainError::Diverged`] naming the first step with a non-finite loss;
    /// [`TrainError::Comm`]; [`TrainError::Output`] if the metrics cannot be written.
    pub(crate) fn flush(&mut self, comm: &CommThread<B>) -> Result<(), TrainError> {
        let Some(last) = self.pending.last() else {
            return Ok(());
        };
        let mut read = Tensor::cat(self.pending.iter().map(|r| r.losses.clone()).collect(), 0);
        let norm_on_device = matches!(last.grad_norm, Scalar::Device(_));
        if let Scalar::Device(norm) = &last.grad_norm {
            read = Tensor::cat(vec![read, norm.clone()], 0);
        }
        let values: Vec<f32> = read
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("f32 after convert");
        let (losses, norm) = values.split_at(3 * self.pending.len());
        let grad_norm = if norm_on_device {
            f64::from(norm[0])
        } else {
            last.grad_norm.value()
        };
        let losses = comm.call({
            let mut losses = losses.to_vec();
            move |c| c.allreduce(&mut losses, ReduceOp::Average).map(|()| losses)
        })?;
        for (record, l) in self.pending.iter().zip(losses.chunks(3)) {
            let loss = f64::from(l[0]);
            if !loss.is_finite() {
                return Err(TrainError::Diverged {
                    step: record.step,
                    loss,
                });
            }
            self.losses.push(loss);
        }
        let last = self.pending.last().expect("checked above");
        let l = &losses[losses.len() - 3..];
        if let Some(metrics) = self.metrics.as_mut() {
            let mut line = json!({
                "event": "train", "step": last.step, "loss": l[0], "mlm_loss": l[1],
                "nsp_loss": l[2], "lr": last.lr, "grad_norm": grad_norm,
                "tokens": self.tokens, "step_s": last.seconds,
                "backward_s": last.backward_seconds, "comm_wait_s": last.comm_wait_s,
                "comm_bytes": last.comm_bytes, "compressed": last.compressed,
                "data_wait_s": last.data_wait_s,
                "elapsed_s": self.started.elapsed().as_secs_f64(),
            });
            if let Some(scale) = last.loss_scale {
                line["loss_scale"] = json!(scale);
                line["skipped_steps"] = json!(last.skipped_steps);
            }
            if let Some(syncs) = last.host_syncs {
                line["host_syncs_backward"] = json!(syncs.backward);
                line["host_syncs_step"] = json!(syncs.step);
            }
            if let Some(launches) = last.kernel_launches {
                line["kernel_launches_step"] = json!(launches);
            }
            metrics.write(line)?;
        }
        self.progress.set_message(format!("loss {:.3}", l[0]));
        self.pending.clear();
        Ok(())
    }

    /// Writes the `skip` record of a step whose gradients overflowed (Note [Agreeing on an
    /// overflow]) and warns: the step is not counted, the scale for the next try is
    /// `next_scale`.
    pub(crate) fn skipped(
        &mut self,
        record: &StepRecord<B>,
        next_scale: f64,
    ) -> Result<(), TrainError> {
        let scale = record.loss_scale.unwrap_or(1.0);
        // Rank 0 (the one with the metrics) speaks for all: every rank skipped.
        let Some(metrics) = self.metrics.as_mut() else {
            return Ok(());
        };
        self.progress.suspend(|| {
            tracing::warn!(
                step = record.step,
                loss_scale = scale,
                next_loss_scale = next_scale,
                skipped_steps = record.skipped_steps,
                "gradients overflowed (inf or NaN): step skipped on every rank"
            )
        });
        metrics.write(json!({
            "event": "skip", "step": record.step, "loss_scale": scale,
            "next_loss_scale": next_scale, "skipped_steps": record.skipped_steps,
            "elapsed_s": self.started.elapsed().as_secs_f64(),
        }))
    }

    /// Writes an evaluation's `eval` record and logs it.
    pub(crate) fn eval(&mut self, step: u64, result: &EvalResult) -> Result<(), TrainError> {
        let Some(metrics) = self.metrics.as_mut() else {
            return Ok(());
        };
        let elapsed = self.started.elapsed().as_secs_f64();
        metrics.write(json!({
            "event": "eval", "step": step, "mlm_accuracy": result.mlm_accuracy,
            "nsp_accuracy": result.nsp_accuracy, "mlm_loss": result.mlm_loss,
            "nsp_loss": result.nsp_loss, "elapsed_s": elapsed,
        }))?;
        let tokens_per_second = self.tokens as f64 / elapsed;
        self.progress.suspend(|| {
            info!(
                step,
                mlm_accuracy = format!("{:.4}", result.mlm_accuracy),
                nsp_accuracy = format!("{:.4}", result.nsp_accuracy),
                mlm_loss = format!("{:.3}", result.mlm_loss),
                tokens_per_second = format!("{tokens_per_second:.0}"),
                "eval"
            )
        });
        Ok(())
    }

    /// Writes `record` to the metrics (rank 0; the other ranks write none).
    ///
    /// # Errors
    /// [`TrainError::Output`] when the metrics file cannot be written.
    pub(crate) fn write(&mut self, record: serde_json::Value) -> Result<(), TrainError> {
        match self.metrics.as_mut() {
            Some(metrics) => metrics.write(record),
            None => Ok(()),
        }
    }

    /// Clears the progress bar and writes the `end` record.
    pub(crate) fn end(&mut self, end: serde_json::Value) -> Result<(), TrainError> {
        self.progress.finish_and_clear();
        match self.metrics.as_mut() {
            Some(metrics) => metrics.write(end),
            None => Ok(()),
        }
    }
}

/// The process's peak resident set size (`VmHWM` of `/proc/self/status`), bytes; `None` where
/// the kernel does not report it.
pub(crate) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
