//! `cargo xtask bench kernels`: each fused op of `ember-backend-ext` against the reference
//! composition (`ember_model::composed`: the reference path's Burn ops with the keyed dropout
//! op, what `--reference-ops` runs in the fused path's place; GELU as `reference::bias_gelu`),
//! on the same backend and device, at BERT shapes.
//!
//! Per op and shape: forward time (the op on the plain backend, dropout on) and forward +
//! backward time (under autodiff, gradient of all inputs), fused and reference, their ratio,
//! and the fused forward's achieved memory bandwidth (the bytes it must move at least: each
//! input read once, each output written once) as a fraction of the device's measured copy
//! bandwidth (an elementwise `x + 0.5` over 256 MiB by default, read + write). The table ends
//! with the model's ops that took longer fused than composed at BERT-large shapes, and the
//! line `slower fused: <ops>` for `--reference-ops` (Note [Fused where it pays]).

use std::time::Instant;

use anyhow::{Result, bail};
use burn::backend::Autodiff;
use burn::module::Param;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};
use clap::Args;
use ember_backend_ext::{DropoutSpec, FusedOps, Gelu, reference};

/// Flags of `bench kernels`.
#[derive(Args, Debug)]
pub struct KernelArgs {
    /// Backend: cpu (NdArray: the fused ops are the reference bodies), wgpu or cuda (need the
    /// features of the same name)
    #[arg(long, default_value = "cuda", value_parser = ["cpu", "wgpu", "cuda"])]
    pub(crate) device: String,
    /// Float type on cuda: f32 or bf16
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub(crate) dtype: String,
    /// Samples per batch
    #[arg(long, default_value_t = 32)]
    pub(crate) batch_size: usize,
    /// Shapes: comma-separated <preset>-<seq>, preset base (H 768, 12 heads) or large
    /// (H 1024, 16 heads)
    #[arg(long, default_value = "base-128,base-512,large-128,large-512")]
    shapes: String,
    /// Timed iterations per measurement (after one warm-up)
    #[arg(long, default_value_t = 20)]
    pub(crate) iters: usize,
    /// Dropout probability of the ops that have dropout
    #[arg(long, default_value_t = 0.1)]
    pub(crate) dropout: f64,
    /// Size of the copy that measures the device's bandwidth, MiB (lavapipe allocates at most
    /// 128 MiB in one buffer)
    #[arg(long, default_value_t = 256)]
    copy_mib: usize,
    /// How the LayerNorm and softmax kernels reduce a row across a cube: auto (planes where
    /// the device reports plane operations: CUDA), planes (warps first, then shared memory)
    /// or tree (shared memory only), to compare (Note [Row reductions])
    #[arg(long, default_value = "auto")]
    row_reductions: ember_backend_ext::RowReductions,
    /// The rows to time: bias_gelu, layer_norm, attention (the masked softmax and the attention
    /// core), cross_entropy (the masked-LM loss on 20 predictions a sequence at seq 128, 76 at
    /// 512), optimizer (multi-tensor AdamW and LAMB over the shapes' models)
    #[arg(long, value_delimiter = ',',
          default_value = "bias_gelu,layer_norm,attention,cross_entropy,optimizer",
          value_parser = ["bias_gelu", "layer_norm", "attention", "cross_entropy", "optimizer"])]
    pub(crate) ops: Vec<String>,
    /// `pytorch`: also time the attention core against PyTorch's
    /// `scaled_dot_product_attention` on the same device (cpu, cuda; a table of its own)
    #[arg(long, default_value = "none", value_parser = ["none", "pytorch"])]
    pub(crate) reference: String,
    /// The reference's Python (default: the virtualenv of `bench --setup-reference`)
    #[arg(long)]
    pub(crate) python: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) name: &'static str,
    pub(crate) hidden: usize,
    pub(crate) heads: usize,
    pub(crate) seq: usize,
}

fn parse_shapes(spec: &str) -> Result<Vec<Shape>> {
    spec.split(',')
        .map(|s| {
            let (preset, seq) = s
                .trim()
                .split_once('-')
                .ok_or_else(|| anyhow::anyhow!("shape `{s}`: expected <preset>-<seq>"))?;
            let seq: usize = seq
                .parse()
                .map_err(|_| anyhow::anyhow!("shape `{s}`: `{seq}` is not a length"))?;
            let (name, hidden, heads) = match preset {
                "base" => ("base", 768, 12),
                "large" => ("large", 1024, 16),
                other => bail!("shape `{s}`: unknown preset `{other}` (base or large)"),
            };
            Ok(Shape {
                name,
                hidden,
                heads,
                seq,
            })
        })
        .collect()
}

pub fn run(args: KernelArgs) -> Result<()> {
    let shapes = parse_shapes(&args.shapes)?;
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    if args.reference == "pytorch" && !args.ops.iter().any(|o| o == "attention") {
        bail!("--reference pytorch times the attention core against SDPA: add attention to --ops");
    }
    if args.reference == "pytorch" && args.device == "wgpu" {
        bail!("--reference pytorch: PyTorch has no wgpu backend to time SDPA on (cpu or cuda)");
    }
    ember_backend_ext::set_row_reductions(args.row_reductions);
    match (args.device.as_str(), args.dtype.as_str()) {
        ("cpu", _) => bench::<burn::backend::NdArray>(&Default::default(), &args, &shapes),
        ("wgpu", _) => bench_wgpu(&args, &shapes),
        ("cuda", dtype) => bench_cuda(&args, &shapes, dtype == "bf16"),
        (other, _) => bail!("unknown device {other}"),
    }
}

#[cfg(feature = "wgpu")]
fn bench_wgpu(args: &KernelArgs, shapes: &[Shape]) -> Result<()> {
    type Wgpu = burn::backend::wgpu::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;
    bench::<Wgpu>(
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
        args,
        shapes,
    )
}

#[cfg(not(feature = "wgpu"))]
fn bench_wgpu(_: &KernelArgs, _: &[Shape]) -> Result<()> {
    bail!("--device wgpu needs a build with the `wgpu` feature (cargo xtask --features wgpu ...)")
}

#[cfg(feature = "cuda")]
fn bench_cuda(args: &KernelArgs, shapes: &[Shape], bf16: bool) -> Result<()> {
    // Burn's `Cuda` is `CubeBackend<CudaRuntime, F, I, u8>` (no fusion feature here).
    let device = crate::cuda::single_device()?;
    if bf16 {
        bench::<burn::backend::Cuda<burn::tensor::bf16, i32>>(&device, args, shapes)
    } else {
        bench::<burn::backend::Cuda<f32, i32>>(&device, args, shapes)
    }
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda(_: &KernelArgs, _: &[Shape], _: bool) -> Result<()> {
    bail!("--device cuda needs a build with the `cuda` feature (cargo xtask --features cuda ...)")
}

/// Mean seconds of `f` over `iters` runs after one warm-up, the device synchronised before
/// the clock stops.
pub(crate) fn time<B: Backend>(
    device: &B::Device,
    iters: usize,
    mut f: impl FnMut(),
) -> Result<f64> {
    f();
    B::sync(device).map_err(|e| anyhow::anyhow!("device sync failed: {e:?}"))?;
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    B::sync(device).map_err(|e| anyhow::anyhow!("device sync failed: {e:?}"))?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

pub(crate) fn normal<B: Backend, const D: usize>(
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

/// The model's composition of a residual block's tail (`--reference-ops layer_norm`): the
/// dense layer's bias added, the keyed dropout op, the residual added, Burn's `LayerNorm` in
/// f32 (`ember_model::composed::dropout_add_layer_norm`), on `[R, N]` rows as `[batch, R /
/// batch, N]`.
fn reference_layer_norm<B: FusedOps>(
    x: Tensor<B, 2>,
    bias: Tensor<B, 1>,
    residual: Tensor<B, 2>,
    norm: &LayerNorm<B>,
    batch: usize,
    p: f64,
) -> Tensor<B, 2> {
    let [r, n] = x.dims();
    let rows = |t: Tensor<B, 2>| t.reshape([batch, r / batch, n]);
    ember_model::composed::dropout_add_layer_norm(
        rows(x + bias.unsqueeze()),
        rows(residual),
        norm,
        DropoutSpec::draw(p),
    )
    .reshape([r, n])
}

/// Burn's `LayerNorm` of `gamma` and `beta` with `eps`, its parameters taking gradients.
fn layer_norm_module<B: Backend>(
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    eps: f64,
) -> LayerNorm<B> {
    let mut norm = LayerNormConfig::new(gamma.dims()[0])
        .with_epsilon(eps)
        .init(&gamma.device());
    norm.gamma = Param::from_tensor(gamma.require_grad());
    norm.beta = Some(Param::from_tensor(beta.require_grad()));
    norm
}

/// AdamW and LAMB over every parameter of BERT-`preset` for pre-training: the multi-tensor ops
/// (fused) against the reference bodies tensor by tensor (Burn's AdamW composition, and
/// [`reference::lamb_apply`] with norms from Burn's `square().sum()`).
fn bench_optimizer<B: FusedOps>(device: &B::Device, preset: &str, n: usize) -> Result<Vec<Row>> {
    use burn::module::{Module, ModuleVisitor, Param};
    use ember_backend_ext::{AdamHyper, AdamKind, AdamTensors, lamb_multi_tensor};
    use ember_model::{BertConfig, Preset};

    let preset = match preset {
        "large" => Preset::Large,
        _ => Preset::Base,
    };
    struct Collect<B: Backend>(Vec<Tensor<B, 1>>);
    impl<B: Backend> ModuleVisitor<B> for Collect<B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let count = value.shape().num_elements();
            self.0.push(value.reshape([count]));
        }
    }
    let mut collect = Collect::<B>(Vec::new());
    BertConfig::preset(preset)
        .init_for_pretraining::<B>(device)
        .visit(&mut collect);
    let params = collect.0;
    let total: usize = params.iter().map(|p| p.shape().num_elements()).sum();
    let state: Vec<[Tensor<B, 1>; 3]> = params
        .iter()
        .map(|p| {
            let shape = [p.shape().num_elements()];
            [
                normal::<B, 1>(shape, device) * 1e-3,
                normal::<B, 1>(shape, device) * 1e-3,
                normal::<B, 1>(shape, device).abs() * 1e-6,
            ]
        })
        .collect();
    let list = || -> Vec<AdamTensors<B>> {
        params
            .iter()
            .zip(&state)
            .map(|(p, [g, m, v])| AdamTensors {
                param: p.clone().into_primitive().tensor(),
                grad: g.clone().into_primitive().tensor(),
                moment_1: m.clone().into_primitive().tensor(),
                moment_2: v.clone().into_primitive().tensor(),
            })
            .collect()
    };
    let hyper = AdamHyper {
        lr: 1e-4,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-6,
        weight_decay: 0.01,
        step: 10,
    };
    let reference_step = |kind| {
        params
            .iter()
            .zip(&state)
            .map(|(p, [g, m, v])| {
                reference::adam_step(p.clone(), g.clone(), m.clone(), v.clone(), hyper, kind)
            })
            .collect::<Vec<_>>()
    };
    let adamw_fused = time::<B>(device, n, || {
        let _ = B::adam_multi_tensor(list(), hyper, AdamKind::AdamW);
    })?;
    let adamw_reference = time::<B>(device, n, || {
        let _ = reference_step(AdamKind::AdamW);
    })?;
    let lamb_fused = time::<B>(device, n, || {
        let _ = lamb_multi_tensor::<B>(list(), hyper);
    })?;
    let lamb_reference = time::<B>(device, n, || {
        for (p, out) in params.iter().zip(reference_step(AdamKind::LambUpdate)) {
            let update =
                Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(out.param));
            let _ = reference::lamb_apply(
                p.clone(),
                update.clone(),
                p.clone().square().sum(),
                update.square().sum(),
                hyper.lr,
            );
        }
    })?;
    let elem = std::mem::size_of::<B::FloatElem>() as f64;
    let label = format!(
        "{preset:?} params [{:.0}M, {} tensors]",
        total as f64 / 1e6,
        params.len()
    );
    let row = |op, fused, reference, passes: f64| Row {
        op,
        shape: label.clone(),
        fused_fwd: fused,
        reference_fwd: reference,
        fused_fwd_bwd: f64::NAN,
        reference_fwd_bwd: f64::NAN,
        bytes: passes * total as f64 * elem,
    };
    Ok(vec![
        // AdamW reads w, g, m, v and writes w, m, v.
        row("adamw_multi_tensor", adamw_fused, adamw_reference, 7.0),
        // LAMB: the same 7, the norms read w and u, the apply reads w and u and writes w.
        row("lamb_multi_tensor", lamb_fused, lamb_reference, 12.0),
    ])
}

pub struct Row {
    /// The op, as the table names it.
    pub op: &'static str,
    /// `<preset>-<seq> [<batch>x<seq>]`, and more for some ops.
    pub shape: String,
    /// Seconds.
    pub fused_fwd: f64,
    /// Seconds.
    pub reference_fwd: f64,
    /// Seconds.
    pub fused_fwd_bwd: f64,
    /// Seconds.
    pub reference_fwd_bwd: f64,
    /// Least bytes the fused forward moves.
    pub bytes: f64,
}

fn bench<B: FusedOps>(device: &B::Device, args: &KernelArgs, shapes: &[Shape]) -> Result<()>
where
    Autodiff<B>: FusedOps,
{
    type A<B> = Autodiff<B>;
    let elem = std::mem::size_of::<B::FloatElem>() as f64;
    let n = args.iters;
    let p = args.dropout;

    // Copy bandwidth: x + 0.5 over `copy_mib` MiB.
    let copy_elems = ((args.copy_mib << 20) as f64 / elem) as usize;
    let x = normal::<B, 1>([copy_elems], device);
    let copy_s = time::<B>(device, n, || {
        let _ = x.clone().add_scalar(0.5);
    })?;
    let copy_bw = 2.0 * copy_elems as f64 * elem / copy_s;
    drop(x);
    println!(
        "device {:?}, {} bytes per element; copy bandwidth {:.1} GB/s; batch {}, dropout {p}, {n} iterations",
        device,
        elem,
        copy_bw / 1e9,
        args.batch_size
    );

    let mut rows = Vec::new();
    for shape in shapes {
        let (b, s, h) = (args.batch_size, shape.seq, shape.hidden);
        let label = format!("{}-{} [{b}x{s}]", shape.name, s);
        let r = b * s;

        // bias + GELU on the FFN's intermediate activations [B·S, 4H], the erf form (the
        // tanh form's kernel differs in its formula alone: Note [Two GELUs]).
        if args.ops.iter().any(|o| o == "bias_gelu") {
            let x = normal::<B, 2>([r, 4 * h], device);
            let bias = normal::<B, 1>([4 * h], device);
            let fused_fwd = time::<B>(device, n, || {
                let _ = ember_backend_ext::bias_gelu(x.clone(), bias.clone(), Gelu::Erf);
            })?;
            let reference_fwd = time::<B>(device, n, || {
                let _ = reference::bias_gelu(x.clone(), bias.clone(), Gelu::Erf);
            })?;
            let (xa, ba) = (
                Tensor::<A<B>, 2>::from_inner(x.clone()).require_grad(),
                Tensor::<A<B>, 1>::from_inner(bias.clone()).require_grad(),
            );
            let fused_fwd_bwd = time::<B>(device, n, || {
                let _ = ember_backend_ext::bias_gelu(xa.clone(), ba.clone(), Gelu::Erf).backward();
            })?;
            let reference_fwd_bwd = time::<B>(device, n, || {
                let _ = reference::bias_gelu(xa.clone(), ba.clone(), Gelu::Erf).backward();
            })?;
            rows.push(Row {
                op: "bias_gelu",
                shape: label.clone(),
                fused_fwd,
                reference_fwd,
                fused_fwd_bwd,
                reference_fwd_bwd,
                bytes: 2.0 * (r * 4 * h) as f64 * elem,
            });
        }

        // bias + dropout + residual + LayerNorm on [B·S, H].
        if args.ops.iter().any(|o| o == "layer_norm") {
            let x = normal::<B, 2>([r, h], device);
            let residual = normal::<B, 2>([r, h], device);
            let bias = normal::<B, 1>([h], device);
            let gamma = normal::<B, 1>([h], device);
            let beta = normal::<B, 1>([h], device);
            let eps = 1e-12;
            let fused_fwd = time::<B>(device, n, || {
                let _ = ember_backend_ext::bias_dropout_add_layer_norm(
                    x.clone(),
                    bias.clone(),
                    residual.clone(),
                    gamma.clone(),
                    beta.clone(),
                    DropoutSpec::draw(p),
                    eps,
                );
            })?;
            // The composition's γ and β in f32, as the model's masters (Burn's LayerNorm
            // in f32 multiplies by them: a half γ would be read as f32).
            let (gamma32, beta32) = (
                ember_model::cast_to(gamma.clone(), burn::tensor::DType::F32),
                ember_model::cast_to(beta.clone(), burn::tensor::DType::F32),
            );
            let norm = layer_norm_module(gamma32.clone(), beta32.clone(), eps);
            let reference_fwd = time::<B>(device, n, || {
                let _ =
                    reference_layer_norm(x.clone(), bias.clone(), residual.clone(), &norm, b, p);
            })?;
            let grad = |t: Tensor<B, 1>| Tensor::<A<B>, 1>::from_inner(t).require_grad();
            let (xa, ra) = (
                Tensor::<A<B>, 2>::from_inner(x.clone()).require_grad(),
                Tensor::<A<B>, 2>::from_inner(residual.clone()).require_grad(),
            );
            let (ba, ga, ta) = (grad(bias.clone()), grad(gamma.clone()), grad(beta.clone()));
            let fused_fwd_bwd = time::<B>(device, n, || {
                let _ = ember_backend_ext::bias_dropout_add_layer_norm(
                    xa.clone(),
                    ba.clone(),
                    ra.clone(),
                    ga.clone(),
                    ta.clone(),
                    DropoutSpec::draw(p),
                    eps,
                )
                .backward();
            })?;
            let norm_a = layer_norm_module(grad(gamma32), grad(beta32), eps);
            let reference_fwd_bwd = time::<B>(device, n, || {
                let out = reference_layer_norm(xa.clone(), ba.clone(), ra.clone(), &norm_a, b, p);
                let _ = out.backward();
            })?;
            rows.push(Row {
                op: "bias_dropout_add_layer_norm",
                shape: label.clone(),
                fused_fwd,
                reference_fwd,
                fused_fwd_bwd,
                reference_fwd_bwd,
                // x, residual in; pre_norm, output out
                bytes: 4.0 * (r * h) as f64 * elem,
            });
        }

        // Attention: masked softmax + dropout alone, and the attention core around it.
        if args.ops.iter().any(|o| o == "attention") {
            rows.extend(crate::bench_kernels_attention::rows::<B>(
                device, *shape, b, p, n, &label,
            )?);
        }

        // The masked-LM loss on the shape's masked positions.
        if args.ops.iter().any(|o| o == "cross_entropy") {
            rows.push(crate::bench_kernels_loss::row::<B>(
                device, *shape, b, n, &label,
            )?);
        }
    }

    // Optimizer steps over each preset's real parameter list (BERT for pre-training).
    let mut presets: Vec<&str> = shapes.iter().map(|s| s.name).collect();
    if !args.ops.iter().any(|o| o == "optimizer") {
        presets.clear();
    }
    presets.dedup();
    for preset in presets {
        rows.extend(bench_optimizer::<B>(device, preset, n)?);
    }

    println!();
    println!(
        "Row kernels' reductions: {} (Note [Row reductions]).",
        args.row_reductions.name()
    );
    println!(
        "| op | shape | fwd fused ms | fwd reference ms | speed-up | fwd+bwd fused ms | fwd+bwd reference ms | speed-up | fused fwd GB/s | of copy bw |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let ms = |s: f64| {
        if s.is_nan() {
            "–".to_string()
        } else {
            format!("{:.3}", s * 1e3)
        }
    };
    let ratio = |a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            "–".to_string()
        } else {
            format!("{:.2}x", b / a)
        }
    };
    for row in &rows {
        let bw = row.bytes / row.fused_fwd;
        let (gbs, frac) = if bw.is_nan() {
            ("–".to_string(), "–".to_string())
        } else {
            (
                format!("{:.1}", bw / 1e9),
                format!("{:.0}%", 100.0 * bw / copy_bw),
            )
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.op,
            row.shape,
            ms(row.fused_fwd),
            ms(row.reference_fwd),
            ratio(row.fused_fwd, row.reference_fwd),
            ms(row.fused_fwd_bwd),
            ms(row.reference_fwd_bwd),
            ratio(row.fused_fwd_bwd, row.reference_fwd_bwd),
            gbs,
            frac
        );
    }
    let slower = slower_fused(&rows);
    println!();
    println!(
        "The model's fused ops slower than their reference forward + backward at BERT-large \
         shapes (Note [Fused where it pays]; `--reference-ops` runs them composed): {}",
        if slower.is_empty() {
            "none".to_string()
        } else {
            slower
                .iter()
                .map(|(op, at)| format!("{} ({at})", op.name()))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    let set: ember_model::ReferenceOps = slower.iter().map(|(op, _)| *op).collect();
    println!("slower fused: {set}");
    if args.reference == "pytorch" {
        crate::bench_kernels_attention::against_sdpa(args, shapes, &rows)?;
    }
    Ok(())
}

/// The model's ops (`model.reference_ops`) whose fused form took longer forward + backward
/// than the reference composition at a BERT-large shape of `rows` (at any shape where none is
/// large), each with the shapes and speed-ups where it did: what Note [Fused where it pays]
/// takes out of the fused path. Rows of other ops (the masked softmax alone, the optimizers)
/// choose nothing.
pub fn slower_fused(rows: &[Row]) -> Vec<(ember_model::FusedOp, String)> {
    use ember_model::FusedOp;
    let op_of = |row: &Row| match row.op {
        "bias_gelu" => Some(FusedOp::BiasGelu),
        "bias_dropout_add_layer_norm" => Some(FusedOp::LayerNorm),
        "attention_core" => Some(FusedOp::Attention),
        "cross_entropy" => Some(FusedOp::CrossEntropy),
        _ => None,
    };
    let any_large = rows.iter().any(|r| r.shape.starts_with("large"));
    let mut slower: Vec<(FusedOp, String)> = Vec::new();
    for row in rows {
        let Some(op) = op_of(row) else { continue };
        let speed_up = row.reference_fwd_bwd / row.fused_fwd_bwd;
        // A NaN (an op that failed) is not slower.
        let slower_here = speed_up < 1.0;
        if (any_large && !row.shape.starts_with("large")) || !slower_here {
            continue;
        }
        let shape = row.shape.split(' ').next().unwrap_or_default();
        let at = format!("{shape}: {speed_up:.2}x");
        match slower.iter_mut().find(|(o, _)| *o == op) {
            Some((_, all)) => *all = format!("{all}, {at}"),
            None => slower.push((op, at)),
        }
    }
    slower
}
