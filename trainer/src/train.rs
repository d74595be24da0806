//! The training loop, top to bottom: config → data → model → optimizer → loop (forward,
//! backward, clip, step, log, evaluate) → checkpoint.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use ember_data::{
    InstanceLoader, TrainingInstance, WordPieceTokenizer, create_training_instances,
    read_documents, split_held_out, tokenize_documents,
};
use ember_model::BertForPreTraining;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use tracing::info;

use crate::eval::{EvalResult, evaluate, forward_loss, unigram_baseline};
use crate::grads::clip_global_norm;
use crate::optim::PreTrainingOptimizer;
use crate::schedule::WarmupPolyDecay;
use crate::{TrainConfig, TrainError};

/// How a run reports while it runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Draw an indicatif progress bar on stderr.
    pub progress: bool,
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct TrainSummary {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Training loss (MLM + NSP) of each step, in order.
    pub losses: Vec<f64>,
    /// The last evaluation.
    pub eval: EvalResult,
    /// Masked-LM accuracy of always predicting the most frequent masked token.
    pub unigram_baseline: f64,
    /// The token the unigram baseline predicts.
    pub unigram_token: String,
    /// Whether the run stopped because it reached `train.target_mlm_accuracy`.
    pub reached_target: bool,
    /// Wall-clock seconds of the training loop (evaluations included, data preparation not).
    pub train_seconds: f64,
    /// Real (unpadded) tokens processed per second of training.
    pub tokens_per_second: f64,
    /// The Hugging Face safetensors checkpoint written at the end.
    pub checkpoint: PathBuf,
    /// The metrics file (JSON lines).
    pub metrics: PathBuf,
}

/// Training and held-out instances of a configuration, with the tokenizer that made them.
pub struct PreparedData {
    pub tokenizer: WordPieceTokenizer,
    pub train: Vec<TrainingInstance>,
    pub eval: Vec<TrainingInstance>,
}

/// Reads the vocabulary and corpus of `config`, holds out the last `eval_documents`
/// documents, and creates the training instances (`dupe_factor` passes) and the evaluation
/// instances (one pass, another seed).
///
/// # Errors
/// [`TrainError::Data`] naming the file: missing or empty corpus, bad vocabulary, too few
/// documents.
pub fn prepare_data(config: &TrainConfig) -> Result<PreparedData, TrainError> {
    let vocab_path = config.vocab_path();
    let corpus_path = config.corpus_path();
    let tokenizer = WordPieceTokenizer::from_vocab_file(&vocab_path)?;
    let documents = tokenize_documents(&tokenizer, &read_documents(&corpus_path)?)?;
    let (train_docs, eval_docs) =
        split_held_out(documents, config.data.eval_documents, &corpus_path)?;
    let special = tokenizer.special();
    let train = create_training_instances(
        &train_docs,
        &config.instances,
        special,
        tokenizer.vocab_size(),
    )?;
    let eval_config = ember_data::PretrainingConfig {
        dupe_factor: 1,
        seed: config.instances.seed.wrapping_add(1),
        ..config.instances.clone()
    };
    let eval =
        create_training_instances(&eval_docs, &eval_config, special, tokenizer.vocab_size())?;
    Ok(PreparedData {
        tokenizer,
        train,
        eval,
    })
}

/// Creates `dir` if needed and checks that a file can be written in it.
fn prepare_output_dir(dir: &Path) -> Result<(), TrainError> {
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
fn write_atomically(path: &Path, text: &str) -> Result<(), TrainError> {
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
struct MetricsWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl MetricsWriter {
    fn create(path: PathBuf) -> Result<Self, TrainError> {
        let file = File::create(&path).map_err(|e| TrainError::Output {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            file: BufWriter::new(file),
            path,
        })
    }

    fn write(&mut self, record: serde_json::Value) -> Result<(), TrainError> {
        writeln!(self.file, "{record}")
            .and_then(|()| self.file.flush())
            .map_err(|e| TrainError::Output {
                path: self.path.clone(),
                reason: e.to_string(),
            })
    }
}

/// Pre-trains BERT as `config` says, on `device`, and writes `metrics.jsonl`,
/// `model.safetensors`, `config.json` (Hugging Face) and `train_config.toml` to `train.out`.
///
/// # Errors
/// Every bad input is reported before the first step: [`TrainError::InvalidSetting`],
/// [`TrainError::SeqLenTooLong`], [`TrainError::Output`] (folder not writable),
/// [`TrainError::Data`] (corpus, vocabulary, batch larger than the data). During the run:
/// [`TrainError::Diverged`] on a non-finite loss, [`TrainError::Output`] if a write fails.
pub fn train<B: AutodiffBackend>(
    config: &TrainConfig,
    device: &B::Device,
    options: RunOptions,
) -> Result<TrainSummary, TrainError> {
    // Config and output.
    config.validate()?;
    let out = &config.train.out;
    prepare_output_dir(out)?;

    // Data.
    let data = prepare_data(config)?;
    let seq_len = config.instances.max_seq_length;
    let (unigram_id, unigram_baseline) = unigram_baseline(&data.train, &data.eval);
    let unigram_token = data.tokenizer.id_to_token(unigram_id).unwrap_or_default();
    let num_train = data.train.len();
    let batch_size = config.train.batch_size;
    let mut loader = InstanceLoader::new(
        data.train,
        batch_size,
        seq_len,
        config.train.seed,
        "training set",
    )?;
    let mut eval_instances = data.eval;
    eval_instances.truncate(config.train.eval_samples);
    // Evaluation needs no full batches: a small held-out set is evaluated in smaller ones.
    let eval_batch_size = batch_size.min(64).min(eval_instances.len().max(1));
    let eval_loader = InstanceLoader::new(
        eval_instances,
        eval_batch_size,
        seq_len,
        0,
        "evaluation set",
    )?;

    // Model and optimizer.
    B::seed(device, config.train.seed);
    let bert_config = config.bert_config(data.tokenizer.vocab_size());
    bert_config.validate()?;
    let mut model: BertForPreTraining<B> = bert_config.init_for_pretraining(device);
    let mut optimizer = PreTrainingOptimizer::new(&config.optimizer, &model);
    let schedule = WarmupPolyDecay::new(
        config.optimizer.lr,
        config.warmup_steps(),
        config.train.steps,
        &config.schedule,
    );

    let mean_len =
        loader.instances().iter().map(|i| i.len()).sum::<usize>() as f64 / num_train as f64;
    info!(
        preset = %config.model.preset,
        parameters = model.num_params(),
        train_instances = num_train,
        eval_instances = eval_loader.len(),
        global_batch_size = batch_size,
        max_seq_length = seq_len,
        mean_tokens_per_sample = format!("{mean_len:.1}"),
        tokens_per_step = format!("{:.0}", mean_len * batch_size as f64),
        optimizer = ?config.optimizer.name,
        peak_lr = config.optimizer.lr,
        warmup_steps = config.warmup_steps(),
        steps = config.train.steps,
        "starting pre-training"
    );
    info!(
        unigram_token = %unigram_token,
        unigram_baseline = format!("{unigram_baseline:.4}"),
        "masked-LM accuracy of always predicting the most frequent masked token"
    );

    let mut metrics = MetricsWriter::create(out.join("metrics.jsonl"))?;
    metrics.write(json!({
        "event": "start", "preset": config.model.preset.name(), "parameters": model.num_params(),
        "train_instances": num_train, "eval_instances": eval_loader.len(),
        "global_batch_size": batch_size, "max_seq_length": seq_len,
        "unigram_token": unigram_token, "unigram_baseline": unigram_baseline,
    }))?;

    let progress = if options.progress {
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

    // The loop.
    let started = Instant::now();
    let mut losses = Vec::with_capacity(config.train.steps as usize);
    let mut tokens = 0usize;
    let mut last_eval = None;
    let mut reached_target = false;
    let mut step = 0;
    while step < config.train.steps {
        let host = loader.next_batch();
        tokens += host.num_tokens();
        let (_, loss) = forward_loss(&model, host.to_device::<B>(device));
        let loss_value = f64::from(loss.total.clone().into_scalar().elem::<f32>());
        if !loss_value.is_finite() {
            return Err(TrainError::Diverged {
                step,
                loss: loss_value,
            });
        }
        let mut grads = GradientsParams::from_grads(loss.total.backward(), &model);
        let grad_norm = clip_global_norm(&model, &mut grads, config.optimizer.max_grad_norm);
        let lr = schedule.lr(step);
        model = optimizer.step(lr, model, grads);
        losses.push(loss_value);
        step += 1;

        if step % config.train.log_every == 0 || step == config.train.steps {
            metrics.write(json!({
                "event": "train", "step": step, "loss": loss_value,
                "mlm_loss": f64::from(loss.mlm.into_scalar().elem::<f32>()),
                "nsp_loss": f64::from(loss.nsp.into_scalar().elem::<f32>()),
                "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "elapsed_s": started.elapsed().as_secs_f64(),
            }))?;
        }
        progress.set_message(format!("loss {loss_value:.3}"));
        progress.inc(1);

        if step % config.train.eval_every == 0 || step == config.train.steps {
            let result = evaluate(&model.valid(), eval_loader.sequential_batches(), device);
            metrics.write(json!({
                "event": "eval", "step": step, "mlm_accuracy": result.mlm_accuracy,
                "nsp_accuracy": result.nsp_accuracy, "mlm_loss": result.mlm_loss,
                "nsp_loss": result.nsp_loss, "elapsed_s": started.elapsed().as_secs_f64(),
            }))?;
            progress.suspend(|| {
                info!(
                    step,
                    mlm_accuracy = format!("{:.4}", result.mlm_accuracy),
                    nsp_accuracy = format!("{:.4}", result.nsp_accuracy),
                    mlm_loss = format!("{:.3}", result.mlm_loss),
                    tokens_per_second =
                        format!("{:.0}", tokens as f64 / started.elapsed().as_secs_f64()),
                    "eval"
                )
            });
            last_eval = Some(result);
            if config
                .train
                .target_mlm_accuracy
                .is_some_and(|t| result.mlm_accuracy >= t)
            {
                reached_target = true;
                break;
            }
        }
    }
    progress.finish_and_clear();
    let train_seconds = started.elapsed().as_secs_f64();
    let eval = last_eval.expect("the last step always evaluates");

    // Checkpoint: Hugging Face layout, each file written to a temporary name and renamed.
    let checkpoint = out.join("model.safetensors");
    model.valid().save_hf_safetensors(&checkpoint)?;
    write_atomically(&out.join("config.json"), &bert_config.to_hf_json())?;
    write_atomically(&out.join("train_config.toml"), &config.to_toml())?;
    metrics.write(json!({
        "event": "end", "steps": step, "reached_target": reached_target,
        "mlm_accuracy": eval.mlm_accuracy, "unigram_baseline": unigram_baseline,
        "train_seconds": train_seconds, "checkpoint": checkpoint,
    }))?;

    Ok(TrainSummary {
        steps: step,
        losses,
        eval,
        unigram_baseline,
        unigram_token,
        reached_target,
        train_seconds,
        tokens_per_second: tokens as f64 / train_seconds,
        checkpoint,
        metrics: metrics.path.clone(),
    })
}
