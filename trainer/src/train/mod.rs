//! The training loop, top to bottom: config → data ([`data`]) → model, buckets and optimizer
//! ([`setup`]) → loop (a step: forward with gradient hooks, backward, bucketed allreduce and
//! clipping, optimizer, [`step`]; log and evaluate, [`output`]; full-state checkpoints every
//! `checkpoint.every` steps, at the end and on SIGTERM, [`checkpointing`]; a resumed run loads
//! one before its first step). One function,
//! [`train_rank`], is one data-parallel rank; a one-rank job is the same loop with a
//! [`SingleRank`](crate::parallel::SingleRank) communicator.

mod checkpointing;
mod data;
mod init_passes;
mod local;
mod output;
mod setup;
pub use setup::{initial_model, initialisation_lock};
mod step;

use std::path::PathBuf;
use std::sync::Arc;

use burn::module::{AutodiffModule, Module};
use serde::Serialize;
use serde_json::{Value, json};
use tracing::info;

use data::RankData;
pub use data::{PreparedData, prepare_data};
pub use local::{train, train_in_process, train_in_process_with_data};
use output::{RunLog, prepare_output_dir, write_atomically};
use setup::{Trainer, init_from};
pub use step::loss_weights;

use crate::checkpoint::RunState;
use crate::eval::{EvalResult, evaluate_sharded};
use crate::loss_scale::LossScaler;
use crate::mllog::MlLog;
use crate::parallel::consistency::check_due;
use crate::parallel::{
    CommThread, Communicator, GradHookBackend, ReduceOp, check_agreement, check_parameters_agree,
};
use crate::{TrainConfig, TrainError};

/// How a run reports while it runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Draw an indicatif progress bar on stderr (rank 0 only).
    pub progress: bool,
    /// A counter of the host's waits for the device, such as
    /// `|| ember_backend_ext::HostSyncs::now().total()` on a `CountingRuntime` backend: when
    /// set, each `train` record of `metrics.jsonl` reports `host_syncs_backward` and
    /// `host_syncs_step` for its step.
    pub host_sync_counter: Option<fn() -> u64>,
    /// A counter of the kernels the rank's thread launched, such as
    /// `|| ember_backend_ext::HostSyncs::now().launches`: when set, each `train` record
    /// reports `kernel_launches_step` for its step (data, forward, backward, reduction and
    /// optimizer; evaluation is not in a step). A step without a host sync may count a few of
    /// its last launches in the next step's figure (the counter sees launches as the device's
    /// queue takes them); the mean over steps is exact.
    pub launch_counter: Option<fn() -> u64>,
    /// Wait for the device before and after each backward, so that `backward_s` in the metrics
    /// is the device's time (two host syncs more per micro-batch: for benchmarks).
    pub sync_backward: bool,
    /// Stop after the current step and write a checkpoint when the process has received
    /// SIGTERM or SIGINT (handlers installed by [`crate::checkpoint::signals::install`]);
    /// the ranks agree on it through one scalar allreduce per step.
    pub stop_on_signal: bool,
    /// Called on rank 0 with the path of `metrics.jsonl` after each evaluation and at the end
    /// (the `train` command draws `curves.png` with it).
    pub on_eval: Option<fn(&std::path::Path)>,
    /// For tests of the loss scaler: called with (steps done, rank) before each backward, it
    /// returns a factor for that rank's loss (`f32::INFINITY` or NaN makes the step's
    /// gradients overflow on that rank; 1 leaves the step as it is).
    pub loss_fault: Option<fn(u64, usize) -> f32>,
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Training loss (MLM + NSP) of each step, averaged over ranks, in order.
    pub losses: Vec<f64>,
    /// Bytes this rank sent for each step of this run (not of a resumed run's earlier steps):
    /// gradients (a ring allreduce's share) or, in 1-bit Adam/LAMB's compression stage,
    /// compressed momenta.
    pub comm_bytes: Vec<u64>,
    /// The last evaluation.
    pub eval: EvalResult,
    /// Masked-LM accuracy of always predicting the most frequent masked token.
    pub unigram_baseline: f64,
    /// The token the unigram baseline predicts.
    pub unigram_token: String,
    /// Whether the run stopped because it reached `train.target_mlm_accuracy`.
    pub reached_target: bool,
    /// Training samples (all ranks) at the evaluation that reached the target.
    pub target_reached_at_samples: Option<u64>,
    /// Seconds this rank's steps waited for their batches, in all.
    pub data_wait_s: f64,
    /// The process's peak resident memory (`VmHWM`, Linux), bytes.
    pub peak_rss_bytes: Option<u64>,
    /// Corpus lines skipped because they were not UTF-8.
    pub corpus_lines_skipped: usize,
    /// Steps skipped because their gradients overflowed (dynamic loss scaling), this run and
    /// the resumed run's before it.
    pub skipped_steps: u64,
    /// The loss scale at the end (dynamic loss scaling only).
    pub loss_scale: Option<f64>,
    /// The dtype the model computed in.
    pub precision: ember_model::Precision,
    /// Wall-clock seconds of the training loop (evaluations included, data preparation not).
    pub train_seconds: f64,
    /// Real (unpadded) tokens processed per second of training.
    pub tokens_per_second: f64,
    /// The Hugging Face safetensors checkpoint written at the end.
    pub checkpoint: PathBuf,
    /// The metrics file (JSON lines).
    pub metrics: PathBuf,
    /// Ranks that trained together.
    pub world_size: usize,
    /// Samples per optimizer step over all ranks and micro-batches.
    pub global_batch_size: usize,
    /// The gradient buckets, `"K buckets: a, b MiB"`.
    pub buckets: String,
    /// Whether the buckets lived on the device (Note [Bucket storage]).
    pub device_buckets: bool,
    /// Whether this is rank 0 (which wrote the checkpoint and metrics).
    pub is_main_rank: bool,
    /// The last full-state checkpoint written (`OUT/checkpoints/step-NNNNNNN`).
    pub last_checkpoint: PathBuf,
    /// The step this run resumed from, if it did.
    pub resumed_from: Option<u64>,
    /// The signal that stopped the run early (after its checkpoint), if one did.
    pub stopped_by: Option<String>,
    /// What `checkpoint.init_from` loaded and initialised, when set.
    pub init: Option<ember_model::LoadReport>,
    /// This rank's loss (MLM + NSP) of each of the `train.init_passes` passes before the
    /// first step (Note [Init passes]): the passes update nothing, so each computes what the
    /// first did (bit for bit where the kernels are deterministic, as on the CPU).
    pub init_pass_losses: Vec<f64>,
}

/// One data-parallel rank of a training run: the whole loop, with `comm` connecting it to
/// the other ranks ([`SingleRank`](crate::parallel::SingleRank) for a job of one). Rank 0 writes the metrics, the
/// checkpoint and the progress bar; every rank evaluates its share of the held-out set.
///
/// `data` lets in-process ranks share one [`PreparedData`]; `None` prepares it here.
///
/// # Errors
/// As [`train`], plus [`TrainError::Comm`] when another rank fails or stalls past
/// `parallel.timeout_s`, and [`TrainError::RankMismatch`] when the ranks' configurations or
/// bucket plans differ (checked before the first step).
pub fn train_rank<B: GradHookBackend>(
    config: &TrainConfig,
    device: &B::Device,
    options: RunOptions,
    comm: Communicator<B::InnerBackend>,
    data: Option<Arc<PreparedData>>,
) -> Result<TrainSummary, TrainError> {
    // Config and output.
    let run_started = std::time::Instant::now();
    config.validate()?;
    config.check_paths()?;
    ember_backend_ext::set_gpu_gemm(config.model.gemm).map_err(|reason| {
        TrainError::InvalidSetting {
            field: "model.gemm",
            reason,
        }
    })?;
    ember_backend_ext::set_cublaslt_sync(config.model.cublaslt_sync);
    let comm = Arc::new(CommThread::spawn(comm));
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let out = &config.train.out;
    if rank == 0 {
        prepare_output_dir(out)?;
    }
    let mut mllog = MlLog::create(config, rank)?;
    mllog.init_start()?;
    check_agreement(&comm, "configuration", config.to_toml())?;

    // Data, model, buckets, optimizer.
    let data = match data {
        Some(data) => data,
        None => Arc::new(prepare_data(config)?),
    };
    let mut rank_data = RankData::new(config, &data, &comm)?;
    let (mut trainer, mut model) = Trainer::<B>::new(
        config,
        device,
        data.tokenizer.vocab_size(),
        &rank_data.eval,
        &comm,
    )?;
    let global_batch_size = config.train.batch_size * config.parallel.grad_accum * world_size;
    let init_report = match (&config.checkpoint.init_from, &config.checkpoint.resume) {
        (Some(from), None) => {
            let report;
            (model, report) = init_from(model, from, data.tokenizer.vocab_size(), rank)?;
            Some(report)
        }
        _ => None,
    };
    let resumed = match &config.checkpoint.resume {
        Some(from) => {
            let resumed;
            (model, resumed) = trainer.resume(model, from, config, &mut rank_data, &comm)?;
            Some(resumed)
        }
        None => None,
    };
    // Note [Ranks stay one model]: equal at start (broadcast, loaded or resumed).
    check_parameters_agree(&model, &comm, "at start".into())?;
    let mut log = start_run(
        config,
        options,
        &comm,
        &trainer,
        &model,
        &rank_data,
        resumed.as_ref(),
    )?;
    // Note [Init passes]: outside the timed run, the dropout masks of the first step.
    let first_step = resumed.as_ref().map_or(0, |r| r.run.step);
    let init_pass_losses;
    (model, init_pass_losses) =
        trainer.init_passes(model, config, first_step, device, &options, &mut log)?;

    // The loop.
    let eval_interval = config
        .train
        .eval_interval_samples
        .map(|i| i.samples(global_batch_size));
    let samples_at = |step: u64| step * global_batch_size as u64;
    let block_samples =
        eval_interval.unwrap_or(config.train.eval_every_steps() * global_batch_size as u64);
    mllog.settings(config, global_batch_size, rank_data.eval.len())?;
    mllog.end("init_stop", Value::Null, Value::Null)?;
    mllog.start("run_start", Value::Null, Value::Null)?;
    let mut block_first = samples_at(first_step);
    let block_meta = |first: u64| json!({"first_epoch_num": first, "epoch_count": block_samples, "samples_count": first});
    mllog.start("block_start", Value::Null, block_meta(block_first))?;
    let tokens_before = log.tokens;
    let mut last_eval = resumed.as_ref().and_then(|r| r.run.last_eval);
    let mut reached_target = false;
    let mut stopped_by = None;
    let mut last_checkpoint = None;
    let mut step = first_step;
    let mut comm_bytes = Vec::new();
    let run_state = |step, log: &RunLog<_>, last_eval| RunState {
        step,
        world_size,
        global_batch_size,
        losses: log.losses.clone(),
        tokens: log.tokens,
        last_eval,
        loss_scaler: None,
        warmup_steps: Some(config.warmup_steps()),
        freeze_step: config
            .optimizer
            .name
            .is_onebit()
            .then(|| config.freeze_step()),
    };
    let mut data_wait_s = 0.0;
    let mut time_to_first_step_s = None;
    let mut last_eval_step = None;
    let mut target_reached_at = None;
    while step < config.train.steps {
        let (micro_batches, waited) = rank_data
            .batches
            .next_step(config.parallel.grad_accum, &comm)?;
        data_wait_s += waited;
        let mut record;
        (model, record) = trainer.step(model, step, micro_batches, device, &options)?;
        record.data_wait_s = waited;
        if time_to_first_step_s.is_none() {
            // The time to the first step (the GPU-speed issue's "fast start"): from this
            // call to the end of the first step's kernels (one wait, outside the step's
            // counted syncs), so data preparation, the device's start, kernel compilation
            // and autotuning are in it; the kernel cache (`ember_backend_ext::
            // set_kernel_cache`) is what makes a second process's shorter.
            B::sync(device).map_err(|e| TrainError::Device(format!("{e:?}")))?;
            let seconds = run_started.elapsed().as_secs_f64();
            time_to_first_step_s = Some(seconds);
            if rank == 0 {
                info!(seconds = format!("{seconds:.1}"), "first step done");
            }
        }
        // A skipped step (its gradients overflowed: `crate::loss_scale`) is not counted: the
        // weights, moments and schedule stay, the next batch tries again; a signal still stops
        // the run, with the checkpoint of the last step taken.
        let stepped = !record.skipped;
        let mut eval_due = false;
        if record.skipped {
            let scaler = trainer
                .loss_scaler
                .as_ref()
                .expect("only a loss scaler skips");
            log.skipped(&record, scaler.scale())?;
            scaler.check_collapse(step + 1)?;
        } else {
            if rank == 0 && record.compressed && step == trainer.optimizer_freeze_step() {
                info!(
                    step = step + 1,
                    warmup_bytes_per_step = comm_bytes.last().copied().unwrap_or_default(),
                    compressed_bytes_per_step = record.comm_bytes,
                    "1-bit compression: momenta averaged compressed from here on, the variance frozen"
                );
            }
            comm_bytes.push(record.comm_bytes);
            step += 1;
            log.record(record, &comm)?;
            // By samples (MLPerf: after the first step whose samples reach the next multiple of
            // the interval), else every `eval_every` steps; and after the last step.
            eval_due = match eval_interval {
                Some(every) => samples_at(step) / every > samples_at(step - 1) / every,
                None => step % config.train.eval_every_steps() == 0,
            };
            if eval_due || step == config.train.steps {
                let samples = samples_at(step);
                mllog.end(
                    "block_stop",
                    Value::Null,
                    json!({"first_epoch_num": block_first, "samples_count": samples}),
                )?;
                mllog.start("eval_start", Value::Null, json!({"epoch_num": samples}))?;
                let result = evaluate_sharded(&model, &rank_data.eval, device, &comm)?;
                mllog.event(
                    "eval_accuracy",
                    json!(result.mlm_accuracy),
                    json!({"epoch_num": samples}),
                )?;
                mllog.end("eval_stop", Value::Null, json!({"epoch_num": samples}))?;
                log.eval(step, &result)?;
                last_eval = Some(result);
                last_eval_step = Some(step);
                if let (0, Some(hook)) = (rank, options.on_eval) {
                    hook(&out.join("metrics.jsonl"));
                }
                reached_target = config
                    .train
                    .target_mlm_accuracy
                    .is_some_and(|t| result.mlm_accuracy >= t);
                if reached_target {
                    target_reached_at = Some(samples_at(step));
                }
            }
        }
        stopped_by = stop_signal(options, &comm)?;
        let every = config.checkpoint.every;
        let due = stepped && every > 0 && step % every == 0;
        let ends = reached_target || stopped_by.is_some() || step == config.train.steps;
        if (stepped || ends) && check_due(config.parallel.check_every, step, due || ends) {
            check_parameters_agree(&model, &comm, format!("after step {step}"))?;
        }
        if due || ends {
            log.flush(&comm)?;
            let mut state = run_state(step, &log, last_eval);
            state.loss_scaler = trainer.loss_scaler.as_ref().map(LossScaler::state);
            last_checkpoint =
                Some(trainer.save_checkpoint(&model, config, &rank_data, &state, &comm)?);
        }
        if ends {
            break;
        }
        if eval_due {
            block_first = samples_at(step);
            mllog.start("block_start", Value::Null, block_meta(block_first))?;
        }
    }
    log.flush(&comm)?;
    let train_seconds = log.started.elapsed().as_secs_f64();
    let eval = match last_eval {
        Some(eval) => eval,
        // Stopped by a signal before the first evaluation.
        None => evaluate_sharded(&model, &rank_data.eval, device, &comm)?,
    };
    let last_checkpoint = last_checkpoint.expect("the last step writes a checkpoint");
    if last_eval_step != Some(step) {
        // Stopped by a signal between evaluations: the open block ends here.
        mllog.end(
            "block_stop",
            Value::Null,
            json!({"first_epoch_num": block_first, "samples_count": samples_at(step)}),
        )?;
    }
    mllog.event(
        "train_samples",
        json!(samples_at(step) - samples_at(first_step)),
        Value::Null,
    )?;
    mllog.end(
        "run_stop",
        Value::Null,
        json!({
            "status": if reached_target { "success" } else { "aborted" },
            "epoch_num": samples_at(step),
        }),
    )?;

    // The trained model (rank 0), Hugging Face layout, beside the metrics; each file written
    // to a temporary name and renamed. Not after a signal: the checkpoint holds it, and the
    // job has seconds left.
    let checkpoint = out.join("model.safetensors");
    if rank == 0 && stopped_by.is_none() {
        model.valid().save_hf_safetensors(&checkpoint)?;
        write_atomically(&out.join("config.json"), &trainer.bert_config.to_hf_json())?;
        write_atomically(&out.join("train_config.toml"), &config.to_toml())?;
    }
    let peak_rss_bytes = output::peak_rss_bytes();
    let scaler_state = trainer.loss_scaler.as_ref().map(LossScaler::state);
    log.end(json!({
        "event": "end", "steps": step, "reached_target": reached_target,
        "target_reached_at_samples": target_reached_at,
        "train_samples": samples_at(step) - samples_at(first_step),
        "mlm_accuracy": eval.mlm_accuracy, "unigram_baseline": rank_data.unigram_baseline,
        "train_seconds": train_seconds, "data_wait_s": data_wait_s,
        "time_to_first_step_s": time_to_first_step_s,
        "peak_rss_mib": peak_rss_bytes.map(|b| b as f64 / (1 << 20) as f64),
        "corpus_lines_skipped": data.skipped_lines,
        "skipped_steps": scaler_state.map_or(0, |s| s.skipped_steps),
        "loss_scale": scaler_state.map(|s| s.scale),
        "checkpoint": checkpoint,
        "last_checkpoint": last_checkpoint, "stopped_by": stopped_by,
    }))?;
    if let (0, Some(hook)) = (rank, options.on_eval) {
        hook(&out.join("metrics.jsonl"));
    }
    // No rank leaves before rank 0 has written the checkpoint: a rank's exit is how the
    // others learn of failures.
    comm.call(|c| c.barrier())?;

    Ok(TrainSummary {
        steps: step,
        losses: std::mem::take(&mut log.losses),
        comm_bytes,
        eval,
        unigram_baseline: rank_data.unigram_baseline,
        unigram_token: rank_data.unigram_token.clone(),
        reached_target,
        target_reached_at_samples: target_reached_at,
        data_wait_s,
        peak_rss_bytes,
        corpus_lines_skipped: data.skipped_lines,
        skipped_steps: scaler_state.map_or(0, |s| s.skipped_steps),
        loss_scale: scaler_state.map(|s| s.scale),
        precision: trainer.precision,
        train_seconds,
        tokens_per_second: (log.tokens - tokens_before) as f64 / train_seconds,
        checkpoint,
        metrics: out.join("metrics.jsonl"),
        world_size,
        global_batch_size,
        buckets: trainer.reducer.plan().summary(),
        device_buckets: trainer.reducer.on_device(),
        is_main_rank: rank == 0,
        last_checkpoint,
        resumed_from: resumed.map(|r| r.run.step),
        stopped_by: stopped_by.map(str::to_string),
        init: init_report,
        init_pass_losses,
    })
}

/// The signal that asks the run to stop after this step, agreed over the ranks (one scalar
/// allreduce per step) when [`RunOptions::stop_on_signal`] is set; `None` otherwise.
fn stop_signal<B: burn::tensor::backend::Backend>(
    options: RunOptions,
    comm: &CommThread<B>,
) -> Result<Option<&'static str>, TrainError> {
    if !options.stop_on_signal {
        return Ok(None);
    }
    let local = crate::checkpoint::signals::received();
    if comm.world_size() == 1 {
        return Ok(local);
    }
    let flag = [f32::from(u8::from(local.is_some()))];
    let any = comm.call(move |c| {
        let mut flag = flag;
        c.allreduce(&mut flag, ReduceOp::Sum).map(|()| flag[0])
    })?;
    Ok((any > 0.0).then(|| local.unwrap_or("a signal to another rank")))
}

/// Logs what the run derived from its configuration (STYLE.md 12: global batch, tokens per
/// step, bucket plan) and opens the run's log with its `start` record.
fn start_run<B: GradHookBackend>(
    config: &TrainConfig,
    options: RunOptions,
    comm: &CommThread<B::InnerBackend>,
    trainer: &Trainer<B>,
    model: &ember_model::BertForPreTraining<B>,
    rank_data: &RankData,
    resumed: Option<&checkpointing::Resumed>,
) -> Result<RunLog<B::InnerBackend>, TrainError> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let global_batch_size = config.train.batch_size * config.parallel.grad_accum * world_size;
    let plan = trainer.reducer.plan();
    let buckets = plan.summary();
    let storage = if trainer.reducer.on_device() {
        "device"
    } else {
        "host"
    };
    info!(
        rank,
        world_size,
        collective = comm.name(),
        buckets = %buckets,
        bucket_storage = storage,
        bucket_plan_hash = format!("{:016x}", plan.fingerprint()),
        reduced_after_backward = %plan.after_backward(&trainer.late),
        clip = %config.parallel.clip,
        "rank ready"
    );
    if rank == 0 {
        info!(
            preset = %config.model.preset,
            parameters = model.num_params(),
            train_instances = rank_data.num_train,
            eval_instances = rank_data.eval.len(),
            world_size,
            global_batch_size,
            max_seq_length = config.instances.max_seq_length,
            mean_tokens_per_sample = format!("{:.1}", rank_data.mean_len),
            tokens_per_step = format!("{:.0}", rank_data.mean_len * global_batch_size as f64),
            optimizer = ?config.optimizer.name,
            freeze_step = config.optimizer.name.is_onebit().then(|| config.freeze_step()),
            peak_lr = config.optimizer.lr,
            warmup_steps = config.warmup_steps(),
            steps = config.train.steps,
            precision = %trainer.precision,
            loss_scale = trainer.loss_scaler.as_ref().map(LossScaler::scale),
            allreduce_dtype = %config.parallel.allreduce_dtype,
            "starting pre-training"
        );
        info!(
            unigram_token = %rank_data.unigram_token,
            unigram_baseline = format!("{:.4}", rank_data.unigram_baseline),
            "masked-LM accuracy of always predicting the most frequent masked token"
        );
    }
    let (event, from) = match resumed {
        Some(r) => ("resume", Some(r.dir.clone())),
        None => ("start", None),
    };
    RunLog::start(
        config,
        comm,
        options.progress,
        json!({
            "event": event, "from": from,
            "step": resumed.map_or(0, |r| r.run.step), "preset": config.model.preset.name(),
            "parameters": model.num_params(), "train_instances": rank_data.num_train,
            "eval_instances": rank_data.eval.len(), "world_size": world_size,
            "global_batch_size": global_batch_size,
            "max_seq_length": config.instances.max_seq_length, "buckets": buckets,
            "bucket_storage": storage, "clip": config.parallel.clip.to_string(),
            "unigram_token": rank_data.unigram_token,
            "unigram_baseline": rank_data.unigram_baseline,
            "precision": trainer.precision.to_string(),
            "loss_scale": trainer.loss_scaler.as_ref().map(LossScaler::scale),
            "allreduce_dtype": config.parallel.allreduce_dtype.to_string(),
        }),
        resumed.map(|r| (r.dir.as_path(), &r.run)),
    )
}
