//! The fused ops as tensor-level functions (what the model calls): each reshapes its inputs
//! to the op's rows and calls the backend's [`FusedOps`] op (under autodiff: with its custom
//! backward).

use burn::tensor::Tensor;

use crate::{
    AdamHyper, AdamKind, AdamOutput, AdamTensors, DropoutSpec, FusedOps, Gelu, float, prim,
};

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

/// [`dense`] of `weight_half` and `bias_half`, the copies in `x`'s (half) dtype of the master
/// parameters `weight` and `bias`, through [`MasterOps::dense_of_masters`](crate::MasterOps::dense_of_masters): the same output;
/// under autodiff the masters get the gradients, in their dtype (Note [Weight gradients in
/// f32] in `linear.rs`). Given the same tensor as master and copy, it is [`dense`].
///
/// # Shapes
/// `x` `[.., I]`, `weight` and `weight_half` `[I, O]`, `bias` pair `[O]` → `[.., O]`
pub fn dense_of_masters<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    weight_half: Tensor<B, 2>,
    bias: Option<(Tensor<B, 1>, Tensor<B, 1>)>,
) -> Tensor<B, D> {
    float(B::dense_of_masters(
        prim(x),
        prim(weight),
        prim(weight_half),
        bias.map(|(b, half)| (prim(b), prim(half))),
    ))
}

/// `x` reshaped to `shape` through [`FusedOps::reshape_contiguous`] (and under autodiff its
/// gradient reshaped back the same way): Burn's `reshape`, without NdArray's copy of a
/// contiguous tensor (the attention's head split and merge).
///
/// # Shapes
/// `x` of any shape → `shape` (same number of elements)
///
/// # Panics
/// If `shape` has a different number of elements than `x` (as Burn's `reshape`).
pub fn reshape<B: FusedOps, const D1: usize, const D2: usize>(
    x: Tensor<B, D1>,
    shape: [usize; D2],
) -> Tensor<B, D2> {
    let shape = burn::tensor::Shape::new(shape);
    assert_eq!(
        x.shape().num_elements(),
        shape.num_elements(),
        "reshape of {:?} to {shape:?}: element counts differ",
        x.dims()
    );
    float(B::reshape_contiguous(prim(x), shape))
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

/// The MLM decoder's matrix, the tied word-embedding table transposed, through
/// [`FusedOps::tied_decoder_weight`]: under autodiff the decoder's share of the table's
/// gradient reaches the table right after the decoder's own backward (`after`, the MLM
/// transform's output, orders it), and the lookup's share is then added into it.
///
/// # Shapes
/// `table` `[V, H]`, `after` `[N, H]` → `[H, V]`
pub fn tied_decoder_weight<B: FusedOps>(table: Tensor<B, 2>, after: &Tensor<B, 2>) -> Tensor<B, 2> {
    float(B::tied_decoder_weight(prim(table), prim(after.clone())))
}

/// `x` through [`FusedOps::ordered_after`]: the same values; under autodiff its gradient
/// reaches `x` before the backward of `after`'s producer runs. Burn runs backward by graph
/// depth, a node one deeper than its deepest parent, so a parameter reaching a layer through
/// this op with the layer's (hooked) input as `after` has its gradient final before the hook
/// at that input runs: without it a parameter cast to a half type, or packed with others
/// (Note [Packed QKV]), sits behind a node of depth 1 or 2, whose backward runs at the very
/// end of backward (Note [Late gradients] in `ember_trainer`'s `parallel/hooks.rs`; Note
/// [Parameters ordered after their layer's input] in `ember_model`'s `weight_casts.rs`). No
/// kernel: the primitive is passed through; `after` gets no gradient.
///
/// # Shapes
/// `x` any, `after` any → `x`'s
pub fn ordered_after<B: FusedOps, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    after: &Tensor<B, E>,
) -> Tensor<B, D> {
    float(B::ordered_after(prim(x), prim(after.clone())))
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

/// `x` `[.., N]` as `[R, N]` rows, with `x`'s shape (for [`reshape`]ing the output back):
/// zero-copy on NdArray for a contiguous `x`, as the dense layers' outputs are.
fn rows<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> (Tensor<B, 2>, [usize; D]) {
    let dims = x.dims();
    let n = dims[D - 1];
    (
        reshape(x, [dims.iter().product::<usize>() / n.max(1), n]),
        dims,
    )
}

/// `GELU(x + bias)` of the chosen form (Note [Two GELUs] in `gelu.rs`) through
/// [`FusedOps::bias_gelu`] (and its backward under autodiff).
///
/// # Shapes
/// `x` `[.., N]`, `bias` `[N]` → the shape of `x`
pub fn bias_gelu<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    gelu: Gelu,
) -> Tensor<B, D> {
    let (x, dims) = rows(x);
    reshape(float::<B, 2>(B::bias_gelu(prim(x), prim(bias), gelu)), dims)
}

/// [`bias_gelu`] of `bias_half`, the copy in `x`'s (half) dtype of the master `bias`, through
/// [`crate::MasterOps::bias_gelu_of_master`]: the same output; under autodiff the master gets the
/// gradient, in its dtype (Note [Parameter gradients in f32] in `masters.rs`). Given the
/// same tensor twice, it is [`bias_gelu`].
///
/// # Shapes
/// `x` `[.., N]`, `bias` and `bias_half` `[N]` → the shape of `x`
pub fn bias_gelu_of_master<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
    bias_half: Tensor<B, 1>,
    gelu: Gelu,
) -> Tensor<B, D> {
    let (x, dims) = rows(x);
    let out = B::bias_gelu_of_master(prim(x), prim(bias), prim(bias_half), gelu);
    reshape(float::<B, 2>(out), dims)
}

/// The fused LayerNorm's operands as rows: `x` and `residual` `[R, N]`, `x`'s shape, and
/// `dropout` keyed by the rows' positions (a `[B, S, N]` input's rows are B samples of S
/// positions, the mask's layout).
#[allow(clippy::type_complexity)]
fn layer_norm_rows<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    dropout: DropoutSpec,
) -> (Tensor<B, 2>, Tensor<B, 2>, [usize; D], DropoutSpec) {
    let (x, dims) = rows(x);
    let (residual, _) = rows(residual);
    let dropout = if D >= 3 {
        dropout.with_seq_len(dims[1..D - 1].iter().product())
    } else {
        dropout
    };
    (x, residual, dims, dropout)
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
    let (x, residual, dims, dropout) = layer_norm_rows(x, residual, dropout);
    let forward = B::bias_dropout_add_layer_norm(
        prim(x),
        prim(bias),
        prim(residual),
        prim(gamma),
        prim(beta),
        dropout,
        None,
        eps,
    );
    reshape(float::<B, 2>(forward.output), dims)
}

/// [`bias_dropout_add_layer_norm`] of the copies in `x`'s (half) dtype of the master bias, γ
/// and β (each pair `(master, copy)`), through
/// [`crate::MasterOps::bias_dropout_add_layer_norm_of_masters`]: the same output; under autodiff the
/// masters get the gradients, in their dtype (Note [Parameter gradients in f32] in
/// `masters.rs`). Given the same tensors as masters and copies, it is
/// [`bias_dropout_add_layer_norm`].
///
/// # Shapes
/// `x`, `residual` `[.., N]`; each of the pairs `[N]` → the shape of `x`
pub fn bias_dropout_add_layer_norm_of_masters<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: (Tensor<B, 1>, Tensor<B, 1>),
    residual: Tensor<B, D>,
    (gamma, beta): ((Tensor<B, 1>, Tensor<B, 1>), (Tensor<B, 1>, Tensor<B, 1>)),
    dropout: DropoutSpec,
    eps: f64,
) -> Tensor<B, D> {
    let (x, residual, dims, dropout) = layer_norm_rows(x, residual, dropout);
    let output = layer_norm_of_masters(x, bias, residual, (gamma, beta), dropout, None, eps);
    reshape(output, dims)
}

/// [`crate::MasterOps::bias_dropout_add_layer_norm_of_masters`] of `[R, N]` rows: its output.
fn layer_norm_of_masters<B: FusedOps>(
    x: Tensor<B, 2>,
    bias: (Tensor<B, 1>, Tensor<B, 1>),
    residual: Tensor<B, 2>,
    (gamma, beta): ((Tensor<B, 1>, Tensor<B, 1>), (Tensor<B, 1>, Tensor<B, 1>)),
    dropout: DropoutSpec,
    dropout_rows: Option<Tensor<B, 1, burn::tensor::Int>>,
    eps: f64,
) -> Tensor<B, 2> {
    let forward = B::bias_dropout_add_layer_norm_of_masters(
        prim(x),
        prim(residual),
        [bias.0, gamma.0, beta.0].map(prim),
        [bias.1, gamma.1, beta.1].map(prim),
        dropout,
        dropout_rows.map(Tensor::into_primitive),
        eps,
    );
    float(forward.output)
}

/// [`bias_dropout_add_layer_norm_of_masters`] of packed rows (`model.unpad`, Note [Padding
/// removed] in `ember-model`'s `unpad.rs`): row `t` of `x` is the padded row
/// `padded_rows[t]` of a batch padded to `dropout.seq_len` = S, and its dropout mask is that
/// row's, as [`dropout_rows`] gives it. The dense bias and the dropout stay inside the one
/// fused op. `dropout` is taken as given: its `seq_len` is the padded length, not T.
///
/// # Shapes
/// `x`, `residual` `[.., N]` of T rows; each of the pairs `[N]`; `padded_rows` `[T]` with
/// values in `0..B·S` → the shape of `x`
///
/// # Panics
/// If dropout is on and `dropout.seq_len` is 0, or `padded_rows` does not hold T rows.
pub fn bias_dropout_add_layer_norm_of_packed_rows<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    bias: (Tensor<B, 1>, Tensor<B, 1>),
    residual: Tensor<B, D>,
    (gamma, beta): ((Tensor<B, 1>, Tensor<B, 1>), (Tensor<B, 1>, Tensor<B, 1>)),
    dropout: DropoutSpec,
    padded_rows: Tensor<B, 1, burn::tensor::Int>,
    eps: f64,
) -> Tensor<B, D> {
    assert!(
        !dropout.enabled() || dropout.seq_len > 0,
        "dropout of packed rows needs the padded length (DropoutSpec::with_seq_len)"
    );
    let (x, dims) = rows(x);
    let (residual, _) = rows(residual);
    let output = layer_norm_of_masters(
        x,
        bias,
        residual,
        (gamma, beta),
        dropout,
        Some(padded_rows),
        eps,
    );
    reshape(output, dims)
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

/// Dropout of packed rows through [`crate::PackedRowOps::dropout_rows`]: row `t` of `x` keyed
/// as row `rows[t]` of the padded `[B·S, N]` rows (`dropout.seq_len` = S), so it gets its
/// padded position's mask; `x` itself when `dropout` drops nothing.
///
/// # Shapes
/// `x` `[.., N]` of T rows, `rows` `[T]` → the shape of `x`
///
/// # Panics
/// If dropout is on and `dropout.seq_len` is 0.
pub fn dropout_rows<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    dropout: DropoutSpec,
    rows: Tensor<B, 1, burn::tensor::Int>,
) -> Tensor<B, D> {
    if !dropout.enabled() {
        return x;
    }
    float::<B, D>(B::dropout_rows(prim(x), dropout, rows.into_primitive()))
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

/// Tensors side by side along their last dimension through [`FusedOps::concat_columns`]
/// (one launch on CubeCL; under autodiff each part's gradient is its contiguous slice of the
/// output's, [`FusedOps::split_columns`]): Burn's `Tensor::cat(xs, D - 1)`.
///
/// # Shapes
/// `xs` `[.., w_t]` (the same leading dimensions) → `[.., Σ w_t]`
///
/// # Panics
/// If `xs` is empty, mixes dtypes or the leading dimensions differ.
pub fn concat_columns<B: FusedOps, const D: usize>(xs: Vec<Tensor<B, D>>) -> Tensor<B, D> {
    float(B::concat_columns(xs.into_iter().map(prim).collect()))
}

/// The attention core of packed projections through [`FusedOps::attention_qkv_core`]: Q, K
/// and V side by side in one tensor, the output of one dense layer whose weight is the three
/// projections' weights side by side (Note [Packed QKV]; NVIDIA's and Samsung's MLPerf BERT's
/// fused QKV).
///
/// # Shapes
/// `qkv` `[B, S, 3·nh·hd]` (Q's columns, then K's, then V's), `heads` nh, `mask_bias`
/// `[B, S]` → `[B, nh, S, hd]`
///
/// # Panics
/// If the width of `qkv` is not a multiple of `3 · heads`.
pub fn attention_qkv<B: FusedOps>(
    qkv: Tensor<B, 3>,
    heads: usize,
    mask_bias: Tensor<B, 2>,
    scale: f64,
    dropout: DropoutSpec,
) -> Tensor<B, 4> {
    float(B::attention_qkv_core(
        prim(qkv),
        heads,
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

/// `Σ x²` of one tensor in a fixed order ([`FusedOps::sum_squares_multi_tensor`]): a squared
/// norm that every process computes to the same bits from the same values (LAMB's trust
/// ratios on every rank).
///
/// # Shapes
/// `x` any → `[1]`
pub fn sum_squares<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    float(B::sum_squares_multi_tensor(vec![prim(x.reshape([n]))]))
}

/// `Σ x` of one tensor in a fixed order ([`FusedOps::sum_ordered`]).
///
/// # Shapes
/// `x` any → `[1]`
pub fn sum_ordered<B: FusedOps, const D: usize>(x: Tensor<B, D>) -> Tensor<B, 1> {
    let n = x.shape().num_elements();
    float(B::sum_ordered(prim(x.reshape([n]))))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    use crate::FusedOps;

    type A = Autodiff<NdArray>;

    fn values<const D: usize>(t: Tensor<NdArray, D>) -> Vec<f32> {
        t.into_data().to_vec::<f32>().unwrap()
    }

    /// [`super::reshape`] against Burn's `reshape`, forward and gradient, the attention's way:
    /// a contiguous split `[B, S, H] → [B, S, nh, hd]` (zero-copy on NdArray) and a merge of
    /// a permuted (non-contiguous) tensor back to `[B, S, H]` (one copy); a loss that weights
    /// every element differently. NdArray's zero-copy output shares the input's buffer: the
    /// input keeps its values.
    #[test]
    fn reshape_equals_burns_reshape_forward_and_backward() {
        let device = Default::default();
        let x0 = Tensor::<NdArray, 3>::random([2, 5, 6], Distribution::Normal(0.0, 1.0), &device);
        let probe =
            Tensor::<NdArray, 3>::random([2, 5, 6], Distribution::Normal(0.0, 1.0), &device);
        let run = |ours: bool| {
            let x = Tensor::<A, 3>::from_inner(x0.clone()).require_grad();
            let split = if ours {
                super::reshape(x.clone() * 2.0, [2, 5, 3, 2])
            } else {
                (x.clone() * 2.0).reshape([2, 5, 3, 2])
            };
            let permuted = split.swap_dims(1, 2) * 3.0; // [2, 3, 5, 2], strided
            let merged = if ours {
                super::reshape(permuted.swap_dims(1, 2), [2, 5, 6])
            } else {
                permuted.swap_dims(1, 2).reshape([2, 5, 6])
            };
            let grads = (merged.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            (values(merged.inner()), values(x.grad(&grads).unwrap()))
        };
        let (y, dx) = run(true);
        let (y_ref, dx_ref) = run(false);
        assert_eq!(y, y_ref, "forward");
        assert_eq!(dx, dx_ref, "gradient");
        let expected: Vec<f32> = values(x0.clone()).iter().map(|v| v * 6.0).collect();
        assert_eq!(y, expected, "reshapes move no element");

        // Zero-copy: the input is not modified through a shared buffer.
        let before = values(x0.clone());
        let flat = <NdArray as FusedOps>::reshape_contiguous(
            x0.clone().into_primitive().tensor(),
            burn::tensor::Shape::new([60]),
        );
        let flat = Tensor::<NdArray, 1>::from_primitive(TensorPrimitive::Float(flat));
        assert_eq!(values(flat), before);
        assert_eq!(values(x0), before);
    }
}
