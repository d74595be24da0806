//! [`FusedOps`] for NdArray, the CPU backend: the fused ops run as their reference
//! composition (`reference.rs`), except where the composition's whole-tensor passes and Burn
//! 0.21 NdArray's copying reshapes cost most of a training step, which run here as host loops
//! on views: the dense layers (`linear.rs`), the losses (`cross_entropy.rs`), the AdamW/LAMB
//! update (`host_adam.rs`) and the optimizer's flattening reshape. Each is tested against the
//! reference in its file; each falls back to the reference for dtypes other than f32.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::{
    AdamHyper, AdamKind, AdamOutput, AdamTensors, CrossEntropyForward, DropoutSpec, FusedOps, Gelu,
    LayerNormBackward, LayerNormForward, MasterOps, SoftmaxForward, cross_entropy, float,
    host_adam, host_embedding, host_layer, host_matmul, host_sum, linear, prim, qkv, reference,
};

/// NdArray takes the default bodies of these supertraits of [`FusedOps`]: [`MasterOps`]'s
/// (its fused ops run in f32, where masters and copies are one) and [`crate::BucketOps`]'s
/// (`cat`, and `slice`'s views).
macro_rules! default_bodies_on_ndarray {
    ($($op:path),*) => {$(
        impl<E, I, Q> $op for burn_ndarray::NdArray<E, I, Q>
        where
            E: burn_ndarray::FloatNdArrayElement,
            I: burn_ndarray::IntNdArrayElement,
            Q: burn_ndarray::QuantElement,
            burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<E>>,
            burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<I>>,
        {
        }
    )*};
}
default_bodies_on_ndarray!(MasterOps, crate::BucketOps);

/// Packed rows on NdArray: dropout on rayon's threads; gathering and scattering by Burn's ops
/// (the default bodies).
impl<E, I, Q> crate::PackedRowOps for burn_ndarray::NdArray<E, I, Q>
where
    E: burn_ndarray::FloatNdArrayElement,
    I: burn_ndarray::IntNdArrayElement,
    Q: burn_ndarray::QuantElement,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<E>>,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<I>>,
{
    fn dropout_rows(
        x: FloatTensor<Self>,
        dropout: DropoutSpec,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        if !dropout.enabled() {
            return x;
        }
        let values = host_rows::<Self>(&rows);
        match host_layer::dropout(&x, dropout, Some(&values)) {
            Some(out) => out,
            None => reference::dropout_rows_primitive::<Self>(x, dropout, rows),
        }
    }
}

impl<E, I, Q> FusedOps for burn_ndarray::NdArray<E, I, Q>
where
    E: burn_ndarray::FloatNdArrayElement,
    I: burn_ndarray::IntNdArrayElement,
    Q: burn_ndarray::QuantElement,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<E>>,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<I>>,
{
    const HAS_MULTI_TENSOR: bool = true;
    const FUSED_BY_DEFAULT: bool = true;

    fn cross_entropy(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
    ) -> CrossEntropyForward<Self> {
        match cross_entropy::ndarray_forward(&logits, &labels) {
            Some((loss, log_sum_exp)) => CrossEntropyForward { loss, log_sum_exp },
            None => cross_entropy::reference_forward::<Self>(logits, labels),
        }
    }

    fn cross_entropy_backward(
        logits: FloatTensor<Self>,
        labels: IntTensor<Self>,
        log_sum_exp: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match cross_entropy::ndarray_backward(&logits, &labels, &log_sum_exp, &grad) {
            Some(grad) => grad,
            None => cross_entropy::reference_backward::<Self>(logits, labels, log_sum_exp, grad),
        }
    }

    fn concat_columns(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        match qkv::ndarray_concat_columns(&xs) {
            Some(packed) => packed,
            None => crate::columns::reference_concat_columns::<Self>(xs),
        }
    }

    fn split_columns(x: FloatTensor<Self>, widths: &[usize]) -> Vec<FloatTensor<Self>> {
        // Contiguous parts (copied on rayon's threads): a strided view would be copied on
        // one thread by each later reshape (the bucket flattening's).
        crate::columns::reference_split_columns::<Self>(x, widths)
            .into_iter()
            .map(|part| {
                let shape = part.shape();
                Self::reshape_contiguous(part, shape)
            })
            .collect()
    }

    fn merge_qkv_heads(parts: [FloatTensor<Self>; 3]) -> FloatTensor<Self> {
        match qkv::ndarray_merge_heads(&parts) {
            Some(merged) => merged,
            None => qkv::reference_merge_heads::<Self>(parts),
        }
    }

    fn reshape_contiguous(x: FloatTensor<Self>, shape: burn::tensor::Shape) -> FloatTensor<Self> {
        match linear::ndarray_reshape(x, &shape) {
            Ok(reshaped) => reshaped,
            Err(x) => <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_reshape(x, shape),
        }
    }

    fn adam_multi_tensor(
        tensors: Vec<AdamTensors<Self>>,
        hyper: AdamHyper,
        kind: AdamKind,
    ) -> Vec<AdamOutput<Self>> {
        tensors
            .into_iter()
            .map(|t| match host_adam::adam_step(t, &hyper, kind) {
                Ok([param, moment_1, moment_2]) => AdamOutput {
                    param,
                    moment_1,
                    moment_2,
                },
                Err(t) => reference::adam_tensors::<Self>(*t, hyper, kind),
            })
            .collect()
    }

    fn sum_squares_multi_tensor(xs: Vec<FloatTensor<Self>>) -> FloatTensor<Self> {
        assert!(!xs.is_empty(), "sum_squares_multi_tensor of no tensors");
        match host_adam::sum_squares(&xs) {
            Some(sums) => sums,
            None => reference::sum_squares_multi_tensor::<Self>(xs),
        }
    }

    fn lamb_apply_multi_tensor(
        params: Vec<FloatTensor<Self>>,
        updates: Vec<FloatTensor<Self>>,
        param_sq: FloatTensor<Self>,
        update_sq: FloatTensor<Self>,
        lr: f64,
    ) -> Vec<FloatTensor<Self>> {
        match host_adam::lamb_apply(params, &updates, &param_sq, &update_sq, lr) {
            Ok(new) => new,
            Err(params) => {
                reference::lamb_apply_multi_tensor::<Self>(params, updates, param_sq, update_sq, lr)
            }
        }
    }

    fn embedding_lookup_backward(
        weights: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match host_embedding::backward(&weights, &grad, &indices) {
            Some(out) => out,
            None => <Self as burn::tensor::ops::ModuleOps<Self>>::embedding_backward(
                weights, grad, indices,
            ),
        }
    }

    fn embedding_lookup_backward_into(
        sum: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match host_embedding::backward_into(sum, &grad, &indices) {
            Ok(out) => out,
            Err(sum) => {
                let rows = Self::embedding_lookup_backward(sum.clone(), grad, indices);
                Self::accumulate(sum, rows)
            }
        }
    }

    fn accumulate(sum: FloatTensor<Self>, value: FloatTensor<Self>) -> FloatTensor<Self> {
        match host_sum::accumulate(sum, &value) {
            Ok(out) => out,
            Err(sum) => <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_add(sum, value),
        }
    }

    fn sum_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match host_sum::sum_rows(&x) {
            Some(out) => out,
            None => reference::sum_rows::<Self>(x),
        }
    }

    fn batched_matmul(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        match host_matmul::batched_matmul(&a, &b) {
            Some(out) => out,
            None => <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_matmul(a, b),
        }
    }

    fn dense(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        match linear::ndarray_linear(&x, &weight, bias.as_ref()) {
            Some(out) => out,
            None => linear::reference_linear::<Self>(x, weight, bias),
        }
    }

    fn dense_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        with_bias: bool,
    ) -> crate::DenseGrads<Self> {
        match linear::ndarray_linear_backward(&x, &weight, &grad, with_bias) {
            Some(grads) => grads,
            None => linear::reference_linear_backward::<Self>(x, weight, grad, with_bias),
        }
    }

    fn bias_gelu(x: FloatTensor<Self>, bias: FloatTensor<Self>, gelu: Gelu) -> FloatTensor<Self> {
        match host_layer::bias_gelu(&x, &bias, gelu) {
            Some(out) => out,
            None => prim(reference::bias_gelu::<Self, 2>(float(x), float(bias), gelu)),
        }
    }

    fn bias_gelu_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        gelu: Gelu,
    ) -> FloatTensor<Self> {
        match host_layer::bias_gelu_backward(&x, &bias, &grad, gelu) {
            Some(out) => out,
            None => prim(reference::bias_gelu_backward::<Self, 2>(
                float(x),
                float(bias),
                float(grad),
                gelu,
            )),
        }
    }

    fn dropout(x: FloatTensor<Self>, dropout: DropoutSpec) -> FloatTensor<Self> {
        match host_layer::dropout(&x, dropout, None) {
            Some(out) => out,
            None => reference::dropout_primitive::<Self>(x, dropout),
        }
    }

    fn bias_dropout_add_layer_norm(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
        eps: f64,
    ) -> LayerNormForward<Self> {
        let rows = mask_rows::<Self>(dropout, &dropout_rows);
        let parts = host_layer::layer_norm(
            [&x, &bias, &residual, &gamma, &beta],
            dropout,
            rows.as_deref(),
            eps,
        );
        match parts {
            Some([output, pre_norm, mean, rstd]) => LayerNormForward {
                output,
                pre_norm,
                mean,
                rstd,
            },
            None => reference::bias_dropout_add_layer_norm_forward::<Self>(
                float(x),
                float(bias),
                float(residual),
                float(gamma),
                float(beta),
                dropout,
                dropout_rows,
                eps,
            ),
        }
    }

    fn bias_dropout_add_layer_norm_backward(
        grad: FloatTensor<Self>,
        pre_norm: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        rstd: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        dropout: DropoutSpec,
        dropout_rows: Option<IntTensor<Self>>,
    ) -> LayerNormBackward<Self> {
        let rows = mask_rows::<Self>(dropout, &dropout_rows);
        let parts = host_layer::layer_norm_backward(
            [&grad, &pre_norm, &mean, &rstd, &gamma],
            dropout,
            rows.as_deref(),
        );
        match parts {
            Some([grad_pre_norm, grad_x, grad_x_hat]) => LayerNormBackward {
                grad_pre_norm,
                grad_x,
                grad_x_hat,
            },
            None => reference::bias_dropout_add_layer_norm_backward::<Self>(
                float(grad),
                float(pre_norm),
                float(mean),
                float(rstd),
                float(gamma),
                dropout,
                dropout_rows,
            ),
        }
    }

    fn masked_softmax_dropout(
        scores: FloatTensor<Self>,
        mask_bias: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> SoftmaxForward<Self> {
        match host_layer::masked_softmax(&scores, &mask_bias, scale, dropout) {
            Some([probs, dropped]) => SoftmaxForward { probs, dropped },
            None => reference::masked_softmax_dropout_forward::<Self>(
                float(scores),
                float(mask_bias),
                scale,
                dropout,
            ),
        }
    }

    fn masked_softmax_dropout_backward(
        grad_dropped: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        scale: f64,
        dropout: DropoutSpec,
    ) -> FloatTensor<Self> {
        match host_layer::masked_softmax_backward(&grad_dropped, &probs, scale, dropout) {
            Some(out) => out,
            None => prim(reference::masked_softmax_dropout_backward::<Self>(
                float(grad_dropped),
                float(probs),
                scale,
                dropout,
            )),
        }
    }
}

/// The values of an integer tensor on the host, as i64 (NdArray: a copy, no device wait).
fn host_rows<B: burn::tensor::backend::Backend>(rows: &IntTensor<B>) -> Vec<i64> {
    burn::tensor::Tensor::<B, 1, burn::tensor::Int>::from_primitive(rows.clone())
        .into_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .expect("i64 rows after convert")
}

/// The padded rows that key a fused LayerNorm's dropout mask, when it has both.
fn mask_rows<B: burn::tensor::backend::Backend>(
    dropout: DropoutSpec,
    dropout_rows: &Option<IntTensor<B>>,
) -> Option<Vec<i64>> {
    dropout_rows
        .as_ref()
        .filter(|_| dropout.enabled())
        .map(host_rows::<B>)
}
