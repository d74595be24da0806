//! NdArray's gradient sums: [`FusedOps::accumulate`](crate::FusedOps::accumulate) (a second
//! gradient of one tensor added into the first, in place) and
//! [`FusedOps::sum_rows`](crate::FusedOps::sum_rows) (a bias's gradient), on rayon's threads.
//!
//! Burn 0.21's autodiff sums the gradients of a tensor used twice with `float_add`, which on
//! NdArray writes a new array on one thread, and a bias's gradient with `sum_dim`, also on one
//! thread. In a BERT step the largest of those sums was the tied word-embedding table's two
//! shares (`[V, H]`: 31 MB for mini), the rest the encoder's residual and Q/K/V input
//! gradients: on 2 cores, while they ran, the other core waited (docs/performance.md, CPU performance).
//! Both sums are elementwise or in the same order as Burn's, so the results are Burn's.

use burn_ndarray::NdArrayTensor;
use ndarray::{Array1, ArrayView2, Axis, Ix2};
use rayon::prelude::*;

/// Elements per rayon task.
const TASK_ELEMENTS: usize = 1 << 15;

/// `sum + value`, in `sum`'s buffer when nothing else holds it (else in a copy:
/// copy-on-write); `None` (the caller runs Burn's `float_add`) for dtypes other than f32 or
/// shapes that differ.
pub(crate) fn accumulate(
    sum: NdArrayTensor,
    value: &NdArrayTensor,
) -> Result<NdArrayTensor, NdArrayTensor> {
    let (NdArrayTensor::F32(storage), NdArrayTensor::F32(value)) = (&sum, value) else {
        return Err(sum);
    };
    if storage.shape() != value.shape() {
        return Err(sum);
    }
    let value = crate::linear::standard_layout(value.view());
    let Some(value) = value.as_slice() else {
        return Err(sum);
    };
    update_in_place(sum, |out| {
        out.par_chunks_mut(TASK_ELEMENTS)
            .zip(value.par_chunks(TASK_ELEMENTS))
            .for_each(|(o, v)| {
                for (o, v) in o.iter_mut().zip(v) {
                    *o += v;
                }
            });
    })
}

/// `x`'s f32 values, in standard layout, handed to `f` to update in place: `x`'s own buffer
/// when nothing else holds it, else a copy (copy-on-write, `host_adam::writable`); `Err(x)` for
/// other dtypes.
pub(crate) fn update_in_place(
    x: NdArrayTensor,
    f: impl FnOnce(&mut [f32]),
) -> Result<NdArrayTensor, NdArrayTensor> {
    if !matches!(x, NdArrayTensor::F32(_)) {
        return Err(x);
    }
    let mut array = crate::host_adam::writable(x).expect("an f32 tensor is writable");
    f(array
        .as_slice_mut()
        .expect("a writable array is in standard layout"));
    Ok(NdArrayTensor::from(array))
}

/// `Σ_r x[r, ..]` `[N]` of `x` `[R, N]`; `None` for dtypes other than f32 or other ranks.
pub(crate) fn sum_rows(x: &NdArrayTensor) -> Option<NdArrayTensor> {
    let NdArrayTensor::F32(storage) = x else {
        return None;
    };
    let view = storage.view();
    let x = view.into_dimensionality::<Ix2>().ok()?;
    Some(NdArrayTensor::from(
        column_sums(&x).into_dyn().into_shared(),
    ))
}

/// `Σ_r g[r, ..]` `[O]` of `g` `[R, O]`: blocks of columns on rayon's threads, each summed row
/// by row in row order (the order of ndarray's `sum_axis(Axis(0))`, which Burn's `sum_dim`
/// runs, on one thread: ~1% of a BERT-base step).
pub(crate) fn column_sums(g: &ArrayView2<f32>) -> Array1<f32> {
    const BLOCK: usize = 512;
    let Some(values) = g.as_slice() else {
        return g.sum_axis(Axis(0));
    };
    let cols = g.ncols();
    let mut out = vec![0.0f32; cols];
    out.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(block, out)| {
            let columns = block * BLOCK..block * BLOCK + out.len();
            for row in values.chunks_exact(cols.max(1)) {
                for (o, &v) in out.iter_mut().zip(&row[columns.clone()]) {
                    *o += v;
                }
            }
        });
    Array1::from(out)
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    use crate::FusedOps;

    fn prim(x: Tensor<NdArray, 2>) -> burn_ndarray::NdArrayTensor {
        x.into_primitive().tensor()
    }

    fn values(x: burn_ndarray::NdArrayTensor) -> Vec<f32> {
        Tensor::<NdArray, 2>::from_primitive(TensorPrimitive::Float(x))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    }

    /// The in-place sum against Burn's `float_add`, bit for bit: a sum held elsewhere too
    /// (copied, the other holder unchanged), a transposed addend, more elements than one task.
    #[test]
    fn ndarray_accumulate_equals_burns_add_and_copies_a_shared_sum() {
        let device = Default::default();
        let a = Tensor::<NdArray, 2>::random([300, 257], Distribution::Normal(0.0, 1.0), &device);
        let b = Tensor::<NdArray, 2>::random([257, 300], Distribution::Normal(0.0, 1.0), &device)
            .transpose();
        let expected = (a.clone() + b.clone()).into_data().to_vec::<f32>().unwrap();
        let before = a.clone().into_data().to_vec::<f32>().unwrap();
        // `a` is still held here: the sum must not write into it.
        let shared = values(NdArray::<f32>::accumulate(prim(a.clone()), prim(b.clone())));
        assert_eq!(shared, expected);
        assert_eq!(a.clone().into_data().to_vec::<f32>().unwrap(), before);
        // Held only by the sum: written in place, same values.
        let owned = values(NdArray::<f32>::accumulate(prim(a), prim(b)));
        assert_eq!(owned, expected);
    }

    /// Column sums against Burn's `sum_dim(0)`, bit for bit (same order), over more columns
    /// than one block.
    #[test]
    fn ndarray_sum_rows_equals_burns_sum_dim() {
        let device = Default::default();
        let x = Tensor::<NdArray, 2>::random([37, 1100], Distribution::Normal(0.0, 1.0), &device);
        let expected = x.clone().sum_dim(0).into_data().to_vec::<f32>().unwrap();
        let ours = Tensor::<NdArray, 1>::from_primitive(TensorPrimitive::Float(
            NdArray::<f32>::sum_rows(prim(x)),
        ))
        .into_data()
        .to_vec::<f32>()
        .unwrap();
        assert_eq!(ours, expected);
    }
}
