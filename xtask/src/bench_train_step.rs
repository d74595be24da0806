//! `cargo xtask bench train-step`: ember's training step against PyTorch's in the same run.
//!
//! For each model × batch size × sequence length: ember initialises the model (dropout 0),
//! exports its weights under Hugging Face's names and a random batch (no padding,
//! `--max-predictions` masked positions per sequence) to a temporary folder, and starts
//! `bench/reference/train_step.py` on them: Hugging Face `BertForPreTraining` with
//! `torch.optim.AdamW`, the MLM head at the masked positions only, the same parameter groups
//! and hyper-parameters. Both sides then:
//! 1. compute the first step's loss on the same weights: they must agree within 1e-3, so that
//!    a fast wrong step cannot win;
//! 2. take one warm-up step (excluded), then `--rounds` rounds of `--steps` steps, alternating
//!    ember and PyTorch so that the machine's drift hits both, with a 0.5 s pause before each
//!    round so that the other side's spinning thread pools have gone to sleep;
//! 3. time an fp32 `[n, n] × [n, n]` GEMM (best of 5), ember's backend and PyTorch's.
//!
//! Reported per row: each side's samples/s (median step), the ratio ember / PyTorch, and each
//! side's MFU = model FLOPs per step ([`BertConfig::train_step_flops`]) per second over the
//! GEMM peak of this run (the faster of the two GEMMs). The table goes to stdout and, as
//! markdown and JSON, to `--out` (`bench/results/`, git-ignored).
//!
//! ember's step is the model-level step the trainer runs on one rank: forward with the fused or
//! composed encoder as `model.kernels = auto` picks, the masked-LM and next-sentence losses,
//! backward, and the AdamW step through [`PreTrainingOptimizer`] (the multi-tensor path where
//! the backend has it); the data-parallel hooks and the gradient clipping of the trainer are not
//! in either side's step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use clap::Args;
use ember_backend_ext::FusedOps;
use ember_data::Batch;
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_trainer::blas::GemmThreads;
use ember_trainer::config::OptimizerConfig;
use ember_trainer::eval::forward_loss;
use ember_trainer::optim::PreTrainingOptimizer;
use serde_json::{Value, json};

use crate::bench_reference::{HostInputs, Reference, reference_python};

/// Flags of `bench train-step`.
#[derive(Args, Debug)]
pub struct TrainStepArgs {
    /// The step to compare with: pytorch (Hugging Face + torch.optim.AdamW), or none
    #[arg(long, default_value = "pytorch", value_parser = ["pytorch", "none"])]
    reference: String,
    /// Models to time
    #[arg(long, value_delimiter = ',', default_value = "tiny,mini,base")]
    presets: Vec<Preset>,
    /// Sequences per step (each value is a row per model)
    #[arg(long, value_delimiter = ',', default_value = "8")]
    batch_size: Vec<usize>,
    /// Tokens per sequence, no padding (each value is a row per model)
    #[arg(long, value_delimiter = ',', default_value = "128")]
    seq_len: Vec<usize>,
    /// Backend: cpu (NdArray); cuda needs the `cuda` feature; wgpu (the default adapter: a
    /// GPU, else Mesa's lavapipe) needs the `wgpu` feature and times PyTorch on the CPU
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    device: String,
    /// Masked positions per sequence
    #[arg(long, default_value_t = 20)]
    max_predictions: usize,
    /// Timed steps per round and side
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Rounds, alternating ember and the reference
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Whose threads run ember's CPU GEMMs (model.gemm_threads): rayon, blas, or both
    /// (`rayon,blas`: a row each, their steps alternating with the reference's in every round)
    #[arg(long, value_delimiter = ',', default_value = "rayon")]
    gemm_threads: Vec<GemmThreads>,
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
    /// Size n of the fp32 [n, n] × [n, n] GEMM that measures the peak
    #[arg(long, default_value_t = 2048)]
    gemm_size: usize,
    /// Folder of the markdown and JSON results
    #[arg(long)]
    out: Option<PathBuf>,
    /// Learning rate of both AdamW steps
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
}

/// One timed configuration.
struct Row {
    preset: Preset,
    /// The CPU's GEMM threads of ember's step (`None` on GPUs).
    gemm_threads: Option<GemmThreads>,
    batch_size: usize,
    seq_len: usize,
    parameters: usize,
    flops: f64,
    ember_s: f64,
    /// Medians of ember's forward, backward and optimizer seconds.
    ember_phases: [f64; 3],
    ember_loss: f64,
    references: Vec<(String, f64, f64)>, // (name, median step seconds, first loss)
}

pub fn run(args: TrainStepArgs) -> Result<()> {
    if args.presets.is_empty() || args.batch_size.is_empty() || args.seq_len.is_empty() {
        bail!("--presets, --batch-size and --seq-len each need at least one value");
    }
    if args.steps == 0 || args.rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    if args.gemm_threads.is_empty() {
        bail!("--gemm-threads needs at least one value (rayon, blas)");
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
        "pytorch" => Some(reference_python(args.python.as_deref())?),
        _ => None,
    };
    match args.device.as_str() {
        "cpu" => bench::<burn::backend::Autodiff<burn::backend::NdArray>>(
            &args,
            &Default::default(),
            python.as_deref(),
            threads,
        ),
        "cuda" => bench_cuda(&args, python.as_deref(), threads),
        "wgpu" => bench_wgpu(&args, python.as_deref(), threads),
        other => bail!("unknown device {other}"),
    }
}

/// The device PyTorch runs on for ember's `device`: the same one, except for wgpu, which
/// PyTorch has no backend for (its CPU step is the reference there).
fn reference_device(device: &str) -> &str {
    match device {
        "wgpu" => "cpu",
        other => other,
    }
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(args: &TrainStepArgs, python: Option<&Path>, threads: usize) -> Result<()> {
    bench::<burn::backend::Autodiff<burn::backend::Wgpu>>(
        args,
        &Default::default(),
        python,
        threads,
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
    bench::<burn::backend::Autodiff<burn::backend::Cuda>>(
        args,
        &burn::backend::cuda::CudaDevice::new(gpu),
        python,
        threads,
    )
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &TrainStepArgs, _: Option<&Path>, _: usize) -> Result<()> {
    bail!(
        "--device cuda needs the cuda feature: cargo run --release -p xtask --features cuda -- bench train-step ..."
    )
}

/// ember's side of one configuration: the model, its optimizer and the batch.
struct EmberStep<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps> {
    model: Option<BertForPreTraining<B>>,
    optimizer: PreTrainingOptimizer<BertForPreTraining<B>, B>,
    inputs: Batch<B>,
    lr: f64,
}

impl<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps> EmberStep<B> {
    fn loss(&self) -> f64 {
        let model = self
            .model
            .as_ref()
            .expect("the model is held between steps");
        let (_, loss) = forward_loss(&model.valid(), self.inputs_valid());
        loss.total.into_scalar().elem()
    }

    fn inputs_valid(&self) -> Batch<B::InnerBackend> {
        let i = &self.inputs;
        Batch {
            input_ids: i.input_ids.clone().inner(),
            segment_ids: i.segment_ids.clone().inner(),
            input_mask: i.input_mask.clone().inner(),
            masked_lm_flat_positions: i.masked_lm_flat_positions.clone().inner(),
            masked_lm_labels: i.masked_lm_labels.clone().inner(),
            next_sentence_labels: i.next_sentence_labels.clone().inner(),
        }
    }

    /// One training step: its phases' seconds [forward and losses, backward, optimizer], each
    /// ended by a read to the host (the loss; a parameter's first value), which also waits for
    /// the device.
    fn step(&mut self) -> [f64; 3] {
        let model = self.model.take().expect("the model is held between steps");
        let start = Instant::now();
        let (_, loss) = forward_loss(&model, self.inputs.clone());
        let _: f64 = loss.total.clone().into_scalar().elem();
        let forward = start.elapsed().as_secs_f64();
        let grads = GradientsParams::from_grads(loss.total.backward(), &model);
        wait_for(&model);
        let backward = start.elapsed().as_secs_f64() - forward;
        let model = self.optimizer.step(self.lr, model, grads);
        wait_for(&model);
        self.model = Some(model);
        [
            forward,
            backward,
            start.elapsed().as_secs_f64() - forward - backward,
        ]
    }

    fn timed_steps(&mut self, n: usize) -> Vec<[f64; 3]> {
        (0..n).map(|_| self.step()).collect()
    }
}

use burn::tensor::ElementConversion;

/// Waits for the device's queued work by reading one value of `model` to the host.
fn wait_for<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(model: &BertForPreTraining<B>) {
    let bias = model.cls.predictions.bias.val().slice([0..1]);
    let _: f64 = bias.into_scalar().elem();
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

/// Best of 5 fp32 `[n, n] × [n, n]` products on `device`, in GFLOP/s, through
/// [`ember_backend_ext::dense`], the path of the model's dense layers (on NdArray split over
/// rayon's threads as `model.gemm_threads` says; Burn's matmul elsewhere).
fn ember_gemm_gflops<B: FusedOps>(n: usize, device: &B::Device) -> f64 {
    use burn::tensor::Distribution;
    let a = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let b = Tensor::<B, 2>::random([n, n], Distribution::Default, device);
    let product = || ember_backend_ext::dense(a.clone(), b.clone(), None).into_data();
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
) -> Result<()> {
    let optimizer_config = OptimizerConfig {
        lr: args.lr,
        ..OptimizerConfig::default()
    };
    let mut references: Vec<(&str, bool)> = Vec::new();
    if python.is_some() {
        references.push(("pytorch", false));
        if args.compile {
            references.push(("torch.compile", true));
        }
    }
    // The CPU's GEMM settings to time, each a row (GPUs: one row, the setting does not apply).
    let modes: Vec<Option<GemmThreads>> = if args.device == "cpu" {
        args.gemm_threads.iter().copied().map(Some).collect()
    } else {
        vec![None]
    };
    let set_mode = |mode: Option<GemmThreads>| {
        if let Some(mode) = mode {
            ember_trainer::blas::set_gemm_threads(1, mode);
        }
    };
    let mut rows = Vec::new();
    let mut versions = Value::Null;
    let mut reference_gemm: Option<f64> = None;
    for &preset in &args.presets {
        let config = BertConfig {
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            ..BertConfig::preset(preset)
        };
        for &batch_size in &args.batch_size {
            for &seq_len in &args.seq_len {
                if args.max_predictions == 0 || args.max_predictions >= seq_len {
                    bail!(
                        "--max-predictions {} must be in 1..{seq_len} (the sequence length)",
                        args.max_predictions
                    );
                }
                if seq_len > config.max_position_embeddings {
                    bail!(
                        "--seq-len {seq_len} exceeds the model's {} positions",
                        config.max_position_embeddings
                    );
                }
                let dir =
                    tempfile::tempdir().context("a temporary folder for the exported model")?;
                let model: BertForPreTraining<B> = config.init_for_pretraining(device);
                model.save_hf_safetensors(&dir.path().join("model.safetensors"))?;
                std::fs::write(dir.path().join("config.json"), config.to_hf_json())?;
                let inputs = HostInputs::random(&config, batch_size, seq_len, args.max_predictions);
                inputs.write_safetensors(&dir.path().join("batch.safetensors"))?;
                let parameters = burn::module::Module::num_params(&model);
                let fused = ember_model::Kernels::Auto.multi_tensor::<B>();
                let mut ember = EmberStep {
                    optimizer: PreTrainingOptimizer::new(&optimizer_config, &model, fused),
                    model: Some(model),
                    inputs: inputs.batch(device),
                    lr: args.lr,
                };
                let ember_loss = ember.loss();
                let mut procs = Vec::new();
                for &(name, compile) in &references {
                    let mut reference = Reference::start(
                        python.expect("references need python"),
                        dir.path(),
                        threads,
                        &optimizer_config,
                        compile,
                        reference_device(&args.device),
                    )?;
                    if reference.ready["parameters"].as_u64() != Some(parameters as u64) {
                        bail!(
                            "{name} has {} parameters, ember {parameters}: not the same model",
                            reference.ready["parameters"]
                        );
                    }
                    let loss = Reference::number(&reference.ask(json!({"cmd": "loss"}))?, "loss")?;
                    if (loss - ember_loss).abs() > 1e-3 {
                        bail!(
                            "{preset} batch {batch_size} seq {seq_len}: first-step loss ember {ember_loss:.6}, {name} {loss:.6}: differ by more than 1e-3, so the two steps are not the same computation"
                        );
                    }
                    versions = reference.ready.clone();
                    procs.push((name.to_string(), reference, loss, Vec::new()));
                }
                // Warm-up (excluded): one step each (ember one per GEMM setting).
                for mode in &modes {
                    set_mode(*mode);
                    ember.step();
                }
                for (_, reference, _, _) in procs.iter_mut() {
                    reference.steps(1)?;
                }
                let mut ember_times = vec![Vec::new(); modes.len()];
                // A pause before each side's round: both sides' thread pools spin for a while
                // after their last op (OpenBLAS ~0.1 s, OpenMP up to 0.2 s) and would otherwise
                // take cores from the other side's first steps.
                let settle = || std::thread::sleep(std::time::Duration::from_millis(500));
                for _ in 0..args.rounds {
                    for (mode, times) in modes.iter().zip(ember_times.iter_mut()) {
                        set_mode(*mode);
                        settle();
                        times.extend(ember.timed_steps(args.steps));
                    }
                    for (_, reference, _, times) in procs.iter_mut() {
                        settle();
                        times.extend(reference.steps(args.steps)?);
                    }
                }
                if reference_gemm.is_none() && !procs.is_empty() {
                    let reply = procs[0]
                        .1
                        .ask(json!({"cmd": "gemm", "n": args.gemm_size, "reps": 5}))?;
                    reference_gemm = Some(Reference::number(&reply, "gflops")?);
                }
                let references: Vec<(String, f64, f64)> = procs
                    .into_iter()
                    .map(|(name, _, loss, times)| (name, median(times), loss))
                    .collect();
                for (mode, times) in modes.iter().zip(ember_times) {
                    let row = Row {
                        preset,
                        gemm_threads: *mode,
                        batch_size,
                        seq_len,
                        parameters,
                        flops: config.train_step_flops(batch_size, seq_len, inputs.predictions()),
                        ember_s: median(times.iter().map(|p| p.iter().sum()).collect()),
                        ember_phases: [0, 1, 2]
                            .map(|i| median(times.iter().map(|p| p[i]).collect())),
                        ember_loss,
                        references: references.clone(),
                    };
                    eprintln!("{}", row_line(&row, None));
                    rows.push(row);
                }
            }
        }
    }
    // ember's GEMM under each setting: its rate, and what runs it.
    let ember_gemms: Vec<(f64, String)> = modes
        .iter()
        .map(|&mode| {
            set_mode(mode);
            let gflops = ember_gemm_gflops::<B::InnerBackend>(args.gemm_size, &Default::default());
            let name = match mode {
                Some(mode) => format!("{mode}: {}", ember_trainer::blas::describe()),
                None => format!("{}'s GEMMs", args.device),
            };
            (gflops, name)
        })
        .collect();
    let ember_gemm = ember_gemms.iter().map(|(g, _)| *g).fold(0.0, f64::max);
    let peak = reference_gemm.map_or(ember_gemm, |r| r.max(ember_gemm));
    let ember_gemm_name = ember_gemms
        .iter()
        .map(|(_, name)| name.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    let ember_gemm_rates = ember_gemms
        .iter()
        .map(|(g, _)| format!("{g:.0}"))
        .collect::<Vec<_>>()
        .join(" / ");
    let mut markdown = format!(
        "Training step, {} on {threads} thread(s): ember ({}, {}) against {}; fp32 GEMM {n}³: ember {ember_gemm_rates} GFLOP/s{}; MFU against the peak {peak:.0} GFLOP/s.\n\n",
        args.device,
        std::any::type_name::<B::InnerBackend>()
            .rsplit("::")
            .next()
            .unwrap_or("backend"),
        ember_gemm_name,
        if references.is_empty() {
            "no reference".to_string()
        } else {
            format!(
                "PyTorch {} + transformers {} ({} attention) on {}",
                versions["torch"].as_str().unwrap_or("?"),
                versions["transformers"].as_str().unwrap_or("?"),
                versions["attn_implementation"].as_str().unwrap_or("?"),
                reference_device(&args.device)
            )
        },
        reference_gemm.map_or(String::new(), |r| format!(", PyTorch {r:.0} GFLOP/s")),
        n = args.gemm_size,
    );
    markdown.push_str(&header(&references));
    for row in &rows {
        markdown.push_str(&row_line(row, Some(peak)));
        markdown.push('\n');
    }
    markdown.push_str("\nember's step by phase (medians, ms): forward and losses / backward / optimizer\n\n| model | batch × seq | GEMM threads | forward | backward | optimizer |\n|---|---|---|---|---|---|\n");
    for row in &rows {
        let [f, b, o] = row.ember_phases.map(|s| s * 1e3);
        markdown.push_str(&format!(
            "| {} | {} × {} | {} | {f:.1} | {b:.1} | {o:.1} |\n",
            row.preset,
            row.batch_size,
            row.seq_len,
            gemm_label(row)
        ));
    }
    println!("\n{markdown}");
    let base = crate::bench_reference::results_base(
        args.out.as_deref(),
        &format!("train-step-{}", args.device),
    )?;
    let json_rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            json!({
                "preset": row.preset.name(),
                "gemm_threads": row.gemm_threads.map(|m| m.to_string()),
                "batch_size": row.batch_size,
                "seq_len": row.seq_len,
                "parameters": row.parameters,
                "step_flops": row.flops,
                "ember": {"step_s": row.ember_s, "forward_s": row.ember_phases[0], "backward_s": row.ember_phases[1], "optimizer_s": row.ember_phases[2], "samples_per_s": row.batch_size as f64 / row.ember_s, "mfu": row.flops / row.ember_s / (peak * 1e9), "first_loss": row.ember_loss},
                "references": row.references.iter().map(|(name, s, loss)| json!({"name": name, "step_s": s, "samples_per_s": row.batch_size as f64 / s, "mfu": row.flops / s / (peak * 1e9), "first_loss": loss, "ratio": s / row.ember_s})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let summary = json!({
        "device": args.device,
        "threads": threads,
        "ember_gemm": ember_gemm_name,
        "gemm_size": args.gemm_size,
        "gemm_gflops": {"ember": ember_gemm, "ember_by_setting": ember_gemms.iter().map(|(g, name)| json!({"gemm": name, "gflops": g})).collect::<Vec<_>>(), "pytorch": reference_gemm},
        "reference": versions,
        "rows": json_rows,
    });
    write_atomically(&base.with_extension("md"), markdown.as_bytes())?;
    write_atomically(
        &base.with_extension("json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    println!("ember: wrote {}.{{md,json}}", base.display());
    Ok(())
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = ember_model::checkpoint::temp_path(path);
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| path.display().to_string())
}

fn header(references: &[(&str, bool)]) -> String {
    let mut head =
        "| model | params | batch × seq | GEMM threads | step GFLOP | ember samples/s | ember MFU |"
            .to_string();
    let mut rule = "|---|---|---|---|---|---|---|".to_string();
    for (name, _) in references {
        head.push_str(&format!(
            " {name} samples/s | {name} MFU | ember / {name} |"
        ));
        rule.push_str("---|---|---|");
    }
    format!("{head}\n{rule}\n")
}

/// The row's GEMM setting for the tables (`–` on GPUs).
fn gemm_label(row: &Row) -> String {
    row.gemm_threads.map_or("–".to_string(), |m| m.to_string())
}

fn row_line(row: &Row, peak: Option<f64>) -> String {
    let mfu = |s: f64| {
        peak.map_or("–".to_string(), |p| {
            format!("{:.0}%", 100.0 * row.flops / s / (p * 1e9))
        })
    };
    let mut line = format!(
        "| {} | {:.1} M | {} × {} | {} | {:.1} | {:.2} | {} |",
        row.preset,
        row.parameters as f64 / 1e6,
        row.batch_size,
        row.seq_len,
        gemm_label(row),
        row.flops / 1e9,
        row.batch_size as f64 / row.ember_s,
        mfu(row.ember_s)
    );
    for (_, s, _) in &row.references {
        line.push_str(&format!(
            " {:.2} | {} | {:.2}× |",
            row.batch_size as f64 / s,
            mfu(*s),
            s / row.ember_s
        ));
    }
    line
}
