//! The masked softmax + dropout kernels of the attention core, forward and backward, and their
//! launches (`FusedOps::masked_softmax_dropout`): a row of scores per cube, or per plane with
//! the row held in registers (Note [Softmax rows in registers] in `reductions.rs`).

use burn::tensor::TensorMetadata;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{dropout_scale, row_index, row_key};
use super::reductions::{self, row_max, row_sum};
use super::{check_rows, dropout_args, empty_like, storage};
use crate::DropoutSpec;

/// The row of a softmax kernel's unit, the unit's first column and the stride between its
/// columns: one cube per row, or with `plane_rows` one plane per row
/// (`CUBE_DIM_X / PLANE_DIM` rows per cube; Note [Softmax rows in registers] in
/// `reductions.rs`).
#[cube]
fn softmax_position(#[comptime] plane_rows: bool) -> (usize, usize, usize) {
    let mut row = row_index();
    let mut unit = UNIT_POS_X as usize;
    let mut stride = CUBE_DIM_X as usize;
    if plane_rows {
        row = row_index() * (CUBE_DIM_X / PLANE_DIM) as usize + (UNIT_POS_X / PLANE_DIM) as usize;
        unit = UNIT_POS_PLANE as usize;
        stride = PLANE_DIM as usize;
    }
    (row, unit, stride)
}

/// `s · scale + mask_bias` of one score (`idx`) and its key's bias (`mask_idx`), in f32.
#[cube]
fn masked_score<F: Float>(
    scores: &Tensor<F>,
    mask_bias: &Tensor<F>,
    idx: usize,
    mask_idx: usize,
    scale: f32,
) -> f32 {
    f32::cast_from(scores[idx]) * scale + f32::cast_from(mask_bias[mask_idx])
}

/// The gradient of a probability through the dropout mask: `grad_dropped[idx]` times the
/// keep scale of column `j` of the row keyed `rk` (as is without dropout), in f32.
#[cube]
#[allow(clippy::too_many_arguments)]
fn dropped_grad<F: Float>(
    grad_dropped: &Tensor<F>,
    idx: usize,
    j: usize,
    rk: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
) -> f32 {
    let mut dp = f32::cast_from(grad_dropped[idx]);
    if dropout {
        dp *= dropout_scale(j, rk, threshold, keep_scale);
    }
    dp
}

/// The row's maximum: across its plane (`plane_rows`), else across the cube.
#[cube]
fn softmax_row_max(
    shared: &mut SharedMemory<f32>,
    value: f32,
    #[comptime] planes: bool,
    #[comptime] plane_rows: bool,
) -> f32 {
    if plane_rows {
        plane_max(value)
    } else {
        row_max(shared, value, planes)
    }
}

/// The row's sum: across its plane (`plane_rows`), else across the cube.
#[cube]
fn softmax_row_sum(
    shared: &mut SharedMemory<f32>,
    value: f32,
    #[comptime] planes: bool,
    #[comptime] plane_rows: bool,
) -> f32 {
    if plane_rows {
        plane_sum(value)
    } else {
        row_sum(shared, value, planes)
    }
}

/// Per row of `[B·nh·S, S]` scores: `softmax(s · scale + mask_bias[b])`, then dropout. With
/// `per_unit` > 0 each unit keeps its `per_unit` elements of the row in registers: the scores
/// are read once and each output written once (Note [Softmax rows in registers]); with 0 (rows
/// too long for that) pass 1 takes the row max, pass 2 writes `exp(s − max)` and sums it, pass
/// 3 normalises.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn masked_softmax_dropout_kernel<F: Float>(
    scores: &Tensor<F>,
    mask_bias: &Tensor<F>,
    probs: &mut Tensor<F>,
    dropped: &mut Tensor<F>,
    rows: u32,
    rows_per_batch: u32,
    scale: f32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
    #[comptime] planes: bool,
    #[comptime] per_unit: u32,
    #[comptime] plane_rows: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, unit, stride) = softmax_position(plane_rows);
    if row >= rows as usize {
        terminate!();
    }
    let rk = row_key(
        key_lo,
        key_hi,
        sample_offset,
        rows_per_sample,
        seq,
        row as u32,
    );
    let n = mask_bias.shape(1);
    let base = row * n;
    let mask_base = (row / rows_per_batch as usize) * n;
    let mut shared = SharedMemory::<f32>::new(block as usize);

    if per_unit > 0 {
        let mut values = Array::<f32>::new(per_unit as usize);
        let mut local_max = f32::new(-3.0e38);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * stride;
            let mut s = f32::new(-3.0e38);
            if j < n {
                s = masked_score(scores, mask_bias, base + j, mask_base + j, scale);
            }
            values[t as usize] = s;
            if s > local_max {
                local_max = s;
            }
        }
        let max = softmax_row_max(&mut shared, local_max, planes, plane_rows);
        let mut sum = f32::new(0.0);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * stride;
            let mut e = f32::new(0.0);
            if j < n {
                e = (values[t as usize] - max).exp();
            }
            values[t as usize] = e;
            sum += e;
        }
        let inv_sum = f32::new(1.0) / softmax_row_sum(&mut shared, sum, planes, plane_rows);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * stride;
            if j < n {
                let p = values[t as usize] * inv_sum;
                probs[base + j] = F::cast_from(p);
                if dropout {
                    dropped[base + j] =
                        F::cast_from(p * dropout_scale(j, rk, threshold, keep_scale));
                } else {
                    dropped[base + j] = F::cast_from(p);
                }
            }
        }
    } else {
        let mut local_max = f32::new(-3.0e38);
        let mut j = unit;
        while j < n {
            let s = masked_score(scores, mask_bias, base + j, mask_base + j, scale);
            if s > local_max {
                local_max = s;
            }
            j += stride;
        }
        let max = softmax_row_max(&mut shared, local_max, planes, plane_rows);

        let mut sum = f32::new(0.0);
        let mut j = unit;
        while j < n {
            let s = masked_score(scores, mask_bias, base + j, mask_base + j, scale);
            let e = (s - max).exp();
            probs[base + j] = F::cast_from(e);
            sum += e;
            j += stride;
        }
        let inv_sum = f32::new(1.0) / softmax_row_sum(&mut shared, sum, planes, plane_rows);

        let mut j = unit;
        while j < n {
            let idx = base + j;
            let p = f32::cast_from(probs[idx]) * inv_sum;
            probs[idx] = F::cast_from(p);
            if dropout {
                dropped[idx] = F::cast_from(p * dropout_scale(j, rk, threshold, keep_scale));
            } else {
                dropped[idx] = F::cast_from(p);
            }
            j += stride;
        }
    }
}

/// Per row: `dS = scale · P · (dP − Σ dP·P)`, `dP = grad through the dropout mask`; rows laid
/// out and held as the forward's (`per_unit`, `plane_rows`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn masked_softmax_dropout_backward_kernel<F: Float>(
    grad_dropped: &Tensor<F>,
    probs: &Tensor<F>,
    grad_scores: &mut Tensor<F>,
    rows: u32,
    scale: f32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
    #[comptime] planes: bool,
    #[comptime] per_unit: u32,
    #[comptime] plane_rows: bool,
    #[define(F)] _dtype: StorageType,
) {
    let (row, unit, stride) = softmax_position(plane_rows);
    if row >= rows as usize {
        terminate!();
    }
    let rk = row_key(
        key_lo,
        key_hi,
        sample_offset,
        rows_per_sample,
        seq,
        row as u32,
    );
    let n = probs.shape(probs.rank() - 1);
    let base = row * n;
    let mut shared = SharedMemory::<f32>::new(block as usize);

    if per_unit > 0 {
        let mut dps = Array::<f32>::new(per_unit as usize);
        let mut ps = Array::<f32>::new(per_unit as usize);
        let mut dot = f32::new(0.0);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * stride;
            let mut dp = f32::new(0.0);
            let mut p = f32::new(0.0);
            if j < n {
                dp = dropped_grad(
                    grad_dropped,
                    base + j,
                    j,
                    rk,
                    threshold,
                    keep_scale,
                    dropout,
                );
                p = f32::cast_from(probs[base + j]);
            }
            dps[t as usize] = dp;
            ps[t as usize] = p;
            dot += dp * p;
        }
        let dot = softmax_row_sum(&mut shared, dot, planes, plane_rows);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * stride;
            if j < n {
                grad_scores[base + j] =
                    F::cast_from(scale * ps[t as usize] * (dps[t as usize] - dot));
            }
        }
    } else {
        let mut dot = f32::new(0.0);
        let mut j = unit;
        while j < n {
            let idx = base + j;
            let dp = dropped_grad(grad_dropped, idx, j, rk, threshold, keep_scale, dropout);
            dot += dp * f32::cast_from(probs[idx]);
            j += stride;
        }
        let dot = softmax_row_sum(&mut shared, dot, planes, plane_rows);

        let mut j = unit;
        while j < n {
            let idx = base + j;
            let dp = dropped_grad(grad_dropped, idx, j, rk, threshold, keep_scale, dropout);
            let p = f32::cast_from(probs[idx]);
            grad_scores[idx] = F::cast_from(scale * p * (dp - dot));
            j += stride;
        }
    }
}

/// The forward's launch (`FusedOps::masked_softmax_dropout`): the probabilities and the
/// dropped probabilities of `[B, nh, Sq, Sk]` scores with a `[B, Sk]` additive mask.
pub(super) fn forward<R: CubeRuntime>(
    scores: CubeTensor<R>,
    mask_bias: CubeTensor<R>,
    scale: f64,
    dropout: DropoutSpec,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let scores = into_contiguous(scores);
    let [batch, heads, seq_q, seq_k] = scores.shape().dims::<4>();
    let rows = batch * heads * seq_q;
    check_rows(rows * seq_k);
    let probs = empty_like(&scores, scores.shape());
    let dropped = empty_like(&scores, scores.shape());
    let (count, dim, planes, layout) = reductions::softmax_launch(&scores.client, rows, seq_k);
    let mask = dropout_args(dropout, &[batch, heads, seq_q, seq_k]);
    let dtype = storage(scores.dtype);
    masked_softmax_dropout_kernel::launch::<R>(
        &scores.client,
        count,
        dim,
        scores.clone().into_tensor_arg(),
        into_contiguous(mask_bias).into_tensor_arg(),
        probs.clone().into_tensor_arg(),
        dropped.clone().into_tensor_arg(),
        rows as u32,
        (heads * seq_q).max(1) as u32,
        scale as f32,
        mask.key_lo,
        mask.key_hi,
        mask.sample_offset,
        mask.rows_per_sample,
        mask.seq,
        mask.threshold,
        mask.keep_scale,
        layout.block as u32,
        mask.enabled,
        planes,
        layout.per_unit as u32,
        layout.plane_rows,
        dtype,
    );
    (probs, dropped)
}

/// The backward's launch: `d scores` from the gradient of the dropped probabilities and the
/// probabilities, `[B, nh, Sq, Sk]`.
pub(super) fn backward<R: CubeRuntime>(
    grad_dropped: CubeTensor<R>,
    probs: CubeTensor<R>,
    scale: f64,
    dropout: DropoutSpec,
) -> CubeTensor<R> {
    let grad_dropped = into_contiguous(grad_dropped);
    let [batch, heads, seq_q, seq_k] = grad_dropped.shape().dims::<4>();
    let rows = batch * heads * seq_q;
    check_rows(rows * seq_k);
    let grad_scores = empty_like(&grad_dropped, grad_dropped.shape());
    let (count, dim, planes, layout) =
        reductions::softmax_launch(&grad_dropped.client, rows, seq_k);
    let mask = dropout_args(dropout, &[batch, heads, seq_q, seq_k]);
    let dtype = storage(grad_dropped.dtype);
    masked_softmax_dropout_backward_kernel::launch::<R>(
        &grad_dropped.client,
        count,
        dim,
        grad_dropped.clone().into_tensor_arg(),
        into_contiguous(probs).into_tensor_arg(),
        grad_scores.clone().into_tensor_arg(),
        rows as u32,
        scale as f32,
        mask.key_lo,
        mask.key_hi,
        mask.sample_offset,
        mask.rows_per_sample,
        mask.seq,
        mask.threshold,
        mask.keep_scale,
        layout.block as u32,
        mask.enabled,
        planes,
        layout.per_unit as u32,
        layout.plane_rows,
        dtype,
    );
    grad_scores
}
