//! `bench gemm`'s table of the dense layer's bias gradient on cuBLASLt (`--device cuda` with
//! `cublaslt` among the GEMM choices): `FusedOps::dense_backward`, which has cuBLASLt write
//! `db = Σ_rows g` in the weight gradient's epilogue (`CUBLASLT_EPILOGUE_BGRADA`, Note
//! [cuBLASLt descriptors kept] in backend-ext/src/cube/cublaslt_call.rs), against the unfused
//! path in the same run: the same two products in one window (`batched_matmul_pair`, what
//! `dense_backward` ran before the epilogue) and Burn's `sum_dim` over the rows.
//!
//! The layers are the two large ones of a BERT step whose bias `dense` adds (the others add
//! theirs inside a fused op, `bias_gelu` or `bias_dropout_add_layer_norm`, which also sums its
//! gradient; the pooler's and NSP's are a few rows): the packed Q, K, V projection on every
//! token and the MLM decoder on the masked positions. Each is timed as `bench gemm`'s products are: one warm-up, then the mean of
//! `--iters` calls between two synchronisations. In bf16 a second row times what autocast's
//! training runs: `MasterOps::dense_backward_as` with `dW` and `db` written in f32 by the
//! product and its epilogue (Note [cuBLASLt's f32 output]), against the bf16 products, the
//! `sum_dim` and the two casts to f32 that it replaces.

use anyhow::Result;
use ember_model::BertConfig;
use serde_json::Value;

/// A dense layer with its bias: `(name, rows, in, out)`.
type Layer = (&'static str, usize, usize, usize);

/// The dense layers of a BERT step whose bias gradient `dense_backward` computes, at `tokens`
/// rows (batch × seq) and `predictions` masked positions.
pub(crate) fn biased_dense_layers(
    config: &BertConfig,
    tokens: usize,
    predictions: usize,
) -> Vec<Layer> {
    let h = config.hidden_size;
    vec![
        ("QKV (packed)", tokens, h, 3 * h),
        ("MLM decoder", predictions, h, config.vocab_size),
    ]
}

/// The table (markdown) and its JSON: per dtype and layer, milliseconds of the dense backward
/// with the epilogue's `db` and of the unfused path, and their ratio (unfused over fused: above 1
/// the epilogue is faster). Runs cuBLASLt with host waits, then restores the GEMM choice.
///
/// # Errors
/// No CUDA device or library; a build without `cuda`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_table(
    dtypes: &[String],
    layers: &[Layer],
    iters: usize,
) -> Result<(String, Value)> {
    use crate::bench_gemm::{CudaBf16, CudaF32};
    use ember_backend_ext::{CublasltSync, Gemm};
    let device = crate::cuda::single_device()?;
    let (gemm, sync) = (
        ember_backend_ext::gpu_gemm(),
        ember_backend_ext::cublaslt_sync(),
    );
    ember_backend_ext::set_gpu_gemm(Gemm::Cublaslt).map_err(anyhow::Error::msg)?;
    ember_backend_ext::set_cublaslt_sync(CublasltSync::Host);
    let mut out = String::from(
        "\nThe dense layers' bias gradient on cuBLASLt (host waits): `db` in the weight \
         gradient's epilogue (BGRADA) against the same two products and a `sum_dim`, ms per \
         backward (the rows with f32 gradients: the unfused path also casts `dW` and `db` to \
         f32)\n\n| layer | dtype | rows × in × out | epilogue | products + sum_dim | ratio |\n\
         |---|---|---|---:|---:|---:|\n",
    );
    let mut records = Vec::new();
    let timed = (|| {
        let runs: Vec<(&str, bool)> = dtypes
            .iter()
            .flat_map(|dtype| match dtype.as_str() {
                "bf16" => vec![("bf16", false), ("bf16, dW and db in f32", true)],
                _ => vec![("f32", false)],
            })
            .collect();
        for (dtype, f32_grads) in runs {
            let times = if dtype.starts_with("bf16") {
                time_layers::<CudaBf16>(&device, layers, iters, f32_grads)?
            } else {
                time_layers::<CudaF32>(&device, layers, iters, false)?
            };
            for (&(name, rows, i, o), (fused, unfused, epilogue)) in layers.iter().zip(times) {
                let fused_cell = if epilogue {
                    format!("{:.3}", fused * 1e3)
                } else {
                    format!("{:.3} (epilogue refused)", fused * 1e3)
                };
                out.push_str(&format!(
                    "| {name} | {dtype} | {rows} × {i} × {o} | {fused_cell} | {:.3} | {:.2}× |\n",
                    unfused * 1e3,
                    unfused / fused
                ));
                records.push(serde_json::json!({
                    "layer": name, "dtype": dtype, "rows": rows, "in": i, "out": o,
                    "epilogue_seconds": fused, "unfused_seconds": unfused,
                    "epilogue_ran": epilogue,
                }));
            }
        }
        anyhow::Ok(())
    })();
    ember_backend_ext::set_gpu_gemm(gemm).map_err(anyhow::Error::msg)?;
    ember_backend_ext::set_cublaslt_sync(sync);
    timed?;
    Ok((out, Value::Array(records)))
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda_table(_: &[String], _: &[Layer], _: usize) -> Result<(String, Value)> {
    anyhow::bail!("--device cuda needs a build with the `cuda` feature")
}

/// Seconds per call of each layer's backward, `(dense_backward, products + sum_dim)`, and
/// whether every `dense_backward` call (the warm-up and the timed ones) had its bias gradient
/// from the epilogue: otherwise (a refused epilogue) the row says so instead of passing the
/// fallback off as the epilogue. With `f32_grads`, `dense_backward_as` writing `dW` and `db`
/// in f32, against the unfused path followed by their casts to f32.
#[cfg(feature = "cuda")]
fn time_layers<B: ember_backend_ext::FusedOps>(
    device: &B::Device,
    layers: &[Layer],
    iters: usize,
    f32_grads: bool,
) -> Result<Vec<(f64, f64, bool)>> {
    use burn::tensor::{Distribution, FloatDType, Tensor};
    let normal = |shape: [usize; 2]| {
        Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, 1.0), device)
            .into_primitive()
            .tensor()
    };
    layers
        .iter()
        .map(|&(_, rows, i, o)| {
            let (x, w, g) = (normal([rows, i]), normal([i, o]), normal([rows, o]));
            let before = ember_backend_ext::cublaslt::bias_gradients();
            let fused = crate::bench_kernels::time::<B>(device, iters.max(1), || {
                let (x, w, g) = (x.clone(), w.clone(), g.clone());
                if f32_grads {
                    drop(B::dense_backward_as(x, w, g, true, FloatDType::F32));
                } else {
                    drop(B::dense_backward(x, w, g, true));
                }
            })?;
            // One warm-up and `iters` timed calls.
            let epilogue =
                ember_backend_ext::cublaslt::bias_gradients() - before == iters.max(1) + 1;
            let unfused = crate::bench_kernels::time::<B>(device, iters.max(1), || {
                let products = B::batched_matmul_pair(
                    g.clone(),
                    B::float_swap_dims(w.clone(), 0, 1),
                    B::float_swap_dims(x.clone(), 0, 1),
                    g.clone(),
                );
                let db = B::float_sum_dim(g.clone(), 0);
                if f32_grads {
                    drop(B::float_cast(products.1, FloatDType::F32));
                    drop(B::float_cast(db, FloatDType::F32));
                } else {
                    drop((products, db));
                }
            })?;
            Ok((fused, unfused, epilogue))
        })
        .collect()
}
