//! The fused ops as tensor-level functions (what the model calls): each reshapes its inputs
//! to the op's rows and calls the backend's [`FusedOps`] op (under autodiff: with its custom
//! backward).

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::{AdamHyper, AdamKind, AdamOutput, AdamTensors, DropoutSpec, FusedOps, float, prim};

/// `x · weight + bias` through [`FusedOps::dense`] (and its backward under autodiff): Burn's
/// `Linear::forward` without NdArray's copies.
///
/// # Shapes
/// `x` `[.., I]`, `weight` `[I, O]`, `bias` `[O]` → `[.., O]`
pub fn dense<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    float(B::dense(prim(x), prim(weight), bias.map(prim)))
}

/// Rows of `weights` at `indices` through [`FusedOps::embedding_lookup`] (and its backward
/// under autodiff): Burn's `embedding`.
///
/// # Shapes
/// `weights` `[V, H]`, `indices` `[B, S]` (values in `0..V`) → `[B, S, H]`
pub fn embedding<B: FusedOps>(
    weights: Tensor<B, 2>,
    indices: Tensor<B, 2, burn::tensor::Int>,
) -> Tensor<B, 3> {
    float(B::embedding_lookup(prim(weights), indices.into_primitive()))
}

/// Mean cross-entropy of `logits` against `labels` through [`FusedOps::cross_entropy`] (and
/// its backward under autodiff): `mean_i(logsumexp(x_i) − x_i[label_i])`,
/// `torch.nn.functional.cross_entropy` with mean reduction.
///
/// # Shapes
/// `logits` `[N, C]`, `labels` `[N]` (values in `0..C`) → `[1]`
pub fn cross_entropy<B: FusedOps>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 1, burn::tensor::Int>,
) -> Tensor<B, 1> {
    float(B::cross_entropy(prim(logits), labels.into_primitive()).loss)
}

/// [`dense`] of a Burn `Linear` module's parameters.
pub fn dense_module<B: FusedOps, const D: usize>(
    module: &burn::nn::Linear<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    dense(
        x,
        module.weight.val(),
        module.bias.as_ref().map(|b| b.val()),
    )
}

fn rows<B: Backend, const D: usize>(x: Tensor<B, D>) -> (Tensor<B, 2>, [usize; D]) {
    let dims = x.dims();
    let n = dims[D - 1];
    (
        x.reshape([dims.iter().product::<usize>() / n.max(1), n]),
        dims,
    )
}

/// `GELU_erf(x + bias)` through [`FusedOps::bias_gelu`] (and its backward under autodiff).
///
/// # Shapes
/// `x` `[.., N]`, `bias` `[N]` → the shape of `x`
pub fn bias_gelu<B: FusedOps, const D: usize>(x: Tensor<B, D>, bias: Tensor<B, 1>) -> Tensor<B, D> {
    let (x, dims) = rows(x);
    float::<B, 2>(B::bias_gelu(prim(x), prim(bias))).reshape(dims)
}

/// `LayerNorm(residual + dropout(x + bias))` through [`FusedOps::bias_dropout_add_layer_norm`].
///
/// # Shapes
/// `x`, `residual` `[.., N]`; `bias`, `gamma`, `beta` `[N]` → the shape of `x`
#[allow(clippy::too_many_arguments)]
pub fn bias_dropout_add_layer_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    residual: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    dropout: DropoutSpec,
    eps: f64,
) -> Tensor<B, D> {
    let (x, dims) = rows(x);
    let (residual, _) = rows(residual);
    // A `[B, S, N]` input's rows are B samples of S positions (the mask's layout).
    let dropout = if D >= 3 {
        dropout.with_seq_len(dims[1..D - 1].iter().product())
    } else {
        dropout
    };
    let forward = B::bias_dropout_add_layer_norm(
        prim(x),
        prim(bias),
        prim(residual),
        prim(gamma),
        prim(beta),
        dropout,
        eps,
    );
    float::<B, 2>(forward.output).reshape(dims)
}

/// Dropout through [`FusedOps::dropout`] (its own backward under autodiff), keyed per sample
/// and position (see [`DropoutSpec`]).
///
/// # Shapes
/// `x` `[B, S, N]` or `[B, nh, S, S]` → the shape of `x`
pub fn dropout<B: FusedOps, const D: usize>(x: Tensor<B, D>, dropout: DropoutSpec) -> Tensor<B, D> {
    if !dropout.enabled() {
        return x;
    }
    float::<B, D>(B::dropout(prim(x), dropout))
}

/// The attention core through [`FusedOps::attention_core`].
///
/// # Shapes
/// `q`, `k`, `v` `[B, nh, S, hd]`, `mask_bias` `[B, S]` → `[B, nh, S, hd]`
pub fn attention<B: FusedOps>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask_bias: Tensor<B, 2>,
    scale: f64,
    dropout: DropoutSpec,
) -> Tensor<B, 4> {
    float(B::attention_core(
        prim(q),
        prim(k),
        prim(v),
        prim(mask_bias),
        scale,
        dropout,
    ))
}

/// A whole LAMB step of many tensors through the multi-tensor ops: the moments and updates
/// ([`AdamKind::LambUpdate`]), the squared norms of parameters and updates in one
/// [`FusedOps::sum_squares_multi_tensor`], then [`FusedOps::lamb_apply_multi_tensor`]. Three
/// launches per group of tensors (plus the norms' final sum), nothing read back to the host.
///
/// # Shapes
/// each of `tensors` flat `[n_i]` → one [`AdamOutput`] per tensor (`param`: the new parameter)
pub fn lamb_multi_tensor<B: FusedOps>(
    tensors: Vec<AdamTensors<B>>,
    hyper: AdamHyper,
) -> Vec<AdamOutput<B>> {
    if tensors.is_empty() {
        return Vec::new();
    }
    let count = tensors.len();
    let params: Vec<_> = tensors.iter().map(|t| t.param.clone()).collect();
    let stage_1 = B::adam_multi_tensor(tensors, hyper, AdamKind::LambUpdate);
    let updates: Vec<_> = stage_1.iter().map(|o| o.param.clone()).collect();
    let norms = float::<B, 1>(B::sum_squares_multi_tensor(
        params.iter().chain(&updates).cloned().collect(),
    ));
    let param_sq = prim(norms.clone().slice(0..count));
    let update_sq = prim(norms.slice(count..2 * count));
    let new_params = B::lamb_apply_multi_tensor(params, updates, param_sq, update_sq, hyper.lr);
    stage_1
        .into_iter()
        .zip(new_params)
        .map(|(out, param)| AdamOutput { param, ..out })
        .collect()
}
