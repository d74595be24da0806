//! NdArray's [`FusedOps::embedding_lookup_backward`](crate::FusedOps::embedding_lookup_backward):
//! the table's gradient as one zeroed buffer with each looked-up row's gradient added at its
//! index.
//!
//! Burn 0.21's `ModuleOps::embedding_backward` builds its `[V, H]` zeros through
//! `TensorData::full`, which pushes the zeros one element at a time (BERT's word table: 3.9 M
//! elements for tiny, 23 M for base, on every step: 5% of tiny's CPU step), then adds the rows
//! with `select_add`. Here the zeros are one allocation and the rows are added in index order,
//! as `select_add` adds them.

use burn_ndarray::NdArrayTensor;
use ndarray::{ArrayD, IxDyn};

/// `[V, H]` gradient of `weights` from `grad` `[.., H]` at `indices` `[..]` (same leading
/// shape); `None` for dtypes other than f32 weights with i64 or i32 indices, mismatched shapes
/// or an index outside the table (the caller then runs Burn's, which reports it).
pub(crate) fn backward(
    weights: &NdArrayTensor,
    grad: &NdArrayTensor,
    indices: &NdArrayTensor,
) -> Option<NdArrayTensor> {
    let (NdArrayTensor::F32(weights), NdArrayTensor::F32(grad)) = (weights, grad) else {
        return None;
    };
    let (rows, width) = match weights.shape() {
        &[rows, width] => (rows, width),
        _ => return None,
    };
    let indices: Vec<i64> = match indices {
        NdArrayTensor::I64(storage) => storage.view().iter().copied().collect(),
        NdArrayTensor::I32(storage) => storage.view().iter().map(|&i| i64::from(i)).collect(),
        _ => return None,
    };
    let grad = grad.view();
    if grad.shape().last() != Some(&width) || grad.len() != indices.len() * width {
        return None;
    }
    if indices.iter().any(|&i| i < 0 || i as usize >= rows) {
        return None;
    }
    let grad = grad.as_standard_layout();
    let grad = grad.as_slice()?;
    let mut out = crate::host_layer::par_zeros(rows * width);
    for (row, &index) in grad.chunks_exact(width.max(1)).zip(&indices) {
        let start = index as usize * width;
        for (o, g) in out[start..start + width].iter_mut().zip(row) {
            *o += g;
        }
    }
    let array = ArrayD::from_shape_vec(IxDyn(&[rows, width]), out).expect("[V, H] elements");
    Some(NdArrayTensor::from(array.into_shared()))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Int, Tensor};

    type A = Autodiff<NdArray>;

    /// The lookup and its gradient against Burn's `embedding` and its autodiff: repeated
    /// indices (rows summed), unused rows (zero), a loss that weights every output differently.
    #[test]
    fn ndarray_embedding_gradient_equals_burns() {
        let device = Default::default();
        let table = Tensor::<NdArray, 2>::random([11, 6], Distribution::Normal(0.0, 1.0), &device);
        let ids = Tensor::<NdArray, 2, Int>::from_ints([[3, 0, 3, 10], [7, 3, 0, 1]], &device);
        let probe =
            Tensor::<NdArray, 3>::random([2, 4, 6], Distribution::Normal(0.0, 1.0), &device);
        let run = |ours: bool| {
            let w = Tensor::<A, 2>::from_inner(table.clone()).require_grad();
            let ids = Tensor::<A, 2, Int>::from_inner(ids.clone());
            let y = if ours {
                crate::embedding(w.clone(), ids)
            } else {
                burn::tensor::module::embedding(w.clone(), ids)
            };
            let grads = (y.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            (
                y.inner().into_data().to_vec::<f32>().unwrap(),
                w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
            )
        };
        let ((y, dw), (y_ref, dw_ref)) = (run(true), run(false));
        assert_eq!(y, y_ref, "lookup");
        for (i, (a, b)) in dw.iter().zip(&dw_ref).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "dweight[{i}]: {a} vs {b}"
            );
        }
        // Rows 2, 4, 5, 6, 8 and 9 are looked up nowhere.
        assert!(dw[2 * 6..3 * 6].iter().all(|&x| x == 0.0));
    }
}
