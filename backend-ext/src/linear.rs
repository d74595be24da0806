//! `x · weight + bias` (Burn's `Linear`) as a [`FusedOps`] op, so that NdArray can run it
//! without copies.
//!
//! Burn 0.21's NdArray matmul reshapes both operands to rank 3 and its output back, and each of
//! those reshapes copies the array (`to_shape(..).into_shared()` turns the borrowed view into a
//! new array, contiguous or not); a transposed weight (the tied MLM decoder, every `dx = g·Wᵀ`)
//! is copied once more to standard layout. For BERT-base at batch 8 × 128 those copies and the
//! page faults of their fresh buffers were about a fifth of the CPU step (perf, docs/performance.md,
//! CPU performance). Here NdArray multiplies views: one GEMM into a new output (the bias
//! broadcast into it first, then `C = 1·A·B + 1·C`), transposes passed to the GEMM as strides
//! (ndarray's `general_mat_mul`: BLAS `sgemm` with the transpose flags when the `blas` feature
//! is on, matrixmultiply otherwise), split over rayon's threads when [`crate::gemm_parts`] says
//! so (`host_gemm.rs`). Every other backend runs Burn's own `linear` ops.

use burn::tensor::ops::FloatTensor;
use burn_ndarray::NdArrayTensor;
use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewD, Axis, CowArray, Ix2, IxDyn};
use rayon::prelude::*;

use burn::tensor::{Shape, TensorMetadata};

use crate::host_gemm::product;
use crate::{DenseGrads, FusedOps};

// Note [Weight gradients in f32]: under autocast (Note [Autocast] in `ember_model`'s
// `precision.rs`) a weight's gradient came out of the weight-gradient GEMM in the half type
// and was cast back to f32 by the copy's cast: a launch per weight, a write and a read of
// the half gradient, and the gradient rounded to 8 (bf16) or 11 (fp16) significant bits
// before it reached the f32 buckets. `MasterOps::dense_of_masters` gives the dense op the f32
// masters as its parents and the half copies to multiply, and its backward
// (`MasterOps::dense_backward_as`) has CubeCL's GEMM write `dW` in f32 from its f32
// accumulator, as Megatron-LM's `gradient_accumulation_fusion` does (its
// `wgrad_gemm_accum_fp32` accumulates the weight gradient into a kept f32 `main_grad`; ember
// writes a new f32 tensor, summed where the hooks take it), the GPU-speed issue's "gradients
// reach the f32 buckets without a separate cast pass where the GEMM can write f32". The bias
// gradient is the column sum written in f32 from its f32 partial sums (Note [Parameter
// gradients in f32] in `masters.rs`; the default body casts it). A deliberate difference
// from `torch.autocast`, whose weight gradients are rounded to the half type: ember's are
// more precise, not equal. cuBLASLt (`model.gemm = "cublaslt"`) writes `dW` in f32 the same
// way, and its bias-gradient epilogue `db` with it (Note [cuBLASLt's f32 output] in
// `cube/cublaslt_call.rs`).

/// `(dx, dweight, dbias)` with `dweight` and `dbias` in `dtype` (cast where they are not):
/// the default body of [`MasterOps::dense_backward_as`](crate::MasterOps::dense_backward_as).
pub(crate) fn grads_as<B: FusedOps>(
    (dx, dweight, dbias): DenseGrads<B>,
    dtype: burn::tensor::FloatDType,
) -> DenseGrads<B> {
    let cast = |t| cast_to::<B>(t, dtype);
    (dx, cast(dweight), dbias.map(cast))
}

/// `t` in `dtype`: itself where it is, else Burn's cast.
pub(crate) fn cast_to<B: FusedOps>(
    t: FloatTensor<B>,
    dtype: burn::tensor::FloatDType,
) -> FloatTensor<B> {
    if t.dtype() == burn::tensor::DType::from(dtype) {
        t
    } else {
        B::float_cast(t, dtype)
    }
}

/// Burn's composition: the default body of [`FusedOps::dense`].
pub(crate) fn reference_linear<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    <B as burn::tensor::ops::ModuleOps<B>>::linear(x, weight, bias)
}

/// Burn's composition of [`FusedOps::dense_backward`] (NdArray's fallback for other dtypes).
pub(crate) fn reference_linear_backward<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    with_bias: bool,
) -> DenseGrads<B> {
    (
        <B as burn::tensor::ops::ModuleOps<B>>::linear_x_backward(weight, grad.clone()),
        <B as burn::tensor::ops::ModuleOps<B>>::linear_weight_backward(x, grad.clone()),
        with_bias.then(|| <B as burn::tensor::ops::ModuleOps<B>>::linear_bias_backward(grad)),
    )
}

/// The default body of [`FusedOps::dense_backward`]: the rows flattened to `[R, I]` and
/// `[R, O]` (views of contiguous tensors), `dx = g·Wᵀ`, `dW = xᵀ·g`, `db = Σ_rows g`, the
/// two products by `products(g, Wᵀ, xᵀ, with_bias)` (Burn's, or the GPU backends' choice of
/// kernel, `gemm.rs`; cuBLASLt runs the pair between one set of host waits and may return
/// `db` from `dW`'s epilogue); `db` is Burn's `sum_dim` where `products` gives none.
pub(crate) fn flattened_linear_backward<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    with_bias: bool,
    products: impl Fn(
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        bool,
    ) -> (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>),
) -> DenseGrads<B> {
    let x_shape = x.shape();
    let (i, o) = (
        x_shape[x_shape.num_dims() - 1],
        grad.shape()[grad.shape().num_dims() - 1],
    );
    let rows = x_shape.num_elements() / i.max(1);
    let x2 = B::float_reshape(x, Shape::new([rows, i]));
    let g2 = B::float_reshape(grad, Shape::new([rows, o]));
    let (dx, dweight, dbias) = products(
        g2.clone(),
        B::float_swap_dims(weight, 0, 1),
        B::float_swap_dims(x2, 0, 1),
        with_bias,
    );
    let dx = B::float_reshape(dx, x_shape);
    debug_assert!(
        with_bias || dbias.is_none(),
        "a bias gradient nobody asked for"
    );
    let dbias = match dbias {
        Some(dbias) => Some(dbias),
        None => with_bias.then(|| B::float_reshape(B::float_sum_dim(g2, 0), Shape::new([o]))),
    };
    (dx, dweight, dbias)
}

/// `x` `[.., I]` as a `[R, I]` view (zero-copy when `x` is in standard layout, else a copy),
/// with `x`'s leading shape.
fn rows<'a>(x: &'a ndarray::ArrayViewD<'a, f32>) -> (ndarray::CowArray<'a, f32, Ix2>, Vec<usize>) {
    let shape = x.shape().to_vec();
    let cols = *shape.last().expect("linear: x has at least one dimension");
    let rows = shape.iter().rev().skip(1).product::<usize>();
    let x = standard_layout(x.view());
    let viewed = x
        .into_shape_with_order((rows, cols))
        .expect("a standard-layout array reshapes to [rows, cols]");
    (viewed, shape[..shape.len() - 1].to_vec())
}

fn matrix<'a>(w: &'a ndarray::ArrayViewD<'a, f32>) -> ArrayView2<'a, f32> {
    w.view()
        .into_dimensionality::<Ix2>()
        .expect("linear: the weight is [I, O]")
}

fn shared(array: Array2<f32>, lead: &[usize]) -> NdArrayTensor {
    let cols = array.ncols();
    let mut shape = lead.to_vec();
    shape.push(cols);
    let array = array
        .into_shape_with_order(IxDyn(&shape))
        .expect("the GEMM output is contiguous");
    NdArrayTensor::from(array.into_shared())
}

/// `x` in standard (row-major) layout: `x` itself when it is, else a copy written by rayon's
/// threads over `x`'s first axis, one slice copy per contiguous run of the last axis
/// (ndarray's `as_standard_layout` copied element by element on one thread: the heads'
/// merge and its gradient, `[B, S, nh, hd]` views of `[B, nh, S, hd]` buffers, were ~1.5% of
/// a mini step).
pub(crate) fn standard_layout<'a>(x: ArrayViewD<'a, f32>) -> CowArray<'a, f32, IxDyn> {
    if x.is_standard_layout() {
        return CowArray::from(x);
    }
    if x.ndim() < 2 || x.is_empty() {
        return CowArray::from(x.as_standard_layout().into_owned());
    }
    let shape = x.shape().to_vec();
    let len = x.len();
    let block = len / shape[0];
    let outer: Vec<ArrayViewD<'_, f32>> = x.axis_iter(Axis(0)).collect();
    let mut values = Vec::with_capacity(len);
    values.spare_capacity_mut()[..len]
        .par_chunks_mut(block)
        .zip(outer.into_par_iter())
        .for_each(|(out, sub)| {
            let width = *sub.shape().last().expect("rank ≥ 1");
            let mut out = out.chunks_exact_mut(width.max(1));
            for lane in sub.lanes(Axis(sub.ndim() - 1)) {
                let o = out.next().expect("one output run per lane");
                match lane.as_slice() {
                    Some(run) => {
                        for (o, &v) in o.iter_mut().zip(run) {
                            o.write(v);
                        }
                    }
                    None => {
                        for (o, &v) in o.iter_mut().zip(lane.iter()) {
                            o.write(v);
                        }
                    }
                }
            }
        });
    // SAFETY: the blocks cover all `len` elements: every lane of every block written above.
    unsafe { values.set_len(len) };
    CowArray::from(ArrayD::from_shape_vec(IxDyn(&shape), values).expect("x's shape"))
}

/// NdArray's reshape of an f32 array: zero-copy when `x` is contiguous, else one copy into
/// standard layout (Burn 0.21's `float_reshape` copies a contiguous array, and a strided one
/// twice); gives `x` back for other dtypes or a shape of another size.
pub(crate) fn ndarray_reshape(
    x: NdArrayTensor,
    shape: &burn::tensor::Shape,
) -> Result<NdArrayTensor, NdArrayTensor> {
    match x {
        NdArrayTensor::F32(storage) if storage.view().len() == shape.num_elements() => {
            let dims: Vec<usize> = shape.iter().copied().collect();
            let array = if storage.view().is_standard_layout() {
                storage.into_shared()
            } else {
                standard_layout(storage.view()).into_owned().into_shared()
            };
            let reshaped = array
                .into_shape_with_order(IxDyn(&dims))
                .expect("a standard-layout array reshapes to any shape of its size");
            Ok(NdArrayTensor::from(reshaped))
        }
        other => Err(other),
    }
}

/// NdArray's forward: `None` for dtypes other than f32 (the caller falls back to Burn's).
pub(crate) fn ndarray_linear(
    x: &NdArrayTensor,
    weight: &NdArrayTensor,
    bias: Option<&NdArrayTensor>,
) -> Option<NdArrayTensor> {
    let (NdArrayTensor::F32(x), NdArrayTensor::F32(w)) = (x, weight) else {
        return None;
    };
    let x = x.view();
    let w = w.view();
    let (x2, lead) = rows(&x);
    let w2 = matrix(&w);
    let (m, n) = (x2.nrows(), w2.ncols());
    let out = match bias {
        Some(NdArrayTensor::F32(b)) => {
            let b = b.view();
            let b = b.into_dimensionality::<ndarray::Ix1>().ok()?;
            // The bias in every row (copied by rayon's threads: ndarray's broadcast
            // `to_owned` ran on one), then the product added onto it.
            let b = b.as_standard_layout();
            let b = b.as_slice()?;
            if b.len() != n {
                return None;
            }
            let rows_per_task = ((1 << 14) / n.max(1)).max(1);
            let mut values = Vec::with_capacity(m * n);
            values.spare_capacity_mut()[..m * n]
                .par_chunks_mut(n.max(1) * rows_per_task)
                .for_each(|rows| {
                    for row in rows.chunks_exact_mut(n.max(1)) {
                        for (o, &v) in row.iter_mut().zip(b) {
                            o.write(v);
                        }
                    }
                });
            // SAFETY: the rows cover the first m · n elements, all written above.
            unsafe { values.set_len(m * n) };
            let mut out = Array2::from_shape_vec((m, n), values).expect("m · n elements");
            crate::host_gemm::gemm(1.0, &x2.view(), &w2, 1.0, &mut out.view_mut());
            out
        }
        Some(_) => return None,
        None => product(&x2.view(), &w2),
    };
    Some(shared(out, &lead))
}

/// NdArray's backward: `(dx, dweight, dbias)` (`dbias` when `with_bias`), `None` for dtypes
/// other than f32.
pub(crate) fn ndarray_linear_backward(
    x: &NdArrayTensor,
    weight: &NdArrayTensor,
    grad: &NdArrayTensor,
    with_bias: bool,
) -> Option<DenseGrads<burn_ndarray::NdArray>> {
    let (NdArrayTensor::F32(x), NdArrayTensor::F32(w), NdArrayTensor::F32(g)) = (x, weight, grad)
    else {
        return None;
    };
    let (x, w, g) = (x.view(), w.view(), g.view());
    let (x2, lead) = rows(&x);
    let (g2, _) = rows(&g);
    let w2 = matrix(&w);
    let dx = product(&g2.view(), &w2.t()); // [R, O] · [O, I]
    // A weight that is the transposed view of an [O, I] table (the tied decoder's word
    // embeddings) gets its gradient in that table's layout, as the same view: computed as
    // (gᵀ·x)ᵀ, so that the transpose's backward hands the table a standard-layout gradient
    // instead of a transposed one that the embedding's gradient sum must copy.
    let dw = if !w2.is_standard_layout() && w2.t().is_standard_layout() {
        product(&g2.t(), &x2.view()).reversed_axes() // ([O, R] · [R, I])ᵀ
    } else {
        product(&x2.t(), &g2.view()) // [I, R] · [R, O]
    };
    let db = with_bias.then(|| {
        let db = crate::host_sum::column_sums(&g2.view()); // [O]
        NdArrayTensor::from(db.into_dyn().into_shared())
    });
    Some((
        shared(dx, &lead),
        NdArrayTensor::from(dw.into_dyn().into_shared()),
        db,
    ))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Distribution, Tensor};

    type A = Autodiff<NdArray>;

    fn close(a: Tensor<NdArray, 2>, b: Tensor<NdArray, 2>, what: &str) {
        let (a, b) = (
            a.into_data().to_vec::<f32>().unwrap(),
            b.into_data().to_vec::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    /// The parallel standard-layout copy against ndarray's, bit for bit: the heads' merge
    /// (`[B, nh, S, hd]` with axes 1 and 2 swapped), a view whose last axis is strided (a
    /// transpose), one that is already standard (no copy), and a first axis of one.
    #[test]
    fn standard_layout_copies_as_ndarray_does() {
        use ndarray::{Array, IxDyn};

        let values = |n: usize| (0..n).map(|i| i as f32 * 0.5 - 3.0).collect::<Vec<f32>>();
        let heads = Array::from_shape_vec(IxDyn(&[3, 4, 5, 6]), values(360)).unwrap();
        let merged = heads.view().permuted_axes(IxDyn(&[0, 2, 1, 3]));
        let transposed = Array::from_shape_vec(IxDyn(&[7, 9]), values(63)).unwrap();
        let transposed = transposed.view().reversed_axes();
        let single = Array::from_shape_vec(IxDyn(&[1, 5, 6]), values(30)).unwrap();
        let single = single.view().permuted_axes(IxDyn(&[0, 2, 1]));
        for (what, view) in [
            ("merge", merged),
            ("transpose", transposed),
            ("one", single),
        ] {
            assert!(!view.is_standard_layout(), "{what}: a strided view");
            let ours = super::standard_layout(view.view());
            assert!(ours.is_standard_layout(), "{what}");
            assert_eq!(ours.shape(), view.shape(), "{what}");
            assert_eq!(
                ours.as_slice().unwrap(),
                view.as_standard_layout().as_slice().unwrap(),
                "{what}"
            );
        }
        let standard = heads.view();
        let same = super::standard_layout(standard.view());
        assert!(same.is_view(), "a standard-layout array is not copied");
    }

    /// NdArray's GEMM on views against Burn's `linear` (forward) and Burn's autodiff of it
    /// (gradients of x, weight and bias): a rank-3 input, a transposed weight (the tied
    /// decoder's case), with and without bias, a loss that weights every output differently.
    #[test]
    fn ndarray_dense_equals_burns_linear_forward_and_backward() {
        let device = Default::default();
        for (transposed, with_bias) in [(false, true), (true, true), (false, false), (true, false)]
        {
            let w_shape = if transposed { [4, 7] } else { [7, 4] };
            let x0 =
                Tensor::<NdArray, 3>::random([3, 5, 7], Distribution::Normal(0.0, 1.0), &device);
            let w0 = Tensor::<NdArray, 2>::random(w_shape, Distribution::Normal(0.0, 1.0), &device);
            let b0 = Tensor::<NdArray, 1>::random([4], Distribution::Normal(0.0, 1.0), &device);
            let probe =
                Tensor::<NdArray, 3>::random([3, 5, 4], Distribution::Normal(0.0, 1.0), &device);
            let what = format!("transposed {transposed}, bias {with_bias}");
            // Each side gets its own leaves: a backward pass consumes the graph it walks.
            let leaves = || {
                (
                    Tensor::<A, 3>::from_inner(x0.clone()).require_grad(),
                    Tensor::<A, 2>::from_inner(w0.clone()).require_grad(),
                    Tensor::<A, 1>::from_inner(b0.clone()).require_grad(),
                )
            };
            let run = |ours: bool| {
                let (x, w, b) = leaves();
                let weight = if transposed {
                    w.clone().transpose()
                } else {
                    w.clone()
                };
                let bias = with_bias.then(|| b.clone());
                let y = if ours {
                    crate::dense(x.clone(), weight, bias)
                } else {
                    burn::tensor::module::linear(x.clone(), weight, bias)
                };
                let grads = (y.clone() * Tensor::from_inner(probe.clone()))
                    .sum()
                    .backward();
                (
                    y.inner().reshape([15, 4]),
                    x.grad(&grads).map(|g| g.reshape([15, 7])),
                    w.grad(&grads),
                    b.grad(&grads).map(|g| g.reshape([1, 4])),
                )
            };
            let (y, dx, dw, db) = run(true);
            let (y_ref, dx_ref, dw_ref, db_ref) = run(false);
            close(y, y_ref, &format!("{what}: output"));
            close(dx.unwrap(), dx_ref.unwrap(), &format!("{what}: dx"));
            close(dw.unwrap(), dw_ref.unwrap(), &format!("{what}: dweight"));
            if with_bias {
                close(db.unwrap(), db_ref.unwrap(), &format!("{what}: dbias"));
            } else {
                assert!(db.is_none(), "{what}: an unused bias has no gradient");
            }
        }
    }
}
