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
        let mut both = super::cublaslt::matmuls(&[(&a1, &b1, None), (&a2, &b2, None)]);
        let second = both.pop().flatten();
        let first = both.pop().flatten();
        return (
            first.unwrap_or_else(|| cube_only(a1, b1)),
            second.unwrap_or_else(|| cube_only(a2, b2)),
        );
    }
    (matmul(a1, b1), matmul(a2, b2))
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
