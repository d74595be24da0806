//! NdArray's fused layer ops: bias + GELU, bias + dropout + residual add + LayerNorm, and the
//! attention's masked softmax + dropout, forward and backward, each as one pass per row on
//! rayon's threads (what the CubeCL kernels do on a GPU, `cube/`).
//!
//! The reference composition (`reference.rs`) computes each of them as five to twelve
//! whole-tensor Burn ops, and Burn 0.21's NdArray runs every one of those on one thread into a
//! freshly allocated array: for BERT at batch 8 × 128 on 2 cores the layer's elementwise work
//! was the largest cost of a step after the GEMMs (docs/performance.md, CPU performance). The arithmetic
//! here is the reference's, in f32, in the same order per element; reductions over a row
//! (LayerNorm's mean and variance, softmax's sum) are summed left to right, so results agree
//! with the reference to f32 rounding (`tests/tests/integration/kernels/mod.rs`, module
//! `ndarray`, holds the forward to 2e-5 absolute + 2e-5 relative and the backward to 1e-4 +
//! 1e-4, as for the kernels;
//! since the host loops became the default the training step's gain was small on its own:
//! OpenBLAS's worker spins on the other core while they run, docs/performance.md, CPU performance). Dropout masks
//! are the same keyed masks ([`DropoutSpec::keeps`]), computed per element instead of read.
//!
//! Each function returns `None` for what it does not handle (dtypes other than f32, shapes
//! that do not match); the caller falls back to the reference.

use burn_ndarray::NdArrayTensor;
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;

use crate::dropout::RowMask;
use crate::host_math;
use crate::{DropoutSpec, Gelu};

/// Elements per rayon task (whole rows, at least one).
const TASK_ELEMENTS: usize = 1 << 14;

fn rows_per_task(columns: usize) -> usize {
    (TASK_ELEMENTS / columns.max(1)).max(1)
}

/// `len` zeros, written by rayon's threads in chunks: a fresh output of a host loop, without
/// one thread's memset of the whole buffer before the parallel loop (~2% of a BERT-base step).
pub(crate) fn par_zeros(len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(TASK_ELEMENTS)
        .for_each(|chunk| chunk.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: the chunks cover the first `len` elements, all written above.
    unsafe { out.set_len(len) };
    out
}

fn output(shape: &[usize], values: Vec<f32>) -> NdArrayTensor {
    let array = ArrayD::from_shape_vec(IxDyn(shape), values).expect("the output has its shape");
    NdArrayTensor::from(array.into_shared())
}

/// A tensor's f32 values in row-major order (a copy only when it is not in standard layout),
/// handed to `f` with its shape; `None` for other dtypes.
fn with_values<R>(x: &NdArrayTensor, f: impl FnOnce(&[usize], &[f32]) -> Option<R>) -> Option<R> {
    let NdArrayTensor::F32(storage) = x else {
        return None;
    };
    let view = storage.view();
    let standard = crate::linear::standard_layout(view);
    f(standard.shape(), standard.as_slice()?)
}

/// `values` (rows of `n`, row-major) times `mask`, on rayon's threads.
fn masked(mask: RowMask, values: &[f32], n: usize) -> Vec<f32> {
    masked_rows(mask, values, n, |row| row)
}

/// [`masked`] with row `r` keyed as row `key_row(r)` of the mask (packed rows: their padded
/// rows).
fn masked_rows(
    mask: RowMask,
    values: &[f32],
    n: usize,
    key_row: impl Fn(usize) -> usize + Sync,
) -> Vec<f32> {
    let rows = rows_per_task(n);
    let mut out = par_zeros(values.len());
    out.par_chunks_mut(rows * n)
        .zip(values.par_chunks(rows * n))
        .enumerate()
        .for_each(|(task, (out, values))| {
            for (i, (out, values)) in out
                .chunks_exact_mut(n)
                .zip(values.chunks_exact(n))
                .enumerate()
            {
                let key = mask.row_key(key_row(task * rows + i));
                for (c, (o, &v)) in out.iter_mut().zip(values).enumerate() {
                    *o = v * mask.factor(key, c);
                }
            }
        });
    out
}

/// The dropout op, `x · mask`, on rayon's threads; with `rows`, row `t` of `x` keyed as row
/// `rows[t]` of the padded rows (`PackedRowOps::dropout_rows`). The reference's product per
/// element. `None` for dtypes other than f32, dropout off, or a row map of another length.
pub(crate) fn dropout(
    x: &NdArrayTensor,
    spec: DropoutSpec,
    rows: Option<&[i64]>,
) -> Option<NdArrayTensor> {
    if !spec.enabled() {
        return None;
    }
    with_values(x, |shape, values| {
        let n = shape.last().copied()?.max(1);
        let out = match rows {
            None => masked(RowMask::new(spec, shape)?, values, n),
            Some(rows) if rows.len() * n == values.len() => {
                masked_rows(RowMask::packed(spec), values, n, |r| rows[r] as usize)
            }
            Some(_) => return None,
        };
        Some(output(shape, out))
    })
}

/// `GELU(x + bias)` of the chosen form, as the reference. `x` `[R, N]`, `bias` `[N]`.
pub(crate) fn bias_gelu(
    x: &NdArrayTensor,
    bias: &NdArrayTensor,
    gelu: Gelu,
) -> Option<NdArrayTensor> {
    with_values(x, |shape, x| {
        with_values(bias, |bias_shape, bias| {
            let n = *shape.last()?;
            if bias_shape != [n] || n == 0 {
                return None;
            }
            let mut out = par_zeros(x.len());
            out.par_chunks_mut(rows_per_task(n) * n)
                .zip(x.par_chunks(rows_per_task(n) * n))
                .for_each(|(out, x)| host_math::bias_gelu_rows(x, bias, out, gelu));
            Some(output(shape, out))
        })
    })
}

/// `grad · GELU'(z)`, `z = x + bias`. `x`, `grad` `[R, N]`, `bias` `[N]`.
pub(crate) fn bias_gelu_backward(
    x: &NdArrayTensor,
    bias: &NdArrayTensor,
    grad: &NdArrayTensor,
    gelu: Gelu,
) -> Option<NdArrayTensor> {
    with_values(x, |shape, x| {
        with_values(bias, |bias_shape, bias| {
            with_values(grad, |grad_shape, grad| {
                let n = *shape.last()?;
                if bias_shape != [n] || grad_shape != shape || n == 0 {
                    return None;
                }
                let task = rows_per_task(n) * n;
                let mut out = par_zeros(x.len());
                out.par_chunks_mut(task)
                    .zip(x.par_chunks(task).zip(grad.par_chunks(task)))
                    .for_each(|(out, (x, grad))| {
                        host_math::bias_gelu_backward_rows(x, bias, grad, out, gelu)
                    });
                Some(output(shape, out))
            })
        })
    })
}

/// The outputs of [`layer_norm`]: output and pre-norm `[R, N]`, mean and rstd `[R]`.
pub(crate) type LayerNormParts = [NdArrayTensor; 4];

/// The dropout mask of a fused LayerNorm's `[R, N]` rows (`None`: dropout off) and the row
/// that keys row `r`: itself, or with `rows` (packed rows, `PackedRowOps::dropout_rows`) its padded
/// row `rows[r]`. `Err` for a row map of another length than R.
#[allow(clippy::type_complexity)]
fn layer_norm_mask<'a>(
    spec: DropoutSpec,
    shape: &[usize],
    rows: Option<&'a [i64]>,
) -> Result<(Option<RowMask>, impl Fn(usize) -> usize + Sync + 'a), ()> {
    let r = shape.first().copied().unwrap_or(0);
    let mask = match rows {
        Some(rows) if rows.len() != r => return Err(()),
        Some(_) => spec.enabled().then(|| RowMask::packed(spec)),
        None => RowMask::new(spec, shape),
    };
    Ok((mask, move |row: usize| {
        rows.map_or(row, |rows| {
            usize::try_from(rows[row]).expect("a padded row index")
        })
    }))
}

/// `LayerNorm(residual + dropout(x + bias)) · gamma + beta` over rows of `[R, N]`
/// (`[x, bias, residual, gamma, beta]`), with what the backward needs; with `rows`, row `r`'s
/// mask keyed as padded row `rows[r]`. Mean and variance are summed left to right in f32;
/// `rstd = 1/√(var + eps)` as the reference.
pub(crate) fn layer_norm(
    [x, bias, residual, gamma, beta]: [&NdArrayTensor; 5],
    dropout: DropoutSpec,
    rows: Option<&[i64]>,
    eps: f64,
) -> Option<LayerNormParts> {
    with_values(x, |shape, x| {
        with_values(residual, |residual_shape, residual| {
            with_values(bias, |bias_shape, bias| {
                with_values(gamma, |gamma_shape, gamma| {
                    with_values(beta, |beta_shape, beta| {
                        let &[r, n] = shape else { return None };
                        if residual_shape != shape
                            || [bias_shape, gamma_shape, beta_shape] != [[n]; 3]
                            || n == 0
                        {
                            return None;
                        }
                        let (mask, key_row) = layer_norm_mask(dropout, shape, rows).ok()?;
                        let eps = eps as f32;
                        let rows = rows_per_task(n);
                        let mut out = par_zeros(r * n);
                        let mut pre = par_zeros(r * n);
                        let mut mean = par_zeros(r);
                        let mut rstd = par_zeros(r);
                        out.par_chunks_mut(rows * n)
                            .zip(pre.par_chunks_mut(rows * n))
                            .zip(mean.par_chunks_mut(rows).zip(rstd.par_chunks_mut(rows)))
                            .enumerate()
                            .for_each(|(task, ((out, pre), (mean, rstd)))| {
                                for (i, (out, pre)) in out
                                    .chunks_exact_mut(n)
                                    .zip(pre.chunks_exact_mut(n))
                                    .enumerate()
                                {
                                    let row = task * rows + i;
                                    let x = &x[row * n..(row + 1) * n];
                                    let residual = &residual[row * n..(row + 1) * n];
                                    match mask {
                                        Some(mask) => {
                                            let key = mask.row_key(key_row(row));
                                            for (c, p) in pre.iter_mut().enumerate() {
                                                *p = (x[c] + bias[c]) * mask.factor(key, c)
                                                    + residual[c];
                                            }
                                        }
                                        None => {
                                            for (c, p) in pre.iter_mut().enumerate() {
                                                *p = x[c] + bias[c] + residual[c];
                                            }
                                        }
                                    }
                                    let (mu, rs) =
                                        host_math::layer_norm_row(pre, gamma, beta, eps, out);
                                    mean[i] = mu;
                                    rstd[i] = rs;
                                }
                            });
                        Some([
                            output(shape, out),
                            output(shape, pre),
                            output(&[r], mean),
                            output(&[r], rstd),
                        ])
                    })
                })
            })
        })
    })
}

/// Backward of [`layer_norm`] (`[grad, pre_norm, mean, rstd, gamma]`, `rows` as the
/// forward's): `[grad_pre_norm, grad_x, grad_x_hat]`, each `[R, N]` (see
/// [`crate::LayerNormBackward`]).
pub(crate) fn layer_norm_backward(
    [grad, pre_norm, mean, rstd, gamma]: [&NdArrayTensor; 5],
    dropout: DropoutSpec,
    rows: Option<&[i64]>,
) -> Option<[NdArrayTensor; 3]> {
    with_values(grad, |shape, grad| {
        with_values(pre_norm, |pre_shape, pre| {
            with_values(mean, |mean_shape, mean| {
                with_values(rstd, |rstd_shape, rstd| {
                    with_values(gamma, |gamma_shape, gamma| {
                        let &[r, n] = shape else { return None };
                        if pre_shape != shape
                            || mean_shape != [r]
                            || rstd_shape != [r]
                            || gamma_shape != [n]
                            || n == 0
                        {
                            return None;
                        }
                        let (mask, key_row) = layer_norm_mask(dropout, shape, rows).ok()?;
                        let rows = rows_per_task(n);
                        let mut grad_pre = par_zeros(r * n);
                        let mut grad_x_hat = par_zeros(r * n);
                        grad_pre
                            .par_chunks_mut(rows * n)
                            .zip(grad_x_hat.par_chunks_mut(rows * n))
                            .enumerate()
                            .for_each(|(t, (grad_pre, grad_x_hat))| {
                                for (i, (dp, dxh)) in grad_pre
                                    .chunks_exact_mut(n)
                                    .zip(grad_x_hat.chunks_exact_mut(n))
                                    .enumerate()
                                {
                                    let row = t * rows + i;
                                    let (mu, rs) = (mean[row], rstd[row]);
                                    let grad = &grad[row * n..(row + 1) * n];
                                    let pre = &pre[row * n..(row + 1) * n];
                                    host_math::layer_norm_backward_row(
                                        grad, pre, gamma, mu, rs, dp, dxh,
                                    );
                                }
                            });
                        let grad_x = mask
                            .map(|mask| output(shape, masked_rows(mask, &grad_pre, n, key_row)));
                        let grad_pre = output(shape, grad_pre);
                        let grad_x = grad_x.unwrap_or_else(|| grad_pre.clone());
                        Some([grad_pre, grad_x, output(shape, grad_x_hat)])
                    })
                })
            })
        })
    })
}

/// `softmax(scores · scale + mask_bias)` over the last dim, then dropout: `[probs, dropped]`
/// (the same array when dropout is off). `scores` `[B, nh, S, S]`, `mask_bias` `[B, S]`.
/// Max-shifted as Burn's `softmax`.
pub(crate) fn masked_softmax(
    scores: &NdArrayTensor,
    mask_bias: &NdArrayTensor,
    scale: f64,
    dropout: DropoutSpec,
) -> Option<[NdArrayTensor; 2]> {
    with_values(scores, |shape, scores| {
        with_values(mask_bias, |mask_shape, mask_bias| {
            let &[b, heads, sq, s] = shape else {
                return None;
            };
            if mask_shape != [b, s] || s == 0 {
                return None;
            }
            let per_sample = heads * sq;
            let scale = scale as f32;
            let task = rows_per_task(s) * s;
            let mut probs = par_zeros(scores.len());
            probs
                .par_chunks_mut(task)
                .enumerate()
                .for_each(|(t, probs)| {
                    let rows = task / s;
                    for (i, p) in probs.chunks_exact_mut(s).enumerate() {
                        let row = t * rows + i;
                        let x = &scores[row * s..(row + 1) * s];
                        let bias = &mask_bias[(row / per_sample) * s..(row / per_sample + 1) * s];
                        for ((p, &x), &m) in p.iter_mut().zip(x).zip(bias) {
                            *p = x * scale + m;
                        }
                        let max = host_math::max(p);
                        let sum = host_math::exp_in_place_sum(p, max);
                        for p in p.iter_mut() {
                            *p /= sum;
                        }
                    }
                });
            let dropped =
                RowMask::new(dropout, shape).map(|mask| output(shape, masked(mask, &probs, s)));
            let probs_tensor = output(shape, probs);
            let dropped = dropped.unwrap_or_else(|| probs_tensor.clone());
            Some([probs_tensor, dropped])
        })
    })
}

/// Gradient of the raw scores of [`masked_softmax`]: `scale · P · (dP − Σ dP·P)` with `dP` the
/// gradient through the dropout mask. `grad_dropped`, `probs` `[B, nh, S, S]`.
pub(crate) fn masked_softmax_backward(
    grad_dropped: &NdArrayTensor,
    probs: &NdArrayTensor,
    scale: f64,
    dropout: DropoutSpec,
) -> Option<NdArrayTensor> {
    with_values(grad_dropped, |shape, grad| {
        with_values(probs, |probs_shape, probs| {
            if probs_shape != shape || shape.len() != 4 {
                return None;
            }
            let s = shape[3];
            if s == 0 {
                return None;
            }
            let mask = RowMask::new(dropout, shape);
            let scale = scale as f32;
            let task = rows_per_task(s) * s;
            let mut out = par_zeros(grad.len());
            out.par_chunks_mut(task).enumerate().for_each(|(t, out)| {
                let rows = task / s;
                for (i, o) in out.chunks_exact_mut(s).enumerate() {
                    let row = t * rows + i;
                    let g = &grad[row * s..(row + 1) * s];
                    let p = &probs[row * s..(row + 1) * s];
                    // dP into the output row first, then the row's dot product.
                    match mask {
                        Some(mask) => {
                            let key = mask.row_key(row);
                            for (c, o) in o.iter_mut().enumerate() {
                                *o = g[c] * mask.factor(key, c);
                            }
                        }
                        None => o.copy_from_slice(g),
                    }
                    let dot = host_math::dot(o, p);
                    for (o, &p) in o.iter_mut().zip(p) {
                        *o = p * (*o - dot) * scale;
                    }
                }
            });
            Some(output(shape, out))
        })
    })
}
