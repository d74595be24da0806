//! `cargo xtask bench train-step`: ember's training step against PyTorch's in the same run.
//!
//! For each model × precision × batch size × sequence length: ember initialises the model
//! (dropout 0),
//! exports its weights under Hugging Face's names and a random batch (no padding,
//! `--max-predictions` masked positions per sequence) to a temporary folder, and starts
//! `bench/reference/train_step.py` on them: Hugging Face `BertForPreTraining` with
//! `torch.optim.AdamW`, the MLM head at the masked positions only, the same parameter groups
//! and hyper-parameters. Both sides then:
//! 1. compute the first step's loss on the same weights: they must agree within 1e-3 in f32
//!    (4u·|loss| more in a half precision, u its unit roundoff), so that a fast wrong step
//!    cannot win;
//! 2. take one warm-up step (excluded), then `--rounds` rounds of `--steps` steps, alternating
//!    ember and PyTorch so that the machine's drift hits both, with a 0.5 s pause before each
//!    round so that the other side's spinning thread pools have gone to sleep;
//! 3. time an `[n, n] × [n, n]` GEMM in each precision of the run (best of 5), ember's backend
//!    and PyTorch's.
//!
//! `--precision` (f32, bf16, fp16; a row each) is mixed precision on both sides: ember's
//! autocast (Note [Autocast] in `ember_model`'s `precision.rs`) and `torch.autocast`, f32
//! weights and AdamW on both (one difference: torch.autocast returns LayerNorm's output in
//! f32, ember in the half type); neither scales the loss (steps from a random initialisation,
//! whose gradients fp16 holds). PyTorch's AdamW on CUDA is its fused kernel (`fused=True`).
//!
//! Reported per row: each side's samples/s (median step), the ratio ember / PyTorch, each
//! side's MFU = model FLOPs per step ([`BertConfig::train_step_flops`]) per second over the
//! GEMM peak of this run in the row's precision (the faster of the two GEMMs), ember's kernel
//! launches per step (median; counted at the runtime, `ember_backend_ext::CountingRuntime`, on
//! cuda and wgpu) and each side's device memory reserved by its allocator (ember: the most
//! CubeCL's pools held at the end of a step's forward, backward or optimizer phase, the pools'
//! free pages released before each row; PyTorch: `torch.cuda.max_memory_reserved`, a process
//! per row; both include the warm-up step). The table goes to stdout and, as markdown and JSON, to
//! `--out` (`bench/results/`, git-ignored).
//!
//! ember's step is the model-level step the trainer runs on one rank: forward with the fused or
//! composed encoder as `model.kernels = auto` picks, the masked-LM and next-sentence losses,
//! backward, and the AdamW step through [`PreTrainingOptimizer`] (the multi-tensor path where
//! the backend has it); the data-parallel hooks and the gradient clipping of the trainer are not
//! in either side's step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use clap::Args;
use ember_backend_ext::FusedOps;
use ember_model::{BertConfig, BertForPreTraining, Precision, Preset};
use ember_trainer::blas::GemmThreads;
use ember_trainer::config::OptimizerConfig;
use serde_json::{Value, json};

use crate::bench_reference::{Lengths, Reference, reference_python};
use crate::bench_train_step_ember::EmberStep;
use crate::bench_train_step_report::{ReferenceResult, Row, row_line};

/// Flags of `bench train-step`.
#[derive(Args, Debug)]
pub struct TrainStepArgs {
    /// The step to compare with: pytorch (Hugging Face + torch.optim.AdamW), or none
    #[arg(long, default_value = "pytorch", value_parser = ["pytorch", "none"])]
    pub(crate) reference: String,
    /// Models to time
    #[arg(long, value_delimiter = ',', default_value = "tiny,mini,base")]
    pub(crate) presets: Vec<Preset>,
    /// Sequences per step (each value is a row per model)
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub(crate) batch_size: Vec<usize>,
    /// Tokens per sequence, no padding (each value is a row per model)
    #[arg(long, value_delimiter = ',', default_value = "128")]
    pub(crate) seq_len: Vec<usize>,
    /// Backend: cpu (NdArray); cuda needs the `cuda` feature; wgpu (the default adapter: a
    /// GPU, else Mesa's lavapipe) needs the `wgpu` feature and times PyTorch on the CPU
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    pub(crate) device: String,
    /// Compute precisions (each value is a row per model): f32, or bf16 / fp16 mixed precision
    /// on both sides (ember's autocast, torch.autocast; f32 weights and optimizer, no loss
    /// scaling). The half types need cuda (bf16, fp16) or wgpu with shader f16 (fp16)
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub(crate) precision: Vec<Precision>,
    /// Masked positions per sequence
    #[arg(long, default_value_t = 20)]
    pub(crate) max_predictions: usize,
    /// The samples' real lengths: full (every sample --seq-len tokens, no padding) or
    /// stratified (MLPerf's stratified batches as Samsung's MLPerf BERT draws them: of every
    /// 16 samples 6 / 3 / 2 / 5 from the four quarters of --seq-len, in that order, so a
    /// batch under 16 holds the short ones first; padded to --seq-len; both sides get the
    /// same padded batch and attention mask)
    #[arg(long, value_enum, default_value = "full")]
    pub(crate) lengths: Lengths,
    /// Whether ember's encoder runs on the real tokens alone (`model.unpad`, Note [Padding
    /// removed]): false, true, or both (`false,true`: a row each, their steps alternating in
    /// every round)
    #[arg(long, value_delimiter = ',', default_value = "false")]
    pub(crate) unpad: Vec<bool>,
    /// Timed steps per round and side
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Rounds, alternating ember and the reference
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Whose threads run ember's CPU GEMMs (model.gemm_threads): rayon, blas, or both
    /// (`rayon,blas`: a row each, their steps alternating with the reference's in every round)
    #[arg(long, value_delimiter = ',', default_value = "rayon")]
    pub(crate) gemm_threads: Vec<GemmThreads>,
    /// Compute threads of both sides [default: the available cores]. ember's are rayon's
    /// (`RAYON_NUM_THREADS`), read once per process: this flag sets it before the first use.
    #[arg(long)]
    threads: Option<usize>,
    /// The reference's Python [default: ~/.cache/ember/reference-venv/bin/python, made by
    /// `cargo xtask bench --setup-reference`]
    #[arg(long)]
    python: Option<PathBuf>,
    /// Also time the reference under torch.compile (a second reference column)
    #[arg(long)]
    compile: bool,
    /// ember's GEMMs on cuda and wgpu (`model.gemm`): auto, autotune, cmma, or cublaslt
    /// (NVIDIA's cuBLASLt, cuda only)
    #[arg(long, default_value = "auto")]
    pub(crate) gemm: ember_backend_ext::Gemm,
    /// How `--gemm cublaslt` orders its products with CubeCL's kernels
    /// (`model.cublaslt_sync`): host (two host waits per window) or device (flags in GPU
    /// memory, no host wait)
    #[arg(long, default_value = "host")]
    pub(crate) cublaslt_sync: ember_backend_ext::CublasltSync,
    /// Size n of the [n, n] × [n, n] GEMM that measures the peak (in each precision of the run)
    #[arg(long, default_value_t = 2048)]
    pub(crate) gemm_size: usize,
    /// Folder of the markdown and JSON results
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Learning rate of both AdamW steps
    #[arg(long, default_value_t = 1e-4)]
    pub(crate) lr: f64,
    /// Instead of timing: search for the largest batch whose step fits in memory, ember's and
    /// PyTorch's, per model × sequence length × precision, from the first `--batch-size`
    /// (Note [Largest batch] in xtask/src/bench_largest_batch.rs; cuda, or cpu with
    /// `--memory-limit-mib`)
    #[arg(long)]
    pub(crate) largest_batch: bool,
    /// The granularity of `--largest-batch`'s bisection: the answer is within this many
    /// sequences of the first batch that does not fit
    #[arg(long, default_value_t = 8)]
    pub(crate) largest_batch_step: usize,
    /// `--largest-batch`: the longest a try of ember's may take, seconds (a try past it is
    /// killed, and stops the search unless its stderr says it ran out of memory)
    #[arg(long, default_value_t = 600)]
    pub(crate) largest_batch_timeout_s: u64,
    /// `--largest-batch` on the CPU: the cap on each try's address space, MiB
    #[arg(long)]
    pub(crate) memory_limit_mib: Option<u64>,
    /// The vocabulary of both sides rounded up to a multiple of this
    /// (`model.make_vocab_size_divisible_by`: 8 pads BERT's 30,522 tokens to 30,528, as
    /// NVIDIA's MLPerf BERT); the batches' ids stay below 30,522
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub(crate) make_vocab_size_divisible_by: usize,
    /// A try of `--largest-batch`: two steps at the first configuration, then "fits" on
    /// stdout (an allocation failure ends the process)
    #[arg(long, hide = true)]
    pub(crate) probe: bool,
}

pub fn run(args: TrainStepArgs) -> Result<()> {
    if args.presets.is_empty() || args.batch_size.is_empty() || args.seq_len.is_empty() {
        bail!("--presets, --batch-size and --seq-len each need at least one value");
    }
    if args.steps == 0 || args.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    if args.unpad.is_empty() {
        bail!("--unpad needs at least one value (false, true)");
    }
    if args.gemm_threads.is_empty() {
        bail!("--gemm-threads needs at least one value (rayon, blas)");
    }
    if args.precision.is_empty() {
        bail!("--precision needs at least one value (f32, bf16, fp16)");
    }
    args.gemm
        .for_device(&args.device)
        .map_err(anyhow::Error::msg)?;
    if args.cublaslt_sync != ember_backend_ext::CublasltSync::Host
        && args.gemm != ember_backend_ext::Gemm::Cublaslt
    {
        bail!(
            "--cublaslt-sync {} has no effect beside --gemm {}: it orders cuBLASLt's products",
            args.cublaslt_sync.name(),
            args.gemm.name()
        );
    }
    let threads = match args.threads {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // SAFETY: set before any thread of this process reads the environment (rayon's pool is
    // built lazily at the first parallel op, which comes later).
    unsafe { std::env::set_var("RAYON_NUM_THREADS", threads.to_string()) };
    if std::env::var_os("OPENBLAS_NUM_THREADS").is_none() {
        // SAFETY: as above; OpenBLAS reads it at its first GEMM's thread-pool start-up.
        unsafe { std::env::set_var("OPENBLAS_NUM_THREADS", threads.to_string()) };
    }
    ember_trainer::blas::share_cores(1, args.gemm_threads[0]);
    let python = match args.reference.as_str() {
        // A try of --largest-batch runs ember alone; on the CPU so does the search.
        "pytorch" if !args.probe && !(args.largest_batch && args.device == "cpu") => {
            Some(reference_python(args.python.as_deref())?)
        }
        _ => None,
    };
    if args.largest_batch && !args.probe {
        return crate::bench_largest_batch::run(&args, python.as_deref(), threads);
    }
    match args.device.as_str() {
        "cpu" => bench::<burn::backend::Autodiff<burn::backend::NdArray>>(
            &args,
            &Default::default(),
            python.as_deref(),
            threads,
            None,
        ),
        "cuda" => bench_cuda(&args, python.as_deref(), threads),
        "wgpu" => bench_wgpu(&args, python.as_deref(), threads),
        other => bail!("unknown device {other}"),
    }
}

/// The device PyTorch runs on for ember's `device`: the same one, except for wgpu, which
/// PyTorch has no backend for (its CPU step is the reference there).
pub(crate) fn reference_device(device: &str) -> &str {
    match device {
        "wgpu" => "cpu",
        other => other,
    }
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(args: &TrainStepArgs, python: Option<&Path>, threads: usize) -> Result<()> {
    bench::<burn::backend::Autodiff<ember_backend_ext::CountingWgpu>>(
        args,
        &Default::default(),
        python,
        threads,
        Some(|| ember_backend_ext::HostSyncs::now().launches),
    )
}

#[cfg(not(feature = "wgpu"))]
fn bench_wgpu(_: &TrainStepArgs, _: Option<&Path>, _: usize) -> Result<()> {
    bail!(
        "--device wgpu needs the wgpu feature: cargo run --release -p xtask --features wgpu -- bench train-step ..."
    )
}

#[cfg(feature = "cuda")]
fn bench_cuda(args: &TrainStepArgs, python: Option<&Path>, threads: usize) -> Result<()> {
    let gpu = crate::cuda::start(&ember_trainer::parallel::LaunchEnv::single(), false)?;
    bench::<burn::backend::Autodiff<ember_backend_ext::CountingCuda>>(
        args,
        &burn::backend::cuda::CudaDevice::new(gpu),
        python,
        threads,
        Some(|| ember_backend_ext::HostSyncs::now().launches),
    )
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &TrainStepArgs, _: Option<&Path>, _: usize) -> Result<()> {
    bail!(
        "--device cuda needs the cuda feature: cargo run --release -p xtask --features cuda -- bench train-step ..."
    )
}

/// One of a configuration's ember rows: its CPU GEMM threads (`None` on GPUs) and whether
/// its encoder removes the padding.
#[derive(Debug, Clone, Copy)]
struct Variant {
    gemm_threads: Option<GemmThreads>,
    unpad: bool,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Best of 5 `[n, n] × [n, n]` products in `precision` on `device`, in GFLOP/s, through
/// [`ember_backend_ext::dense`], the path of the model's dense layers (on NdArray split over
/// rayon's threads as `model.gemm_threads` says; `model.gemm`'s kernel on GPUs).
fn ember_gemm_gflops<B: FusedOps>(n: usize, precision: Precision, device: &B::Device) -> f64 {
    use burn::tensor::Distribution;
    let operand = || {
        ember_model::cast_to(
            Tensor::<B, 2>::random([n, n], Distribution::Default, device),
            precision.dtype().into(),
        )
    };
    let (a, b) = (operand(), operand());
    // One element read back: it waits for the product without timing the copy of the
    // whole result to the host (8 MB at n = 2048 in bf16, longer than the product on a GPU).
    let product = || {
        ember_backend_ext::dense(a.clone(), b.clone(), None)
            .slice([0..1, 0..1])
            .into_data()
    };
    let _ = product();
    let best = (0..5)
        .map(|_| {
            let start = Instant::now();
            let _ = product();
            start.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    2.0 * (n as f64).powi(3) / best / 1e9
}

fn bench<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    args: &TrainStepArgs,
    device: &B::Device,
    python: Option<&Path>,
    threads: usize,
    launches: Option<fn() -> u64>,
) -> Result<()> {
    for &precision in &args.precision {
        if !precision.supported::<B>(device) {
            bail!(
                "--precision {precision}: --device {} does not compute in {precision} (NdArray has no half type, WGSL no bf16); f32 runs everywhere, bf16 and fp16 on cuda",
                args.device
            );
        }
    }
    if args.device != "cpu" {
        // After CUDA's start, which links cuBLASLt where it is found under another name.
        ember_backend_ext::set_gpu_gemm(args.gemm).map_err(anyhow::Error::msg)?;
        ember_backend_ext::set_cublaslt_sync(args.cublaslt_sync);
    }
    if args.probe {
        return crate::bench_largest_batch::probe::<B>(args, device);
    }
    let mut references: Vec<(&str, bool)> = Vec::new();
    if python.is_some() {
        references.push(("pytorch", false));
        if args.compile {
            references.push(("torch.compile", true));
        }
    }
    // The CPU's GEMM settings to time, each a row (GPUs: one row, the setting does not apply),
    // each with and without padding as `--unpad` asks.
    let gemm_modes: Vec<Option<GemmThreads>> = if args.device == "cpu" {
        args.gemm_threads.iter().copied().map(Some).collect()
    } else {
        vec![None]
    };
    let modes: Vec<Variant> = gemm_modes
        .iter()
        .flat_map(|&gemm_threads| {
            args.unpad.iter().map(move |&unpad| Variant {
                gemm_threads,
                unpad,
            })
        })
        .collect();
    let set_mode = |mode: Option<GemmThreads>| {
        if let Some(mode) = mode {
            ember_trainer::blas::set_gemm_threads(1, mode);
        }
    };
    let mut rows = Vec::new();
    let mut versions = Value::Null;
    // PyTorch's GEMM rate per precision, measured once.
    let mut reference_gemm: Vec<(Precision, f64)> = Vec::new();
    for &preset in &args.presets {
        let config =
            crate::bench_train_step_ember::bench_config(preset, args.make_vocab_size_divisible_by);
        for &precision in &args.precision {
            for &batch_size in &args.batch_size {
                for &seq_len in &args.seq_len {
                    let row = bench_row::<B>(
                        args,
                        &config,
                        (preset, precision, batch_size, seq_len),
                        device,
                        python,
                        threads,
                        launches,
                        &references,
                        (&modes, &set_mode),
                    )?;
                    let (new_rows, ready, gemm) = row;
                    if let Some(ready) = ready {
                        versions = ready;
                    }
                    if let Some(gflops) = gemm
                        && !reference_gemm.iter().any(|(p, _)| *p == precision)
                    {
                        reference_gemm.push((precision, gflops));
                    }
                    rows.extend(new_rows);
                }
            }
        }
    }
    // ember's GEMM under each setting and precision: its rate, and what runs it.
    let mut ember_gemms: Vec<(Precision, f64, String)> = Vec::new();
    for &precision in &args.precision {
        for &mode in &gemm_modes {
            set_mode(mode);
            let gflops = ember_gemm_gflops::<B::InnerBackend>(args.gemm_size, precision, device);
            let name = match mode {
                Some(mode) => format!("{mode}: {}", ember_trainer::blas::describe()),
                None => match ember_backend_ext::gpu_gemm() {
                    ember_backend_ext::Gemm::Cublaslt => format!(
                        "cublaslt GEMMs ({} sync)",
                        ember_backend_ext::cublaslt_sync().name()
                    ),
                    other => format!("{} GEMMs", other.name()),
                },
            };
            ember_gemms.push((precision, gflops, name));
        }
    }
    crate::bench_train_step_report::write(
        args,
        threads,
        match args.device.as_str() {
            "cpu" => "NdArray",
            "cuda" => "CubeCL's CUDA runtime",
            _ => "CubeCL's wgpu runtime",
        },
        &rows,
        &references,
        &versions,
        &ember_gemms,
        &reference_gemm,
    )
}

/// The rows of one configuration (one per CPU GEMM setting), the reference's `ready` message
/// and, when a reference runs, its GEMM rate in the row's precision.
#[allow(clippy::too_many_arguments)]
fn bench_row<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    args: &TrainStepArgs,
    config: &BertConfig,
    (preset, precision, batch_size, seq_len): (Preset, Precision, usize, usize),
    device: &B::Device,
    python: Option<&Path>,
    threads: usize,
    launches: Option<fn() -> u64>,
    references: &[(&str, bool)],
    (modes, set_mode): (&[Variant], &dyn Fn(Option<GemmThreads>)),
) -> Result<(Vec<Row>, Option<Value>, Option<f64>)> {
    let optimizer_config = OptimizerConfig {
        lr: args.lr,
        ..OptimizerConfig::default()
    };
    crate::bench_train_step_ember::check_shape(config, seq_len, args.max_predictions)?;
    let dir = tempfile::tempdir().context("a temporary folder for the exported model")?;
    // The previous row's model and optimizer are gone: the pools give their pages back, so
    // that this row's reserved memory is its own (PyTorch starts a process per row).
    <B as burn::tensor::backend::Backend>::memory_cleanup(device);
    let mut model: BertForPreTraining<B> = config.init_for_pretraining(device);
    model.save_hf_safetensors(&dir.path().join("model.safetensors"))?;
    std::fs::write(dir.path().join("config.json"), config.to_hf_json())?;
    model.set_precision(precision);
    let inputs = crate::bench_train_step_ember::bench_inputs(args, preset, batch_size, seq_len);
    inputs.write_safetensors(&dir.path().join("batch.safetensors"))?;
    let parameters = burn::module::Module::num_params(&model);
    let mut ember = EmberStep::new(model, &inputs, args.lr, device, launches);
    // Each padding mode's first loss (the same weights and batch).
    let mut losses: Vec<(bool, f64)> = Vec::new();
    for &unpad in &args.unpad {
        ember.set_unpad(unpad);
        losses.push((unpad, ember.loss()));
    }
    let ember_loss = losses[0].1;
    // Both losses come from the same weights and batch: f32 within 1e-3; a half precision
    // rounds every activation to its u, so 4u of the loss more.
    let tolerance = 1e-3
        + if precision.is_half() {
            4.0 * precision.unit_roundoff() * ember_loss.abs()
        } else {
            0.0
        };
    let mut procs = Vec::new();
    let mut ready = None;
    for &(name, compile) in references {
        let mut reference = Reference::start(
            python.expect("references need python"),
            dir.path(),
            threads,
            &optimizer_config,
            compile,
            reference_device(&args.device),
            precision,
        )?;
        if reference.ready["parameters"].as_u64() != Some(parameters as u64) {
            bail!(
                "{name} has {} parameters, ember {parameters}: not the same model",
                reference.ready["parameters"]
            );
        }
        let loss = Reference::number(&reference.ask(json!({"cmd": "loss"}))?, "loss")?;
        for &(unpad, ember_loss) in &losses {
            if (loss - ember_loss).abs() > tolerance {
                bail!(
                    "{preset} {precision} batch {batch_size} seq {seq_len} (unpad {unpad}): first-step loss ember {ember_loss:.6}, {name} {loss:.6}: differ by more than {tolerance:.1e}, so the two steps are not the same computation"
                );
            }
        }
        ready = Some(reference.ready.clone());
        procs.push((name.to_string(), reference, loss, Vec::new(), None));
    }
    // With or without a reference, ember's padding modes must agree with each other.
    let (first_unpad, _) = losses[0];
    for &(unpad, loss) in &losses[1..] {
        if (loss - ember_loss).abs() > tolerance {
            bail!(
                "{preset} {precision} batch {batch_size} seq {seq_len}: first-step loss with unpad {unpad} {loss:.6}, with unpad {first_unpad} {ember_loss:.6}: differ by more than {tolerance:.1e}"
            );
        }
    }
    // Warm-up (excluded): one step each (ember one per GEMM setting and padding mode).
    for mode in modes {
        set_mode(mode.gemm_threads);
        ember.set_unpad(mode.unpad);
        ember.step();
    }
    for (_, reference, _, _, _) in procs.iter_mut() {
        reference.steps(1)?;
    }
    let mut ember_times = vec![Vec::new(); modes.len()];
    // A pause before each side's round: both sides' thread pools spin for a while after their
    // last op (OpenBLAS ~0.1 s, OpenMP up to 0.2 s) and would otherwise take cores from the
    // other side's first steps.
    let settle = || std::thread::sleep(std::time::Duration::from_millis(500));
    for _ in 0..args.rounds {
        for (mode, times) in modes.iter().zip(ember_times.iter_mut()) {
            set_mode(mode.gemm_threads);
            ember.set_unpad(mode.unpad);
            settle();
            times.extend(ember.timed_steps(args.steps));
        }
        for (_, reference, _, times, reserved) in procs.iter_mut() {
            settle();
            let steps = reference.steps(args.steps)?;
            times.extend(steps.seconds);
            *reserved = steps.reserved_bytes;
        }
    }
    let gemm = match procs.first_mut() {
        Some((_, reference, _, _, _)) => {
            let reply = reference.ask(json!({"cmd": "gemm", "n": args.gemm_size, "reps": 5, "dtype": precision.to_string()}))?;
            Some(Reference::number(&reply, "gflops")?)
        }
        None => None,
    };
    let references: Vec<ReferenceResult> = procs
        .into_iter()
        .map(|(name, _, first_loss, times, reserved)| ReferenceResult {
            name,
            step_s: median(times),
            first_loss,
            reserved,
        })
        .collect();
    let mut rows = Vec::new();
    for (mode, times) in modes.iter().zip(ember_times) {
        let launches: Vec<f64> = times
            .iter()
            .filter_map(|(_, n)| n.map(|n| n as f64))
            .collect();
        let row = Row {
            preset,
            precision,
            gemm_threads: mode.gemm_threads,
            unpad: mode.unpad,
            real_tokens: inputs.real_tokens(),
            batch_size,
            seq_len,
            parameters,
            flops: config.train_step_flops(batch_size, seq_len, inputs.predictions()),
            ember_s: median(times.iter().map(|(p, _)| p.iter().sum()).collect()),
            ember_phases: [0, 1, 2].map(|i| median(times.iter().map(|(p, _)| p[i]).collect())),
            ember_loss: losses
                .iter()
                .find(|(unpad, _)| *unpad == mode.unpad)
                .map_or(ember_loss, |(_, loss)| *loss),
            ember_launches: (!launches.is_empty()).then(|| median(launches) as u64),
            ember_reserved: ember.reserved,
            references: references.clone(),
        };
        eprintln!("{}", row_line(&row, None));
        rows.push(row);
    }
    Ok((rows, ready, gemm))
}
