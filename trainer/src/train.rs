//! The training loop, top to bottom: config → data → model → optimizer → loop (forward with
//! gradient hooks, backward, bucketed allreduce and clipping, step, log, evaluate) →
//! checkpoint. One function, [`train_rank`], is one data-parallel rank; a one-rank job is the
//! same loop with a [`SingleRank`] communicator.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Tensor, TensorData};
use ember_data::{
    HostBatch, InstanceLoader, SamplerConfig, ShardLoader, ShardedDataset, TrainingInstance,
    WordPieceTokenizer, create_training_instances, decode_refs, encode_refs, read_documents,
    split_held_out, tokenize_documents,
};
use ember_model::BertForPreTraining;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use tracing::info;

use crate::dist::check_agreement;
use crate::dist::hooks::ready_order;
use crate::dist::{
    BucketPlan, Collective, CommError, CommThread, GradHookBackend, GradHooks, InProcess, ReduceOp,
    Reducer, SingleRank,
};
use crate::eval::{EvalResult, evaluate, forward_loss_hooked, unigram_baseline};
use crate::grads::named_params;
use crate::optim::PreTrainingOptimizer;
use crate::schedule::WarmupPolyDecay;
use crate::{TrainConfig, TrainError};

/// How a run reports while it runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// Draw an indicatif progress bar on stderr (rank 0 only).
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
    /// Ranks that trained together.
    pub world_size: usize,
    /// Samples per optimizer step over all ranks and micro-batches.
    pub global_batch_size: usize,
    /// The gradient buckets, `"K buckets: a, b MiB"`.
    pub buckets: String,
    /// Whether this is rank 0 (which wrote the checkpoint and metrics).
    pub is_main_rank: bool,
}

/// Training and held-out instances of a configuration, with the tokenizer that made them.
pub struct PreparedData {
    pub tokenizer: WordPieceTokenizer,
    /// Shared, so that in-process ranks read one copy. Empty when training on shards.
    pub train: Arc<[TrainingInstance]>,
    pub eval: Arc<[TrainingInstance]>,
    /// The training shards (`data.shards`) and their samples per length bin.
    pub shards: Option<(ShardedDataset, Vec<Arc<[TrainingInstance]>>)>,
}

/// Where a rank's training batches come from.
enum TrainBatches {
    /// Instances made from the corpus: a shared permutation dealt out to ranks.
    Instances(InstanceLoader),
    /// Shards, through a sampler.
    Shards(ShardLoader),
}

impl TrainBatches {
    /// The `k` micro-batches of the next step. Presort exchanges the ranks' own draws through
    /// an allgather (sample references, 8 bytes each; every rank holds the samples).
    fn next_step(&mut self, k: usize, comm: &CommThread) -> Result<Vec<HostBatch>, TrainError> {
        Ok(match self {
            Self::Instances(loader) => (0..k).map(|_| loader.next_batch()).collect(),
            Self::Shards(loader) if loader.exchanges() => {
                let own = encode_refs(&loader.draw_own());
                let world = comm.call(move |c| c.allgather(&own))?;
                let draws = world
                    .iter()
                    .map(|bytes| decode_refs(bytes))
                    .collect::<Result<Vec<_>, _>>()?;
                loader.batches_from(&draws)
            }
            Self::Shards(loader) => loader.next_step(),
        })
    }
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
    // Held out before tokenising, by raw document count, as `prepare-data` holds them out of
    // its shards.
    let (train_docs, eval_docs) = split_held_out(
        read_documents(&corpus_path)?,
        config.data.eval_documents,
        &corpus_path,
    )?;
    let eval_docs = tokenize_documents(&tokenizer, &eval_docs)?;
    let special = tokenizer.special();
    let shards = match &config.data.shards {
        Some(path) => {
            let (dataset, samples) =
                ShardedDataset::load(path, tokenizer.vocab_size(), config.data.skip_bad_shards)?;
            for skipped in &dataset.skipped {
                tracing::warn!("skipped a bad shard: {skipped}");
            }
            Some((dataset, samples))
        }
        None => None,
    };
    let train = if shards.is_some() {
        Vec::new()
    } else {
        create_training_instances(
            &tokenize_documents(&tokenizer, &train_docs)?,
            &config.instances,
            special,
            tokenizer.vocab_size(),
        )?
    };
    let eval_config = ember_data::PretrainingConfig {
        dupe_factor: 1,
        seed: config.instances.seed.wrapping_add(1),
        ..config.instances.clone()
    };
    let eval =
        create_training_instances(&eval_docs, &eval_config, special, tokenizer.vocab_size())?;
    Ok(PreparedData {
        tokenizer,
        train: train.into(),
        eval: eval.into(),
        shards,
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

/// Pre-trains BERT as `config` says, on `device`, as a single process, and writes
/// `metrics.jsonl`, `model.safetensors`, `config.json` (Hugging Face) and `train_config.toml`
/// to `train.out`.
///
/// # Errors
/// Every bad input is reported before the first step: [`TrainError::InvalidSetting`],
/// [`TrainError::SeqLenTooLong`], [`TrainError::Output`] (folder not writable),
/// [`TrainError::Data`] (corpus, vocabulary, batch larger than the data). During the run:
/// [`TrainError::Diverged`] on a non-finite loss, [`TrainError::Output`] if a write fails.
pub fn train<B: GradHookBackend>(
    config: &TrainConfig,
    device: &B::Device,
    options: RunOptions,
) -> Result<TrainSummary, TrainError> {
    train_rank::<B>(config, device, options, Box::new(SingleRank), None)
}

/// Trains with `world_size` data-parallel ranks as threads of this process (each with its
/// own model replica on `device`, meeting through [`InProcess`] collectives), and returns
/// rank 0's summary. The result equals one rank with `world_size` times the batch.
///
/// # Errors
/// As [`train`]. When a rank fails, the others stop with [`TrainError::Comm`] naming it; the
/// error returned is the first rank's own failure, not the others' reaction to it.
pub fn train_in_process<B: GradHookBackend>(
    config: &TrainConfig,
    world_size: usize,
    device: &B::Device,
    options: RunOptions,
) -> Result<TrainSummary, TrainError> {
    train_in_process_with_data::<B>(config, world_size, device, options, None)
}

/// [`train_in_process`] on data prepared by the caller (`None`: prepared here), so that
/// several runs can share one [`prepare_data`].
///
/// # Errors
/// As [`train_in_process`].
pub fn train_in_process_with_data<B: GradHookBackend>(
    config: &TrainConfig,
    world_size: usize,
    device: &B::Device,
    options: RunOptions,
    data: Option<Arc<PreparedData>>,
) -> Result<TrainSummary, TrainError> {
    if world_size == 0 {
        return Err(TrainError::InvalidSetting {
            field: "nproc",
            reason: "must be at least 1".into(),
        });
    }
    config.validate()?;
    let data = match data {
        Some(data) => data,
        None => Arc::new(prepare_data(config)?),
    };
    let timeout = Duration::from_secs_f64(config.parallel.timeout_s);
    let results: Vec<Result<TrainSummary, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = InProcess::group(world_size, timeout)
            .into_iter()
            .map(|comm| {
                let data = data.clone();
                scope.spawn(move || {
                    train_rank::<B>(config, device, options, Box::new(comm), Some(data))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(TrainError::Comm(CommError::Backend {
                        backend: "in-process",
                        message: format!("rank {rank} panicked"),
                    }))
                })
            })
            .collect()
    });
    let mut errors = Vec::new();
    let mut summary = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(s) if rank == 0 => summary = Some(s),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    // A rank's own failure first; the others' communication errors are its echo.
    if let Some(i) = errors
        .iter()
        .position(|e| !matches!(e, TrainError::Comm(_)))
    {
        return Err(errors.swap_remove(i));
    }
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(summary.expect("rank 0 returned a summary")),
    }
}

/// Serialises model initialisation across in-process ranks: Burn's NdArray random generator
/// is process-wide, so ranks initialising at once would interleave their draws. (Rank 0's
/// parameters are broadcast anyway; this makes rank 0's equal a one-rank run's.)
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// The bucket plan of a model: its float parameters in `order` (the order their gradients
/// become ready, [`crate::dist::hooks::ready_order`]), bucketed by size.
pub fn bucket_plan<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    order: &[burn::module::ParamId],
    first_bucket_mb: f64,
    bucket_cap_mb: f64,
) -> BucketPlan {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.shape().dims::<D>().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    let mut by_id: std::collections::HashMap<_, (String, Vec<usize>)> =
        named_params::<B, M>(module)
            .into_iter()
            .zip(shapes.0)
            .map(|((name, id), shape)| (id, (name, shape)))
            .collect();
    let params: Vec<(String, _, Vec<usize>)> = order
        .iter()
        .map(|id| {
            let (name, shape) = by_id
                .remove(id)
                .expect("the order lists each parameter once");
            (name, *id, shape)
        })
        .collect();
    BucketPlan::new(&params, first_bucket_mb, bucket_cap_mb)
}

/// Replaces `module`'s parameters with rank 0's (PyTorch DDP does the same at construction),
/// one bucket-sized broadcast at a time.
fn broadcast_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    plan: &BucketPlan,
    comm: &CommThread,
) -> Result<M, TrainError> {
    let mut values: std::collections::HashMap<burn::module::ParamId, Vec<f32>> = Default::default();
    struct Read<'a>(&'a mut std::collections::HashMap<burn::module::ParamId, Vec<f32>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0
                .insert(param.id, data.into_vec::<f32>().expect("f32 data"));
        }
    }
    module.visit(&mut Read(&mut values));
    for bucket in &plan.buckets {
        let mut flat = Vec::with_capacity(bucket.numel);
        for p in &bucket.params {
            flat.extend_from_slice(&values[&p.id]);
        }
        let flat = comm.call(move |c| {
            let mut flat = flat;
            c.broadcast(&mut flat, 0).map(|()| flat)
        })?;
        for p in &bucket.params {
            values.insert(p.id, flat[p.offset..p.offset + p.numel()].to_vec());
        }
    }
    struct Write(std::collections::HashMap<burn::module::ParamId, Vec<f32>>);
    impl<B: AutodiffBackend> ModuleMapper<B> for Write {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(values) = self.0.remove(&param.id) else {
                return param;
            };
            param.map(|tensor| {
                let shape = tensor.shape();
                Tensor::from_data(TensorData::new(values, shape), &tensor.device()).require_grad()
            })
        }
    }
    Ok(module.map(&mut Write(values)))
}

/// One data-parallel rank of a training run: the whole loop, with `comm` connecting it to
/// the other ranks ([`SingleRank`] for a job of one). Rank 0 writes the metrics, the
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
    comm: Box<dyn Collective>,
    data: Option<Arc<PreparedData>>,
) -> Result<TrainSummary, TrainError> {
    // Config and output.
    config.validate()?;
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let main = rank == 0;
    let out = &config.train.out;
    if main {
        prepare_output_dir(out)?;
    }
    let comm = Arc::new(CommThread::spawn(comm));
    check_agreement(&comm, "configuration", config.to_toml())?;

    // Data.
    let data = match data {
        Some(data) => data,
        None => Arc::new(prepare_data(config)?),
    };
    let seq_len = config.instances.max_seq_length;
    let batch_size = config.train.batch_size;
    let grad_accum = config.parallel.grad_accum;
    let global_batch_size = batch_size * grad_accum * world_size;
    let (unigram_id, unigram_baseline, num_train, mean_len, mut loader) = match &data.shards {
        None => {
            let (id, acc) = unigram_baseline(data.train.iter(), &data.eval);
            let mean_len = data.train.iter().map(|i| i.len()).sum::<usize>() as f64
                / data.train.len().max(1) as f64;
            let loader = InstanceLoader::for_rank(
                data.train.clone(),
                batch_size,
                seq_len,
                config.train.seed,
                "training set",
                rank,
                world_size,
            )?;
            let n = data.train.len();
            (id, acc, n, mean_len, TrainBatches::Instances(loader))
        }
        Some((dataset, samples)) => {
            let all = || samples.iter().flat_map(|bin| bin.iter());
            let (id, acc) = unigram_baseline(all(), &data.eval);
            let n = dataset.num_samples();
            let mean_len = all().map(|i| i.len()).sum::<usize>() as f64 / n.max(1) as f64;
            let sampler = SamplerConfig {
                kind: config.data.sampler,
                local_batch: batch_size * grad_accum,
                presort_group: config.data.presort_group,
                bin_quota: config.data.bin_quota.clone(),
                seed: config.train.seed,
                exchange: world_size > 1,
            };
            let loader = ShardLoader::new(
                dataset,
                samples.clone(),
                &sampler,
                config.data.padding,
                grad_accum,
                seq_len,
                rank,
                world_size,
            )?;
            if main {
                for (b, bin) in dataset.bins.iter().enumerate() {
                    let quota = loader.sampler().quota();
                    if quota.len() > 1 && quota[b] == 0 && !dataset.lengths[b].is_empty() {
                        tracing::warn!(
                            "length bin {}-{} ({} samples) has quota 0 and is never drawn; \
                             set data.bin_quota (--bin-quota) to include it",
                            bin.lo,
                            bin.hi,
                            dataset.lengths[b].len()
                        );
                    }
                }
                info!(
                    shards = %dataset.root.display(),
                    samples = n,
                    bins = dataset.bins.len(),
                    sampler = %config.data.sampler,
                    padding = ?config.data.padding,
                    quota = ?loader.sampler().quota(),
                    "training on shards"
                );
            }
            // Every rank must read the same shards (a shard skipped on one node only would
            // shift the others' sample indices).
            let listing: Vec<String> = dataset
                .bins
                .iter()
                .zip(&dataset.shards)
                .zip(&dataset.shard_sizes)
                .flat_map(|((bin, files), sizes)| {
                    files.iter().zip(sizes).map(move |(f, n)| {
                        let name = f.file_name().unwrap_or_default().to_string_lossy();
                        format!("{} {name} {n}", bin.dir_name())
                    })
                })
                .collect();
            check_agreement(&comm, "training shards", listing.join("\n"))?;
            (id, acc, n, mean_len, TrainBatches::Shards(loader))
        }
    };
    let unigram_token = data.tokenizer.id_to_token(unigram_id).unwrap_or_default();
    let eval_instances: Vec<TrainingInstance> = data
        .eval
        .iter()
        .take(config.train.eval_samples)
        .cloned()
        .collect();
    // Evaluation needs no full batches: a small held-out set is evaluated in smaller ones.
    let eval_batch_size = batch_size.min(64).min(eval_instances.len().max(1));
    let eval_loader = InstanceLoader::new(
        eval_instances,
        eval_batch_size,
        seq_len,
        0,
        "evaluation set",
    )?;

    // Model, buckets, optimizer.
    let bert_config = config.bert_config(data.tokenizer.vocab_size());
    bert_config.validate()?;
    let model: BertForPreTraining<B> = {
        let _guard = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        B::seed(device, config.train.seed);
        ember_backend_ext::reseed_dropout(config.train.seed);
        let model = bert_config
            .init_for_pretraining(device)
            .with_kernels(config.model.kernels);
        // Burn initialises parameters lazily, at their first use: draw them all now, in
        // module order, while this rank holds the generator.
        struct Materialize;
        impl<B: AutodiffBackend> ModuleVisitor<B> for Materialize {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let _ = param.val();
            }
        }
        model.visit(&mut Materialize);
        model
    };
    // Which gradients the hooks can hand over, in which order: one probe backward on the
    // first held-out batch (Note [Late gradients] in dist/hooks.rs).
    let probe = eval_loader
        .sequential_batches()
        .next()
        .expect("the evaluation set is not empty");
    let order = ready_order(&model, probe.to_device::<B>(device));
    let plan = bucket_plan::<B, _>(
        &model,
        &order.params(),
        config.parallel.first_bucket_mb,
        config.parallel.bucket_cap_mb,
    );
    check_agreement(&comm, "bucket plan", plan.describe())?;
    let mut model = broadcast_parameters::<B, _>(model, &plan, &comm)?;
    let hooked = order.hooked_set();
    let after_backward = order.late.clone();
    let bucket_summary = plan.summary();
    let reducer = Reducer::new(
        plan,
        config.parallel.clip,
        config.optimizer.max_grad_norm,
        comm.clone(),
    );
    let fused = config.model.kernels.fused::<B>();
    let mut optimizer = PreTrainingOptimizer::new(&config.optimizer, &model, fused);
    let schedule = WarmupPolyDecay::new(
        config.optimizer.lr,
        config.warmup_steps(),
        config.train.steps,
        &config.schedule,
    );

    info!(
        rank,
        world_size,
        collective = comm.name(),
        device = ?device,
        buckets = %bucket_summary,
        bucket_plan_hash = format!("{:016x}", reducer.plan().fingerprint()),
        clip = %config.parallel.clip,
        "rank ready"
    );
    if main {
        info!(
            preset = %config.model.preset,
            parameters = model.num_params(),
            train_instances = num_train,
            eval_instances = eval_loader.len(),
            world_size,
            global_batch_size,
            max_seq_length = seq_len,
            mean_tokens_per_sample = format!("{mean_len:.1}"),
            tokens_per_step = format!("{:.0}", mean_len * global_batch_size as f64),
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
    }

    let mut metrics = if main {
        let mut metrics = MetricsWriter::create(out.join("metrics.jsonl"))?;
        metrics.write(json!({
            "event": "start", "preset": config.model.preset.name(), "parameters": model.num_params(),
            "train_instances": num_train, "eval_instances": eval_loader.len(),
            "world_size": world_size, "global_batch_size": global_batch_size,
            "max_seq_length": seq_len, "buckets": bucket_summary,
            "clip": config.parallel.clip.to_string(),
            "unigram_token": unigram_token, "unigram_baseline": unigram_baseline,
        }))?;
        Some(metrics)
    } else {
        None
    };

    let progress = if options.progress && main {
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
        // Micro-batches: gradients accumulate in the reducer's buckets; only the last one's
        // backward launches allreduces. Each loss is divided by K, so the step's gradient is
        // the mean over the K micro-batches.
        let mut step_losses = [0f32; 3];
        for (micro, host) in loader.next_step(grad_accum, &comm)?.into_iter().enumerate() {
            tokens += host.num_tokens();
            let batch = host.to_device::<B>(device);
            reducer.begin_micro_batch(micro == 0, micro + 1 == grad_accum);
            let hooks = GradHooks::new(&model, reducer.callback(), Some(&hooked));
            let (_, loss) = forward_loss_hooked(&model, batch, &hooks);
            for (sum, term) in step_losses
                .iter_mut()
                .zip([&loss.total, &loss.mlm, &loss.nsp])
            {
                *sum += term.clone().into_scalar().elem::<f32>() / grad_accum as f32;
            }
            let total = if grad_accum > 1 {
                loss.total.div_scalar(grad_accum as f32)
            } else {
                loss.total
            };
            let mut grads = GradientsParams::from_grads(total.backward(), &model);
            drop(hooks);
            // The embeddings are final only now (the word embedding is also the decoder).
            reducer.deliver(crate::grads::take_host_grads(
                &model,
                &mut grads,
                &after_backward,
            ));
        }
        let reduced = reducer.finish()?;
        // The loss averaged over ranks, for the log (queued behind the buckets).
        let step_losses = comm.call(move |c| {
            let mut l = step_losses;
            c.allreduce(&mut l, ReduceOp::Average).map(|()| l)
        })?;
        let loss_value = f64::from(step_losses[0]);
        if !loss_value.is_finite() {
            return Err(TrainError::Diverged {
                step,
                loss: loss_value,
            });
        }
        let grads = reducer.gradients::<B, _>(&model, device);
        let lr = schedule.lr(step);
        model = optimizer.step(lr, model, grads);
        losses.push(loss_value);
        step += 1;

        if let Some(metrics) = metrics.as_mut() {
            if step % config.train.log_every == 0 || step == config.train.steps {
                metrics.write(json!({
                    "event": "train", "step": step, "loss": loss_value,
                    "mlm_loss": step_losses[1], "nsp_loss": step_losses[2],
                    "lr": lr, "grad_norm": reduced.grad_norm, "tokens": tokens * world_size,
                    "comm_wait_s": reduced.timings.wait_after_backward.as_secs_f64(),
                    "elapsed_s": started.elapsed().as_secs_f64(),
                }))?;
            }
        }
        progress.set_message(format!("loss {loss_value:.3}"));
        progress.inc(1);

        if step % config.train.eval_every == 0 || step == config.train.steps {
            let result = evaluate_sharded(&model, &eval_loader, device, &comm)?;
            if let Some(metrics) = metrics.as_mut() {
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
                        tokens_per_second = format!(
                            "{:.0}",
                            (tokens * world_size) as f64 / started.elapsed().as_secs_f64()
                        ),
                        "eval"
                    )
                });
            }
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

    // Checkpoint (rank 0): Hugging Face layout, each file written to a temporary name and
    // renamed.
    let checkpoint = out.join("model.safetensors");
    if let Some(metrics) = metrics.as_mut() {
        model.valid().save_hf_safetensors(&checkpoint)?;
        write_atomically(&out.join("config.json"), &bert_config.to_hf_json())?;
        write_atomically(&out.join("train_config.toml"), &config.to_toml())?;
        metrics.write(json!({
            "event": "end", "steps": step, "reached_target": reached_target,
            "mlm_accuracy": eval.mlm_accuracy, "unigram_baseline": unigram_baseline,
            "train_seconds": train_seconds, "checkpoint": checkpoint,
        }))?;
    }
    // Each rank's sampler state (shards): where its data order stopped, for
    // `RankSampler::restore` (the trainer does not resume runs yet).
    if let TrainBatches::Shards(loader) = &loader {
        std::fs::create_dir_all(out).map_err(|e| TrainError::Output {
            path: out.clone(),
            reason: e.to_string(),
        })?;
        let state = serde_json::to_string_pretty(&loader.sampler().state())
            .expect("a sampler state serialises");
        write_atomically(&out.join(format!("sampler_state.rank{rank}.json")), &state)?;
    }
    // No rank leaves before rank 0 has written the checkpoint: a rank's exit is how the
    // others learn of failures.
    comm.call(|c| c.barrier())?;

    Ok(TrainSummary {
        steps: step,
        losses,
        eval,
        unigram_baseline,
        unigram_token,
        reached_target,
        train_seconds,
        tokens_per_second: (tokens * world_size) as f64 / train_seconds,
        checkpoint,
        metrics: out.join("metrics.jsonl"),
        world_size,
        global_batch_size,
        buckets: bucket_summary,
        is_main_rank: main,
    })
}

/// Evaluates the held-out set split over the ranks (batch i on rank i mod W) and sums the
/// counts over ranks, so every rank gets the whole set's result.
fn evaluate_sharded<B: GradHookBackend>(
    model: &BertForPreTraining<B>,
    eval_loader: &InstanceLoader,
    device: &B::Device,
    comm: &CommThread,
) -> Result<EvalResult, TrainError> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let mine = eval_loader
        .sequential_batches()
        .enumerate()
        .filter(|(i, _)| i % world_size == rank)
        .map(|(_, b)| b);
    let local = evaluate(&model.valid(), mine, device);
    if world_size == 1 {
        return Ok(local);
    }
    // Counts are integers (exact in f32 below 2^24); loss sums lose only f32 rounding.
    let (n, s) = (local.num_predictions as f64, local.num_samples as f64);
    let sums = [
        (local.mlm_accuracy * n).round(),
        local.mlm_loss * n,
        n,
        (local.nsp_accuracy * s).round(),
        local.nsp_loss * s,
        s,
    ]
    .map(|x| x as f32);
    let sums = comm.call(move |c| {
        let mut sums = sums;
        c.allreduce(&mut sums, ReduceOp::Sum).map(|()| sums)
    })?;
    let per = |x: f32, n: f32| if n > 0.0 { f64::from(x / n) } else { 0.0 };
    Ok(EvalResult {
        mlm_accuracy: per(sums[0], sums[2]),
        mlm_loss: per(sums[1], sums[2]),
        nsp_accuracy: per(sums[3], sums[5]),
        nsp_loss: per(sums[4], sums[5]),
        num_predictions: sums[2].round() as usize,
        num_samples: sums[5].round() as usize,
    })
}
