//! [`FusedOps`] for `CubeBackend<R, F, I, BT>`: one CubeCL source for CUDA and wgpu.

mod kernels;

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

use crate::{
    AdamHyper, AdamOutput, DropoutSpec, FusedOps, LayerNormBackward, LayerNormForward,
    SoftmaxForward,
};

/// Units per cube of the row kernels (a power of two; rows shorter than this use fewer).
const ROW_BLOCK: usize = 256;
/// Largest cube count in one grid dimension that every runtime accepts.
const MAX_GRID: usize = 65_535;

fn empty_like<R: CubeRuntime>(t: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, t.dtype)
}

/// Cube count, cube dim and block size for `rows` rows of `n` elements, one cube per row.
fn row_launch(rows: usize, n: usize) -> (CubeCount, CubeDim, usize) {
    let block = n.next_power_of_two().clamp(1, ROW_BLOCK);
    let x = rows.clamp(1, MAX_GRID);
    let y = rows.div_ceil(x).max(1);
    (
        CubeCount::Static(x as u32, y as u32, 1),
        CubeDim::new_1d(block as u32),
        block,
    )
}

fn elemwise_launch<R: CubeRuntime>(t: &CubeTensor<R>, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, n);
    (calculate_cube_count_elemwise(&t.client, n, dim), dim)
}

fn storage(dtype: DType) -> StorageType {
    dtype.into()
}

/// The kernels' dropout arguments: (key, threshold, keep scale, enabled).
fn dropout_args(dropout: DropoutSpec) -> (u32, u32, f32, bool) {
    (
        dropout.key(),
        dropout.threshold(),
        dropout.keep_scale() as f32,
        dropout.enabled(),
    )
}

/// Cubes of the first pass of [`FusedOps::sum_squares`]: enough to fill a large GPU, few
/// enough for one cube to sum their partials.
const SUM_CUBES: usize = 1024;

/// [`FusedOps::adamw_step`] (`lamb` false) or [`FusedOps::lamb_update`] (`lamb` true).
fn adam_launch<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    moment_1: CubeTensor<R>,
    moment_2: CubeTensor<R>,
    hyper: AdamHyper,
    lamb: bool,
) -> AdamOutput<CubeBackend<R, F, I, BT>> {
    let param = into_contiguous(param);
    let shape = param.shape();
    let output = empty_like(&param, shape.clone());
    let moment_1_out = empty_like(&param, shape.clone());
    let moment_2_out = empty_like(&param, shape.clone());
    let (count, dim) = elemwise_launch(&param, shape.num_elements());
    let (c1, c2) = hyper.corrections();
    let dtype = storage(param.dtype);
    kernels::adam_kernel::launch::<R>(
        &param.client,
        count,
        dim,
        param.clone().into_tensor_arg(),
        into_contiguous(grad).into_tensor_arg(),
        into_contiguous(moment_1).into_tensor_arg(),
        into_contiguous(moment_2).into_tensor_arg(),
        output.clone().into_tensor_arg(),
        moment_1_out.clone().into_tensor_arg(),
        moment_2_out.clone().into_tensor_arg(),
        hyper.lr as f32,
        hyper.weight_decay as f32,
        hyper.beta_1 as f32,
        hyper.beta_2 as f32,
        hyper.epsilon as f32,
        c1 as f32,
        c2 as f32,
        lamb,
        dtype,
    );
    AdamOutput {
        param: output,
        moment_1: moment_1_out,
        moment_2: moment_2_out,
    }
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

    fn bias_gelu(x: CubeTensor<R>, bias: CubeTensor<R>) -> CubeTensor<R> {
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
            dtype,
        );
        output
    }

    fn bias_gelu_backward(
        x: CubeTensor<R>,
        bias: CubeTensor<R>,
        grad: CubeTensor<R>,
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
        eps: f64,
    ) -> LayerNormForward<Self> {
        let x = into_contiguous(x);
        let [rows, n] = x.shape().dims::<2>();
        check_rows(rows * n);
        let pre_norm = empty_like(&x, x.shape());
        let output = empty_like(&x, x.shape());
        let mean = empty_like(&x, Shape::new([rows]));
        let rstd = empty_like(&x, Shape::new([rows]));
        let (count, dim, block) = row_launch(rows, n);
        let (key, threshold, keep_scale, enabled) = dropout_args(dropout);
        let dtype = storage(x.dtype);
        kernels::bias_dropout_add_layer_norm_kernel::launch::<R>(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            into_contiguous(bias).into_tensor_arg(),
            into_contiguous(residual).into_tensor_arg(),
            into_contiguous(gamma).into_tensor_arg(),
            into_contiguous(beta).into_tensor_arg(),
            pre_norm.clone().into_tensor_arg(),
            output.clone().into_tensor_arg(),
            mean.clone().into_tensor_arg(),
            rstd.clone().into_tensor_arg(),
            rows as u32,
            key,
            threshold,
            keep_scale,
            eps as f32,
            block as u32,
            enabled,
            dtype,
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
    ) -> LayerNormBackward<Self> {
        let grad = into_contiguous(grad);
        let [rows, n] = grad.shape().dims::<2>();
        check_rows(rows * n);
        let grad_pre_norm = empty_like(&grad, grad.shape());
        let grad_x = empty_like(&grad, grad.shape());
        let grad_x_hat = empty_like(&grad, grad.shape());
        let (count, dim, block) = row_launch(rows, n);
        let (key, threshold, keep_scale, enabled) = dropout_args(dropout);
        let dtype = storage(grad.dtype);
        kernels::layer_norm_backward_kernel::launch::<R>(
            &grad.client,
            count,
            dim,
            grad.clone().into_tensor_arg(),
            into_contiguous(pre_norm).into_tensor_arg(),
            into_contiguous(mean).into_tensor_arg(),
            into_contiguous(rstd).into_tensor_arg(),
            into_contiguous(gamma).into_tensor_arg(),
            grad_pre_norm.clone().into_tensor_arg(),
            grad_x.clone().into_tensor_arg(),
            grad_x_hat.clone().into_tensor_arg(),
            rows as u32,
            key,
            threshold,
            keep_scale,
            block as u32,
            enabled,
            dtype,
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
        let scores = into_contiguous(scores);
        let [batch, heads, seq_q, seq_k] = scores.shape().dims::<4>();
        let rows = batch * heads * seq_q;
        check_rows(rows * seq_k);
        let probs = empty_like(&scores, scores.shape());
        let dropped = empty_like(&scores, scores.shape());
        let (count, dim, block) = row_launch(rows, seq_k);
        let (key, threshold, keep_scale, enabled) = dropout_args(dropout);
        let dtype = storage(scores.dtype);
        kernels::masked_softmax_dropout_kernel::launch::<R>(
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
            key,
            threshold,
            keep_scale,
            block as u32,
            enabled,
            dtype,
        );
        SoftmaxForward { probs, dropped }
    }

    fn masked_softmax_dropout_backward(
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
        let (count, dim, block) = row_launch(rows, seq_k);
        let (key, threshold, keep_scale, enabled) = dropout_args(dropout);
        let dtype = storage(grad_dropped.dtype);
        kernels::masked_softmax_dropout_backward_kernel::launch::<R>(
            &grad_dropped.client,
            count,
            dim,
            grad_dropped.clone().into_tensor_arg(),
            into_contiguous(probs).into_tensor_arg(),
            grad_scores.clone().into_tensor_arg(),
            rows as u32,
            scale as f32,
            key,
            threshold,
            keep_scale,
            block as u32,
            enabled,
            dtype,
        );
        grad_scores
    }

    fn adamw_step(
        param: CubeTensor<R>,
        grad: CubeTensor<R>,
        moment_1: CubeTensor<R>,
        moment_2: CubeTensor<R>,
        hyper: AdamHyper,
    ) -> AdamOutput<Self> {
        adam_launch(param, grad, moment_1, moment_2, hyper, false)
    }

    fn lamb_update(
        param: CubeTensor<R>,
        grad: CubeTensor<R>,
        moment_1: CubeTensor<R>,
        moment_2: CubeTensor<R>,
        hyper: AdamHyper,
    ) -> AdamOutput<Self> {
        adam_launch(param, grad, moment_1, moment_2, hyper, true)
    }

    fn sum_squares(x: CubeTensor<R>) -> CubeTensor<R> {
        let x = into_contiguous(x);
        let n = x.shape().num_elements();
        let cubes = n.div_ceil(ROW_BLOCK).clamp(1, SUM_CUBES);
        let partials = empty_like(&x, Shape::new([cubes]));
        let dtype = storage(x.dtype);
        kernels::sum_squares_kernel::launch::<R>(
            &x.client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(ROW_BLOCK as u32),
            x.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            ROW_BLOCK as u32,
            true,
            dtype,
        );
        let total = empty_like(&x, Shape::new([1]));
        kernels::sum_squares_kernel::launch::<R>(
            &x.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(ROW_BLOCK as u32),
            partials.into_tensor_arg(),
            total.clone().into_tensor_arg(),
            ROW_BLOCK as u32,
            false,
            dtype,
        );
        total
    }

    fn lamb_apply(
        param: CubeTensor<R>,
        update: CubeTensor<R>,
        param_sq: CubeTensor<R>,
        update_sq: CubeTensor<R>,
        lr: f64,
    ) -> CubeTensor<R> {
        let param = into_contiguous(param);
        let output = empty_like(&param, param.shape());
        let n = param.shape().num_elements();
        let (count, dim) = elemwise_launch(&param, n);
        let dtype = storage(param.dtype);
        kernels::lamb_apply_kernel::launch::<R>(
            &param.client,
            count,
            dim,
            param.clone().into_tensor_arg(),
            into_contiguous(update).into_tensor_arg(),
            into_contiguous(param_sq).into_tensor_arg(),
            into_contiguous(update_sq).into_tensor_arg(),
            output.clone().into_tensor_arg(),
            lr as f32,
            dtype,
        );
        output
    }
}
