//! The multi-tensor kernels (apex's `multi_tensor_apply` family): the optimizers' updates and
//! the squared norms of many tensors per launch, and the fixed-order sum of rows that finishes
//! those norms. Element types are defined at launch; arithmetic runs in f32.

use cubecl::prelude::*;

use super::kernels::row_index;
use super::reductions::cube_sum;

/// The cubes tensor `len` gets in a packed multi-tensor grid (Note [Packed multi-tensor
/// grids] in `multi_tensor.rs`): one per `CUBE_DIM_X` elements, at least one, at most
/// `max_cubes` (more elements are strided over); the host's `multi_tensor::tensor_cubes`.
#[cube]
fn tensor_cubes(len: usize, #[comptime] max_cubes: u32) -> usize {
    let dim = CUBE_DIM_X as usize;
    let most = max_cubes as usize;
    let mut cubes = len.div_ceil(dim);
    if cubes > most {
        cubes = most;
    }
    if cubes == 0 {
        cubes = 1;
    }
    cubes
}

/// Element `i` of an Adam-family step: the new moments, and the new parameter (`lamb`: the
/// update direction `m̂/(sqrt(v̂)+ε) + λ·w`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn adam_element<F: Float>(
    param: &Tensor<F>,
    grad: &Tensor<F>,
    moment_1: &Tensor<F>,
    moment_2: &Tensor<F>,
    output: &mut Tensor<F>,
    moment_1_out: &mut Tensor<F>,
    moment_2_out: &mut Tensor<F>,
    i: usize,
    lr: f32,
    weight_decay: f32,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    correction_1: f32,
    correction_2: f32,
    #[comptime] lamb: bool,
) {
    let g = f32::cast_from(grad[i]);
    let m = beta_1 * f32::cast_from(moment_1[i]) + (f32::new(1.0) - beta_1) * g;
    let v = beta_2 * f32::cast_from(moment_2[i]) + (f32::new(1.0) - beta_2) * g * g;
    moment_1_out[i] = F::cast_from(m);
    moment_2_out[i] = F::cast_from(v);
    let direction = (m / correction_1) / ((v / correction_2).sqrt() + epsilon);
    let w = f32::cast_from(param[i]);
    if lamb {
        output[i] = F::cast_from(direction + weight_decay * w);
    } else {
        output[i] = F::cast_from(w * (f32::new(1.0) - lr * weight_decay) - lr * direction);
    }
}

/// An AdamW step (`lamb` false) or LAMB's update (`lamb` true) of every tensor in `params`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn multi_adam_kernel<F: Float>(
    params: &Sequence<Tensor<F>>,
    grads: &Sequence<Tensor<F>>,
    moments_1: &Sequence<Tensor<F>>,
    moments_2: &Sequence<Tensor<F>>,
    outputs: &mut Sequence<Tensor<F>>,
    moments_1_out: &mut Sequence<Tensor<F>>,
    moments_2_out: &mut Sequence<Tensor<F>>,
    lr: f32,
    weight_decay: f32,
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    correction_1: f32,
    correction_2: f32,
    #[comptime] lamb: bool,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = params.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    #[unroll]
    for t in 0..count {
        let n = params[t].len();
        let cubes = tensor_cubes(n, max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < n {
                adam_element(
                    &params[t],
                    &grads[t],
                    &moments_1[t],
                    &moments_2[t],
                    outputs.index_mut(t),
                    moments_1_out.index_mut(t),
                    moments_2_out.index_mut(t),
                    i,
                    lr,
                    weight_decay,
                    beta_1,
                    beta_2,
                    epsilon,
                    correction_1,
                    correction_2,
                    lamb,
                );
                i += stride;
            }
        }
        start += cubes;
    }
}

/// Partial sums of `x²` of every tensor in `xs`: cube `(g, t)` writes
/// `partials[first + t, g]` (G = `CUBE_COUNT_X` columns); the sum over g is tensor t's `Σx²`.
#[cube(launch)]
pub fn multi_sum_squares_kernel<F: Float>(
    xs: &Sequence<Tensor<F>>,
    partials: &mut Tensor<F>,
    first: u32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = xs.len().comptime();
    let tensor = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    let mut shared = SharedMemory::<f32>::new(block as usize);
    let mut sum = f32::new(0.0);
    #[unroll]
    for t in 0..count {
        if tensor == t {
            let x = &xs[t];
            let mut i = CUBE_POS_X as usize * CUBE_DIM_X as usize + unit;
            while i < x.len() {
                let v = f32::cast_from(x[i]);
                sum += v * v;
                i += stride;
            }
        }
    }
    let total = cube_sum(&mut shared, sum);
    if unit == 0 {
        let row = first as usize + tensor;
        partials[row * CUBE_COUNT_X as usize + CUBE_POS_X as usize] = F::cast_from(total);
    }
}

/// The clip coefficient `min(1, max_norm / (√sq_norm + 1e-6))` in f32, with the operations of
/// Burn's composition in their order (`bucket_ops::clip_coefficient`), in `F`.
#[cube]
fn clip_coefficient<F: Float>(sq_norm: F, max_norm: f32) -> F {
    let one = f32::new(1.0);
    let root = f32::sqrt(f32::cast_from(sq_norm));
    let raw = (one / (root + f32::new(1e-6))) * max_norm;
    // Burn's `clamp_max`: `1` where the value is greater, else the value (a NaN stays NaN,
    // where `min` may return 1).
    F::cast_from(select(raw > one, one, raw))
}

/// `x` multiplied in place by the clip coefficient of its own squared norm, which each cube
/// finishes from `partials` (`[G]`, [`multi_sum_squares_kernel`]'s partial sums of `x²`):
/// every unit sums its strided share of them, then the cube's tree (`block` = `CUBE_DIM_X`
/// units), the additions of [`sum_rows_ordered_kernel`] in its order, so the same bits (its
/// cube of `b` ≤ `block` units adds what this one's first `b` units add; the others hold
/// +0). Cube 0 writes that squared norm to `sq_norm[0]`. Bucket-wise clipping in two
/// launches instead of three (Note [Clipped by its own norm] in `bucket_ops.rs`).
#[cube(launch)]
pub fn clip_by_partials_kernel<F: Float>(
    x: &mut Tensor<F>,
    partials: &Tensor<F>,
    sq_norm: &mut Tensor<F>,
    max_norm: f32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let unit = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block as usize);
    let mut sum = f32::new(0.0);
    let mut c = unit;
    while c < partials.len() {
        sum += f32::cast_from(partials[c]);
        c += block as usize;
    }
    let total = F::cast_from(cube_sum(&mut shared, sum));
    if CUBE_POS_X == 0 && unit == 0 {
        sq_norm[0] = total;
    }
    let coefficient = clip_coefficient::<F>(total, max_norm);
    let stride = CUBE_COUNT_X as usize * CUBE_DIM_X as usize;
    let mut i = CUBE_POS_X as usize * CUBE_DIM_X as usize + unit;
    while i < x.len() {
        x[i] = x[i] * coefficient;
        i += stride;
    }
}

/// Every tensor in `xs` multiplied in place by the clip coefficient
/// `min(1, max_norm / (√sq_norm[0] + 1e-6))`, which each unit computes from the squared norm
/// in f32 with the operations of Burn's composition in their order
/// (`bucket_ops::clip_coefficient`; for f32 buckets the same bits). Cube `(g, t)` scales part
/// of tensor t (Note [Clipped in one launch]).
#[cube(launch)]
pub fn multi_clip_kernel<F: Float>(
    xs: &mut Sequence<Tensor<F>>,
    sq_norm: &Tensor<F>,
    max_norm: f32,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = xs.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    let coefficient = clip_coefficient::<F>(sq_norm[0], max_norm);
    #[unroll]
    for t in 0..count {
        let cubes = tensor_cubes(xs[t].len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let x = xs.index_mut(t);
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < x.len() {
                x[i] = x[i] * coefficient;
                i += stride;
            }
        }
        start += cubes;
    }
}

/// Every tensor in `xs` copied into `output` back to back, from element `first` on: tensor t
/// at `first + Σ_{s<t} len(xs[s])`, each element times `scale` where `scaled` (apex's
/// `multi_tensor_scale`, with which apex's DDP flattens gradients into its allreduce buckets
/// and apex's `amp` unscales them). Cube `(g, t)` copies part of tensor t.
#[cube(launch)]
pub fn multi_flatten_kernel<F: Float>(
    xs: &Sequence<Tensor<F>>,
    output: &mut Tensor<F>,
    first: usize,
    scale: f32,
    #[comptime] scaled: bool,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = xs.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    // Burn's `mul_scalar`: the scalar in the element type, the product in it.
    let factor = F::cast_from(scale);
    let mut offset = first;
    #[unroll]
    for t in 0..count {
        let x = &xs[t];
        let cubes = tensor_cubes(x.len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < x.len() {
                if scaled {
                    output[offset + i] = x[i] * factor;
                } else {
                    output[offset + i] = x[i];
                }
                i += stride;
            }
        }
        start += cubes;
        offset += x.len();
    }
}

/// Every tensor of `xs` (contiguous, `[R, w_t]`: one row count, widths `w_t`) written into
/// the columns `c_t..c_t + w_t` of `output` (`[R, total]`, `c_t = first + Σ_{s<t} w_s`): `cat`
/// along the last dimension (the packed QKV weight, Note [Packed QKV]). Cube `(g, t)` copies
/// part of tensor t.
#[cube(launch)]
pub fn multi_concat_columns_kernel<F: Float>(
    xs: &Sequence<Tensor<F>>,
    output: &mut Tensor<F>,
    total: usize,
    first: usize,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = xs.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    let mut column = first;
    #[unroll]
    for t in 0..count {
        let x = &xs[t];
        let width = x.shape(x.rank() - 1);
        let cubes = tensor_cubes(x.len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < x.len() {
                output[(i / width) * total + column + i % width] = x[i];
                i += stride;
            }
        }
        start += cubes;
        column += width;
    }
}

/// The inverse of [`multi_concat_columns_kernel`]: each of `outputs` (`[R, w_t]`) from the
/// columns `c_t..c_t + w_t` (from column `first` on) of `input` (`[R, total]`, contiguous): the packed gradient split
/// into contiguous gradients of its parts.
#[cube(launch)]
pub fn multi_split_columns_kernel<F: Float>(
    input: &Tensor<F>,
    outputs: &mut Sequence<Tensor<F>>,
    total: usize,
    first: usize,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = outputs.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    let mut column = first;
    #[unroll]
    for t in 0..count {
        let part = &outputs[t];
        let width = part.shape(part.rank() - 1);
        let cubes = tensor_cubes(part.len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let out = outputs.index_mut(t);
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < out.len() {
                out[i] = input[(i / width) * total + column + i % width];
                i += stride;
            }
        }
        start += cubes;
        column += width;
    }
}

/// LAMB's second half for every tensor: `w − lr · r · u`, `r = ‖w‖/‖u‖` from the squared norms
/// `param_sq[first + t]`, `update_sq[first + t]` (1 if either is 0).
#[cube(launch)]
pub fn multi_lamb_apply_kernel<F: Float>(
    params: &Sequence<Tensor<F>>,
    updates: &Sequence<Tensor<F>>,
    param_sq: &Tensor<F>,
    update_sq: &Tensor<F>,
    outputs: &mut Sequence<Tensor<F>>,
    first: u32,
    lr: f32,
    #[comptime] max_cubes: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = params.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    #[unroll]
    for t in 0..count {
        let param = &params[t];
        let cubes = tensor_cubes(param.len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let w_norm = f32::cast_from(param_sq[first as usize + t]).sqrt();
            let u_norm = f32::cast_from(update_sq[first as usize + t]).sqrt();
            let mut ratio = f32::new(1.0);
            if w_norm > f32::new(0.0) && u_norm > f32::new(0.0) {
                ratio = w_norm / u_norm;
            }
            let stride = cubes * CUBE_DIM_X as usize;
            let update = &updates[t];
            let output = outputs.index_mut(t);
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < param.len() {
                output[i] =
                    F::cast_from(f32::cast_from(param[i]) - lr * ratio * f32::cast_from(update[i]));
                i += stride;
            }
        }
        start += cubes;
    }
}

/// `out[r] = scale · Σ x[r·cols .. min((r+1)·cols, len)]` of a contiguous tensor of `len`
/// elements, one cube per row (the last row may be short): each unit sums its strided columns
/// in order, then `cube_sum`'s tree (`scale` 1: the sum's bits; `1/len`: a mean). A fixed
/// order, so the same bits on every run and in every process (Note [Ranks stay one model] in
/// ember-trainer's `parallel/consistency.rs`), unlike an autotuned or atomic reduction.
#[cube(launch)]
pub fn sum_rows_ordered_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    len: u32,
    scale: f32,
    #[comptime] block: u32,
    #[define(F)] _dtype: StorageType,
) {
    let row = row_index();
    if row >= rows as usize {
        terminate!();
    }
    let base = row * cols as usize;
    let unit = UNIT_POS_X as usize;
    let mut shared = SharedMemory::<f32>::new(block as usize);
    let mut sum = f32::new(0.0);
    let mut c = unit;
    while c < cols as usize && base + c < len as usize {
        sum += f32::cast_from(x[base + c]);
        c += block as usize;
    }
    let total = cube_sum(&mut shared, sum);
    if unit == 0 {
        out[row] = F::cast_from(total * scale);
    }
}

/// First pass of the column sums of every `[rows, cols]` row-major matrix in `xs`: cube
/// `(c, k, t)` sums rows `k·chunk .. (k+1)·chunk` of `tile` consecutive columns of matrix t
/// (each row's read coalesced across the cube's x units) into
/// `partials[(t·chunks + k)·cols + column]`, f32. Unit `(j, p)` sums rows p, p + `phases`, …
/// of its chunk in order, then unit `(j, 0)` adds the `phases` partial sums in order. Chunks
/// of rows give the GPU enough cubes (a cube per 32 columns alone left 96 cubes for
/// BERT-large's LayerNorm, each thread reading thousands of rows one after another).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn multi_column_partial_sums_kernel<F: Float>(
    xs: &Sequence<Tensor<F>>,
    partials: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    chunk: u32,
    #[comptime] tile: u32,
    #[comptime] phases: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = xs.len().comptime();
    let tensor = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let column = CUBE_POS_X as usize * tile as usize + unit;
    let phase = UNIT_POS_Y as usize;
    let start = CUBE_POS_Y as usize * chunk as usize;
    let mut end = start + chunk as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    let mut shared = SharedMemory::<f32>::new((tile * phases) as usize);
    let mut sum = f32::new(0.0);
    if column < cols as usize {
        #[unroll]
        for t in 0..count {
            if tensor == t {
                let x = &xs[t];
                let mut r = start + phase;
                while r < end {
                    sum += f32::cast_from(x[r * cols as usize + column]);
                    r += phases as usize;
                }
            }
        }
    }
    shared[phase * tile as usize + unit] = sum;
    sync_cube();
    if phase == 0 && column < cols as usize {
        let mut total = f32::new(0.0);
        #[unroll]
        for p in 0..phases as usize {
            total += shared[p * tile as usize + unit];
        }
        let chunks = CUBE_COUNT_Y as usize;
        partials[(tensor * chunks + CUBE_POS_Y as usize) * cols as usize + column] = total;
    }
}

/// Second pass of the column sums: `outs[t][column]` = the sum of matrix t's `chunks` partial
/// sums of that column, in chunk order (so the whole sum has a fixed order: the same bits on
/// every run, as [`sum_rows_ordered_kernel`]), written in `F`: the inputs' dtype, or f32 for
/// an f32 master's gradient (Note [Parameter gradients in f32] in `masters.rs`). Cube
/// `(c, t)`, a unit per column.
#[cube(launch)]
pub fn multi_column_sums_finish_kernel<F: Float>(
    partials: &Tensor<f32>,
    outs: &mut Sequence<Tensor<F>>,
    cols: u32,
    chunks: u32,
    #[define(F)] _dtype: StorageType,
) {
    let count = outs.len().comptime();
    let tensor = CUBE_POS_Y as usize;
    let column = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if column < cols as usize {
        let mut total = f32::new(0.0);
        for k in 0..chunks as usize {
            total += partials[(tensor * chunks as usize + k) * cols as usize + column];
        }
        #[unroll]
        for t in 0..count {
            if tensor == t {
                let out = outs.index_mut(t);
                out[column] = F::cast_from(total);
            }
        }
    }
}

/// Every tensor in `xs` converted to `outs`' element type, element by element (the rounding
/// of CubeCL's `cast_from`, as Burn's cast kernel): apex's `multi_tensor_scale` at scale 1
/// between dtypes, which is how apex O2 refreshes its half copy of the model. Cube `(g, t)`
/// converts part of tensor t.
#[cube(launch)]
pub fn multi_cast_kernel<F: Float, H: Float>(
    xs: &Sequence<Tensor<F>>,
    outs: &mut Sequence<Tensor<H>>,
    #[comptime] max_cubes: u32,
    #[define(F, H)] _dtypes: [StorageType; 2],
) {
    let count = xs.len().comptime();
    let cube = CUBE_POS_X as usize;
    let mut start = 0usize;
    #[unroll]
    for t in 0..count {
        let x = &xs[t];
        let cubes = tensor_cubes(x.len(), max_cubes);
        if cube >= start && cube < start + cubes {
            let stride = cubes * CUBE_DIM_X as usize;
            let out = outs.index_mut(t);
            let mut i = (cube - start) * CUBE_DIM_X as usize + UNIT_POS_X as usize;
            while i < x.len() {
                out[i] = H::cast_from(x[i]);
                i += stride;
            }
        }
        start += cubes;
    }
}
