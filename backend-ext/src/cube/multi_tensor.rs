//! The host side of the multi-tensor kernels (`multi_tensor_kernels.rs`): how many tensors one
//! launch binds, the packed and the `[G, T]` grids, and the launches of the Adam-family step, of the bucket
//! flattening, of the column sums of several matrices and of the casts of many tensors.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::{CubeCount, CubeDim};

use super::{ROW_BLOCK, empty_like, multi_tensor_kernels, numel, storage};
use crate::{AdamHyper, AdamKind, AdamOutput, AdamTensors};

/// Most tensors one multi-tensor launch takes (each is unrolled into the kernel).
pub(super) const MAX_TENSORS_PER_LAUNCH: usize = 32;
/// Most cubes a multi-tensor kernel gives one tensor: enough to fill a large GPU; more
/// elements are strided over.
const MAX_CUBES_PER_TENSOR: usize = 1024;

/// Splits `items` into launches of at most `per_launch`, and of one dtype each.
pub(super) fn launches<T>(
    items: Vec<T>,
    per_launch: usize,
    dtype: impl Fn(&T) -> DType,
) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::new();
    for item in items {
        match out.last_mut() {
            Some(last) if last.len() < per_launch && dtype(&last[0]) == dtype(&item) => {
                last.push(item)
            }
            _ => out.push(vec![item]),
        }
    }
    out
}

/// How many tensors of `bindings_per_tensor` buffers each (plus `extra`) one launch can bind.
pub(super) fn tensors_per_launch<R: CubeRuntime>(
    t: &CubeTensor<R>,
    bindings_per_tensor: usize,
    extra: usize,
) -> usize {
    // One binding is kept for the kernel's metadata.
    let bindings = t.client.properties().hardware.max_bindings as usize;
    (bindings.saturating_sub(extra + 1) / bindings_per_tensor).clamp(1, MAX_TENSORS_PER_LAUNCH)
}

// Note [Packed multi-tensor grids]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A multi-tensor kernel whose elements are independent (the optimizers' updates and LAMB's
// second pass, the flattening into buckets, clipping, casts, the column splits and
// concatenations of packed weights) runs on a
// packed 1-D grid: tensor t gets `tensor_cubes(len_t)` consecutive cubes (one per 256
// elements, at least one, at most 1,024, the rest strided over), and each cube finds its
// tensor by the running sum of those counts, in the kernel, from the tensors' lengths. As
// apex's `multi_tensor_apply`, whose launch lists only the (tensor, chunk) pairs that exist,
// no cube is idle. The `[G, T]` grid before gave every tensor the largest one's G cubes: a
// bucket of BERT's word embeddings (30,522 × H) beside biases of H elements launched 1,024 ×
// T cubes of which most returned at once; on lavapipe, where every cube costs the CPU
// time, one such flattening took 243 ms (2026-12-07). The reductions (`multi_sum_squares`,
// `clip_by_partials`) keep the `[G, T]` grid: their partial sums' layout is their order of
// addition, and so their bits.

/// The cubes tensor of `len` elements gets in a packed grid (Note [Packed multi-tensor
/// grids]); the kernels' `tensor_cubes`.
pub(super) fn tensor_cubes(len: usize) -> usize {
    len.div_ceil(ROW_BLOCK).clamp(1, MAX_CUBES_PER_TENSOR)
}

/// The packed 1-D grid of a multi-tensor kernel over tensors of `lens` elements (Note
/// [Packed multi-tensor grids]): Σ `tensor_cubes` cubes of `ROW_BLOCK` units. The kernel
/// takes `MAX_CUBES` as its `max_cubes`.
pub(super) fn packed_launch(lens: impl IntoIterator<Item = usize>) -> (CubeCount, CubeDim) {
    let cubes: usize = lens.into_iter().map(tensor_cubes).sum();
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(ROW_BLOCK as u32),
    )
}

/// The `max_cubes` the packed kernels take: [`MAX_CUBES_PER_TENSOR`].
pub(super) const MAX_CUBES: u32 = MAX_CUBES_PER_TENSOR as u32;

/// The `[G, T]` grid of a multi-tensor kernel: G cubes per tensor, from the largest.
pub(super) fn multi_launch(largest: usize, tensors: usize) -> (CubeCount, CubeDim, usize) {
    let cubes = largest.div_ceil(ROW_BLOCK).clamp(1, MAX_CUBES_PER_TENSOR);
    (
        CubeCount::Static(cubes as u32, tensors as u32, 1),
        CubeDim::new_1d(ROW_BLOCK as u32),
        cubes,
    )
}

/// One launch of [`multi_tensor_kernels::multi_adam_kernel`].
pub(super) fn adam_launch<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    tensors: Vec<AdamTensors<CubeBackend<R, F, I, BT>>>,
    hyper: AdamHyper,
    kind: AdamKind,
) -> Vec<AdamOutput<CubeBackend<R, F, I, BT>>> {
    let tensors: Vec<_> = tensors
        .into_iter()
        .map(|t| AdamTensors::<CubeBackend<R, F, I, BT>> {
            param: into_contiguous(t.param),
            grad: into_contiguous(t.grad),
            moment_1: into_contiguous(t.moment_1),
            moment_2: into_contiguous(t.moment_2),
        })
        .collect();
    let first = &tensors[0].param;
    let (client, dtype) = (first.client.clone(), storage(first.dtype));
    let outputs: Vec<_> = tensors
        .iter()
        .map(|t| {
            let empty = || empty_like(&t.param, t.param.shape());
            AdamOutput::<CubeBackend<R, F, I, BT>> {
                param: empty(),
                moment_1: empty(),
                moment_2: empty(),
            }
        })
        .collect();
    let (count, dim) = packed_launch(tensors.iter().map(|t| numel(&t.param)));
    let (c1, c2) = hyper.corrections();
    let args = |f: &dyn Fn(&AdamTensors<CubeBackend<R, F, I, BT>>) -> &CubeTensor<R>| {
        tensors
            .iter()
            .map(|t| f(t).clone().into_tensor_arg())
            .collect()
    };
    let outs = |f: &dyn Fn(&AdamOutput<CubeBackend<R, F, I, BT>>) -> &CubeTensor<R>| {
        outputs
            .iter()
            .map(|o| f(o).clone().into_tensor_arg())
            .collect()
    };
    multi_tensor_kernels::multi_adam_kernel::launch::<R>(
        &client,
        count,
        dim,
        args(&|t| &t.param),
        args(&|t| &t.grad),
        args(&|t| &t.moment_1),
        args(&|t| &t.moment_2),
        outs(&|o| &o.param),
        outs(&|o| &o.moment_1),
        outs(&|o| &o.moment_2),
        hyper.lr as f32,
        hyper.weight_decay as f32,
        hyper.beta_1 as f32,
        hyper.beta_2 as f32,
        hyper.epsilon as f32,
        c1 as f32,
        c2 as f32,
        kind == AdamKind::LambUpdate,
        MAX_CUBES,
        dtype,
    );
    outputs
}

/// [`crate::BucketOps::flatten_multi_tensor`]: [`multi_tensor_kernels::multi_flatten_kernel`] per
/// group of tensors, each element times `scale` unless it is 1.
pub(super) fn flatten<R: CubeRuntime>(xs: Vec<CubeTensor<R>>, scale: f32) -> CubeTensor<R> {
    assert!(!xs.is_empty(), "flatten_multi_tensor of no tensors");
    let xs: Vec<_> = xs.into_iter().map(into_contiguous).collect();
    let dtype = xs[0].dtype;
    assert!(
        xs.iter().all(|x| x.dtype == dtype),
        "flatten_multi_tensor of tensors of several dtypes"
    );
    let total: usize = xs.iter().map(numel).sum();
    let output = empty_like(&xs[0], Shape::new([total]));
    let per_launch = tensors_per_launch(&xs[0], 1, 1);
    let mut first = 0;
    for group in launches(xs, per_launch, |x| x.dtype) {
        let (count, dim) = packed_launch(group.iter().map(numel));
        multi_tensor_kernels::multi_flatten_kernel::launch::<R>(
            &output.client,
            count,
            dim,
            group.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            output.clone().into_tensor_arg(),
            first,
            scale,
            scale != 1.0,
            MAX_CUBES,
            storage(dtype),
        );
        first += group.iter().map(numel).sum::<usize>();
    }
    output
}

/// The partial sums of `x²` of every tensor in `xs` (contiguous, one dtype):
/// [`multi_tensor_kernels::multi_sum_squares_kernel`] per group of tensors, into one `[T, G]`
/// buffer (row t: tensor t's G partial sums, whose ordered sum is its `Σx²`).
pub(super) fn sum_squares_partials<R: CubeRuntime>(xs: Vec<CubeTensor<R>>) -> CubeTensor<R> {
    assert!(!xs.is_empty(), "sum_squares_multi_tensor of no tensors");
    let total = xs.len();
    let largest = xs.iter().map(numel).max().unwrap_or(0);
    let per_launch = tensors_per_launch(&xs[0], 1, 1);
    // One partials buffer `[T, G]` for every launch: launch k writes rows from `first`.
    let (_, dim, cubes) = multi_launch(largest, 1);
    let partials = empty_like(&xs[0], Shape::new([total, cubes]));
    let mut first = 0;
    for group in launches(xs, per_launch, |x| x.dtype) {
        let (count, _, _) = multi_launch(largest, group.len());
        let len = group.len();
        multi_tensor_kernels::multi_sum_squares_kernel::launch::<R>(
            &partials.client,
            count,
            dim,
            group.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            partials.clone().into_tensor_arg(),
            first as u32,
            ROW_BLOCK as u32,
            storage(group[0].dtype),
        );
        first += len;
    }
    partials
}

/// Bucket-wise clipping of `x` (contiguous, `can_mut`) by its own norm in place, from the
/// `[1, G]` partial sums of its `x²` ([`sum_squares_partials`]):
/// [`multi_tensor_kernels::clip_by_partials_kernel`], one launch; returns the squared norm
/// (`[1]`, `x`'s dtype), the bits of `sum_rows_ordered` of the partials.
pub(super) fn clip_by_partials<R: CubeRuntime>(
    x: &CubeTensor<R>,
    partials: CubeTensor<R>,
    max_norm: f32,
) -> CubeTensor<R> {
    let sq_norm = empty_like(x, Shape::new([1]));
    let (count, dim, _) = multi_launch(numel(x), 1);
    multi_tensor_kernels::clip_by_partials_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        partials.into_tensor_arg(),
        sq_norm.clone().into_tensor_arg(),
        max_norm,
        ROW_BLOCK as u32,
        storage(x.dtype),
    );
    sq_norm
}

/// [`crate::BucketOps::clip_multi_tensor`] of tensors whose memory is their own (contiguous,
/// `can_mut`, of `sq_norm`'s dtype): [`multi_tensor_kernels::multi_clip_kernel`] in place, up
/// to 32 per launch (fewer where the device binds fewer buffers).
pub(super) fn clip_in_place<R: CubeRuntime>(
    xs: &[CubeTensor<R>],
    sq_norm: &CubeTensor<R>,
    max_norm: f32,
) {
    let Some(first) = xs.first() else {
        return;
    };
    let per_launch = tensors_per_launch(first, 1, 1);
    for group in xs.chunks(per_launch) {
        let (count, dim) = packed_launch(group.iter().map(numel));
        multi_tensor_kernels::multi_clip_kernel::launch::<R>(
            &first.client,
            count,
            dim,
            group.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            sq_norm.clone().into_tensor_arg(),
            max_norm,
            MAX_CUBES,
            storage(first.dtype),
        );
    }
}

/// [`FusedOps::concat_columns`]: [`multi_tensor_kernels::multi_concat_columns_kernel`], one
/// launch for up to 32 parts (fewer where the device binds fewer buffers).
///
/// # Panics
/// If `xs` is empty, mixes dtypes or their element counts over the last dimension differ.
pub(super) fn concat_columns<R: CubeRuntime>(xs: Vec<CubeTensor<R>>) -> CubeTensor<R> {
    let widths = column_widths(&xs);
    let xs: Vec<_> = xs.into_iter().map(into_contiguous).collect();
    let total: usize = widths.iter().sum();
    let mut shape = xs[0].shape();
    let last = shape.num_dims() - 1;
    shape[last] = total;
    let output = empty_like(&xs[0], shape);
    let per_launch = tensors_per_launch(&output, 1, 1);
    let mut first = 0;
    for group in launches(xs, per_launch, |x| x.dtype) {
        let (count, dim) = packed_launch(group.iter().map(numel));
        multi_tensor_kernels::multi_concat_columns_kernel::launch::<R>(
            &output.client,
            count,
            dim,
            group.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            output.clone().into_tensor_arg(),
            total,
            first,
            MAX_CUBES,
            storage(output.dtype),
        );
        first += group.iter().map(|x| x.shape()[last]).sum::<usize>();
    }
    output
}

/// [`FusedOps::split_columns`]: contiguous parts of `x`'s columns, one launch of
/// [`multi_tensor_kernels::multi_split_columns_kernel`] for up to 32 parts.
///
/// # Panics
/// If `widths` do not add up to `x`'s last dimension.
pub(super) fn split_columns<R: CubeRuntime>(
    x: CubeTensor<R>,
    widths: &[usize],
) -> Vec<CubeTensor<R>> {
    let x = into_contiguous(x);
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    let total = shape[last];
    assert_eq!(
        widths.iter().sum::<usize>(),
        total,
        "split_columns of {total} columns into {widths:?}"
    );
    let outputs: Vec<_> = widths
        .iter()
        .map(|&width| {
            let mut part = shape.clone();
            part[last] = width;
            empty_like(&x, part)
        })
        .collect();
    let per_launch = tensors_per_launch(&x, 1, 1);
    let mut first = 0;
    for group in outputs.chunks(per_launch) {
        split_columns_launch(&x, group, total, first);
        first += group.iter().map(|o| o.shape()[last]).sum::<usize>();
    }
    outputs
}

/// One launch of [`multi_tensor_kernels::multi_split_columns_kernel`]: each of `outputs`
/// (contiguous, `[R, w_t]`) from the columns of `x` (contiguous, `[R, total]`) from column
/// `first` on, back to back.
pub(super) fn split_columns_launch<R: CubeRuntime>(
    x: &CubeTensor<R>,
    outputs: &[CubeTensor<R>],
    total: usize,
    first: usize,
) {
    let (count, dim) = packed_launch(outputs.iter().map(numel));
    multi_tensor_kernels::multi_split_columns_kernel::launch::<R>(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        outputs
            .iter()
            .map(|o| o.clone().into_tensor_arg())
            .collect(),
        total,
        first,
        MAX_CUBES,
        storage(x.dtype),
    );
}

/// The last-dimension widths of the parts of a column concatenation, checked to share a row
/// count and a dtype.
fn column_widths<R: CubeRuntime>(xs: &[CubeTensor<R>]) -> Vec<usize> {
    assert!(!xs.is_empty(), "concat_columns of no tensors");
    let dtype = xs[0].dtype;
    let widths: Vec<usize> = xs
        .iter()
        .map(|x| {
            let shape = x.shape();
            shape[shape.num_dims() - 1]
        })
        .collect();
    let rows = numel(&xs[0]) / widths[0].max(1);
    for (x, width) in xs.iter().zip(&widths) {
        assert_eq!(
            x.dtype, dtype,
            "concat_columns of tensors of several dtypes"
        );
        assert_eq!(
            numel(x),
            rows * width,
            "concat_columns of parts with different row counts"
        );
    }
    widths
}

/// Columns per cube, row phases per column and rows per chunk of
/// [`multi_tensor_kernels::multi_column_partial_sums_kernel`]: 256 units, each summing 32 rows
/// of a chunk.
const COLUMN_TILE: usize = 32;
const ROW_PHASES: usize = 8;
const ROWS_PER_CHUNK: usize = 256;

/// The column sums of `xs` (`[R, N]` each, one shape and dtype), in `out_dtype` (the inputs'
/// where `None`): per group the device binds, two launches (partial sums per chunk of rows in
/// f32, then their fixed-order sum, written in `out_dtype`) for the whole group; `Err(xs)`
/// when they are not all of one 2-d shape and dtype.
pub(super) fn column_sums<R: CubeRuntime>(
    xs: Vec<CubeTensor<R>>,
    out_dtype: Option<DType>,
) -> Result<Vec<CubeTensor<R>>, Vec<CubeTensor<R>>> {
    let same = xs
        .windows(2)
        .all(|w| w[0].shape() == w[1].shape() && w[0].dtype == w[1].dtype);
    if xs.is_empty() || !same || xs[0].shape().num_dims() != 2 {
        return Err(xs);
    }
    let [rows, cols] = xs[0].shape().dims();
    let xs: Vec<_> = xs.into_iter().map(into_contiguous).collect();
    let per_launch = tensors_per_launch(&xs[0], 2, 1);
    let chunks = rows.div_ceil(ROWS_PER_CHUNK).max(1);
    let mut sums = Vec::with_capacity(xs.len());
    for group in launches(xs, per_launch, |x| x.dtype) {
        let client = group[0].client.clone();
        let partials = empty_device_contiguous_dtype(
            client.clone(),
            group[0].device.clone(),
            Shape::new([group.len() * chunks * cols]),
            DType::F32,
        );
        multi_tensor_kernels::multi_column_partial_sums_kernel::launch::<R>(
            &client,
            CubeCount::Static(
                cols.div_ceil(COLUMN_TILE) as u32,
                chunks as u32,
                group.len() as u32,
            ),
            CubeDim::new_2d(COLUMN_TILE as u32, ROW_PHASES as u32),
            group.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            partials.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            ROWS_PER_CHUNK as u32,
            COLUMN_TILE as u32,
            ROW_PHASES as u32,
            storage(group[0].dtype),
        );
        let out_dtype = out_dtype.unwrap_or(group[0].dtype);
        let outs: Vec<_> = group
            .iter()
            .map(|x| {
                empty_device_contiguous_dtype(
                    x.client.clone(),
                    x.device.clone(),
                    Shape::new([cols]),
                    out_dtype,
                )
            })
            .collect();
        multi_tensor_kernels::multi_column_sums_finish_kernel::launch::<R>(
            &client,
            CubeCount::Static(cols.div_ceil(ROW_BLOCK) as u32, group.len() as u32, 1),
            CubeDim::new_1d(ROW_BLOCK as u32),
            partials.into_tensor_arg(),
            outs.iter().map(|x| x.clone().into_tensor_arg()).collect(),
            cols as u32,
            chunks as u32,
            storage(out_dtype),
        );
        sums.extend(outs);
    }
    Ok(sums)
}

/// [`crate::FusedOps::cast_multi_tensor`]: tensors already in `dtype` as they are, the others
/// through [`multi_tensor_kernels::multi_cast_kernel`], a launch per group of one input dtype
/// that the device binds.
pub(super) fn cast<R: CubeRuntime>(xs: Vec<CubeTensor<R>>, dtype: DType) -> Vec<CubeTensor<R>> {
    let mut out: Vec<Option<CubeTensor<R>>> = Vec::with_capacity(xs.len());
    let mut to_cast = Vec::new();
    for (i, x) in xs.into_iter().enumerate() {
        if x.dtype == dtype {
            out.push(Some(x));
        } else {
            out.push(None);
            to_cast.push((i, into_contiguous(x)));
        }
    }
    if let Some((_, first)) = to_cast.first() {
        let per_launch = tensors_per_launch(first, 2, 0);
        for group in launches(to_cast, per_launch, |(_, x)| x.dtype) {
            let outs: Vec<CubeTensor<R>> = group
                .iter()
                .map(|(_, x)| {
                    empty_device_contiguous_dtype(
                        x.client.clone(),
                        x.device.clone(),
                        x.shape(),
                        dtype,
                    )
                })
                .collect();
            let (count, dim) = packed_launch(group.iter().map(|(_, x)| numel(x)));
            multi_tensor_kernels::multi_cast_kernel::launch::<R>(
                &group[0].1.client,
                count,
                dim,
                group
                    .iter()
                    .map(|(_, x)| x.clone().into_tensor_arg())
                    .collect(),
                outs.iter().map(|x| x.clone().into_tensor_arg()).collect(),
                MAX_CUBES,
                [storage(group[0].1.dtype), storage(dtype)],
            );
            for ((i, _), cast) in group.into_iter().zip(outs) {
                out[i] = Some(cast);
            }
        }
    }
    out.into_iter()
        .map(|x| x.expect("every tensor kept or cast"))
        .collect()
}
