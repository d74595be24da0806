//! `cargo xtask bench step`: training steps through the whole trainer (gradient hooks,
//! reducer, optimizer) on one rank, timed, with the host synchronisations of each step counted,
//! for device and host gradient buckets. On CUDA the rank reduces through NCCL with a world of
//! one (the same code path as a cluster rank: device buckets, NCCL in place on its own stream).
//!
//! Per model and bucket storage, two runs of `--steps` steps after one warm-up step:
//! - the step time is the wall time between two logged steps with `train.log_every = 1`: each
//!   log reads the step's loss, so the device has finished the step when the clock is read;
//! - the host synchronisations are counted by `ember-backend-ext`'s `CountingRuntime` (reads
//!   of device memory and waits for the device), during backward (from its start to the step's
//!   wait for its buckets) and over the whole step, the log's own read excluded;
//! - backward time comes from a second run that waits for the device before and after
//!   backward (`RunOptions::sync_backward`), so that it is the device's time.
//!
//! `--top-kernels N` adds two runs per model and bucket storage that record the launches by
//! kernel (`KernelLaunches`), `--steps` steps apart, and prints the N kernels launched most per
//! step from their difference (start-up, first step and evaluation cancel): where a step's
//! launches come from.
//!
//! `--check` first trains the tiny model for 3 steps with device and with host buckets and
//! compares the weights (1e-5): the device reducer against the host path on this device.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use clap::Args;
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_trainer::parallel::{BucketStorage, Communicator, GradHookBackend};
use ember_trainer::{PreparedData, RunOptions, TrainConfig, prepare_data, train_rank};

/// Flags of `bench step`.
#[derive(Args, Debug)]
pub struct StepArgs {
    /// Backend: cpu (NdArray), wgpu or cuda (need the features of the same name)
    #[arg(long, default_value = "cuda", value_parser = ["cpu", "wgpu", "cuda"])]
    device: String,
    /// Models to time
    #[arg(long, value_delimiter = ',', default_value = "base,large")]
    presets: Vec<Preset>,
    /// Samples per step, one per preset or one for all
    #[arg(long, value_delimiter = ',', default_value = "64,32")]
    batch_size: Vec<usize>,
    /// Maximum sequence length of the samples (`instances.max_seq_length`); each batch is
    /// padded to its longest sample
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Whether the encoder runs on the real tokens alone (`model.unpad`; Note [Padding
    /// removed]): false, true, or both (`false,true`: a row each, and the unpadded rows'
    /// samples/s over the padded ones')
    #[arg(long, value_delimiter = ',', default_value = "false")]
    unpad: Vec<bool>,
    /// Masked positions per sample
    #[arg(long, default_value_t = 20)]
    max_predictions: usize,
    /// Timed steps per run, after one warm-up step
    #[arg(long, default_value_t = 5)]
    steps: u64,
    /// Bucket storages to time
    #[arg(long, value_delimiter = ',', default_value = "device,host")]
    buckets: Vec<BucketStorage>,
    /// First compare device and host buckets on the tiny model (3 steps, weights within 1e-5)
    #[arg(long)]
    check: bool,
    /// After the table, the N kernels launched most per step, per model and bucket storage
    /// (GPU backends; from two more runs, `steps` steps apart)
    #[arg(long, default_value_t = 0, value_name = "N")]
    top_kernels: usize,
    /// GEMM kernels on cuda and wgpu (`model.gemm`): auto, autotune, cmma, or cublaslt
    /// (NVIDIA's cuBLASLt, cuda only)
    #[arg(long, default_value = "auto")]
    gemm: ember_backend_ext::Gemm,
    /// How `--gemm cublaslt` orders its products with CubeCL's kernels
    /// (`model.cublaslt_sync`): host (two host waits per window) or device (flags in GPU
    /// memory, no host wait)
    #[arg(long, default_value = "host")]
    cublaslt_sync: ember_backend_ext::CublasltSync,
    /// The query, key and value projections (`model.qkv_projections`): auto, packed (one
    /// dense layer) or separate (three; also with attention among --reference-ops), to compare
    #[arg(long, default_value = "auto")]
    qkv_projections: ember_model::QkvProjections,
    /// Fused ops run as their reference composition (`model.reference_ops`: bias_gelu,
    /// layer_norm, attention, cross_entropy, comma-separated; none), to compare
    #[arg(long, default_value = "none")]
    reference_ops: ember_model::ReferenceOps,
    /// The vocabulary rounded up to a multiple of this (`model.make_vocab_size_divisible_by`:
    /// 8 pads BERT's 30,522 tokens to 30,528 rows, NVIDIA's MLPerf BERT), to compare
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    make_vocab_size_divisible_by: usize,
    /// Compute precision (`train.precision`): f32, bf16 or fp16; unset, the device's default
    /// (bf16 on cuda, f32 elsewhere)
    #[arg(long)]
    precision: Option<ember_model::Precision>,
    /// Loss scaling (`loss_scale.mode`): auto (dynamic in fp16), none or dynamic. fp16 with
    /// none launches what bf16 does, on backends without bf16 (wgpu)
    #[arg(long, default_value = "auto")]
    loss_scale: ember_trainer::config::LossScaleMode,
    /// Gradient bucket cap, MiB (`parallel.bucket_cap_mb`, PyTorch DDP's `bucket_cap_mb`): a
    /// small model with a small cap has as many buckets per layer as a large one at 25
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// Gradient clipping (`parallel.clip`): none, global, local-global or bucket (Samsung's
    /// bucket-wise clipping)
    #[arg(long, default_value = "global")]
    clip: ember_trainer::parallel::ClipMode,
}

pub fn run(args: StepArgs) -> Result<()> {
    args.gemm
        .for_device(&args.device)
        .map_err(anyhow::Error::msg)?;
    match args.device.as_str() {
        "cpu" => bench::<Autodiff<burn::backend::NdArray>>(
            &args,
            &Default::default(),
            &|| Communicator::Device(Box::new(ember_trainer::parallel::SingleRank)),
            None,
            None,
        ),
        "wgpu" => bench_wgpu(&args),
        "cuda" => bench_cuda(&args),
        other => bail!("unknown device {other}"),
    }
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(args: &StepArgs) -> Result<()> {
    bench::<Autodiff<ember_backend_ext::CountingWgpu>>(
        args,
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
        &|| Communicator::Device(Box::new(ember_trainer::parallel::SingleRank)),
        Some(|| ember_backend_ext::HostSyncs::now().total()),
        Some(|| ember_backend_ext::HostSyncs::now().launches),
    )
}

#[cfg(not(feature = "wgpu"))]
fn bench_wgpu(_: &StepArgs) -> Result<()> {
    bail!("--device wgpu needs a build with the `wgpu` feature (cargo xtask --features wgpu ...)")
}

#[cfg(feature = "cuda")]
fn bench_cuda(args: &StepArgs) -> Result<()> {
    use ember_trainer::parallel::nccl::{Nccl, new_unique_id};
    let gpu = crate::cuda::start(&ember_trainer::parallel::LaunchEnv::single(), true)?;
    // NCCL with a world of one: the cluster's code path on one GPU.
    let nccl = || -> Result<Nccl> {
        let id = new_unique_id()?;
        Ok(Nccl::new(
            gpu,
            0,
            1,
            &id,
            std::time::Duration::from_secs(300),
        )?)
    };
    if let Err(e) = nccl() {
        bail!("NCCL with a world of one failed: {e:#}");
    }
    println!("collectives: NCCL, world of one");
    bench::<Autodiff<ember_backend_ext::CountingCuda>>(
        args,
        &burn::backend::cuda::CudaDevice::new(gpu),
        &|| Communicator::Device(Box::new(nccl().expect("NCCL formed above"))),
        Some(|| ember_backend_ext::HostSyncs::now().total()),
        Some(|| ember_backend_ext::HostSyncs::now().launches),
    )
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &StepArgs) -> Result<()> {
    bail!("--device cuda needs a build with the `cuda` feature (cargo xtask --features cuda ...)")
}

/// A run's configuration: `preset`, `batch_size` samples of `seq_len` tokens, `steps` steps,
/// each one logged, evaluation only at the end on a few samples.
fn config(
    preset: Preset,
    batch_size: usize,
    args: &StepArgs,
    steps: u64,
    out: &Path,
) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.preset = preset;
    config.instances.max_seq_length = args.seq_len;
    config.instances.max_predictions_per_seq = args.max_predictions;
    config.instances.dupe_factor = 1;
    config.train.batch_size = batch_size;
    config.train.steps = steps;
    config.train.log_every = 1;
    config.train.eval_every = Some(steps);
    config.train.eval_samples = batch_size.min(64);
    config.train.out = out.to_path_buf();
    // Timed steps are plain steps: the periodic re-check of the hooks' gradients reads the
    // device (Note [Re-checking late gradients]).
    config.parallel.check_gradients_every = 0;
    config.model.gemm = args.gemm;
    config.model.cublaslt_sync = args.cublaslt_sync;
    config.model.qkv_projections = args.qkv_projections;
    config.model.reference_ops = args.reference_ops;
    config.model.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by;
    config.train.precision = args.precision;
    config.loss_scale.mode = args.loss_scale;
    config.parallel.bucket_cap_mb = args.bucket_cap_mb;
    config.parallel.clip = args.clip;
    config
}

fn bench<B: GradHookBackend>(
    args: &StepArgs,
    device: &B::Device,
    comm: &dyn Fn() -> Communicator<B::InnerBackend>,
    counter: Option<fn() -> u64>,
    launches: Option<fn() -> u64>,
) -> Result<()> {
    let dir = tempfile::tempdir().context("a temporary folder for the runs")?;
    let train = |config: &TrainConfig, data: &Arc<PreparedData>, options: RunOptions| {
        train_rank::<B>(config, device, options, comm(), Some(data.clone()))
            .context("training failed")
    };
    let data = Arc::new(prepare_data(&config(
        Preset::Tiny,
        1,
        args,
        1,
        Path::new("unused"),
    ))?);
    let mut failed = false;
    if args.check {
        let mut tiny = config(Preset::Tiny, 8, args, 3, &dir.path().join("check-device"));
        tiny.model.hidden_dropout_prob = Some(0.0);
        tiny.model.attention_probs_dropout_prob = Some(0.0);
        tiny.parallel.buckets = BucketStorage::Device;
        let device_run = train(&tiny, &data, RunOptions::default())?;
        tiny.parallel.buckets = BucketStorage::Host;
        tiny.train.out = dir.path().join("check-host");
        let host_run = train(&tiny, &data, RunOptions::default())?;
        let worst = largest_difference(&device_run.checkpoint, &host_run.checkpoint)?;
        failed = worst > 1e-5;
        println!(
            "reducer check (tiny, 3 steps of {} samples): device vs host buckets, largest \
             weight difference {worst:.2e}: {}",
            tiny.train.batch_size,
            if failed {
                "FAIL (bound 1e-5)"
            } else {
                "pass (bound 1e-5)"
            }
        );
    }
    println!();
    println!(
        "GEMMs: {} (f32 operands multiplied as {}); fused ops run as their reference \
         composition (model.reference_ops): {}. First step: from the run's start to the end \
         of its first step (the process's first run compiles and autotunes; later runs reuse \
         its kernels).",
        match args.gemm.resolve().map_err(anyhow::Error::msg)? {
            ember_backend_ext::Gemm::Cublaslt =>
                format!("cublaslt ({} sync)", args.cublaslt_sync.name()),
            other => other.name().to_string(),
        },
        B::f32_gemm_precision(device).name(),
        args.reference_ops
    );
    println!(
        "| model | batch × seq | buckets | unpad | real tokens per step | step ms | backward ms | samples/s | × padded | host syncs in backward | host syncs per step | kernel launches per step | first step s |"
    );
    println!("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut by_kernel = Vec::new();
    for (i, &preset) in args.presets.iter().enumerate() {
        let batch_size = *args
            .batch_size
            .get(i)
            .or(args.batch_size.last())
            .context("--batch-size needs a value")?;
        // The padded rows' samples/s by bucket storage, for the unpadded rows' ratio.
        let mut padded_samples_s: Vec<(BucketStorage, f64)> = Vec::new();
        for (&buckets, &unpad) in args
            .buckets
            .iter()
            .flat_map(|b| args.unpad.iter().map(move |u| (b, u)))
        {
            let name = format!("{preset}-{buckets}-unpad-{unpad}");
            let mut run = config(
                preset,
                batch_size,
                args,
                args.steps + 1,
                &dir.path().join(&name),
            );
            run.parallel.buckets = buckets;
            run.model.unpad = unpad;
            let counted = train(
                &run,
                &data,
                RunOptions {
                    host_sync_counter: counter,
                    launch_counter: launches,
                    ..RunOptions::default()
                },
            )?;
            let records = train_records(&counted.metrics)?;
            let first_step_s = end_record(&counted.metrics)?["time_to_first_step_s"]
                .as_f64()
                .unwrap_or(f64::NAN);
            run.train.out = dir.path().join(format!("{name}-timed"));
            let timed = train(
                &run,
                &data,
                RunOptions {
                    sync_backward: true,
                    ..RunOptions::default()
                },
            )?;
            let timed_records = train_records(&timed.metrics)?;
            // Step 1 warms up (kernel compilation, autotuning): left out.
            let step_s = mean(records.windows(2).map(|w| {
                w[1]["elapsed_s"].as_f64().unwrap_or(0.0)
                    - w[0]["elapsed_s"].as_f64().unwrap_or(0.0)
            }));
            let backward_s = mean(
                timed_records
                    .iter()
                    .skip(1)
                    .map(|r| r["backward_s"].as_f64().unwrap_or(f64::NAN)),
            );
            // The most of the steps after the first (which autotunes and compiles).
            let most = |key: &str, counter: Option<fn() -> u64>| match counter {
                Some(_) => records
                    .iter()
                    .skip(1)
                    .map(|r| r[key].as_u64().unwrap_or(0))
                    .max()
                    .unwrap_or(0)
                    .to_string(),
                None => "–".to_string(),
            };
            let samples_s = batch_size as f64 / step_s;
            // The real (unpadded) tokens of the timed steps, each batch padded to its longest
            // sample.
            let tokens = mean(records.windows(2).map(|w| {
                w[1]["tokens"].as_f64().unwrap_or(f64::NAN)
                    - w[0]["tokens"].as_f64().unwrap_or(f64::NAN)
            }));
            if !unpad {
                padded_samples_s.push((buckets, samples_s));
            }
            println!(
                "| {preset} | {batch_size} × {} | {buckets} | {unpad} | {tokens:.0} | {:.1} | {:.1} | {samples_s:.1} | {} | {} | {} | {} | {first_step_s:.1} |",
                args.seq_len,
                step_s * 1e3,
                backward_s * 1e3,
                match padded_samples_s.iter().find(|(b, _)| *b == buckets) {
                    Some((_, padded)) if unpad => format!("{:.2}×", samples_s / padded),
                    _ => "–".to_string(),
                },
                most("host_syncs_backward", counter),
                most("host_syncs_step", counter),
                match launches {
                    // The mean: a step that does not wait for the device may count its last
                    // launches in the next step's figure.
                    Some(_) =>
                        format!(
                            "{:.0}",
                            mean(records.iter().skip(1).map(|r| {
                                r["kernel_launches_step"].as_f64().unwrap_or(f64::NAN)
                            }))
                        ),
                    None => "–".to_string(),
                },
            );
            if args.top_kernels > 0 && launches.is_some() {
                let counts = launches_by_kernel(
                    &|config| train(config, &data, RunOptions::default()).map(drop),
                    &run,
                    args.steps,
                    &dir.path().join(format!("{name}-kernels")),
                )?;
                by_kernel.push((name, args.steps, counts));
            }
        }
    }
    for (name, steps, counts) in by_kernel {
        let total: u64 = counts.iter().map(|(_, n)| n).sum();
        println!();
        println!(
            "{name}: {:.0} launches per step over {steps} steps ({} kernels), most launched:",
            total as f64 / steps as f64,
            counts.len()
        );
        println!("| kernel | launches per step |");
        println!("|---|---:|");
        for (kernel, n) in counts.iter().take(args.top_kernels) {
            println!(
                "| `{}` | {:.1} |",
                short_name(kernel),
                *n as f64 / steps as f64
            );
        }
    }
    if failed {
        bail!("the device reducer differs from the host path");
    }
    Ok(())
}

/// Launches per kernel over `steps` steps of `run`: a run of n + `steps` steps less a run of n,
/// so that the model's initialisation, the first step, the evaluation and the checkpoint
/// cancel (GPU backends: the counting runtime).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn launches_by_kernel(
    train: &dyn Fn(&TrainConfig) -> Result<()>,
    run: &TrainConfig,
    steps: u64,
    out: &Path,
) -> Result<Vec<(&'static str, u64)>> {
    use ember_backend_ext::KernelLaunches;
    let n = run.train.steps;
    let mut by_run = Vec::new();
    for total in [n, n + steps] {
        let mut counted = run.clone();
        counted.train.steps = total;
        counted.train.eval_every = Some(total);
        counted.train.out = out.join(total.to_string());
        KernelLaunches::record(true);
        let before = KernelLaunches::now();
        let trained = train(&counted);
        by_run.push(KernelLaunches::since(&KernelLaunches::now(), &before));
        KernelLaunches::record(false);
        trained?;
    }
    Ok(KernelLaunches::since(&by_run[1], &by_run[0]))
}

/// Without a GPU backend nothing counts launches (`bench` passes no launch counter).
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
fn launches_by_kernel(
    _: &dyn Fn(&TrainConfig) -> Result<()>,
    _: &TrainConfig,
    _: u64,
    _: &Path,
) -> Result<Vec<(&'static str, u64)>> {
    Ok(Vec::new())
}

/// A kernel's Rust type name without module paths, the runtime argument and the matmul's
/// long list of type parameters: `KernelBinop<AddOp>`, `MatmulEntry<..>`.
fn short_name(kernel: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    for c in kernel.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else if c == ':' {
            word.clear();
        } else {
            out.push_str(&std::mem::take(&mut word));
            out.push(c);
        }
    }
    out.push_str(&word);
    let out = out
        .replace(", CountingRuntime<CudaRuntime>", "")
        .replace(", CountingRuntime<WgpuRuntime>", "")
        .replace("<CountingRuntime<CudaRuntime>>", "")
        .replace("<CountingRuntime<WgpuRuntime>>", "");
    match out.find('<') {
        Some(open) if out.len() > 80 => format!("{}<..>", &out[..open]),
        _ => out,
    }
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let values: Vec<f64> = values.collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

/// The `train` records of a run's metrics.
fn train_records(metrics: &Path) -> Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("reading {}", metrics.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["event"] == "train")
        .collect())
}

/// The `end` record of a run's metrics.
fn end_record(metrics: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(metrics)
        .with_context(|| format!("reading {}", metrics.display()))?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|r| r["event"] == "end")
        .with_context(|| format!("{} has no end record", metrics.display()))
}

/// The largest absolute difference between the weights of two checkpoints of one model.
fn largest_difference(a: &Path, b: &Path) -> Result<f64> {
    let (x, y) = (weights(a)?, weights(b)?);
    let mut worst = 0f64;
    for (name, values) in &x {
        let other = y
            .get(name)
            .with_context(|| format!("{name} is missing from {}", b.display()))?;
        for (p, q) in values.iter().zip(other) {
            worst = worst.max(f64::from((p - q).abs()));
        }
    }
    Ok(worst)
}

/// Every parameter of a run's checkpoint (with the `config.json` beside it), by path.
fn weights(checkpoint: &Path) -> Result<HashMap<String, Vec<f32>>> {
    type Cpu = burn::backend::NdArray;
    let folder = checkpoint
        .parent()
        .context("a checkpoint lies in a folder")?;
    let config = BertConfig::load_json(&folder.join("config.json"))?;
    let model: BertForPreTraining<Cpu> = config
        .init_for_pretraining(&Default::default())
        .load_hf_safetensors(checkpoint)?;
    struct Read(Vec<Vec<f32>>);
    impl<B: Backend> ModuleVisitor<B> for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0
                .push(data.into_vec::<f32>().expect("f32 after convert"));
        }
    }
    let mut read = Read(Vec::new());
    model.visit(&mut read);
    let names = ember_trainer::grads::named_params::<Cpu, _>(&model);
    Ok(names.into_iter().map(|(n, _)| n).zip(read.0).collect())
}
