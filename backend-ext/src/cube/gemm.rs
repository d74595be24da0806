//! The GPU backends' GEMMs under the `model.gemm` choice (Note [GPU GEMMs] in `gemm.rs`).

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul as cube_matmul};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::CubePrimitive;

#[cfg(any(feature = "autotune", feature = "cuda"))]
use crate::Gemm;
use crate::{GemmPrecision, gpu_gemm};

/// Burn's matmul strategy for [`gpu_gemm`]'s choice (cuBLASLt's products that it hands back
/// run the autotuned one).
fn strategy() -> MatmulStrategy {
    // `Gemm::resolve` refuses autotune and cuBLASLt in a build without them. `Cube` is
    // cubek's `Strategy::Auto`: SimpleCyclicCmma, or the unit kernel without tensor cores.
    #[cfg(feature = "autotune")]
    if matches!(gpu_gemm(), Gemm::Autotune | Gemm::Cublaslt) {
        return MatmulStrategy::Autotune;
    }
    #[cfg(not(feature = "autotune"))]
    let _ = gpu_gemm();
    MatmulStrategy::Cube
}

/// `a · b` (Burn's `float_matmul`: batched over the leading dimensions, broadcast where one
/// side has 1) with the chosen kernel (cuBLASLt on CUDA where it takes the layout), in `a`'s
/// dtype.
///
/// # Panics
/// As Burn's `float_matmul`, when cubek has no kernel for the operands (mismatched dtypes).
pub(crate) fn matmul<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
    #[cfg(feature = "cuda")]
    if gpu_gemm() == Gemm::Cublaslt
        && let Some(product) = super::cublaslt::matmul(&a, &b, None)
    {
        return product;
    }
    let dtype = a.dtype;
    cube_matmul(a, b, None, strategy(), dtype)
        .unwrap_or_else(|e| panic!("matmul of {dtype:?} operands: {e:?}"))
}

/// `a1 · b1` and `a2 · b2`, as [`matmul`] each, for products that do not read each other's
/// output: on cuBLASLt in one window of host waits (Note [cuBLASLt beside CubeCL]).
pub(crate) fn matmul_pair<R: CubeRuntime>(
    a1: CubeTensor<R>,
    b1: CubeTensor<R>,
    a2: CubeTensor<R>,
    b2: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    #[cfg(feature = "cuda")]
    if gpu_gemm() == Gemm::Cublaslt {
        use super::cublaslt::With;
        let mut both = super::cublaslt::matmuls(&[
            (&a1, &b1, With::Nothing, a1.dtype),
            (&a2, &b2, With::Nothing, a2.dtype),
        ]);
        let second = both.pop().flatten().map(|p| p.out);
        let first = both.pop().flatten().map(|p| p.out);
        return (
            first.unwrap_or_else(|| cube_only(a1, b1)),
            second.unwrap_or_else(|| cube_only(a2, b2)),
        );
    }
    (matmul(a1, b1), matmul(a2, b2))
}

/// The dense layer's gradient products, `dx = g·Wᵀ` and `dW = xᵀ·g` (`g2`, `weight_t`, `x_t`:
/// the output's gradient `[R, O]`, the weight's transposed view `[O, I]`, the input's
/// `[I, R]`), as [`matmul_pair`]; with `with_bias`, cuBLASLt also writes `db = Σ_rows g` `[O]`
/// in `dW`'s epilogue (`CUBLASLT_EPILOGUE_BGRADA`, Note [cuBLASLt descriptors kept] in
/// `cublaslt_call.rs`). `db` is `None` where no epilogue computed it (another kernel, a refused
/// kind), for the caller's reduction.
pub(crate) fn dense_backward_products<R: CubeRuntime>(
    g2: CubeTensor<R>,
    weight_t: CubeTensor<R>,
    x_t: CubeTensor<R>,
    with_bias: bool,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    let dtype = g2.dtype;
    dense_backward_products_as(g2, weight_t, x_t, with_bias, dtype)
}

/// [`dense_backward_products`] with `dW` (and cuBLASLt's `db`) written in `dweight_dtype`: f32
/// from half operands, their accumulator's precision (Note [Weight gradients in f32] in
/// `linear.rs`; on cuBLASLt, Note [cuBLASLt's f32 output] in `cublaslt_call.rs`).
pub(crate) fn dense_backward_products_as<R: CubeRuntime>(
    g2: CubeTensor<R>,
    weight_t: CubeTensor<R>,
    x_t: CubeTensor<R>,
    with_bias: bool,
    dweight_dtype: burn::tensor::DType,
) -> (CubeTensor<R>, CubeTensor<R>, Option<CubeTensor<R>>) {
    #[cfg(feature = "cuda")]
    if gpu_gemm() == Gemm::Cublaslt {
        use super::cublaslt::With;
        let with = if with_bias {
            With::BiasGradient
        } else {
            With::Nothing
        };
        let mut both = super::cublaslt::matmuls(&[
            (&g2, &weight_t, With::Nothing, g2.dtype),
            (&x_t, &g2, with, dweight_dtype),
        ]);
        let dweight = both.pop().flatten();
        let dx = both.pop().flatten().map(|p| p.out);
        let (dweight, dbias) = match dweight {
            Some(p) => (p.out, p.bias_gradient),
            None => (weight_gradient(x_t, g2.clone(), dweight_dtype), None),
        };
        return (
            dx.unwrap_or_else(|| cube_only(g2, weight_t)),
            dweight,
            dbias,
        );
    }
    let _ = with_bias;
    if dweight_dtype == g2.dtype {
        let (dx, dweight) = matmul_pair(g2.clone(), weight_t, x_t, g2);
        return (dx, dweight, None);
    }
    let dx = matmul(g2.clone(), weight_t);
    (dx, weight_gradient(x_t, g2, dweight_dtype), None)
}

/// `x_t · g2` on CubeCL's kernels, written in `dtype`.
///
/// # Panics
/// Where no kernel takes the operands with that output. cubek's `MatmulElems` take half
/// operands with an f32 output (its accumulator's type); cubek panics inside (Auto's unit
/// kernel, autotune's "all operations failed") rather than return an error where no kernel
/// takes them, so there is no fallback to offer here.
fn weight_gradient<R: CubeRuntime>(
    x_t: CubeTensor<R>,
    g2: CubeTensor<R>,
    dtype: burn::tensor::DType,
) -> CubeTensor<R> {
    let operands = g2.dtype;
    cube_matmul(x_t, g2, None, strategy(), dtype).unwrap_or_else(|e| {
        panic!("the weight gradient in {dtype:?} from {operands:?} operands: {e:?}")
    })
}

/// [`matmul`] on CubeCL's kernel, whatever the choice (a product cuBLASLt did not take).
#[cfg(feature = "cuda")]
fn cube_only<R: CubeRuntime>(a: CubeTensor<R>, b: CubeTensor<R>) -> CubeTensor<R> {
    let dtype = a.dtype;
    cube_matmul(a, b, None, strategy(), dtype)
        .unwrap_or_else(|e| panic!("matmul of {dtype:?} operands: {e:?}"))
}

/// `x · weight + bias` on the rows flattened to `[R, I]`: one `[R, I]·[I, O]` GEMM, where
/// Burn's `linear` multiplies `[B, S, I]` by the weight broadcast to `[1, I, O]` (B products
/// of S rows each, too few rows to fill a tensor-core tile schedule at S = 128).
///
/// # Shapes
/// `x` `[.., I]`, `weight` `[I, O]`, `bias` `[O]` → `[.., O]`
pub(crate) fn dense<R: CubeRuntime>(
    x: CubeTensor<R>,
    weight: CubeTensor<R>,
    bias: Option<CubeTensor<R>>,
    reshape: impl Fn(CubeTensor<R>, Shape) -> CubeTensor<R>,
    add: impl Fn(CubeTensor<R>, CubeTensor<R>) -> CubeTensor<R>,
) -> CubeTensor<R> {
    let x_shape = x.shape();
    let i = x_shape[x_shape.num_dims() - 1];
    let o = weight.shape()[1];
    let rows = x_shape.num_elements() / i.max(1);
    let x = reshape(x, Shape::new([rows, i]));
    // cuBLASLt adds the bias in its epilogue.
    #[cfg(feature = "cuda")]
    if gpu_gemm() == Gemm::Cublaslt
        && let Some(y) = super::cublaslt::matmul(&x, &weight, bias.as_ref())
    {
        let mut out_dims = x_shape.as_slice().to_vec();
        *out_dims.last_mut().expect("x has at least one dimension") = o;
        return reshape(y, Shape::from(out_dims));
    }
    let y = matmul(x, weight);
    let y = match bias {
        Some(bias) => add(y, reshape(bias, Shape::new([1, o]))),
        None => y,
    };
    let mut out_dims = x_shape.as_slice().to_vec();
    *out_dims.last_mut().expect("x has at least one dimension") = o;
    reshape(y, Shape::from(out_dims))
}

/// What the device's f32 GEMMs are: TF32 where cubek's tensor-core kernels can read f32 as
/// TF32 (`adjust_dtypes` in cubek-matmul 0.2's blueprint.rs asks the same question).
pub(crate) fn f32_precision<R: CubeRuntime>(device: &R::Device) -> GemmPrecision {
    let client = R::client(device);
    let tf32 = cubecl::tf32::as_type_native_unchecked().storage_type();
    if client.properties().supports_type(tf32) {
        GemmPrecision::Tf32
    } else {
        GemmPrecision::F32
    }
}
