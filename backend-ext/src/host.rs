//! [`FusedOps`] for NdArray, the CPU backend: the fused ops run as their reference
//! composition (`reference.rs`), except where the composition's whole-tensor passes and Burn
//! 0.21 NdArray's copying reshapes cost most of a training step, which run here as host loops
//! on views: the dense layers (`linear.rs`), the losses (`cross_entropy.rs`), the AdamW/LAMB
//! update (`host_adam.rs`) and the optimizer's flattening reshape. Each is tested against the
//! reference in its file; each falls back to the reference for dtypes other than f32.

use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::{
    AdamHyper, AdamKind, AdamOutput, AdamTensors, CrossEntropyForward, FusedOps, cross_entropy,
    host_adam, linear, reference,
};

impl<E, I, Q> FusedOps for burn_ndarray::NdArray<E, I, Q>
where
    E: burn_ndarray::FloatNdArrayElement,
    I: burn_ndarray::IntNdArrayElement,
    Q: burn_ndarray::QuantElement,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<E>>,
    burn_ndarray::NdArrayTensor: From<burn_ndarray::SharedArray<I>>,
{
    const HAS_MULTI_TENSOR: bool = true;

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
            .map(|t| {
                match host_adam::adam_step(
                    [&t.param, &t.grad, &t.moment_1, &t.moment_2],
                    &hyper,
                    kind,
                ) {
                    Some([param, moment_1, moment_2]) => AdamOutput {
                        param,
                        moment_1,
                        moment_2,
                    },
                    None => reference::adam_tensors::<Self>(t, hyper, kind),
                }
            })
            .collect()
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
    ) -> [FloatTensor<Self>; 3] {
        match linear::ndarray_linear_backward(&x, &weight, &grad) {
            Some(grads) => grads,
            None => linear::reference_linear_backward::<Self>(x, weight, grad),
        }
    }
}
