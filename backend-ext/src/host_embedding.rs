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

/// The looked-up rows' gradient `[N · H]` in standard layout and the indices `[N]`, checked
/// against a table of `rows` × `width`: `None` for dtypes other than f32 with i64 or i32
/// indices, mismatched shapes or an index outside the table.
fn looked_up<'a>(
    grad: &'a NdArrayTensor,
    indices: &NdArrayTensor,
    rows: usize,
    width: usize,
) -> Option<(ndarray::CowArray<'a, f32, IxDyn>, Vec<i64>)> {
    let NdArrayTensor::F32(grad) = grad else {
        return None;
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
    Some((crate::linear::standard_layout(grad), indices))
}

fn table_shape(x: &NdArrayTensor) -> Option<(usize, usize)> {
    match x {
        NdArrayTensor::F32(storage) => match storage.shape() {
            &[rows, width] => Some((rows, width)),
            _ => None,
        },
        _ => None,
    }
}

/// `[V, H]` gradient of `weights` from `grad` `[.., H]` at `indices` `[..]` (same leading
/// shape); `None` for dtypes other than f32 weights with i64 or i32 indices, mismatched shapes
/// or an index outside the table (the caller then runs Burn's, which reports it).
pub(crate) fn backward(
    weights: &NdArrayTensor,
    grad: &NdArrayTensor,
    indices: &NdArrayTensor,
) -> Option<NdArrayTensor> {
    let (rows, width) = table_shape(weights)?;
    let (grad, indices) = looked_up(grad, indices, rows, width)?;
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

/// `sum` `[V, H]` plus the gradient [`backward`] returns, added in `sum`'s buffer (a copy if
/// something else holds it): each index's rows are summed from zero in index order, as
/// [`backward`]'s table holds them, and that sum added to `sum`'s row, so the result is
/// `sum + backward(..)` exactly. `Err(sum)` where [`backward`] gives `None`.
pub(crate) fn backward_into(
    sum: NdArrayTensor,
    grad: &NdArrayTensor,
    indices: &NdArrayTensor,
) -> Result<NdArrayTensor, NdArrayTensor> {
    let Some((rows, width)) = table_shape(&sum) else {
        return Err(sum);
    };
    let Some((grad, indices)) = looked_up(grad, indices, rows, width) else {
        return Err(sum);
    };
    let Some(grad) = grad.as_slice() else {
        return Err(sum);
    };
    crate::host_sum::update_in_place(sum, |out| {
        // Occurrences grouped by index, each group in occurrence order.
        let mut order: Vec<usize> = (0..indices.len()).collect();
        order.sort_by_key(|&i| indices[i]);
        let mut acc = vec![0.0f32; width];
        for group in order.chunk_by(|&a, &b| indices[a] == indices[b]) {
            acc.fill(0.0);
            for &i in group {
                for (a, g) in acc.iter_mut().zip(&grad[i * width..(i + 1) * width]) {
                    *a += g;
                }
            }
            let start = indices[group[0]] as usize * width;
            for (o, a) in out[start..start + width].iter_mut().zip(&acc) {
                *o += a;
            }
        }
    })
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

    /// The lookup's share added into a table gradient already there (the tied decoder's),
    /// against that gradient plus Burn's `embedding_backward`, bit for bit: repeated indices
    /// (summed first, as Burn's table holds them), a sum that something else still holds (copied,
    /// unchanged) and one held by nothing else (written in place).
    #[test]
    fn ndarray_lookup_gradient_into_equals_the_sum_of_both_shares() {
        use burn::tensor::TensorPrimitive;

        use crate::FusedOps;

        type N = NdArray<f32>;
        let device = Default::default();
        let sum = Tensor::<N, 2>::random([11, 6], Distribution::Normal(0.0, 1.0), &device);
        let grad = Tensor::<N, 3>::random([2, 4, 6], Distribution::Normal(0.0, 1.0), &device);
        let ids = Tensor::<N, 2, Int>::from_ints([[3, 0, 3, 10], [7, 3, 0, 1]], &device);
        let rows = Tensor::<N, 2>::from_primitive(TensorPrimitive::Float(
            <N as burn::tensor::ops::ModuleOps<N>>::embedding_backward(
                sum.clone().into_primitive().tensor(),
                grad.clone().into_primitive().tensor(),
                ids.clone().into_primitive(),
            ),
        ));
        let expected = (sum.clone() + rows).into_data().to_vec::<f32>().unwrap();
        let before = sum.clone().into_data().to_vec::<f32>().unwrap();
        let into = |sum: Tensor<N, 2>, ids: Tensor<N, 2, Int>| {
            Tensor::<N, 2>::from_primitive(TensorPrimitive::Float(
                N::embedding_lookup_backward_into(
                    sum.into_primitive().tensor(),
                    grad.clone().into_primitive().tensor(),
                    ids.into_primitive(),
                ),
            ))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
        };
        assert_eq!(into(sum.clone(), ids.clone()), expected, "shared sum");
        assert_eq!(sum.clone().into_data().to_vec::<f32>().unwrap(), before);
        assert_eq!(into(sum, ids), expected, "owned sum");
    }

    /// The tied table's gradient through `tied_decoder_weight` (the decoder's share first,
    /// the lookup's added into it) against Burn's composition (`embedding`, `transpose`,
    /// `linear`: the two shares summed as whole tables), with the decoder deeper in the graph
    /// than the lookup as in BERT, repeated tokens, and rows looked up nowhere.
    #[test]
    fn tied_table_gradient_equals_burns_composition() {
        let device = Default::default();
        let table = Tensor::<NdArray, 2>::random([11, 6], Distribution::Normal(0.0, 1.0), &device);
        let ids = Tensor::<NdArray, 2, Int>::from_ints([[3, 0, 3, 10], [7, 3, 0, 1]], &device);
        let probe = Tensor::<NdArray, 2>::random([8, 11], Distribution::Normal(0.0, 1.0), &device);
        let run = |ours: bool| {
            let w = Tensor::<A, 2>::from_inner(table.clone()).require_grad();
            let ids = Tensor::<A, 2, Int>::from_inner(ids.clone());
            let hidden = if ours {
                crate::embedding(w.clone(), ids)
            } else {
                burn::tensor::module::embedding(w.clone(), ids)
            };
            // A few ops between the lookup and the decoder, as BERT's encoder.
            let transformed = burn::tensor::activation::gelu(hidden.reshape([8, 6]) * 1.5);
            let logits = if ours {
                let decoder = crate::tied_decoder_weight(w.clone(), &transformed);
                crate::dense(transformed, decoder, None)
            } else {
                burn::tensor::module::linear(transformed, w.clone().transpose(), None)
            };
            let grads = (logits * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            w.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap()
        };
        let (ours, reference) = (run(true), run(false));
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "dtable[{i}]: {a} vs {b}"
            );
        }
        // Row 2 is looked up nowhere: the decoder's share alone, nonzero.
        assert!(ours[2 * 6..3 * 6].iter().any(|&x| x != 0.0));
    }
}
