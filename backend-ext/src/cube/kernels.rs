//! The CubeCL kernels. Element types are defined at launch (`#[define(F)]`: f32, f16 or bf16);
//! arithmetic and reductions run in f32.
//!
//! Row kernels (LayerNorm, softmax) give one cube to a row: its units stride over the row and
//! reduce across the cube by planes or by a tree in shared memory (`CUBE_DIM_X` a power of
//! two; Note [Row reductions] in `reductions.rs`, the `planes` argument). Rows are numbered
//! `CUBE_POS_X + CUBE_POS_Y · CUBE_COUNT_X`, so more rows than one grid dimension holds still fit.

use cubecl::prelude::*;

use super::reductions::{row_sum, row_sum_pair};

/// PCG's RXS-M-XS output permutation; the host's `dropout::pcg_hash`.
#[cube]
fn pcg_hash(v: u32) -> u32 {
    let state = v * 747796405u32 + 2891336453u32;
    let word = ((state >> ((state >> 28u32) + 4u32)) ^ state) * 277803737u32;
    (word >> 22u32) ^ word
}

/// The key of row `row` of a dropout mask (the host's `dropout::row_key`): the row is row
/// `row mod rows_per_sample` of sample `sample_offset + row / rows_per_sample`, and the key
/// takes the sample and the row's position in it, never the padded length.
#[cube]
pub(super) fn row_key(
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    row: u32,
) -> u32 {
    let sample = sample_offset + row / rows_per_sample;
    let within = row % rows_per_sample;
    let canonical = (within / seq) * 65536u32 + within % seq;
    let sample_key = pcg_hash(key_lo ^ pcg_hash(key_hi ^ pcg_hash(sample)));
    pcg_hash(sample_key ^ pcg_hash(canonical + 0x9e3779b9u32))
}

/// The row that keys row `row`'s dropout mask: itself, or with `mapped` (packed rows,
/// `PackedRowOps::dropout_rows`) its padded row `padded_rows[row]`.
#[cube]
fn mask_row<I: Int>(padded_rows: &Tensor<I>, row: usize, #[comptime] mapped: bool) -> u32 {
    let mut key_row = row as u32;
    if mapped {
        key_row = u32::cast_from(padded_rows[row]);
    }
    key_row
}

/// The dropout scale of element `column` of a row keyed `rk`: `keep_scale` if kept, 0 if
/// dropped (the host's `dropout::keeps`).
#[cube]
pub(super) fn dropout_scale(column: usize, rk: u32, threshold: u32, keep_scale: f32) -> f32 {
    let bits = pcg_hash(pcg_hash((column as u32) ^ rk) + rk);
    let mut scale = f32::new(0.0);
    if (bits >> 8u32) >= threshold {
        scale = keep_scale;
    }
    scale
}

#[cube]
pub(super) fn row_index() -> usize {
    (CUBE_POS_X + CUBE_POS_Y * CUBE_COUNT_X) as usize
}

/// `Φ(z) = ½ (1 + erf(z/√2))`.
#[cube]
fn normal_cdf(z: f32) -> f32 {
    f32::new(0.5) * (f32::new(1.0) + Erf::erf(z * f32::new(std::f32::consts::FRAC_1_SQRT_2)))
}

/// The tanh GELU's gate `σ(t)`, `t = 2u = 2√(2/π)(z + 0.044715 z³)` (Note [Two GELUs] in
/// `gelu.rs`; 2√(2/π) = 1.5957692): `1 / (1 + e)` for `t ≥ 0`, `e / (1 + e)` below, with
/// `e = e^(−|t|) ≤ 1`, so that no exponential overflows.
#[cube]
fn tanh_gate(z: f32) -> f32 {
    let z = clamp(z, f32::new(-15.0), f32::new(15.0)); // GELU_TANH_CLAMP
    let t = (z + f32::new(0.044_715) * z * z * z) * f32::new(1.595_769_2);
    let mut neg_abs = t;
    if t > f32::new(0.0) {
        neg_abs = -t;
    }
    let e = neg_abs.exp();
    let r = f32::new(1.0) / (f32::new(1.0) + e);
    let mut gate = e * r;
    if t >= f32::new(0.0) {
        gate = r;
    }
    gate
}

/// `GELU(x + bias)`: erf, `z · Φ(z)`; with `tanh`, `z · σ(2u)`.
#[cube(launch)]
pub fn bias_gelu_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    output: &mut Tensor<F>,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= output.len() {
        terminate!();
    }
    let z = f32::cast_from(x[i]) + f32::cast_from(bias[i % bias.len()]);
    if tanh {
        output[i] = F::cast_from(z * tanh_gate(z));
    } else {
        output[i] = F::cast_from(z * normal_cdf(z));
    }
}

/// `grad · GELU'(z)`: erf, `Φ(z) + z·φ(z)`; with `tanh`, `σ(2u) + z · σ(2u)(1 − σ(2u)) · 2u'`.
#[cube(launch)]
pub fn bias_gelu_backward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    grad: &Tensor<F>,
    output: &mut Tensor<F>,
    #[comptime] tanh: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= output.len() {
        terminate!();
    }
    let z = f32::cast_from(x[i]) + f32::cast_from(bias[i % bias.len()]);
    if tanh {
        let gate = tanh_gate(z);
        // 2u' = 2√(2/π)(1 + 3·0.044715 z²)
        let c = clamp(z, f32::new(-15.0), f32::new(15.0)); // GELU_TANH_CLAMP
        let du = (f32::new(1.0) + f32::new(0.134_145) * c * c) * f32::new(1.595_769_2);
        let slope = gate * (f32::new(1.0) - gate) * du;
        output[i] = F::cast_from(f32::cast_from(grad[i]) * (gate + z * slope));
    } else {
        // φ(z) = exp(−z²/2) / √(2π)
        let pdf = (f32::new(-0.5) * z * z).exp() * f32::new(0.398_942_3);
        output[i] = F::cast_from(f32::cast_from(grad[i]) * (normal_cdf(z) + z * pdf));
    }
}

/// `residual + dropout(x + bias)` at element `idx` (column `j`) of a LayerNorm row, in f32.
#[cube]
#[allow(clippy::too_many_arguments)]
fn pre_norm_value<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    residual: &Tensor<F>,
    idx: usize,
    j: usize,
    rk: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] dropout: bool,
) -> f32 {
    let mut z = f32::cast_from(x[idx]) + f32::cast_from(bias[j]);
    if dropout {
        z *= dropout_scale(j, rk, threshold, keep_scale);
    }
    z + f32::cast_from(residual[idx])
}

/// One cube per row: `y = residual + dropout(x + bias)`, then LayerNorm of y (two-pass
/// variance over the stored y). With `per_unit` > 0 each unit keeps its `per_unit` elements of
/// y, as stored, in registers instead of reading them back twice (Note [Softmax rows in
/// registers] in `reductions.rs`: the same values, the same bits). With `mapped`, row r's
/// dropout mask is keyed as padded row `padded_rows[r]` (packed rows; otherwise
/// `padded_rows` is not read).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add_layer_norm_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    residual: &Tensor<F>,
    gamma: &Tensor<F>,
    beta: &Tensor<F>,
    padded_rows: &Tensor<I>,
    pre_norm: &mut Tensor<F>,
    output: &mut Tensor<F>,
    mean_out: &mut Tensor<f32>,
    rstd_out: &mut Tensor<f32>,
    rows: u32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    eps: f32,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
    #[comptime] mapped: bool,
    #[comptime] planes: bool,
    #[comptime] per_unit: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let rk = row_key(
        key_lo,
        key_hi,
        sample_offset,
        rows_per_sample,
        seq,
        mask_row(padded_rows, row, mapped),
    );
    let n = gamma.len();
    let base = row * n;
    let unit = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block as usize);

    if per_unit > 0 {
        // y as stored (rounded to F), as the streaming form reads it back.
        let mut stored = Array::<f32>::new(per_unit as usize);
        let mut sum = f32::new(0.0);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * block as usize;
            let mut kept = f32::new(0.0);
            if j < n {
                let idx = base + j;
                let y = pre_norm_value(
                    x, bias, residual, idx, j, rk, threshold, keep_scale, dropout,
                );
                let y_stored = F::cast_from(y);
                pre_norm[idx] = y_stored;
                kept = f32::cast_from(y_stored);
                sum += y;
            }
            stored[t as usize] = kept;
        }
        let mean = row_sum(&mut shared, sum, planes) / f32::cast_from(n as u32);
        let mut squares = f32::new(0.0);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * block as usize;
            if j < n {
                let centered = stored[t as usize] - mean;
                squares += centered * centered;
            }
        }
        let var = row_sum(&mut shared, squares, planes) / f32::cast_from(n as u32);
        let rstd = f32::new(1.0) / (var + eps).sqrt();
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * block as usize;
            if j < n {
                let x_hat = (stored[t as usize] - mean) * rstd;
                output[base + j] =
                    F::cast_from(x_hat * f32::cast_from(gamma[j]) + f32::cast_from(beta[j]));
            }
        }
        if unit == 0 {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
    } else {
        let mut sum = f32::new(0.0);
        let mut j = unit;
        while j < n {
            let idx = base + j;
            let y = pre_norm_value(
                x, bias, residual, idx, j, rk, threshold, keep_scale, dropout,
            );
            pre_norm[idx] = F::cast_from(y);
            sum += y;
            j += block as usize;
        }
        let mean = row_sum(&mut shared, sum, planes) / f32::cast_from(n as u32);

        let mut squares = f32::new(0.0);
        let mut j = unit;
        while j < n {
            let centered = f32::cast_from(pre_norm[base + j]) - mean;
            squares += centered * centered;
            j += block as usize;
        }
        let var = row_sum(&mut shared, squares, planes) / f32::cast_from(n as u32);
        let rstd = f32::new(1.0) / (var + eps).sqrt();

        let mut j = unit;
        while j < n {
            let idx = base + j;
            let x_hat = (f32::cast_from(pre_norm[idx]) - mean) * rstd;
            output[idx] = F::cast_from(x_hat * f32::cast_from(gamma[j]) + f32::cast_from(beta[j]));
            j += block as usize;
        }
        if unit == 0 {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
    }
}

/// One cube per row: `dy = rstd · (g − mean(g) − x̂ · mean(g·x̂))`, `g = grad · gamma`; writes
/// dy, dy through the dropout mask, and `grad · x̂`. With `per_unit` > 0 each unit keeps its
/// elements' `g` and `x̂` in registers for the second pass instead of reading `grad`,
/// `pre_norm` and `gamma` again.
///
/// Note [LayerNorm backward order]: dy is computed as apex's `cuComputeGradInput`
/// (csrc/layer_norm_cuda_kernel.cu) does, `(N·g − Σg − x̂·Σ(g·x̂)) · rstd / N`, not as
/// `(g − Σg/N − ..) · rstd`. Both are the same number in exact arithmetic, but rstd can be
/// huge (`1/√eps` = 1e6 for a constant row, and for hidden size 1 every row is constant), so
/// a rounding difference between the `g` inside `Σg` and the `g` of the second pass is
/// amplified a million times. NVRTC contracts `g − mean` into `fma(grad, gamma, −mean)`, an
/// unrounded `g` against the rounded one of the sum: on an H200 hidden size 1 gave dx =
/// 0.014 where 0 is exact. In apex's order `g` enters only as a rounded factor
/// (`fma(g, N, −Σg)`), so a constant row's `N·g − Σg` is exactly 0 for N = 1 and the
/// difference of two roundings of the same sum otherwise. `padded_rows` and `mapped` as the
/// forward kernel's.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward_kernel<F: Float, I: Int>(
    grad: &Tensor<F>,
    pre_norm: &Tensor<F>,
    mean: &Tensor<f32>,
    rstd: &Tensor<f32>,
    gamma: &Tensor<F>,
    padded_rows: &Tensor<I>,
    grad_pre_norm: &mut Tensor<F>,
    grad_x: &mut Tensor<F>,
    grad_x_hat: &mut Tensor<F>,
    rows: u32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
    #[comptime] dropout: bool,
    #[comptime] mapped: bool,
    #[comptime] planes: bool,
    #[comptime] per_unit: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let rk = row_key(
        key_lo,
        key_hi,
        sample_offset,
        rows_per_sample,
        seq,
        mask_row(padded_rows, row, mapped),
    );
    let n = gamma.len();
    let base = row * n;
    let unit = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(2 * block as usize); // Σg and Σg·x̂ side by side
    let mu = mean[row];
    let rs = rstd[row];

    if per_unit > 0 {
        let mut gs = Array::<f32>::new(per_unit as usize);
        let mut x_hats = Array::<f32>::new(per_unit as usize);
        let mut sum_g = f32::new(0.0);
        let mut sum_gx = f32::new(0.0);
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * block as usize;
            let mut g = f32::new(0.0);
            let mut x_hat = f32::new(0.0);
            if j < n {
                let idx = base + j;
                let dy = f32::cast_from(grad[idx]);
                x_hat = (f32::cast_from(pre_norm[idx]) - mu) * rs;
                g = dy * f32::cast_from(gamma[j]);
                sum_g += g;
                sum_gx += g * x_hat;
                grad_x_hat[idx] = F::cast_from(dy * x_hat);
            }
            gs[t as usize] = g;
            x_hats[t as usize] = x_hat;
        }
        // Note [LayerNorm backward order].
        let n_f = f32::cast_from(n as u32);
        let (sum_g, sum_gx) = row_sum_pair(&mut shared, sum_g, sum_gx, planes);
        let scale = rs / n_f;
        #[unroll]
        for t in 0..per_unit {
            let j = unit + t as usize * block as usize;
            if j < n {
                let idx = base + j;
                let d = (gs[t as usize] * n_f - sum_g - x_hats[t as usize] * sum_gx) * scale;
                grad_pre_norm[idx] = F::cast_from(d);
                if dropout {
                    grad_x[idx] = F::cast_from(d * dropout_scale(j, rk, threshold, keep_scale));
                } else {
                    grad_x[idx] = F::cast_from(d);
                }
            }
        }
    } else {
        let mut sum_g = f32::new(0.0);
        let mut sum_gx = f32::new(0.0);
        let mut j = unit;
        while j < n {
            let idx = base + j;
            let dy = f32::cast_from(grad[idx]);
            let x_hat = (f32::cast_from(pre_norm[idx]) - mu) * rs;
            let g = dy * f32::cast_from(gamma[j]);
            sum_g += g;
            sum_gx += g * x_hat;
            grad_x_hat[idx] = F::cast_from(dy * x_hat);
            j += block as usize;
        }
        // Note [LayerNorm backward order].
        let n_f = f32::cast_from(n as u32);
        let (sum_g, sum_gx) = row_sum_pair(&mut shared, sum_g, sum_gx, planes);
        let scale = rs / n_f;

        let mut j = unit;
        while j < n {
            let idx = base + j;
            let x_hat = (f32::cast_from(pre_norm[idx]) - mu) * rs;
            let g = f32::cast_from(grad[idx]) * f32::cast_from(gamma[j]);
            let d = (g * n_f - sum_g - x_hat * sum_gx) * scale;
            grad_pre_norm[idx] = F::cast_from(d);
            if dropout {
                grad_x[idx] = F::cast_from(d * dropout_scale(j, rk, threshold, keep_scale));
            } else {
                grad_x[idx] = F::cast_from(d);
            }
            j += block as usize;
        }
    }
}

/// One cube per row of `[R, N]`: `output = x · mask`, the scaled keep mask of the row (dropout,
/// and its backward applied to the gradient).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout_kernel<F: Float>(
    x: &Tensor<F>,
    output: &mut Tensor<F>,
    rows: u32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
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
    dropout_row(x, output, row, rk, threshold, keep_scale, block);
}

/// Row `row` of `output` = row `row` of `x` times the mask of the row keyed `rk`, the cube's
/// units striding over the row.
#[cube]
fn dropout_row<F: Float>(
    x: &Tensor<F>,
    output: &mut Tensor<F>,
    row: usize,
    rk: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
) {
    let n = x.shape(x.rank() - 1);
    let base = row * n;
    let mut j = UNIT_POS_X as usize;
    while j < n {
        let idx = base + j;
        output[idx] =
            F::cast_from(f32::cast_from(x[idx]) * dropout_scale(j, rk, threshold, keep_scale));
        j += block as usize;
    }
}

/// [`dropout_kernel`] of packed rows (`PackedRowOps::dropout_rows`): row `r` of `x` is keyed as
/// row `padded_rows[r]` of the padded rows, `seq` of them per sample.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn dropout_rows_kernel<F: Float, I: Int>(
    x: &Tensor<F>,
    padded_rows: &Tensor<I>,
    output: &mut Tensor<F>,
    rows: u32,
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    #[comptime] block: u32,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let padded = u32::cast_from(padded_rows[row]);
    let rk = row_key(key_lo, key_hi, sample_offset, seq, seq, padded);
    dropout_row(x, output, row, rk, threshold, keep_scale, block);
}

// Multi-tensor kernels (apex's `multi_tensor_apply`): one launch updates or reduces a list of
// tensors, passed as `Sequence`s (one binding each). The element-wise ones run on a packed
// 1-D grid, tensor t's cubes after those of the tensors before it (Note [Packed multi-tensor
// grids] in `multi_tensor.rs`); the reductions on a `[G, T]` grid, cube row `CUBE_POS_Y`
// striding over tensor `CUBE_POS_Y`. A sequence is indexed with comptime indices only, so
// each tensor's body is unrolled under its own test of the cube's position; a launch
// compiles once per tensor count.
