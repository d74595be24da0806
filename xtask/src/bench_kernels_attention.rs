//! `bench kernels`' attention rows: the masked softmax with dropout alone and the attention
//! core around it (`ember_backend_ext::attention`) against the model's composition (the softmax
//! in f32, the keyed dropout op: `ember_model::composed::attention`, what `--reference-ops
//! attention` runs), and with
//! `--reference pytorch` the core against PyTorch's `scaled_dot_product_attention` on the same
//! device (`bench/reference/attention.py`; the GPU-speed issue asks for attention at seq 512
//! no slower than PyTorch's SDPA in the same run).

use anyhow::{Context, Result, bail};
use burn::backend::Autodiff;
use burn::tensor::Tensor;
use ember_backend_ext::{DropoutSpec, FusedOps};
use serde_json::json;

use crate::bench_kernels::{KernelArgs, Row, Shape, normal, time};

type A<B> = Autodiff<B>;

/// An attention core: `q`, `k`, `v` `[B, nh, S, hd]`, `mask_bias` `[B, S]`, scale, dropout.
type Attention<X> =
    fn(Tensor<X, 4>, Tensor<X, 4>, Tensor<X, 4>, Tensor<X, 2>, f64, DropoutSpec) -> Tensor<X, 4>;

/// The rows of one shape at batch `b`, dropout `p`, `n` timed iterations.
pub(crate) fn rows<B: FusedOps>(
    device: &B::Device,
    shape: Shape,
    b: usize,
    p: f64,
    n: usize,
    label: &str,
) -> Result<Vec<Row>>
where
    Autodiff<B>: FusedOps,
{
    let (s, h, nh) = (shape.seq, shape.hidden, shape.heads);
    let elem = std::mem::size_of::<B::FloatElem>() as f64;
    let label = label.to_string();
    let mut rows = Vec::new();
    let hd = h / nh;
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = normal::<B, 4>([b, nh, s, s], device);
    // Every other sample padded to 3/4 of the length.
    let mask_bias = Tensor::<B, 2>::from_data(
        burn::tensor::TensorData::new(
            (0..b * s)
                .map(|i| {
                    if (i / s) % 2 == 1 && i % s >= 3 * s / 4 {
                        -10000.0f32
                    } else {
                        0.0
                    }
                })
                .collect::<Vec<_>>(),
            [b, s],
        ),
        device,
    );
    let mask4 = mask_bias.clone().reshape([b, 1, 1, s]);
    let softmax_fwd = time::<B>(device, n, || {
        let _ = B::masked_softmax_dropout(
            scores.clone().into_primitive().tensor(),
            mask_bias.clone().into_primitive().tensor(),
            scale,
            DropoutSpec::draw(p),
        );
    })?;
    let softmax_ref = time::<B>(device, n, || {
        let probs = ember_model::softmax_f32(scores.clone() * scale + mask4.clone(), 3);
        let _ = ember_backend_ext::dropout(probs, DropoutSpec::draw(p));
    })?;
    let (q, k, v) = (
        normal::<B, 4>([b, nh, s, hd], device),
        normal::<B, 4>([b, nh, s, hd], device),
        normal::<B, 4>([b, nh, s, hd], device),
    );
    // The fused op and the model's composition, forward alone and forward + backward.
    let forward = |attention: Attention<B>| {
        time::<B>(device, n, || {
            let _ = attention(
                q.clone(),
                k.clone(),
                v.clone(),
                mask_bias.clone(),
                scale,
                DropoutSpec::draw(p),
            );
        })
    };
    let attention_fwd = forward(ember_backend_ext::attention::<B>)?;
    let attention_ref = forward(ember_model::composed::attention::<B>)?;
    let leaf = |t: &Tensor<B, 4>| Tensor::<A<B>, 4>::from_inner(t.clone()).require_grad();
    let (qa, ka, va) = (leaf(&q), leaf(&k), leaf(&v));
    let mask_a = Tensor::<A<B>, 2>::from_inner(mask_bias.clone());
    let forward_backward = |attention: Attention<A<B>>| {
        time::<B>(device, n, || {
            let _ = attention(
                qa.clone(),
                ka.clone(),
                va.clone(),
                mask_a.clone(),
                scale,
                DropoutSpec::draw(p),
            )
            .backward();
        })
    };
    let attention_fused_bwd = forward_backward(ember_backend_ext::attention::<A<B>>)?;
    let attention_ref_bwd = forward_backward(ember_model::composed::attention::<A<B>>)?;
    rows.push(Row {
        op: "masked_softmax_dropout",
        shape: label.clone(),
        fused_fwd: softmax_fwd,
        reference_fwd: softmax_ref,
        fused_fwd_bwd: f64::NAN,
        reference_fwd_bwd: f64::NAN,
        // scores in; probs and dropped out
        bytes: 3.0 * (b * nh * s * s) as f64 * elem,
    });
    rows.push(Row {
        op: "attention_core",
        shape: label.clone(),
        fused_fwd: attention_fwd,
        reference_fwd: attention_ref,
        fused_fwd_bwd: attention_fused_bwd,
        reference_fwd_bwd: attention_ref_bwd,
        bytes: f64::NAN,
    });
    Ok(rows)
}

/// `--reference pytorch`: the attention core's rows against PyTorch's
/// `scaled_dot_product_attention` at the same shapes, dtype, dropout and device, timed alike
/// (`bench/reference/attention.py`), as a table of its own.
///
/// # Errors
/// The reference's (Python missing, the script failing, a reply without times).
pub(crate) fn against_sdpa(args: &KernelArgs, shapes: &[Shape], rows: &[Row]) -> Result<()> {
    let python = crate::bench_reference::reference_python(args.python.as_deref())?;
    let dir = tempfile::tempdir().context("a temporary folder for the reference")?;
    let list: Vec<_> = shapes
        .iter()
        .map(|shape| {
            let head_dim = shape.hidden / shape.heads;
            json!({
                "name": shape.name,
                "batch": args.batch_size,
                "heads": shape.heads,
                "seq": shape.seq,
                "head_dim": head_dim,
                "scale": 1.0 / (head_dim as f64).sqrt(),
            })
        })
        .collect();
    let file = dir.path().join("shapes.json");
    std::fs::write(&file, serde_json::to_string(&list)?)?;
    let reply = crate::bench_reference::run_script(
        &python,
        dir.path(),
        "attention.py",
        &[
            "--shapes".into(),
            file.into_os_string(),
            "--device".into(),
            args.device.clone().into(),
            // NdArray computes in f32 whatever --dtype says (it is cuda's setting).
            "--dtype".into(),
            if args.device == "cuda" {
                args.dtype.as_str()
            } else {
                "f32"
            }
            .into(),
            "--dropout".into(),
            args.dropout.to_string().into(),
            "--iters".into(),
            args.iters.max(1).to_string().into(),
        ],
    )?;
    let times = |key: &str| -> Result<Vec<f64>> {
        reply[key]
            .as_array()
            .filter(|t| t.len() == shapes.len())
            .with_context(|| format!("the reference's reply lacks {key} per shape: {reply}"))?
            .iter()
            .map(|t| t.as_f64().context("a time that is not a number"))
            .collect()
    };
    let (forward, forward_backward) = (times("forward_s")?, times("forward_backward_s")?);
    let ember: Vec<&Row> = rows.iter().filter(|r| r.op == "attention_core").collect();
    if ember.len() != shapes.len() {
        bail!("{} attention rows for {} shapes", ember.len(), shapes.len());
    }
    println!();
    println!(
        "Attention core against PyTorch {}'s scaled_dot_product_attention on {} ({}, dropout {}, additive key mask; ratio = SDPA time / ember's, above 1 ember is faster):",
        reply["torch"].as_str().unwrap_or("?"),
        reply["device"].as_str().unwrap_or("?"),
        args.dtype,
        args.dropout
    );
    println!(
        "| shape | fwd ember ms | fwd SDPA ms | ratio | fwd+bwd ember ms | fwd+bwd SDPA ms | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (i, row) in ember.iter().enumerate() {
        println!(
            "| {} | {:.3} | {:.3} | {:.2}x | {:.3} | {:.3} | {:.2}x |",
            row.shape,
            row.fused_fwd * 1e3,
            forward[i] * 1e3,
            forward[i] / row.fused_fwd,
            row.fused_fwd_bwd * 1e3,
            forward_backward[i] * 1e3,
            forward_backward[i] / row.fused_fwd_bwd,
        );
    }
    Ok(())
}
