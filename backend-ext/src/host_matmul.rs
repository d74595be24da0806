//! NdArray's [`FusedOps::batched_matmul`](crate::FusedOps::batched_matmul): the attention's
//! `[B, nh, M, K] · [B, nh, K, N]` products as one GEMM per `[b, h]` pair on strided views,
//! the pairs split over rayon's threads.
//!
//! Burn 0.21's NdArray matmul reshapes both operands to rank 3 and its output back, and each
//! reshape copies (see `linear.rs`); the attention's operands are head-strided views (`Q`, `K`,
//! `V` split from `[B, S, H]` by a reshape and a transpose) or transposed ones (`Kᵀ`, `Pᵀ`), so
//! every attention product copied three tensors. Here each pair is multiplied in place by
//! matrixmultiply's `sgemm`, which takes any row and column strides, into a new contiguous
//! output. matrixmultiply rather than BLAS: these products are small (BERT: 128 × 128 × 64),
//! where one single-threaded GEMM per rayon task beats OpenBLAS splitting each small product
//! over its own threads (measured in the docs/performance.md, CPU performance).

use burn_ndarray::NdArrayTensor;
use ndarray::{ArrayD, ArrayView4, Ix4, IxDyn, s};
use rayon::prelude::*;

fn rank_4(x: &NdArrayTensor) -> Option<ArrayView4<'_, f32>> {
    match x {
        NdArrayTensor::F32(storage) => storage.view().into_dimensionality::<Ix4>().ok(),
        _ => None,
    }
}

/// `a[b, h] · b[b, h]` for every pair; `None` for other dtypes, ranks, or shapes that Burn's
/// matmul would broadcast (the caller then runs Burn's).
pub(crate) fn batched_matmul(a: &NdArrayTensor, b: &NdArrayTensor) -> Option<NdArrayTensor> {
    let (NdArrayTensor::F32(_), NdArrayTensor::F32(_)) = (a, b) else {
        return None;
    };
    let (a, b) = (rank_4(a)?, rank_4(b)?);
    let (batch, heads, m, k) = a.dim();
    let (batch_b, heads_b, k_b, n) = b.dim();
    if (batch, heads, k) != (batch_b, heads_b, k_b) {
        return None;
    }
    let len = batch * heads * m * n;
    if m * n == 0 || k == 0 {
        let array = ArrayD::<f32>::zeros(IxDyn(&[batch, heads, m, n]));
        return Some(NdArrayTensor::from(array.into_shared()));
    }
    // Not zeroed: with β = 0 the GEMM writes every element of its output without reading it.
    let mut out: Vec<f32> = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(m * n)
        .enumerate()
        .for_each(|(pair, c)| {
            let (bi, hi) = (pair / heads, pair % heads);
            let (a, b) = (a.slice(s![bi, hi, .., ..]), b.slice(s![bi, hi, .., ..]));
            let ([rsa, csa], [rsb, csb]) = (
                [a.strides()[0], a.strides()[1]],
                [b.strides()[0], b.strides()[1]],
            );
            // SAFETY: `a` and `b` are live views of m × k and k × n elements with these
            // strides (in elements); `c` is this task's own m × n row-major block, which
            // `sgemm` with β = 0 writes in full without reading (its documented contract).
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    rsa,
                    csa,
                    b.as_ptr(),
                    rsb,
                    csb,
                    0.0,
                    c.as_mut_ptr().cast::<f32>(),
                    n as isize,
                    1,
                );
            }
        });
    // SAFETY: the blocks cover all `len` elements, each written by its GEMM above.
    unsafe { out.set_len(len) };
    let array = ArrayD::from_shape_vec(IxDyn(&[batch, heads, m, n]), out)
        .expect("the output has its shape");
    Some(NdArrayTensor::from(array.into_shared()))
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    use crate::FusedOps;

    /// Per-pair GEMMs on views against Burn's matmul: head-split operands (a reshape and a
    /// transpose of `[B, S, H]`, as the attention's Q, K, V), a transposed right operand (Kᵀ),
    /// a transposed left one (Pᵀ), and a shape Burn broadcasts (falls back to Burn's).
    #[test]
    fn ndarray_batched_matmul_equals_burns_matmul_on_strided_views() {
        let device = Default::default();
        let (b, s, nh, hd) = (3, 7, 2, 5);
        let split = |x: Tensor<NdArray, 3>| x.reshape([b, s, nh, hd]).swap_dims(1, 2);
        let random = || {
            Tensor::<NdArray, 3>::random([b, s, nh * hd], Distribution::Normal(0.0, 1.0), &device)
        };
        let (q, k, v) = (split(random()), split(random()), split(random()));
        let p =
            Tensor::<NdArray, 4>::random([b, nh, s, s], Distribution::Normal(0.0, 1.0), &device);
        let broadcast =
            Tensor::<NdArray, 4>::random([1, nh, hd, s], Distribution::Normal(0.0, 1.0), &device);
        let cases = [
            ("Q·Kᵀ", q.clone(), k.clone().swap_dims(2, 3)),
            ("P·V", p.clone(), v.clone()),
            ("Pᵀ·V", p.swap_dims(2, 3), v),
            ("Q·broadcast", q, broadcast),
        ];
        for (what, x, y) in cases {
            let reference = x.clone().matmul(y.clone());
            let ours = Tensor::<NdArray, 4>::from_primitive(TensorPrimitive::Float(
                <NdArray as FusedOps>::batched_matmul(
                    x.into_primitive().tensor(),
                    y.into_primitive().tensor(),
                ),
            ));
            assert_eq!(ours.dims(), reference.dims(), "{what}: shape");
            let (ours, reference) = (
                ours.into_data().to_vec::<f32>().unwrap(),
                reference.into_data().to_vec::<f32>().unwrap(),
            );
            for (i, (x, y)) in ours.iter().zip(&reference).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{what}[{i}]: {x} vs {y}"
                );
            }
        }
    }
}
