//! The reference composition of every fused op, in Burn tensor ops: the default bodies of
//! [`FusedOps`](crate::FusedOps), what NdArray runs, and the oracle of the kernel tests. Under
//! an autodiff backend the tensor-level functions here ([`bias_gelu`],
//! [`bias_dropout_add_layer_norm`], [`attention`]) are differentiated by Burn's autodiff.
//!
//! Dropout masks come from [`keep_mask`](crate::keep_mask), the same counter-based masks the
//! kernels compute.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::gelu::{GELU_TANH_CLAMP, GELU_TANH_CUBIC, SQRT_2_OVER_PI};
use crate::{
    AdamHyper, AdamKind, AdamOutput, DropoutSpec, Gelu, LayerNormForward, SoftmaxForward,
    keep_mask, prim,
};

const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

pub use crate::cross_entropy::{
    reference_backward as cross_entropy_backward, reference_forward as cross_entropy_forward,
};

/// `GELU(x + bias)` of the chosen form (Note [Two GELUs] in `gelu.rs`): erf,
/// `z · Φ(z)`, `Φ(z) = ½ (1 + erf(z/√2))`; tanh, `z · σ(2u)`, `u = √(2/π)(z + 0.044715 z³)`.
///
/// # Shapes
/// `x` `[.., N]`, `bias` `[N]` → the shape of `x`
pub fn bias_gelu<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    gelu: Gelu,
) -> Tensor<B, D> {
    self::gelu(x + bias.unsqueeze::<D>(), gelu)
}

/// `GELU(z)` of the chosen form composed of Burn ops, differentiated by Burn's autodiff: erf,
/// `z · Φ(z)`; tanh, `z · σ(2u)` (Note [Two GELUs] in `gelu.rs`). What the model's reference
/// path and [`bias_gelu`] compute.
///
/// # Shapes
/// any shape; the output has the input's shape.
pub fn gelu<B: Backend, const D: usize>(z: Tensor<B, D>, gelu: Gelu) -> Tensor<B, D> {
    z.clone() * gelu_gate(z, gelu)
}

/// The gate `g(z)` of `GELU(z) = z · g(z)`: `Φ(z)` (erf) or `σ(2u)` (tanh).
fn gelu_gate<B: Backend, const D: usize>(z: Tensor<B, D>, gelu: Gelu) -> Tensor<B, D> {
    match gelu {
        Gelu::Erf => (z * std::f64::consts::FRAC_1_SQRT_2).erf().add_scalar(1.0) * 0.5,
        Gelu::Tanh => {
            // σ(2u), 2u = 2√(2/π)(z + 0.044715 z³), by Burn's sigmoid: `1 / (1 + e^(−2u))`
            // composed would overflow to ∞ at z ≲ −10, and its autodiff then gives 0·∞ = NaN.
            // z³ as products: a power of a negative base is undefined on some GPUs' `pow`.
            // z clamped as every implementation does ([`GELU_TANH_CLAMP`]).
            let z = z.clamp(-GELU_TANH_CLAMP, GELU_TANH_CLAMP);
            let cubic = z.clone() * z.clone() * z.clone() * GELU_TANH_CUBIC + z;
            burn::tensor::activation::sigmoid(cubic * (2.0 * SQRT_2_OVER_PI))
        }
    }
}

/// `grad · GELU'(z)`, `z = x + bias`: erf, `Φ(z) + z·φ(z)`, `φ(z) = exp(−z²/2) / √(2π)`;
/// tanh, `σ(2u) + z · σ(2u)(1 − σ(2u)) · 2u'`, `u' = √(2/π)(1 + 3·0.044715 z²)`.
///
/// # Shapes
/// `x`, `grad` `[.., N]`, `bias` `[N]` → the shape of `x`
pub fn bias_gelu_backward<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    grad: Tensor<B, D>,
    gelu: Gelu,
) -> Tensor<B, D> {
    let z = x + bias.unsqueeze::<D>();
    let gate = gelu_gate(z.clone(), gelu);
    let slope = match gelu {
        Gelu::Erf => (z.clone().powi_scalar(2) * -0.5).exp() * FRAC_1_SQRT_2PI,
        Gelu::Tanh => {
            let c = z.clone().clamp(-GELU_TANH_CLAMP, GELU_TANH_CLAMP);
            let du =
                (c.clone() * c * (3.0 * GELU_TANH_CUBIC)).add_scalar(1.0) * (2.0 * SQRT_2_OVER_PI);
            gate.clone() * gate.clone().neg().add_scalar(1.0) * du
        }
    };
    grad * (gate + z * slope)
}

/// The tensors of the LayerNorm forward: output, pre-norm sum, mean `[R, 1]`, rstd `[R, 1]`.
type LayerNormParts<B> = (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 2>);

#[allow(clippy::too_many_arguments)]
fn layer_norm_parts<B: Backend>(
    x: Tensor<B, 2>,
    bias: Tensor<B, 1>,
    residual: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    dropout: DropoutSpec,
    dropout_rows: Option<IntTensor<B>>,
    eps: f64,
) -> LayerNormParts<B> {
    let mut z = x + bias.unsqueeze::<2>();
    if dropout.enabled() {
        z = z.clone() * rows_keep_mask::<B>(dropout, dropout_rows, z.dims(), &z.device());
    }
    let pre_norm = z + residual;
    let mean = pre_norm.clone().mean_dim(1); // [R, 1]
    let centered = pre_norm.clone() - mean.clone();
    let var = centered.clone().powi_scalar(2).mean_dim(1);
    let rstd = var.add_scalar(eps).sqrt().recip();
    let output = centered * rstd.clone() * gamma.unsqueeze::<2>() + beta.unsqueeze::<2>();
    (output, pre_norm, mean, rstd)
}

/// `LayerNorm(residual + dropout(x + bias))`, differentiable by composition.
///
/// # Shapes
/// `x`, `residual` `[.., N]`; `bias`, `gamma`, `beta` `[N]` → the shape of `x`
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add_layer_norm<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    residual: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    dropout: DropoutSpec,
    eps: f64,
) -> Tensor<B, D> {
    let dims = x.dims();
    let n = dims[D - 1];
    let r = dims.iter().product::<usize>() / n.max(1);
    // A `[B, S, N]` input's rows are B samples of S positions (the mask's layout).
    let dropout = if D >= 3 {
        dropout.with_seq_len(dims[1..D - 1].iter().product())
    } else {
        dropout
    };
    let (output, ..) = layer_norm_parts(
        x.reshape([r, n]),
        bias,
        residual.reshape([r, n]),
        gamma,
        beta,
        dropout,
        None,
        eps,
    );
    output.reshape(dims)
}

/// The keep mask of `[R, N]` rows, each row keyed as itself or, with `dropout_rows`, as its
/// padded row (read back to the host; [`crate::PackedRowOps::dropout_rows`]'s mask).
fn rows_keep_mask<B: Backend>(
    dropout: DropoutSpec,
    dropout_rows: Option<IntTensor<B>>,
    [r, n]: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2> {
    let Some(rows) = dropout_rows else {
        return keep_mask::<B, 2>(dropout, [r, n], device);
    };
    let values = packed_mask_values::<B>(dropout, rows, r, n);
    Tensor::from_data(TensorData::new(values, [r, n]), device)
}

/// The mask values of `r` packed rows of `columns`, row `t` keyed as padded row `rows[t]`
/// (read back to the host), row-major.
///
/// # Panics
/// If `rows` does not hold `r` rows, or `dropout.seq_len` is 0.
fn packed_mask_values<B: Backend>(
    dropout: DropoutSpec,
    rows: IntTensor<B>,
    r: usize,
    columns: usize,
) -> Vec<f32> {
    let rows = Tensor::<B, 1, burn::tensor::Int>::from_primitive(rows)
        .into_data()
        .convert::<i64>();
    let rows = rows.as_slice::<i64>().expect("i64 rows after convert");
    assert_eq!(rows.len(), r, "packed rows: a padded row per row");
    crate::dropout::mask_values_of_rows(dropout, columns, rows)
}

/// The default body of [`FusedOps::bias_dropout_add_layer_norm`](crate::FusedOps).
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add_layer_norm_forward<B: Backend>(
    x: Tensor<B, 2>,
    bias: Tensor<B, 1>,
    residual: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    dropout: DropoutSpec,
    dropout_rows: Option<IntTensor<B>>,
    eps: f64,
) -> LayerNormForward<B> {
    let [r, _] = x.dims();
    let (output, pre_norm, mean, rstd) =
        layer_norm_parts(x, bias, residual, gamma, beta, dropout, dropout_rows, eps);
    LayerNormForward {
        output: prim(output),
        pre_norm: prim(pre_norm),
        mean: prim(mean.reshape([r])),
        rstd: prim(rstd.reshape([r])),
    }
}

/// The default body of
/// [`FusedOps::bias_dropout_add_layer_norm_backward`](crate::FusedOps).
pub fn bias_dropout_add_layer_norm_backward<B: Backend>(
    grad: Tensor<B, 2>,
    pre_norm: Tensor<B, 2>,
    mean: Tensor<B, 1>,
    rstd: Tensor<B, 1>,
    gamma: Tensor<B, 1>,
    dropout: DropoutSpec,
    dropout_rows: Option<IntTensor<B>>,
) -> crate::LayerNormBackward<B> {
    let [r, n] = grad.dims();
    let rstd = rstd.reshape([r, 1]);
    let x_hat = (pre_norm - mean.reshape([r, 1])) * rstd.clone();
    let g = grad.clone() * gamma.unsqueeze::<2>();
    let mean_g = g.clone().mean_dim(1);
    let mean_gx = (g.clone() * x_hat.clone()).mean_dim(1);
    let grad_pre_norm = (g - mean_g - x_hat.clone() * mean_gx) * rstd;
    let grad_x = if dropout.enabled() {
        grad_pre_norm.clone() * rows_keep_mask::<B>(dropout, dropout_rows, [r, n], &grad.device())
    } else {
        grad_pre_norm.clone()
    };
    crate::LayerNormBackward {
        grad_pre_norm: prim(grad_pre_norm),
        grad_x: prim(grad_x),
        grad_x_hat: prim(grad * x_hat),
    }
}

fn masked_softmax<B: Backend>(
    scores: Tensor<B, 4>,
    mask_bias: Tensor<B, 2>,
    scale: f64,
) -> Tensor<B, 4> {
    let [batch, seq] = mask_bias.dims();
    burn::tensor::activation::softmax(scores * scale + mask_bias.reshape([batch, 1, 1, seq]), 3)
}

fn drop<B: Backend, const D: usize>(x: Tensor<B, D>, dropout: DropoutSpec) -> Tensor<B, D> {
    if dropout.enabled() {
        let mask = keep_mask::<B, D>(dropout, x.dims(), &x.device()).cast(x.dtype());
        x * mask
    } else {
        x
    }
}

/// Dropout through the host-computed [`keep_mask`], differentiable by composition: what the
/// reference path of the model runs.
///
/// # Shapes
/// `x` `[B, S, N]` or `[B, nh, S, S]` (or rows with `dropout.seq_len`) → the shape of `x`
pub fn dropout<B: Backend, const D: usize>(x: Tensor<B, D>, dropout: DropoutSpec) -> Tensor<B, D> {
    drop(x, dropout)
}

/// The default body of [`FusedOps::dropout`](crate::FusedOps::dropout), on a primitive of any
/// rank.
pub fn dropout_primitive<B: Backend>(x: FloatTensor<B>, dropout: DropoutSpec) -> FloatTensor<B> {
    if !dropout.enabled() {
        return x;
    }
    let shape = x.shape();
    let values = crate::dropout::mask_values(dropout, shape.as_slice());
    let data = TensorData::new(values, shape).convert_dtype(x.dtype());
    let mask = B::float_from_data(data, &B::float_device(&x));
    B::float_mul(x, mask)
}

/// Dropout of packed rows, the default body of
/// [`PackedRowOps::dropout_rows`](crate::PackedRowOps::dropout_rows): `rows` read back to the host,
/// the mask built there ([`crate::dropout::RowMask`], each row keyed as its padded row) and
/// multiplied in.
pub fn dropout_rows_primitive<B: Backend>(
    x: FloatTensor<B>,
    dropout: DropoutSpec,
    rows: IntTensor<B>,
) -> FloatTensor<B> {
    if !dropout.enabled() {
        return x;
    }
    let shape = x.shape();
    let columns = shape.as_slice().last().copied().unwrap_or(1).max(1);
    let values = packed_mask_values::<B>(dropout, rows, shape.num_elements() / columns, columns);
    let data = TensorData::new(values, shape).convert_dtype(x.dtype());
    let mask = B::float_from_data(data, &B::float_device(&x));
    B::float_mul(x, mask)
}

/// `Σ_r x[r, ..]` (Burn's `sum_dim(0)`): the default body of
/// [`FusedOps::sum_rows`](crate::FusedOps::sum_rows), a bias's gradient.
///
/// # Shapes
/// `x` `[R, N]` → `[N]`
pub fn sum_rows<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let t: Tensor<B, 2> = Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(x));
    let [_, n] = t.dims();
    prim(t.sum_dim(0).reshape([n]))
}

/// The default body of [`FusedOps::masked_softmax_dropout`](crate::FusedOps).
pub fn masked_softmax_dropout_forward<B: Backend>(
    scores: Tensor<B, 4>,
    mask_bias: Tensor<B, 2>,
    scale: f64,
    dropout: DropoutSpec,
) -> SoftmaxForward<B> {
    let probs = masked_softmax(scores, mask_bias, scale);
    SoftmaxForward {
        dropped: prim(drop(probs.clone(), dropout)),
        probs: prim(probs),
    }
}

/// The default body of [`FusedOps::masked_softmax_dropout_backward`](crate::FusedOps).
pub fn masked_softmax_dropout_backward<B: Backend>(
    grad_dropped: Tensor<B, 4>,
    probs: Tensor<B, 4>,
    scale: f64,
    dropout: DropoutSpec,
) -> Tensor<B, 4> {
    let grad_probs = drop(grad_dropped, dropout);
    let dot = (grad_probs.clone() * probs.clone()).sum_dim(3);
    probs * (grad_probs - dot) * scale
}

/// `dropout(softmax(Q·Kᵀ·scale + mask_bias)) · V`, differentiable by composition.
///
/// # Shapes
/// `q`, `k`, `v` `[B, nh, S, hd]`, `mask_bias` `[B, S]` → `[B, nh, S, hd]`
pub fn attention<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_bias: Tensor<B, 2>,
    scale: f64,
    dropout: DropoutSpec,
) -> Tensor<B, 4> {
    let probs = masked_softmax(q.matmul(k.swap_dims(2, 3)), mask_bias, scale);
    drop(probs, dropout).matmul(v)
}

/// Adam's moments and bias-corrected direction `m̂ / (sqrt(v̂) + ε)` (Burn's
/// `AdaptiveMomentumW::transform`).
fn adam_direction<B: Backend>(
    grad: Tensor<B, 1>,
    moment_1: Tensor<B, 1>,
    moment_2: Tensor<B, 1>,
    hyper: AdamHyper,
) -> (Tensor<B, 1>, Tensor<B, 1>, Tensor<B, 1>) {
    let (b1, b2) = (hyper.beta_1, hyper.beta_2);
    let moment_1 = moment_1 * b1 + grad.clone() * (1.0 - b1);
    let moment_2 = moment_2 * b2 + grad.square() * (1.0 - b2);
    let (c1, c2) = hyper.corrections();
    let direction =
        (moment_1.clone() / c1) / (moment_2.clone() / c2).sqrt().add_scalar(hyper.epsilon);
    (direction, moment_1, moment_2)
}

/// One Adam-family step of a flattened tensor, the default body of
/// [`FusedOps::adam_multi_tensor`](crate::FusedOps::adam_multi_tensor): `AdamW` returns
/// Burn's `AdamW` step of the parameter, `LambUpdate` LAMB's update direction.
pub fn adam_step<B: Backend>(
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    moment_1: Tensor<B, 1>,
    moment_2: Tensor<B, 1>,
    hyper: AdamHyper,
    kind: AdamKind,
) -> AdamOutput<B> {
    let (direction, moment_1, moment_2) = adam_direction(grad, moment_1, moment_2, hyper);
    let param = match kind {
        AdamKind::AdamW if hyper.weight_decay == 0.0 => param - direction * hyper.lr,
        AdamKind::AdamW => param * (1.0 - hyper.lr * hyper.weight_decay) - direction * hyper.lr,
        AdamKind::LambUpdate if hyper.weight_decay == 0.0 => direction,
        AdamKind::LambUpdate => direction + param * hyper.weight_decay,
    };
    AdamOutput {
        param: prim(param),
        moment_1: prim(moment_1),
        moment_2: prim(moment_2),
    }
}

/// [`adam_step`] of one [`AdamTensors`](crate::AdamTensors) of primitives.
pub fn adam_tensors<B: Backend>(
    t: crate::AdamTensors<B>,
    hyper: AdamHyper,
    kind: AdamKind,
) -> AdamOutput<B> {
    let float = |x| Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(x));
    adam_step::<B>(
        float(t.param),
        float(t.grad),
        float(t.moment_1),
        float(t.moment_2),
        hyper,
        kind,
    )
}

/// `Σ x²` of each tensor (the default body of
/// [`FusedOps::sum_squares_multi_tensor`](crate::FusedOps::sum_squares_multi_tensor)),
/// accumulated in f64 where the backend has it.
///
/// # Shapes
/// `xs` (not empty), each flat `[n_i]` → `[xs.len()]`
///
/// # Panics
/// If `xs` is empty.
pub fn sum_squares_multi_tensor<B: Backend>(xs: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    assert!(!xs.is_empty(), "sum_squares_multi_tensor of no tensors");
    let sums = xs
        .into_iter()
        .map(|x| {
            let x = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x));
            let (device, dtype) = (x.device(), x.dtype());
            // A plain sum of millions of f32 squares (an embedding table's) is off by about
            // 1e-5 of its value; where the backend has f64 (NdArray), accumulate in it. The
            // CubeCL kernel sums strided partials per unit, then a tree, which stays near
            // f32's rounding.
            if dtype != DType::F64 && B::supports_dtype(&device, DType::F64) {
                x.cast(FloatDType::F64).square().sum().cast(dtype)
            } else {
                x.square().sum()
            }
        })
        .collect();
    Tensor::cat(sums, 0).into_primitive().tensor()
}

/// LAMB's second half for many tensors (the default body of
/// [`FusedOps::lamb_apply_multi_tensor`](crate::FusedOps::lamb_apply_multi_tensor)):
/// [`lamb_apply`] tensor by tensor.
///
/// # Shapes
/// `params`, `updates` flat `[n_i]`; `param_sq`, `update_sq` `[params.len()]` → one `[n_i]`
/// per tensor
pub fn lamb_apply_multi_tensor<B: Backend>(
    params: Vec<FloatTensor<B>>,
    updates: Vec<FloatTensor<B>>,
    param_sq: FloatTensor<B>,
    update_sq: FloatTensor<B>,
    lr: f64,
) -> Vec<FloatTensor<B>> {
    let float = |x| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x));
    let (param_sq, update_sq) = (float(param_sq), float(update_sq));
    params
        .into_iter()
        .zip(updates)
        .enumerate()
        .map(|(i, (param, update))| {
            lamb_apply(
                float(param),
                float(update),
                param_sq.clone().slice(i..i + 1),
                update_sq.clone().slice(i..i + 1),
                lr,
            )
            .into_primitive()
            .tensor()
        })
        .collect()
}

/// LAMB's second half for one tensor (the default body of
/// [`FusedOps::lamb_apply_multi_tensor`](crate::FusedOps::lamb_apply_multi_tensor)):
/// `w − lr · r · u` with `r = ‖w‖/‖u‖` (1 if either is 0) from the squared norms `[1]`.
pub fn lamb_apply<B: Backend>(
    param: Tensor<B, 1>,
    update: Tensor<B, 1>,
    param_sq: Tensor<B, 1>,
    update_sq: Tensor<B, 1>,
    lr: f64,
) -> Tensor<B, 1> {
    let (w_norm, u_norm) = (param_sq.sqrt(), update_sq.sqrt());
    let ratio = (w_norm.clone() / u_norm.clone().clamp_min(f32::MIN_POSITIVE))
        .mask_fill(w_norm.lower_equal_elem(0.0), 1.0)
        .mask_fill(u_norm.lower_equal_elem(0.0), 1.0);
    param - update * ratio.mul_scalar(lr)
}
