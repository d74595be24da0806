//! `cargo xtask bench gemm`: every matrix product of a BERT training step
//! (`BertConfig::train_step_gemms`: the dense layers' forward, `dx` and `dW`, attention's
//! `Q·Kᵀ`, `P·V` and their gradients), timed alone on the device through ember's GEMM path
//! (`FusedOps::batched_matmul`: on cuda and wgpu under each `model.gemm` choice, Note [GPU
//! GEMMs]), in f32 and bf16, against `torch.matmul` on the same device in the same run
//! (`bench/reference/gemm.py`, PyTorch's default exact-f32 GEMMs).
//!
//! Each product is timed as one warm-up (which autotunes a new shape) and the mean of
//! `--iters` products between two synchronisations, with operands laid out as ember's are
//! (a transposed operand is a transposed view). The summary adds each path's times weighted
//! by how often a step runs each product: the step's GEMM time on that path, and its TFLOP/s.
//! With cuBLASLt, a second table times the dense layers' bias gradient in the weight
//! gradient's epilogue against the unfused path (`bench_gemm_bias.rs`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use clap::Args;
use ember_backend_ext::{FusedOps, Gemm};
use ember_model::{BertConfig, Preset, StepGemm};
use serde_json::{Value, json};

/// Flags of `bench gemm`.
#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Backend: cpu (NdArray), wgpu or cuda (need the features of the same name)
    #[arg(long, default_value = "cuda", value_parser = ["cpu", "wgpu", "cuda"])]
    device: String,
    /// Model whose products are timed
    #[arg(long, default_value = "large")]
    preset: Preset,
    /// Sequence lengths, each with its --batch-size and --max-predictions
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    seq_len: Vec<usize>,
    /// Samples per step at each sequence length
    #[arg(long, value_delimiter = ',', default_value = "32,16")]
    batch_size: Vec<usize>,
    /// Masked positions per sample at each sequence length (MLPerf's 20 at 128, 76 at 512)
    #[arg(long, value_delimiter = ',', default_value = "20,76")]
    max_predictions: Vec<usize>,
    /// GEMM kernels to time on cuda and wgpu (`model.gemm`: autotune, cmma, cublaslt on cuda);
    /// default: every one this build has for the device
    #[arg(long, value_delimiter = ',')]
    gemm: Vec<Gemm>,
    /// Operand dtypes: f32, bf16 (bf16: cuda only); default f32,bf16 on cuda, else f32
    #[arg(long, value_delimiter = ',')]
    dtypes: Vec<String>,
    /// Timed products per GEMM, after one warm-up
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// torch.matmul on the same device in the same run (`pytorch`), or ember alone (`none`)
    #[arg(long, default_value = "pytorch", value_parser = ["pytorch", "none"])]
    reference: String,
    /// The reference's Python (default: the virtualenv of `bench --setup-reference`)
    #[arg(long)]
    python: Option<PathBuf>,
    /// The vocabulary rounded up to a multiple of this (`model.make_vocab_size_divisible_by`),
    /// for the MLM decoder's products: 8 pads BERT's 30,522 tokens to 30,528
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    make_vocab_size_divisible_by: usize,
    /// Only the products whose name contains this (e.g. `ffn`, `attn`)
    #[arg(long)]
    only: Option<String>,
    /// Where the table and the JSON go (default: bench/results)
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One timed path: a GEMM choice (or NdArray's) and a dtype, seconds per product.
struct Path {
    name: String,
    seconds: Vec<f64>,
}

pub fn run(mut args: GemmArgs) -> Result<()> {
    if args.dtypes.is_empty() {
        args.dtypes = match args.device.as_str() {
            "cuda" => vec!["f32".into(), "bf16".into()],
            _ => vec!["f32".into()],
        };
    }
    if args.seq_len.len() != args.batch_size.len()
        || args.seq_len.len() != args.max_predictions.len()
    {
        bail!(
            "--seq-len, --batch-size and --max-predictions need one value each per sequence \
             length (given {}, {} and {})",
            args.seq_len.len(),
            args.batch_size.len(),
            args.max_predictions.len()
        );
    }
    for dtype in &args.dtypes {
        match dtype.as_str() {
            "f32" => {}
            "bf16" if args.device == "cuda" => {}
            "bf16" => bail!("--dtypes bf16 needs --device cuda (wgpu and NdArray run f32 GEMMs)"),
            other => bail!("unknown dtype `{other}` (expected f32 or bf16)"),
        }
    }
    let gemms = if args.gemm.is_empty() {
        let mut all = vec![Gemm::Cmma];
        if ember_backend_ext::AUTOTUNE_BUILT {
            all.insert(0, Gemm::Autotune);
        }
        if ember_backend_ext::CUBLASLT_BUILT && args.device == "cuda" {
            all.push(Gemm::Cublaslt);
        }
        all
    } else {
        args.gemm.clone()
    };
    for gemm in &gemms {
        gemm.for_device(&args.device).map_err(anyhow::Error::msg)?;
    }
    let mut config = BertConfig::preset(args.preset);
    config.vocab_size =
        ember_model::padded_vocab_size(config.vocab_size, args.make_vocab_size_divisible_by);
    let base = crate::bench_reference::results_base(args.out.as_deref(), "gemm")?;
    let mut markdown = String::new();
    let mut records = Vec::new();
    for ((&seq, &batch), &predictions) in args
        .seq_len
        .iter()
        .zip(&args.batch_size)
        .zip(&args.max_predictions)
    {
        let list: Vec<StepGemm> = config
            .train_step_gemms(batch, seq, batch * predictions)
            .into_iter()
            .filter(|g| args.only.as_deref().is_none_or(|o| g.name.contains(o)))
            .collect();
        if list.is_empty() {
            bail!(
                "--only {:?} matches no product",
                args.only.unwrap_or_default()
            );
        }
        let mut paths = ember_paths(&args, &gemms, &list)?;
        let (reference, precision) = match args.reference.as_str() {
            "pytorch" => torch_paths(&args, &list)?,
            _ => (Vec::new(), String::new()),
        };
        paths.extend(reference);
        let title = format!(
            "BERT-{} at batch {batch} × seq {seq} ({predictions} predictions per sample, \
             vocabulary {}), {}: TFLOP/s of each product{}",
            args.preset, config.vocab_size, args.device, precision
        );
        let table = table(&title, &list, &paths);
        print!("{table}");
        markdown.push_str(&table);
        let mut record = json!({
            "preset": args.preset.to_string(), "batch_size": batch, "seq_len": seq,
            "vocab_size": config.vocab_size, "gemms": list,
            "paths": paths.iter().map(|p| json!({"name": p.name, "seconds": p.seconds})).collect::<Vec<Value>>(),
        });
        // (Not with `--only`: it keeps some products, and the table is of two dense layers.)
        if args.device == "cuda" && gemms.contains(&Gemm::Cublaslt) && args.only.is_none() {
            let layers = crate::bench_gemm_bias::biased_dense_layers(
                &config,
                batch * seq,
                batch * predictions,
            );
            let (bias_table, bias_record) =
                crate::bench_gemm_bias::cuda_table(&args.dtypes, &layers, args.iters)?;
            print!("{bias_table}");
            markdown.push_str(&bias_table);
            record["bias_gradient"] = bias_record;
        }
        records.push(record);
    }
    let md = base.with_extension("md");
    std::fs::write(&md, &markdown).with_context(|| md.display().to_string())?;
    let js = base.with_extension("json");
    std::fs::write(&js, serde_json::to_string_pretty(&records)?)
        .with_context(|| js.display().to_string())?;
    println!("written: {} and {}", md.display(), js.display());
    Ok(())
}

/// The table of one shape: a row per product, a TFLOP/s column per path, then the step's GEMM
/// time per path (each product's time × its count) and the rate that makes.
fn table(title: &str, list: &[StepGemm], paths: &[Path]) -> String {
    let mut out = format!("\n{title}\n\n| product | per step | batch × m × k × n |");
    for path in paths {
        out.push_str(&format!(" {} |", path.name));
    }
    out.push_str("\n|---|---:|---|");
    out.push_str(&"---:|".repeat(paths.len()));
    out.push('\n');
    for (i, g) in list.iter().enumerate() {
        let t = |on: bool| if on { "ᵀ" } else { "" };
        out.push_str(&format!(
            "| {} | {} | {} × {} × {}{} × {}{} |",
            g.name,
            g.count,
            g.batch,
            g.m,
            g.k,
            t(g.trans_a),
            g.n,
            t(g.trans_b)
        ));
        for path in paths {
            out.push_str(&format!(" {:.3} |", g.flops() / path.seconds[i] / 1e12));
        }
        out.push('\n');
    }
    let flops: f64 = list.iter().map(|g| g.count as f64 * g.flops()).sum();
    out.push_str(&format!("| **step** (ms) | | {:.3e} FLOP |", flops));
    for path in paths {
        let seconds: f64 = list
            .iter()
            .zip(&path.seconds)
            .map(|(g, s)| g.count as f64 * s)
            .sum();
        out.push_str(&format!(
            " {:.1} ms, {:.3} TFLOP/s |",
            seconds * 1e3,
            flops / seconds / 1e12
        ));
    }
    out.push('\n');
    out
}

/// ember's paths on `args.device`: each GEMM choice × dtype (NdArray: its one path).
fn ember_paths(args: &GemmArgs, gemms: &[Gemm], list: &[StepGemm]) -> Result<Vec<Path>> {
    match args.device.as_str() {
        "cpu" => Ok(vec![Path {
            name: "ember ndarray f32".into(),
            seconds: time_all::<burn::backend::NdArray>(&Default::default(), list, args.iters)?,
        }]),
        "wgpu" => wgpu_paths(args, gemms, list),
        _ => cuda_paths(args, gemms, list),
    }
}

#[cfg(feature = "wgpu")]
fn wgpu_paths(args: &GemmArgs, gemms: &[Gemm], list: &[StepGemm]) -> Result<Vec<Path>> {
    type Wgpu = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let precision = <Wgpu as FusedOps>::f32_gemm_precision(&device).name();
    let mut paths = Vec::new();
    for &gemm in gemms {
        ember_backend_ext::set_gpu_gemm(gemm).map_err(anyhow::Error::msg)?;
        paths.push(Path {
            name: format!("ember {} f32 ({precision})", gemm.name()),
            seconds: time_all::<Wgpu>(&device, list, args.iters)?,
        });
    }
    Ok(paths)
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_paths(_: &GemmArgs, _: &[Gemm], _: &[StepGemm]) -> Result<Vec<Path>> {
    bail!("--device wgpu needs a build with the `wgpu` feature (cargo xtask --features wgpu ...)")
}

/// Burn's CUDA backend in f32 and bf16: the GEMM benchmarks' backends.
#[cfg(feature = "cuda")]
pub(crate) type CudaF32 = burn::backend::Cuda<f32, i32>;
#[cfg(feature = "cuda")]
pub(crate) type CudaBf16 = burn::backend::Cuda<burn::tensor::bf16, i32>;

#[cfg(feature = "cuda")]
fn cuda_paths(args: &GemmArgs, gemms: &[Gemm], list: &[StepGemm]) -> Result<Vec<Path>> {
    use ember_backend_ext::CublasltSync;
    let device = crate::cuda::single_device()?;
    let precision = <CudaF32 as FusedOps>::f32_gemm_precision(&device).name();
    let mut paths = Vec::new();
    // cuBLASLt twice: with host waits around each product, and with device-side windows.
    let runs = gemms.iter().flat_map(|&gemm| {
        let syncs: &[CublasltSync] = if gemm == Gemm::Cublaslt {
            &[CublasltSync::Host, CublasltSync::Device]
        } else {
            &[CublasltSync::Host]
        };
        syncs.iter().map(move |&sync| (gemm, sync))
    });
    for (gemm, sync) in runs {
        ember_backend_ext::set_gpu_gemm(gemm).map_err(anyhow::Error::msg)?;
        ember_backend_ext::set_cublaslt_sync(sync);
        let gemm_name = if gemm == Gemm::Cublaslt {
            format!("cublaslt ({} sync)", sync.name())
        } else {
            gemm.name().to_string()
        };
        for dtype in &args.dtypes {
            let refused = ember_backend_ext::cublaslt::refusals();
            let seconds = match dtype.as_str() {
                "bf16" => time_all::<CudaBf16>(&device, list, args.iters)?,
                _ => time_all::<CudaF32>(&device, list, args.iters)?,
            };
            let mut what = if dtype == "f32" {
                format!("f32 ({precision})")
            } else {
                dtype.clone()
            };
            // Products cuBLASLt refused ran CubeCL's matmul: the row says how many.
            let refused = ember_backend_ext::cublaslt::refusals() - refused;
            if refused > 0 {
                what.push_str(&format!(", {refused} products refused by cuBLASLt"));
            }
            paths.push(Path {
                name: format!("ember {gemm_name} {what}"),
                seconds,
            });
        }
    }
    ember_backend_ext::set_cublaslt_sync(CublasltSync::Host);
    Ok(paths)
}

#[cfg(not(feature = "cuda"))]
fn cuda_paths(_: &GemmArgs, _: &[Gemm], _: &[StepGemm]) -> Result<Vec<Path>> {
    bail!("--device cuda needs a build with the `cuda` feature (cargo xtask --features cuda ...)")
}

/// Seconds per product of each GEMM of `list` on backend `B` (its float dtype).
fn time_all<B: FusedOps>(device: &B::Device, list: &[StepGemm], iters: usize) -> Result<Vec<f64>> {
    list.iter()
        .map(|g| {
            let a = operand::<B>([g.batch, g.m, g.k], g.trans_a, device);
            let b = operand::<B>([g.batch, g.k, g.n], g.trans_b, device);
            crate::bench_kernels::time::<B>(device, iters.max(1), || {
                drop(B::batched_matmul(a.clone(), b.clone()));
            })
        })
        .collect()
}

/// A `[1, batch, rows, cols]` operand: row-major, or the transposed view of a row-major
/// `[.., cols, rows]` (rank 4, the attention products' rank, which every backend's
/// `batched_matmul` takes).
fn operand<B: Backend>(
    [batch, rows, cols]: [usize; 3],
    transposed: bool,
    device: &B::Device,
) -> burn::tensor::ops::FloatTensor<B> {
    let normal = Distribution::Normal(0.0, 1.0);
    let t = if transposed {
        Tensor::<B, 4>::random([1, batch, cols, rows], normal, device).swap_dims(2, 3)
    } else {
        Tensor::<B, 4>::random([1, batch, rows, cols], normal, device)
    };
    match t.into_primitive() {
        TensorPrimitive::Float(t) => t,
        TensorPrimitive::QFloat(_) => unreachable!("a random tensor is not quantized"),
    }
}

/// `torch.matmul` on the same device: a path per dtype, and what its f32 is.
fn torch_paths(args: &GemmArgs, list: &[StepGemm]) -> Result<(Vec<Path>, String)> {
    let device = match args.device.as_str() {
        "cuda" => "cuda",
        "cpu" => "cpu",
        _ => bail!("--device wgpu has no PyTorch counterpart: pass --reference none"),
    };
    let python = crate::bench_reference::reference_python(args.python.as_deref())?;
    let dir = tempfile::tempdir().context("a temporary folder for the reference")?;
    let gemms = dir.path().join("gemms.json");
    std::fs::write(&gemms, serde_json::to_string(list)?)?;
    let reply = crate::bench_reference::run_script(
        &python,
        dir.path(),
        "gemm.py",
        &[
            "--gemms".into(),
            gemms.into_os_string(),
            "--device".into(),
            device.into(),
            "--dtypes".into(),
            args.dtypes.join(",").into(),
            "--iters".into(),
            args.iters.max(1).to_string().into(),
        ],
    )?;
    let mut paths = Vec::new();
    for dtype in &args.dtypes {
        let rates = reply["tflops"][dtype.as_str()]
            .as_array()
            .with_context(|| format!("the reference's reply lacks {dtype}: {reply}"))?;
        let seconds = list
            .iter()
            .zip(rates)
            .map(|(g, r)| {
                let r = r.as_f64().context("a rate that is not a number")?;
                Ok(g.flops() / (r * 1e12))
            })
            .collect::<Result<Vec<f64>>>()?;
        paths.push(Path {
            name: format!("torch {dtype}"),
            seconds,
        });
    }
    let device_name = reply["device"].as_str().unwrap_or("?");
    Ok((
        paths,
        format!("; torch.matmul on {device_name}, its f32 exact (PyTorch's default)"),
    ))
}
