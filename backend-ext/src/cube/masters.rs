//! [`MasterOps`] on CubeCL backends: the masters' gradients written in their dtype by the
//! kernels that compute them (Note [Parameter gradients in f32] in `masters.rs`).

use burn::tensor::FloatDType;
use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::{gemm, multi_tensor};
use crate::{FusedOps, MasterOps};

impl<R, F, I, BT> MasterOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    /// `dW` from the weight-gradient GEMM in `dtype` (CubeCL's kernels, or cuBLASLt's with `db`
    /// in its epilogue), `db` by [`multi_tensor::column_sums`] in `dtype` where no epilogue
    /// computed it.
    fn dense_backward_as(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        with_bias: bool,
        dtype: FloatDType,
    ) -> crate::DenseGrads<Self> {
        let grads = crate::linear::flattened_linear_backward::<Self>(
            x,
            weight,
            grad,
            with_bias,
            |g, weight_t, x_t, with_bias| {
                let operands = g.dtype;
                let (dx, dweight, dbias) = gemm::dense_backward_products_as(
                    g.clone(),
                    weight_t,
                    x_t,
                    with_bias,
                    dtype.into(),
                );
                // The bias gradient in `dtype` from the f32 partial sums: two launches, as
                // Burn's reduction in the operands' dtype and its cast were.
                let dbias = match dbias {
                    None if with_bias && operands != burn::tensor::DType::from(dtype) => {
                        multi_tensor::column_sums(vec![g], Some(dtype.into()))
                            .ok()
                            .and_then(|mut sums| sums.pop())
                    }
                    dbias => dbias,
                };
                (dx, dweight, dbias)
            },
        );
        crate::linear::grads_as::<Self>(grads, dtype)
    }

    fn sum_rows_many_as(xs: Vec<FloatTensor<Self>>, dtype: FloatDType) -> Vec<FloatTensor<Self>> {
        multi_tensor::column_sums(xs, Some(dtype.into())).unwrap_or_else(|xs| {
            xs.into_iter()
                .map(|x| {
                    let sum = Self::sum_rows(x);
                    crate::linear::cast_to::<Self>(sum, dtype)
                })
                .collect()
        })
    }
}
