//! [`FusedOps`] for `CubeBackend<R, F, I, BT>`: one CubeCL source for CUDA and wgpu.

mod buckets;
pub mod counting;
mod cross_entropy;
#[cfg(feature = "cuda")]
pub mod cublaslt;
#[cfg(feature = "cuda")]
mod cublaslt_call;
#[cfg(feature = "cuda")]
mod cublaslt_window;
mod gemm;
pub mod gemm_window;
pub mod kernel_cache;
mod kernels;
mod masters;
mod multi_tensor;
mod multi_tensor_kernels;
mod packed_rows;
mod qkv;
mod reductions;
mod softmax_kernels;

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

use multi_tensor::{MAX_CUBES, adam_launch, launches, packed_launch, tensors_per_launch};
use reductions::row_launch;

use crate::{
    AdamHyper, AdamKind, AdamOutput, AdamTensors, DropoutSpec, FusedOps, Gelu, LayerNormBackward,
    LayerNormForward, SoftmaxForward,
};

/// Units per cube of the row kernels (a power of two; rows shorter than this use fewer).
const ROW_BLOCK: usize = 256;
/// Largest cube count in one grid dimension that every runtime accepts.
const MAX_GRID: usize = 65_535;

fn empty_like<R: CubeRuntime>(t: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, t.dtype)
}

fn elemwise_launch<R: CubeRuntime>(t: &CubeTensor<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, n);
    (calculate_cube_count_elemwise(&t.client, n, dim), dim)
}

fn storage(dtype: DType) -> StorageType {
    dtype.into()
}

/// Note [LayerNorm statistics in f32]: the fused LayerNorm keeps each row's mean and
/// `1/√(var + eps)` for its backward in f32, whatever the storage type, as apex's
/// `MixedFusedLayerNorm` keeps `mean` and `invvar` (and PyTorch's autocast runs `layer_norm`
/// in f32): the backward's `x̂ = (y − mean)·rstd` is then the forward's, bit for bit. Kept in
/// bf16 they were rounded to 8 significant bits, `rstd` off by up to 0.4% and the mean by
/// its own magnitude's 2⁻⁹, for the whole row: a bias of every `dx` and `dγ` that the storage
/// rounding of `y`, different for each element, does not have. Two f32 values per row,
/// whatever the width.
///
/// `t` (`[R]`) as a contiguous f32 tensor: the backward's statistics, a cast only where a
/// caller made them in another type.
fn f32_stats<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    t: CubeTensor<R>,
) -> CubeTensor<R> {
    let t = into_contiguous(t);
    if t.dtype == DType::F32 {
        t
    } else {
        <CubeBackend<R, F, I, BT> as FloatTensorOps<CubeBackend<R, F, I, BT>>>::float_cast(
            t,
            burn::tensor::FloatDType::F32,
        )
    }
}

/// The kernels' dropout arguments for a tensor of `shape` (see `dropout::MaskLayout`).
struct MaskArgs {
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    threshold: u32,
    keep_scale: f32,
    enabled: bool,
}

fn dropout_args(dropout: DropoutSpec, shape: &[usize]) -> MaskArgs {
    let (key_lo, key_hi) = dropout.key_halves();
    let layout = dropout.layout(shape);
    MaskArgs {
        key_lo,
        key_hi,
        sample_offset: layout.sample_offset,
        rows_per_sample: layout.rows_per_sample,
        seq: layout.seq,
        threshold: dropout.threshold(),
        keep_scale: dropout.keep_scale() as f32,
        enabled: dropout.enabled(),
    }
}

/// The padded rows and mask arguments of a fused LayerNorm's `[rows, n]` rows (`x` gives the
/// device): with `dropout_rows` and dropout on, the row map (contiguous) and the layout of
/// `[B·S, n]` padded rows, S = `dropout.seq_len` per sample (as `dropout_rows` keys them);
/// else an unread one-element stand-in (an allocation, no launch) and the rows' own layout.
/// The third value is the kernels' `mapped`.
fn mask_of_rows<R: CubeRuntime, I: IntElement>(
    x: &CubeTensor<R>,
    dropout: DropoutSpec,
    dropout_rows: Option<CubeTensor<R>>,
    [rows, n]: [usize; 2],
) -> (CubeTensor<R>, MaskArgs, bool) {
    match dropout_rows.filter(|_| dropout.enabled()) {
        Some(padded_rows) => {
            assert!(
                dropout.seq_len > 0,
                "dropout of packed rows needs the padded length (DropoutSpec::with_seq_len)"
            );
            assert_eq!(
                padded_rows.shape().num_elements(),
                rows,
                "bias_dropout_add_layer_norm: a padded row per row"
            );
            let mask = dropout_args(dropout, &[dropout.seq_len as usize, n]);
            (into_contiguous(padded_rows), mask, true)
        }
        None => {
            let stand_in = empty_device_contiguous_dtype(
                x.client.clone(),
                x.device.clone(),
                Shape::new([1]),
                I::dtype(),
            );
            (stand_in, dropout_args(dropout, &[rows, n]), false)
        }
    }
}

fn numel<R: CubeRuntime>(t: &CubeTensor<R>) -> usize {
    t.shape().num_elements()
}

/// `[R, C]` → `[R]`, each row summed in a fixed order
/// ([`multi_tensor_kernels::sum_rows_ordered_kernel`]).
fn sum_rows_ordered<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let [_, cols] = x.shape().dims();
    sum_chunks_ordered(into_contiguous(x), cols, 1.0)
}

/// The sums of consecutive chunks of `chunk` elements of a contiguous tensor (the last may be
/// short), each in a fixed order and times `scale`: `[⌈n/chunk⌉]`.
fn sum_chunks_ordered<R: CubeRuntime>(x: CubeTensor<R>, chunk: usize, scale: f32) -> CubeTensor<R> {
    let n = numel(&x);
    let rows = n.div_ceil(chunk).max(1);
    let out = empty_like(&x, Shape::new([rows]));
    let (count, dim, block) = row_launch(rows, chunk, 1);
    multi_tensor_kernels::sum_rows_ordered_kernel::launch::<R>(
        &out.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        rows as u32,
        chunk as u32,
        n as u32,
        scale,
        block as u32,
        storage(x.dtype),
    );
    out
}

fn check_rows(n_elements: usize) {
    assert!(
        n_elements <= u32::MAX as usize,
        "fused ops index elements with 32 bits ({n_elements} elements)"
    );
}

impl<R, F, I, BT> FusedOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    const HAS_KERNELS: bool = true;

    fn dense(
        x: CubeTensor<R>,
        weight: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
    ) -> CubeTensor<R> {
        gemm::dense(
            x,
            weight,
            bias,
            <Self as FloatTensorOps<Self>>::float_reshape,
            <Self as FloatTensorOps<Self>>::float_add,
        )
    }

    fn dense_backward(
        x: CubeTensor<R>,
        weight: CubeTensor<R>,
        grad: CubeTensor<R>,
        with_bias: bool,
    ) -> crate::DenseGrads<Self> {
        crate::linear::flattened_linear_backward::<Self>(
            x,
            weight,
            grad,
            with_bias,
            gemm::dense_backward_products,
        )
    }

    fn batched_matmul(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
        gemm::matmul(a, b)
    }

    fn batched_matmul_pair(
        a1: CubeTensor<R>,
        b1: CubeTensor<R>,
        a2: CubeTensor<R>,
        b2: CubeTensor<R>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        gemm::matmul_pair(a1, b1, a2, b2)
    }

    fn f32_gemm_precision(device: &Self::Device) -> crate::GemmPrecision {
        gemm::f32_precision::<R>(device)
    }

    fn cast_multi_tensor(
        xs: Vec<CubeTensor<R>>,
        dtype: burn::tensor::FloatDType,
    ) -> Vec<CubeTensor<R>> {
        multi_tensor::cast(xs, dtype.into())
    }

    fn sum_rows_many(xs: Vec<CubeTensor<R>>) -> Vec<CubeTensor<R>> {
        let dtype = xs.first().map(|x| x.dtype);
        multi_tensor::column_sums(xs, dtype)
            .unwrap_or_else(|xs| xs.into_iter().map(Self::sum_rows).collect())
    }

    fn contiguous(x: CubeTensor<R>) -> CubeTensor<R> {
        into_contiguous(x)
    }

    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_reserved)
    }

    fn cross_entropy(
        logits: CubeTensor<R>,
        labels: CubeTensor<R>,
    ) -> crate::CrossEntropyForward<Self> {
        if logits.shape().num_elements() == 0 {
            return crate::cross_entropy::reference_forward::<Self>(logits, labels);
        }
        let (row_loss, log_sum_exp) = cross_entropy::rows(logits, labels);
        // The mean in a fixed order, by one cube (Note [Cross-entropy in one pass]).
        let rows = numel(&row_loss);
        crate::CrossEntropyForward {
            loss: sum_chunks_ordered(row_loss, rows, 1.0 / rows as f32),
            log_sum_exp,
        }
    }

    fn cross_entropy_backward(
        logits: CubeTensor<R>,
        labels: CubeTensor<R>,
        log_sum_exp: CubeTensor<R>,
        grad: CubeTensor<R>,
    ) -> CubeTensor<R> {
        // Burn's cast returns an f32 tensor as it is.
        let f32 = |t| Self::float_cast(t, burn::tensor::FloatDType::F32);
        cross_entropy::backward(logits, labels, f32(log_sum_exp), f32(grad))
    }

    fn bias_gelu(x: CubeTensor<R>, bias: CubeTensor<R>, gelu: Gelu) -> CubeTensor<R> {
        let x = into_contiguous(x);
        let bias = into_contiguous(bias);
        let output = empty_like(&x, x.shape());
        let n = x.shape().num_elements();
        let (count, dim) = elemwise_launch(&x, n);
        let dtype = storage(x.dtype);
        kernels::bias_gelu_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            bias.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            gelu == Gelu::Tanh,
            dtype,
        );
        output
    }

    fn bias_gelu_backward(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        grad: CubeTensor<R>,
        gelu: Gelu,
    ) -> CubeTensor<R> {
        let x = into_contiguous(x);
        let bias = into_contiguous(bias);
        let grad = into_contiguous(grad);
        let output = empty_like(&x, x.shape());
        let n = x.shape().num_elements();
        let (count, dim) = elemwise_launch(&x, n);
        let dtype = storage(x.dtype);
        kernels::bias_gelu_backward_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            bias.into_tensor_arg(),
            grad.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            gelu == Gelu::Tanh,
            dtype,
        );
        output
    }

    fn bias_dropout_add_layer_norm(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        residual: CubeTensor<R>,
        gamma: CubeTensor<R>,
        beta: CubeTensor<R>,
        dropout: DropoutSpec,
        dropout_rows: Option<CubeTensor<R>>,
        eps: f64,
    ) -> LayerNormForward<Self> {
        let x = into_contiguous(x);
        let [rows, n] = x.shape().dims::<2>();
        check_rows(rows * n);
        let (padded_rows, mask, mapped) =
            mask_of_rows::<R, I>(&x, dropout, dropout_rows, [rows, n]);
        let pre_norm = empty_like(&x, x.shape());
        let output = empty_like(&x, x.shape());
        // Note [LayerNorm statistics in f32].
        let stats = || {
            empty_device_contiguous_dtype(
                x.client.clone(),
                x.device.clone(),
                Shape::new([rows]),
                DType::F32,
            )
        };
        let (mean, rstd) = (stats(), stats());
        let (planes, min_units) = reductions::row_form(&x.client);
        let (count, dim, block) = row_launch(rows, n, min_units);
        let dtypes = [storage(x.dtype), storage(padded_rows.dtype)];
        kernels::bias_dropout_add_layer_norm_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            into_contiguous(bias).into_tensor_arg(),
            into_contiguous(residual).into_tensor_arg(),
            into_contiguous(gamma).into_tensor_arg(),
            into_contiguous(beta).into_tensor_arg(),
            padded_rows.into_tensor_arg(),
            pre_norm.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            rows as u32,
            mask.key_lo,
            mask.key_hi,
            mask.sample_offset,
            mask.rows_per_sample,
            mask.seq,
            mask.threshold,
            mask.keep_scale,
            eps as f32,
            block as u32,
            mask.enabled,
            mapped,
            planes,
            reductions::registers_per_unit(n, block) as u32,
            dtypes,
        );
        LayerNormForward {
            output,
            pre_norm,
            mean,
            rstd,
        }
    }

    fn bias_dropout_add_layer_norm_backward(
        grad: CubeTensor<R>,
        pre_norm: CubeTensor<R>,
        mean: CubeTensor<R>,
        rstd: CubeTensor<R>,
        gamma: CubeTensor<R>,
        dropout: DropoutSpec,
        dropout_rows: Option<CubeTensor<R>>,
    ) -> LayerNormBackward<Self> {
        let grad = into_contiguous(grad);
        let [rows, n] = grad.shape().dims::<2>();
        check_rows(rows * n);
        let (padded_rows, mask, mapped) =
            mask_of_rows::<R, I>(&grad, dropout, dropout_rows, [rows, n]);
        let grad_pre_norm = empty_like(&grad, grad.shape());
        let grad_x = empty_like(&grad, grad.shape());
        let grad_x_hat = empty_like(&grad, grad.shape());
        let (planes, min_units) = reductions::row_form(&grad.client);
        let (count, dim, block) = row_launch(rows, n, min_units);
        let dtypes = [storage(grad.dtype), storage(padded_rows.dtype)];
        kernels::layer_norm_backward_kernel::launch::<R>(
            &grad.client,
            count,
            dim,
            grad.clone().into_tensor_arg(),
            into_contiguous(pre_norm).into_tensor_arg(),
            f32_stats::<R, F, I, BT>(mean).into_tensor_arg(),
            f32_stats::<R, F, I, BT>(rstd).into_tensor_arg(),
            into_contiguous(gamma).into_tensor_arg(),
            padded_rows.into_tensor_arg(),
            grad_pre_norm.clone().into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            grad_x_hat.clone().into_tensor_arg(),
            rows as u32,
            mask.key_lo,
            mask.key_hi,
            mask.sample_offset,
            mask.rows_per_sample,
            mask.seq,
            mask.threshold,
            mask.keep_scale,
            block as u32,
            mask.enabled,
            mapped,
            planes,
            reductions::registers_per_unit(n, block) as u32,
            dtypes,
        );
        LayerNormBackward {
            grad_pre_norm,
            grad_x,
            grad_x_hat,
        }
    }

    fn masked_softmax_dropout(
        scores: CubeTensor<R>,
        mask_bias: CubeTensor<R>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> SoftmaxForward<Self> {
        let (probs, dropped) = softmax_kernels::forward(scores, mask_bias, scale, dropout);
        SoftmaxForward { probs, dropped }
    }

    fn masked_softmax_dropout_backward(
        grad_dropped: CubeTensor<R>,
        probs: CubeTensor<R>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> CubeTensor<R> {
        softmax_kernels::backward(grad_dropped, probs, scale, dropout)
    }

    fn dropout(x: CubeTensor<R>, dropout: DropoutSpec) -> CubeTensor<R> {
        if !dropout.enabled() {
            return x;
        }
        let x = into_contiguous(x);
        let dims = x.shape().to_vec();
        let n = dims.last().copied().unwrap_or(1).max(1);
        let rows = x.shape().num_elements() / n;
        check_rows(rows * n);
        let output = empty_like(&x, x.shape());
        let (count, dim, block) = row_launch(rows, n, 1);
        let mask = dropout_args(dropout, &dims);
        let dtype = storage(x.dtype);
        kernels::dropout_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            rows as u32,
            mask.key_lo,
            mask.key_hi,
            mask.sample_offset,
            mask.rows_per_sample,
            mask.seq,
            mask.threshold,
            mask.keep_scale,
            block as u32,
            dtype,
        );
        output
    }

    fn adam_multi_tensor(
        tensors: Vec<AdamTensors<Self>>,
        hyper: AdamHyper,
        kind: AdamKind,
    ) -> Vec<AdamOutput<Self>> {
        let Some(first) = tensors.first() else {
            return Vec::new();
        };
        let per_launch = tensors_per_launch(&first.param, 7, 0);
        launches(tensors, per_launch, |t| t.param.dtype)
            .into_iter()
            .flat_map(|group| adam_launch(group, hyper, kind))
            .collect()
    }

    fn sum_squares_multi_tensor(xs: Vec<CubeTensor<R>>) -> CubeTensor<R> {
        let xs: Vec<_> = xs.into_iter().map(into_contiguous).collect();
        // Note [Ranks stay one model]: the partials added in a fixed order.
        sum_rows_ordered(multi_tensor::sum_squares_partials(xs))
    }

    fn clip_by_own_norm(x: CubeTensor<R>, max_norm: f32) -> (CubeTensor<R>, CubeTensor<R>) {
        buckets::clip_by_own_norm::<R, F, I, BT>(x, max_norm)
    }

    fn unpack_qkv_heads(qkv: CubeTensor<R>, heads: usize) -> [CubeTensor<R>; 3] {
        qkv::unpack(qkv, heads)
    }

    fn merge_qkv_heads(parts: [CubeTensor<R>; 3]) -> CubeTensor<R> {
        qkv::pack(parts)
    }

    fn concat_columns(xs: Vec<CubeTensor<R>>) -> CubeTensor<R> {
        multi_tensor::concat_columns(xs)
    }

    fn split_columns(x: CubeTensor<R>, widths: &[usize]) -> Vec<CubeTensor<R>> {
        multi_tensor::split_columns(x, widths)
    }

    fn sum_ordered(x: CubeTensor<R>) -> CubeTensor<R> {
        // Two passes over large tensors (one cube per chunk, then one over the partials): the
        // same fixed order, without one cube reading everything.
        const CHUNK: usize = 1 << 16;
        let n = numel(&x);
        let partials = sum_chunks_ordered(into_contiguous(x), CHUNK.min(n.max(1)), 1.0);
        let count = numel(&partials);
        if count == 1 {
            return partials;
        }
        sum_chunks_ordered(partials, count, 1.0)
    }

    fn lamb_apply_multi_tensor(
        params: Vec<CubeTensor<R>>,
        updates: Vec<CubeTensor<R>>,
        param_sq: CubeTensor<R>,
        update_sq: CubeTensor<R>,
        lr: f64,
    ) -> Vec<CubeTensor<R>> {
        let Some(first_param) = params.first() else {
            return Vec::new();
        };
        let per_launch = tensors_per_launch(first_param, 3, 2);
        let (param_sq, update_sq) = (into_contiguous(param_sq), into_contiguous(update_sq));
        let pairs: Vec<_> = params
            .into_iter()
            .map(into_contiguous)
            .zip(updates.into_iter().map(into_contiguous))
            .collect();
        let mut outputs = Vec::with_capacity(pairs.len());
        let mut first = 0;
        for group in launches(pairs, per_launch, |(p, _)| p.dtype) {
            let (count, dim) = packed_launch(group.iter().map(|(p, _)| numel(p)));
            let outs: Vec<_> = group
                .iter()
                .map(|(p, _)| empty_like(p, p.shape()))
                .collect();
            multi_tensor_kernels::multi_lamb_apply_kernel::launch::<R>(
                &param_sq.client,
                count,
                dim,
                group
                    .iter()
                    .map(|(p, _)| p.clone().into_tensor_arg())
                    .collect(),
                group
                    .iter()
                    .map(|(_, u)| u.clone().into_tensor_arg())
                    .collect(),
                param_sq.clone().into_tensor_arg(),
                update_sq.clone().into_tensor_arg(),
                outs.iter().map(|o| o.clone().into_tensor_arg()).collect(),
                first as u32,
                lr as f32,
                MAX_CUBES,
                storage(group[0].0.dtype),
            );
            first += group.len();
            outputs.extend(outs);
        }
        outputs
    }
}
