//! `cargo xtask train`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::backend::{Autodiff, NdArray};
use clap::Args;
use ember_data::{Padding, SamplerKind};
use ember_model::{Precision, Preset};
use ember_trainer::loss_scale::LossScaleMode;
use ember_trainer::parallel::{AllreduceDtype, BucketStorage, ClipMode, LaunchEnv, TiedEmbedding};
use ember_trainer::{LossNormalization, OptimizerKind, RunOptions, TrainConfig};

/// Flags of `train`. Each overrides the same setting of the config file.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// TOML training config: a file, or a shipped one by name (tiny-cpu,
    /// mlperf-bert-large-adam, mlperf-bert-large-lamb; compiled into the binary)
    /// [default: tiny-cpu]
    #[arg(long)]
    config: Option<PathBuf>,
    /// Optimizer steps (train.steps)
    #[arg(long, allow_negative_numbers = true)]
    steps: Option<u64>,
    /// Samples per rank and micro-batch; the global batch size is this × grad-accum × ranks
    /// (train.batch_size)
    #[arg(long, allow_negative_numbers = true)]
    batch_size: Option<usize>,
    /// Peak learning rate after warmup (optimizer.lr)
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    /// Steps of linear warmup (schedule.warmup_steps) [default: warmup_proportion of --steps]
    #[arg(long, allow_negative_numbers = true)]
    warmup_steps: Option<u64>,
    /// Step at which warmup starts; negative starts the run part-way into it, as MLPerf's
    /// --start_warmup_step (schedule.start_warmup_step)
    #[arg(long, allow_negative_numbers = true)]
    start_warmup_step: Option<i64>,
    /// What the decay measures its progress from: warmup-end (Hugging Face) or start
    /// (Google's BERT and NVIDIA's MLPerf scheduler: the rate drops at the end of warmup)
    /// (schedule.decay_from)
    #[arg(long)]
    decay_from: Option<ember_trainer::schedule::DecayFrom>,
    /// LAMB: adapt biases and LayerNorm parameters too (NVLAMB); without it they take the plain
    /// Adam step, as MLPerf's reference and apex FusedLAMB(use_nvlamb=False) (optimizer.nvlamb)
    #[arg(long, overrides_with = "no_nvlamb")]
    nvlamb: bool,
    /// LAMB: biases and LayerNorm parameters take the plain Adam step (optimizer.nvlamb = false)
    #[arg(long, overrides_with = "nvlamb")]
    no_nvlamb: bool,
    /// Optimizer: adamw, lamb, onebit-adam or onebit-lamb (optimizer.name). The 1-bit ones
    /// run AdamW/LAMB for --freeze-step steps, then average compressed momenta
    #[arg(long, value_parser = parse_optimizer)]
    optimizer: Option<OptimizerKind>,
    /// 1-bit Adam/LAMB: steps of exact AdamW/LAMB before compression
    /// (optimizer.onebit.freeze_step) [default: 20% of --steps]
    #[arg(long, allow_negative_numbers = true)]
    freeze_step: Option<u64>,
    /// Longest sequence in tokens, [CLS] and [SEP]s included (instances.max_seq_length)
    #[arg(long, allow_negative_numbers = true)]
    seq_len: Option<usize>,
    /// Most masked positions per sequence (instances.max_predictions_per_seq)
    #[arg(long, allow_negative_numbers = true)]
    max_predictions: Option<usize>,
    /// Model size: tiny, mini, small, base or large (model.preset)
    #[arg(long)]
    preset: Option<Preset>,
    /// Encoder implementation: fused (ember-backend-ext's ops: CubeCL kernels on cuda/wgpu,
    /// host loops on cpu), reference (Burn ops composed module by module) or auto (fused where
    /// the backend has them: cuda, wgpu and cpu) (model.kernels)
    #[arg(long)]
    kernels: Option<ember_model::Kernels>,
    /// Whose threads run the CPU's dense-layer GEMMs: rayon (each GEMM split over the pool
    /// that runs the fused ops, OpenBLAS at one thread per call) or blas (OpenBLAS's own
    /// threads) (model.gemm_threads)
    #[arg(long)]
    gemm_threads: Option<ember_trainer::blas::GemmThreads>,
    /// Corpus file or folder of .txt files: one sentence per line, blank line between
    /// documents (data.corpus) [default: the embedded Wikipedia corpus]
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// WordPiece vocab.txt (data.vocab) [default: bert-base-uncased's]
    #[arg(long)]
    vocab: Option<PathBuf>,
    /// Output folder for metrics.jsonl, model.safetensors, config.json (train.out)
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seed of model initialisation, dropout, batch order and instance creation
    /// (train.seed and instances.seed)
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// Evaluate every N steps (train.eval_every; replaces the config's
    /// train.eval_interval_samples)
    #[arg(
        long,
        allow_negative_numbers = true,
        conflicts_with = "eval_interval_samples"
    )]
    eval_every: Option<u64>,
    /// Stop once held-out masked-LM accuracy reaches this fraction (train.target_mlm_accuracy)
    #[arg(long, allow_negative_numbers = true)]
    target_mlm_accuracy: Option<f64>,
    /// Data-parallel ranks as threads of this process (in-process collectives). Under
    /// mpirun, srun or torchrun the ranks come from the launcher instead
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    nproc: usize,
    /// Gradient clipping: none, global, local-global or bucket (parallel.clip)
    #[arg(long, value_parser = parse_clip)]
    clip: Option<ClipMode>,
    /// K of --clip bucket: each bucket clipped to max-grad-norm/√K; Samsung's MLPerf v1.1
    /// code uses 22 (parallel.bucket_clip_count) [default: the number of buckets]
    #[arg(long, allow_negative_numbers = true)]
    bucket_clip_count: Option<usize>,
    /// How accumulated micro-batches weigh their losses: micro-batch (the mean of their mean
    /// losses, NVIDIA's and Samsung's rule) or batch (exactly the whole local batch's
    /// gradient) (train.loss_normalization)
    #[arg(long)]
    loss_normalization: Option<LossNormalization>,
    /// Cap of each gradient bucket after the first, MiB (parallel.bucket_cap_mb)
    #[arg(long, allow_negative_numbers = true)]
    bucket_cap_mb: Option<f64>,
    /// Cap of the first gradient bucket, MiB (parallel.first_bucket_mb)
    #[arg(long, allow_negative_numbers = true)]
    first_bucket_mb: Option<f64>,
    /// Micro-batches per optimizer step (parallel.grad_accum)
    #[arg(long, allow_negative_numbers = true)]
    grad_accum: Option<usize>,
    /// Seconds a collective waits for the other ranks before the run stops
    /// (parallel.timeout_s)
    #[arg(long, allow_negative_numbers = true)]
    collective_timeout: Option<f64>,
    /// Where gradient buckets live: auto (the GPU on cuda and wgpu, the host on cpu), host or
    /// device (parallel.buckets)
    #[arg(long)]
    buckets: Option<BucketStorage>,
    /// How the tied word embedding's gradient is reduced: auto (split with several ranks),
    /// split (the decoder's share with the heads, the batch's rows after backward) or whole
    /// (parallel.tied_embedding)
    #[arg(long)]
    tied_embedding: Option<TiedEmbedding>,
    /// The element type gradient buckets travel in: f32, or bf16 (half the bytes; host buckets
    /// sum in f32, device buckets through NCCL's bf16 allreduce, rounded at every hop of its
    /// ring) (parallel.allreduce_dtype)
    #[arg(long)]
    allreduce_dtype: Option<AllreduceDtype>,
    /// The dtype the model computes in, with f32 weights: f32, bf16 (CUDA) or fp16 (CUDA,
    /// wgpu) (train.precision) [default: bf16 on cuda, f32 on cpu and wgpu]
    #[arg(long)]
    precision: Option<Precision>,
    /// Loss scaling: auto (dynamic with fp16), none, or dynamic (PyTorch GradScaler's rule: a
    /// step whose gradients overflow is skipped on every rank and the scale halves)
    /// (loss_scale.mode)
    #[arg(long)]
    loss_scale: Option<LossScaleMode>,
    /// The first step's loss scale (loss_scale.init_scale) [default: 65536]
    #[arg(long, allow_negative_numbers = true)]
    init_loss_scale: Option<f64>,
    /// The loss scale never goes below this (loss_scale.min_scale) [default: 1]
    #[arg(long, allow_negative_numbers = true)]
    min_loss_scale: Option<f64>,
    /// Consecutive skipped steps after which the run stops with an error
    /// (loss_scale.max_skipped_steps) [default: 20]
    #[arg(long, allow_negative_numbers = true)]
    max_skipped_steps: Option<u64>,
    /// Where to train: cpu (Burn's NdArray), cuda (NVIDIA GPU `LOCAL_RANK`, needs the `cuda`
    /// feature; several GPUs: one process each, under torchrun, srun or mpirun) or wgpu (any
    /// Vulkan/Metal/DX12 GPU, or Mesa's lavapipe on the CPU; needs the `wgpu` feature; one
    /// process, --nproc ranks sharing the adapter)
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    device: String,
    /// Train on MLPerf HDF5 shards (a folder, or a stratified folder from `stratify`) instead
    /// of the corpus, each rank streaming the samples it is dealt; evaluation uses --eval-data
    /// if given, else the corpus's held-out documents (data.shards)
    #[arg(long)]
    data: Option<PathBuf>,
    /// Evaluation set: an HDF5 shard or folder of them; its first --eval-samples samples are
    /// evaluated (MLPerf: the first 10,000 of its eval shard) (data.eval_shards)
    #[arg(long)]
    eval_data: Option<PathBuf>,
    /// Samples evaluated each time (train.eval_samples)
    #[arg(long, allow_negative_numbers = true)]
    eval_samples: Option<usize>,
    /// Evaluate every N training samples instead of every --eval-every steps; `mlperf` for
    /// the BERT rule FLOOR(0.05 × (230.23 × global batch + 3,000,000), 25,000)
    /// (train.eval_interval_samples; replaces the config's train.eval_every)
    #[arg(long, allow_negative_numbers = true)]
    eval_interval_samples: Option<ember_trainer::config::EvalInterval>,
    /// Local batches the shard reader prepares ahead (data.prefetch)
    #[arg(long, allow_negative_numbers = true)]
    prefetch: Option<usize>,
    /// Sampler over the shards: random, stratified or presort (data.sampler)
    #[arg(long)]
    sampler: Option<SamplerKind>,
    /// Ranks per presort group (data.presort_group)
    #[arg(long, allow_negative_numbers = true)]
    presort_group: Option<usize>,
    /// Samples per length bin in each local batch, e.g. 6,3,2,5; must sum to
    /// batch-size × grad-accum, or batch-size (per micro-batch) (data.bin_quota) [default:
    /// proportional]
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    bin_quota: Option<Vec<usize>>,
    /// Padding of shard batches: max, dynamic, or grouped (sorted by length, cut into
    /// grad-accum micro-batches each padded to its longest) (data.padding)
    #[arg(long)]
    padding: Option<Padding>,
    /// Skip unreadable or invalid shards with a warning instead of stopping
    /// (data.skip_bad_shards)
    #[arg(long, overrides_with = "no_skip_bad_shards")]
    skip_bad_shards: bool,
    /// Stop at an unreadable or invalid shard (data.skip_bad_shards = false)
    #[arg(long, overrides_with = "skip_bad_shards")]
    no_skip_bad_shards: bool,
    /// Stop at a corpus line that is not UTF-8 instead of skipping it with a warning
    /// (data.strict)
    #[arg(long, overrides_with = "no_strict")]
    strict: bool,
    /// Skip corpus lines that are not UTF-8 with a warning (data.strict = false)
    #[arg(long, overrides_with = "strict")]
    no_strict: bool,
    /// Write a full-state checkpoint (weights, optimizer, data position) to
    /// OUT/checkpoints/step-NNNNNNN every N optimizer steps; one is always written at the end
    /// and on SIGTERM or SIGINT (checkpoint.every)
    #[arg(long, allow_negative_numbers = true)]
    checkpoint_every: Option<u64>,
    /// Keep only the newest K complete checkpoints; 0 keeps all (checkpoint.keep)
    #[arg(long, allow_negative_numbers = true)]
    keep_checkpoints: Option<usize>,
    /// Continue the run whose output folder is DIR from its newest complete checkpoint; the
    /// model, world size, global batch size, optimizer, data and seed must be as they were
    /// (checkpoint.resume)
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Start from these weights with a fresh optimizer and schedule: a Hugging Face folder,
    /// .safetensors or pytorch_model.bin (with or without the pre-training heads), or an ember
    /// run or checkpoint folder (checkpoint.init_from)
    #[arg(long, value_name = "PATH")]
    init_from: Option<PathBuf>,
    /// Write MLPerf's `:::MLLOG` lines (mlperf-logging's format, the BERT keys) to FILE from
    /// rank 0 (mllog.file)
    #[arg(long, value_name = "FILE")]
    mllog: Option<PathBuf>,
    /// submission_division of the MLPerf log: open or closed (mllog.division)
    #[arg(long)]
    mllog_division: Option<ember_trainer::mllog::Division>,
    /// submission_org of the MLPerf log (mllog.org)
    #[arg(long)]
    mllog_org: Option<String>,
    /// submission_platform of the MLPerf log (mllog.platform) [default: the host name]
    #[arg(long)]
    mllog_platform: Option<String>,
    /// Write a metrics line every N steps (train.log_every)
    #[arg(long, allow_negative_numbers = true)]
    log_every: Option<u64>,
    /// Do not draw the progress bar
    #[arg(long)]
    no_progress: bool,
}

/// An on/off setting from its `--X` and `--no-X` flags (the later one wins): `None` when
/// neither was given, so the config's value stands.
fn switch(on: bool, off: bool) -> Option<bool> {
    match (on, off) {
        (true, _) => Some(true),
        (_, true) => Some(false),
        _ => None,
    }
}

fn parse_clip(s: &str) -> Result<ClipMode, String> {
    s.parse()
}

fn parse_optimizer(s: &str) -> Result<OptimizerKind, String> {
    match s.to_ascii_lowercase().as_str() {
        "adamw" => Ok(OptimizerKind::AdamW),
        "lamb" => Ok(OptimizerKind::Lamb),
        "onebit-adam" => Ok(OptimizerKind::OnebitAdam),
        "onebit-lamb" => Ok(OptimizerKind::OnebitLamb),
        other => Err(format!(
            "unknown optimizer {other:?} (expected adamw, lamb, onebit-adam or onebit-lamb)"
        )),
    }
}

impl TrainArgs {
    /// The config file with the flags applied.
    fn resolve(&self) -> Result<TrainConfig> {
        let mut config = crate::shipped::load_config(self.config.as_deref())?;
        let t = &mut config.train;
        if let Some(v) = self.steps {
            t.steps = v;
        }
        if let Some(v) = self.batch_size {
            t.batch_size = v;
        }
        // A cadence given on the command line replaces the config's, in steps or samples.
        if let Some(v) = self.eval_every {
            t.eval_every = Some(v);
            t.eval_interval_samples = None;
        }
        if let Some(v) = self.log_every {
            t.log_every = v;
        }
        if let Some(v) = self.loss_normalization {
            t.loss_normalization = v;
        }
        if let Some(v) = self.target_mlm_accuracy {
            t.target_mlm_accuracy = Some(v);
        }
        if let Some(v) = &self.out {
            t.out = v.clone();
        }
        if let Some(v) = self.seed {
            t.seed = v;
            config.instances.seed = v;
        }
        if let Some(v) = self.lr {
            config.optimizer.lr = v;
        }
        if let Some(v) = self.optimizer {
            config.optimizer.name = v;
        }
        if let Some(v) = switch(self.nvlamb, self.no_nvlamb) {
            config.optimizer.nvlamb = v;
        }
        if let Some(v) = self.warmup_steps {
            config.schedule.warmup_steps = Some(v);
        }
        if let Some(v) = self.start_warmup_step {
            config.schedule.start_warmup_step = v;
        }
        if let Some(v) = self.decay_from {
            config.schedule.decay_from = v;
        }
        if let Some(v) = self.freeze_step {
            config.optimizer.onebit.freeze_step = Some(v);
        }
        if let Some(v) = self.seq_len {
            config.instances.max_seq_length = v;
        }
        if let Some(v) = self.max_predictions {
            config.instances.max_predictions_per_seq = v;
        }
        if let Some(v) = self.preset {
            config.model.preset = v;
        }
        if let Some(v) = self.kernels {
            config.model.kernels = v;
        }
        if let Some(v) = self.gemm_threads {
            config.model.gemm_threads = v;
        }
        if let Some(v) = &self.corpus {
            config.data.corpus = Some(v.clone());
        }
        if let Some(v) = &self.vocab {
            config.data.vocab = Some(v.clone());
        }
        if let Some(v) = self.eval_samples {
            config.train.eval_samples = v;
        }
        if let Some(v) = self.eval_interval_samples {
            config.train.eval_interval_samples = Some(v);
            config.train.eval_every = None;
        }
        let d = &mut config.data;
        if let Some(v) = &self.data {
            d.shards = Some(v.clone());
        }
        if let Some(v) = &self.eval_data {
            d.eval_shards = Some(v.clone());
        }
        if let Some(v) = self.prefetch {
            d.prefetch = v;
        }
        if let Some(v) = self.sampler {
            d.sampler = v;
        }
        if let Some(v) = self.presort_group {
            d.presort_group = v;
        }
        if let Some(v) = &self.bin_quota {
            d.bin_quota = Some(v.clone());
        }
        if let Some(v) = self.padding {
            d.padding = v;
        }
        if let Some(v) = switch(self.skip_bad_shards, self.no_skip_bad_shards) {
            d.skip_bad_shards = v;
        }
        if let Some(v) = switch(self.strict, self.no_strict) {
            d.strict = v;
        }
        let p = &mut config.parallel;
        if let Some(v) = self.clip {
            p.clip = v;
        }
        if let Some(v) = self.bucket_clip_count {
            p.bucket_clip_count = Some(v);
        }
        if let Some(v) = self.bucket_cap_mb {
            p.bucket_cap_mb = v;
        }
        if let Some(v) = self.first_bucket_mb {
            p.first_bucket_mb = v;
        }
        if let Some(v) = self.grad_accum {
            p.grad_accum = v;
        }
        if let Some(v) = self.collective_timeout {
            p.timeout_s = v;
        }
        if let Some(v) = self.buckets {
            p.buckets = v;
        }
        if let Some(v) = self.tied_embedding {
            p.tied_embedding = v;
        }
        if let Some(v) = self.allreduce_dtype {
            p.allreduce_dtype = v;
        }
        if let Some(v) = self.precision {
            config.train.precision = Some(v);
        }
        let l = &mut config.loss_scale;
        if let Some(v) = self.loss_scale {
            l.mode = v;
        }
        if let Some(v) = self.init_loss_scale {
            l.init_scale = v;
        }
        if let Some(v) = self.max_skipped_steps {
            l.max_skipped_steps = v;
        }
        if let Some(v) = self.min_loss_scale {
            l.min_scale = v;
        }
        let m = &mut config.mllog;
        if let Some(v) = &self.mllog {
            m.file = Some(v.clone());
        }
        if let Some(v) = self.mllog_division {
            m.division = v;
        }
        if let Some(v) = &self.mllog_org {
            m.org = v.clone();
        }
        if let Some(v) = &self.mllog_platform {
            m.platform = v.clone();
        }
        let c = &mut config.checkpoint;
        if let Some(v) = self.checkpoint_every {
            c.every = v;
        }
        if let Some(v) = self.keep_checkpoints {
            c.keep = v;
        }
        if let Some(v) = &self.resume {
            c.resume = Some(v.clone());
        }
        if let Some(v) = &self.init_from {
            c.init_from = Some(v.clone());
        }
        Ok(config)
    }
}

pub fn run(args: TrainArgs) -> Result<()> {
    let config = args.resolve()?;
    let device = Default::default();
    // SIGTERM/SIGINT: finish the step, write a checkpoint, exit 0 (a second one ends at once).
    ember_trainer::checkpoint::signals::install().context("installing the signal handlers")?;
    let options = RunOptions {
        progress: !args.no_progress,
        stop_on_signal: true,
        on_eval: Some(crate::curves::on_eval),
        ..RunOptions::default()
    };
    let launch = LaunchEnv::from_env(None)?;
    if let Some(note) = &launch.note {
        tracing::warn!("{note}");
    }
    let summary = if args.device == "cuda" {
        train_cuda(&config, options, &launch, args.nproc)?
    } else if args.device == "wgpu" {
        train_wgpu(&config, options, &launch, args.nproc)?
    } else if launch.world_size > 1 {
        if args.nproc > 1 {
            bail!(
                "--nproc {} asks for in-process ranks, but this process is already rank {} of {} \
                 from the {}",
                args.nproc,
                launch.rank,
                launch.world_size,
                launch.source
            );
        }
        crate::launch::train_launched(&config, &device, options, &launch)
            .context("training failed")?
    } else if args.nproc > 1 {
        ember_trainer::train_in_process::<Autodiff<NdArray>>(&config, args.nproc, &device, options)
            .context("training failed")?
    } else {
        ember_trainer::train::<Autodiff<NdArray>>(&config, &device, options)
            .context("training failed")?
    };
    if !summary.is_main_rank {
        return Ok(());
    }
    if let Some(signal) = &summary.stopped_by {
        println!(
            "ember: stopped by {signal} after step {}; checkpoint {}; continue with --resume {}",
            summary.steps,
            summary.last_checkpoint.display(),
            config.train.out.display()
        );
        return Ok(());
    }
    println!(
        "ember: {} steps of {} samples on {} rank(s) in {:.0} s ({:.0} tokens/s); held-out masked-LM accuracy {:.4} \
         (unigram baseline {:.4}, always {:?}), next-sentence accuracy {:.4}; loss {:.3} -> {:.3}; \
         model {}, full-state checkpoint {}",
        summary.steps,
        summary.global_batch_size,
        summary.world_size,
        summary.train_seconds,
        summary.tokens_per_second,
        summary.eval.mlm_accuracy,
        summary.unigram_baseline,
        summary.unigram_token,
        summary.eval.nsp_accuracy,
        summary.losses.first().copied().unwrap_or(f64::NAN),
        summary.losses.last().copied().unwrap_or(f64::NAN),
        summary.checkpoint.display(),
        summary.last_checkpoint.display(),
    );
    println!(
        "ember: data wait {:.1} s ({:.1}% of training); peak memory {}{}",
        summary.data_wait_s,
        100.0 * summary.data_wait_s / summary.train_seconds.max(1e-9),
        summary
            .peak_rss_bytes
            .map_or("unknown".to_string(), |b| format!(
                "{:.0} MiB",
                b as f64 / 1048576.0
            )),
        summary
            .target_reached_at_samples
            .map_or(String::new(), |n| format!(
                "; target reached at {n} training samples"
            )),
    );
    if summary.precision.is_half() || summary.loss_scale.is_some() {
        println!(
            "ember: computed in {}{}",
            summary.precision,
            summary.loss_scale.map_or(String::new(), |scale| format!(
                "; loss scale {scale} at the end, {} step(s) skipped for an overflow",
                summary.skipped_steps
            ))
        );
    }
    if summary.corpus_lines_skipped > 0 {
        println!(
            "ember: skipped {} corpus line(s) that were not UTF-8 (see the warnings; --strict \
             stops at the first)",
            summary.corpus_lines_skipped
        );
    }
    Ok(())
}

/// Training on NVIDIA GPUs: one process per GPU.
#[cfg(feature = "cuda")]
fn train_cuda(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
    nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    if nproc > 1 {
        bail!(
            "--nproc runs ranks as threads; on NVIDIA GPUs start one process per GPU (torchrun \
             --nproc-per-node N, srun, or mpirun)"
        );
    }
    if launch.world_size > 1 {
        return crate::launch::train_launched_cuda(config, options, launch)
            .context("training failed");
    }
    let device = burn::backend::cuda::CudaDevice::new(crate::cuda::start(launch, false)?);
    let options = RunOptions {
        host_sync_counter: Some(host_syncs),
        ..options
    };
    ember_trainer::train::<Autodiff<ember_backend_ext::CountingCuda>>(config, &device, options)
        .context("training failed")
}

/// Training on one wgpu adapter (the default one: a GPU, else Mesa's lavapipe).
#[cfg(feature = "wgpu")]
fn train_wgpu(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
    nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    if launch.world_size > 1 {
        bail!("--device wgpu trains in one process on one adapter (--nproc ranks as threads)");
    }
    // Burn's wgpu backend with its host synchronisations counted (reported in the metrics).
    type Wgpu = ember_backend_ext::CountingWgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let options = RunOptions {
        host_sync_counter: Some(host_syncs),
        ..options
    };
    if nproc > 1 {
        ember_trainer::train_in_process::<Autodiff<Wgpu>>(config, nproc, &device, options)
            .context("training failed")
    } else {
        ember_trainer::train::<Autodiff<Wgpu>>(config, &device, options).context("training failed")
    }
}

#[cfg(not(feature = "wgpu"))]
fn train_wgpu(
    _config: &TrainConfig,
    _options: RunOptions,
    _launch: &LaunchEnv,
    _nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    bail!(
        "--device wgpu needs a build with the `wgpu` feature: cargo run --release -p xtask --features wgpu -- train --device wgpu"
    )
}

#[cfg(not(feature = "cuda"))]
fn train_cuda(
    _config: &TrainConfig,
    _options: RunOptions,
    _launch: &LaunchEnv,
    _nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    bail!(
        "--device cuda needs a build with the `cuda` feature: cargo run --release -p xtask --features cuda -- train --device cuda"
    )
}

/// The calling thread's host synchronisations (GPU backends run on `CountingRuntime`, so that
/// the metrics report them per step: `host_syncs_backward`, `host_syncs_step`).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn host_syncs() -> u64 {
    ember_backend_ext::HostSyncs::now().total()
}
