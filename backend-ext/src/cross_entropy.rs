//! Mean cross-entropy of logits against class labels (`torch.nn.functional.cross_entropy`),
//! the masked-LM and next-sentence losses, as a [`FusedOps`](crate::FusedOps) op with its own backward.
//!
//! The reference composition (max-shifted log-sum-exp minus the gathered logit) makes about
//! eight whole-matrix passes forward and as many backward, each single-threaded on NdArray and
//! each allocating; on the `[N, 30522]` masked-LM logits they were a large share of the tiny
//! model's CPU step. NdArray runs the loss as PyTorch's fused `log_softmax` + `nll_loss` do: per
//! row (rows split over rayon's threads) the max, the sum of exponentials and the log-sum-exp
//! forward, and backward `(softmax − onehot) · grad / N` in one pass, from the log-sum-exp saved
//! by the forward.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_ndarray::NdArrayTensor;
use ndarray::{Array1, Array2, Ix1, Ix2};
use rayon::prelude::*;

use crate::host_math;

/// What [`FusedOps::cross_entropy`](crate::FusedOps::cross_entropy) returns: the loss and what its backward needs.
#[derive(Debug, Clone)]
pub struct CrossEntropyForward<B: burn::tensor::backend::Backend> {
    /// `mean_i(lse_i − logits[i, label_i])`, `[1]`, f32.
    pub loss: FloatTensor<B>,
    /// `lse_i = log Σ_j exp(logits[i, j])`, `[N]`, f32.
    pub log_sum_exp: FloatTensor<B>,
}

fn labels_of(labels: &NdArrayTensor) -> Option<Vec<usize>> {
    let to_usize = |v: i64| usize::try_from(v).ok();
    match labels {
        NdArrayTensor::I64(s) => s.view().iter().map(|&v| to_usize(v)).collect(),
        NdArrayTensor::I32(s) => s.view().iter().map(|&v| to_usize(v.into())).collect(),
        _ => None,
    }
}

/// NdArray's forward; `None` (the caller runs the reference) for other dtypes or a label out
/// of range.
pub(crate) fn ndarray_forward(
    logits: &NdArrayTensor,
    labels: &NdArrayTensor,
) -> Option<(NdArrayTensor, NdArrayTensor)> {
    let NdArrayTensor::F32(logits) = logits else {
        return None;
    };
    let view = logits.view();
    let x = view.as_standard_layout();
    let x = x.view().into_dimensionality::<Ix2>().ok()?;
    let labels = labels_of(labels)?;
    let (n, c) = x.dim();
    if labels.len() != n || labels.iter().any(|&l| l >= c) || n == 0 {
        return None;
    }
    let rows = x.as_slice()?;
    let mut lse = vec![0.0f32; n];
    lse.par_iter_mut().enumerate().for_each(|(i, out)| {
        let row = &rows[i * c..(i + 1) * c];
        let max = host_math::max(row);
        *out = host_math::sum_exp(row, max).ln() + max;
    });
    // Summed in f64: a serial f32 sum of 70,000 rows drifts by 3e-5 relative.
    let total: f64 = (0..n)
        .map(|i| f64::from(lse[i] - rows[i * c + labels[i]]))
        .sum();
    let loss = Array1::from(vec![(total / n as f64) as f32]);
    Some((
        NdArrayTensor::from(loss.into_dyn().into_shared()),
        NdArrayTensor::from(Array1::from(lse).into_dyn().into_shared()),
    ))
}

/// NdArray's backward: `d logits [N, C] = (exp(logits − lse) − onehot(labels)) · grad / N`.
pub(crate) fn ndarray_backward(
    logits: &NdArrayTensor,
    labels: &NdArrayTensor,
    log_sum_exp: &NdArrayTensor,
    grad: &NdArrayTensor,
) -> Option<NdArrayTensor> {
    let (NdArrayTensor::F32(logits), NdArrayTensor::F32(lse), NdArrayTensor::F32(grad)) =
        (logits, log_sum_exp, grad)
    else {
        return None;
    };
    let view = logits.view();
    let x = view.as_standard_layout();
    let x = x.view().into_dimensionality::<Ix2>().ok()?;
    let lse = lse.view().into_dimensionality::<Ix1>().ok()?;
    let grad = *grad.view().iter().next()?;
    let labels = labels_of(labels)?;
    let (n, c) = x.dim();
    let scale = grad / n as f32;
    let x = x.as_slice()?;
    let mut out = crate::host_layer::par_zeros(n * c);
    out.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .enumerate()
        .for_each(|(i, (out, x))| {
            host_math::exp_scaled(x, lse[i], scale, out);
            out[labels[i]] -= scale;
        });
    let out = Array2::from_shape_vec((n, c), out).expect("n · c values");
    Some(NdArrayTensor::from(out.into_dyn().into_shared()))
}

/// The reference composition, forward with the log-sum-exp kept (the trait's default body).
///
/// # Shapes
/// `logits` `[N, C]`, `labels` `[N]` (values in `0..C`) → loss `[1]`, log-sum-exp `[N]`, both
/// f32 (half logits are cast to f32 first: `torch.autocast` runs `cross_entropy` in f32)
pub fn reference_forward<B: burn::tensor::backend::Backend>(
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
) -> CrossEntropyForward<B> {
    use burn::tensor::{FloatDType, Int, Tensor, TensorPrimitive};
    let logits =
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits)).cast(FloatDType::F32);
    let labels = Tensor::<B, 1, Int>::from_primitive(labels);
    let [n, _] = logits.dims();
    let max = logits.clone().max_dim(1); // [N, 1]
    let log_sum_exp = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max; // [N, 1]
    let target = logits.gather(1, labels.reshape([n, 1])); // [N, 1]
    let loss = (log_sum_exp.clone() - target).mean();
    CrossEntropyForward {
        loss: loss.into_primitive().tensor(),
        log_sum_exp: log_sum_exp.reshape([n]).into_primitive().tensor(),
    }
}

/// The reference backward, `(exp(logits − lse) − onehot) · grad / N` (the trait's default
/// body).
///
/// # Shapes
/// `logits` `[N, C]`, `labels` `[N]`, `log_sum_exp` `[N]`, `grad` `[1]` → `[N, C]`, computed
/// in f32 and returned in the logits' dtype
pub fn reference_backward<B: burn::tensor::backend::Backend>(
    logits: FloatTensor<B>,
    labels: IntTensor<B>,
    log_sum_exp: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    use burn::tensor::{FloatDType, Int, Tensor, TensorPrimitive};
    let f32 = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).cast(FloatDType::F32);
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let dtype = logits.dtype();
    let logits = logits.cast(FloatDType::F32);
    let labels = Tensor::<B, 1, Int>::from_primitive(labels);
    let (lse, grad) = (f32(log_sum_exp), f32(grad));
    let [n, c] = logits.dims();
    let device = logits.device();
    let probs = (logits - lse.reshape([n, 1])).exp();
    // The one-hot as a comparison with the class index: Burn's `one_hot` reads the labels to
    // the host to check their range, a device synchronisation inside backward.
    let classes = Tensor::<B, 1, Int>::arange(0..c as i64, &device)
        .reshape([1, c])
        .expand([n, c]);
    let onehot = labels.reshape([n, 1]).expand([n, c]).equal(classes).float();
    ((probs - onehot) * grad.reshape([1, 1]).div_scalar(n as f64))
        .cast(dtype)
        .into_primitive()
        .tensor()
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};

    type A = Autodiff<NdArray>;

    /// NdArray's fused loss and gradient against Burn's autodiff of the composition
    /// (`log_softmax` and the gathered label), on logits with row offsets up to 300 (the max
    /// shift matters) and repeated labels, loss scaled by 3 so that the incoming gradient is not 1.
    #[test]
    fn ndarray_cross_entropy_equals_autodiff_of_the_composition() {
        let device = Default::default();
        // Deterministic values (the global RNG is shared with concurrent tests): spread ±4
        // within a row, rows offset by 50 each, so the max shift matters.
        let values: Vec<f32> = (0..7 * 301)
            .map(|k| {
                let (i, j) = (k / 301, k % 301);
                4.0 * ((i as f32) * 0.37 + (j as f32) * 1.3).sin() + 50.0 * i as f32
            })
            .collect();
        let logits = Tensor::<NdArray, 2>::from_data(TensorData::new(values, [7, 301]), &device);
        let labels = Tensor::<A, 1, Int>::from_data(
            TensorData::new(vec![0i64, 300, 5, 5, 17, 299, 1], [7]),
            &device,
        );
        let run = |fused: bool| {
            let x = Tensor::<A, 2>::from_inner(logits.clone()).require_grad();
            let loss = if fused {
                crate::cross_entropy(x.clone(), labels.clone())
            } else {
                let log_probs = burn::tensor::activation::log_softmax(x.clone(), 1);
                -log_probs.gather(1, labels.clone().reshape([7, 1])).mean()
            };
            let grads = (loss.clone() * 3.0).backward();
            let value = loss.into_scalar();
            (
                value,
                x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
            )
        };
        let (loss, grad) = run(true);
        let (loss_ref, grad_ref) = run(false);
        assert!(
            (loss - loss_ref).abs() <= 1e-5 * loss_ref.abs(),
            "loss {loss} vs {loss_ref}"
        );
        // Relative 1e-4: a log-sum-exp near 300 carries f32 rounding of 3e-5, which the
        // probabilities exp(x − lse) inherit (the two sides round it differently).
        for (i, (a, b)) in grad.iter().zip(&grad_ref).enumerate() {
            assert!(
                (a - b).abs() <= 1e-7 + 1e-4 * b.abs(),
                "grad[{i}]: {a} vs {b}"
            );
        }
        // A label outside 0..C is not read out of bounds: the reference path takes it.
        assert!(
            super::ndarray_forward(
                &logits.clone().into_primitive().tensor(),
                &Tensor::<NdArray, 1, Int>::from_data(
                    TensorData::new(vec![301i64; 7], [7]),
                    &device
                )
                .into_primitive(),
            )
            .is_none()
        );
    }
}
