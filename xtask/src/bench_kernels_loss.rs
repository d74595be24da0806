//! `bench kernels`' loss row: the masked-LM cross-entropy (`ember_backend_ext::cross_entropy`,
//! Note [Cross-entropy in one pass] in backend-ext's `cube/cross_entropy.rs`) against what a
//! Burn user writes, `−mean(log_softmax(x)[label])` with the log-softmax in f32 (autocast's),
//! differentiated by Burn's autodiff (`ember_model::composed::cross_entropy`, what
//! `--reference-ops cross_entropy` runs), on the `[B·P, 30522]` logits of the shape's masked
//! positions.

use anyhow::Result;
use burn::backend::Autodiff;
use burn::tensor::{Int, Tensor, TensorData};
use ember_backend_ext::FusedOps;

use crate::bench_kernels::{Row, Shape, normal, time};

/// BERT's vocabulary (the masked-LM logits' width).
const VOCAB: usize = 30_522;

/// Masked positions per sequence at `seq`: MLPerf's 76 at 512, else 20 (Google's
/// `max_predictions_per_seq` for 128).
fn predictions(seq: usize) -> usize {
    if seq >= 512 { 76 } else { 20 }
}

/// The row of one shape at batch `b`, `n` timed iterations.
pub(crate) fn row<B: FusedOps>(
    device: &B::Device,
    shape: Shape,
    b: usize,
    n: usize,
    label: &str,
) -> Result<Row>
where
    Autodiff<B>: FusedOps,
{
    let rows = b * predictions(shape.seq);
    let logits = normal::<B, 2>([rows, VOCAB], device) * 3.0;
    let ids: Vec<i64> = (0..rows).map(|i| ((i * 7919) % VOCAB) as i64).collect();
    let labels = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows]), device);
    let fused_fwd = time::<B>(device, n, || {
        let _ = ember_backend_ext::cross_entropy(logits.clone(), labels.clone());
    })?;
    let reference_fwd = time::<B>(device, n, || {
        let _ = ember_model::composed::cross_entropy(logits.clone(), labels.clone());
    })?;
    let xa = Tensor::<Autodiff<B>, 2>::from_inner(logits.clone()).require_grad();
    let la = Tensor::<Autodiff<B>, 1, Int>::from_inner(labels.clone());
    let fused_fwd_bwd = time::<B>(device, n, || {
        let _ = ember_backend_ext::cross_entropy(xa.clone(), la.clone()).backward();
    })?;
    let reference_fwd_bwd = time::<B>(device, n, || {
        let _ = ember_model::composed::cross_entropy(xa.clone(), la.clone()).backward();
    })?;
    let elem = std::mem::size_of::<B::FloatElem>() as f64;
    Ok(Row {
        op: "cross_entropy",
        shape: format!("{label} [{rows}x{VOCAB} logits]"),
        fused_fwd,
        reference_fwd,
        fused_fwd_bwd,
        reference_fwd_bwd,
        // the logits read once
        bytes: (rows * VOCAB) as f64 * elem,
    })
}
