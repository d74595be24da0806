//! Mixed precision: the dtype BERT computes in, with f32 weights.
//!
//! Note [Autocast]: the parameters stay f32 (the master weights the optimizer updates, the
//! checkpoint holds and the reducer's buckets sum); with [`Precision::Bf16`] or
//! [`Precision::Fp16`] the embeddings' output is cast to the half type, and from there every
//! layer computes in the dtype of its input: each weight is cast to it where it is used (the
//! layer's parameters cast together, Note [Weights cast together] in `weight_casts.rs`).
//! The GEMMs, attention, GELU, dropout, residual adds and the fused kernels run on half
//! tensors; what needs range or precision runs in f32 and casts its result back:
//! LayerNorm (statistics, γ and β), the attention softmax, the losses (the fused kernels of
//! `ember-backend-ext` accumulate in f32 inside). The MLM and NSP logits stay in the half type,
//! as autocast's linear layers return them; the losses' op reads them as they are and
//! computes and returns in f32 (Note [Cross-entropy in one pass] in its `cube/cross_entropy.rs`). This is
//! PyTorch's `torch.autocast` recipe (f32 parameters, a cast per op, `GradScaler` for fp16:
//! `crate`'s user is the trainer's `loss_scale`), chosen over a half copy of the model
//! refreshed after each step (apex O2, NVIDIA's MLPerf BERT) because the model, its
//! checkpoints, the gradient hooks, buckets and optimizers all stay f32 and generic over the
//! backend: the cost is one cast of each weight per micro-batch, a few percent of a step's
//! memory traffic for BERT-large (weights 1.3 GB against activations many times that). No
//! gradient is cast back: the ops take the f32 parameters beside their copies and write the
//! parameters' gradients in f32, the dense weights' by the GEMM itself ([`dense_as`]: Note
//! [Weight gradients in f32] in `ember-backend-ext`'s `linear.rs`), the biases', γ's and β's
//! by the fused ops' column sums (Note [Parameter gradients in f32] in its `masters.rs`).
//!
//! Backends without the half type (NdArray has neither f16 nor bf16; WGSL has no bf16) refuse
//! it before training (`Backend::supports_dtype`).

use burn::module::Param;
use burn::nn::{LayerNorm, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};
use ember_backend_ext::FusedOps;
use serde::{Deserialize, Serialize};

use crate::weight_casts::param_pair;

/// The dtype BERT computes in (`train.precision`; Note [Autocast]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// bfloat16 compute (8 exponent bits: f32's range; no loss scaling needed).
    Bf16,
    /// IEEE half compute (5 exponent bits: needs loss scaling).
    #[serde(alias = "f16")]
    Fp16,
}

impl Precision {
    /// The float dtype activations take.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::Bf16 => FloatDType::BF16,
            Precision::Fp16 => FloatDType::F16,
        }
    }

    /// Unit roundoff u of the type's storage (half the distance from 1 to the next value):
    /// f32 2⁻²⁴, bf16 2⁻⁸ (7 stored mantissa bits), fp16 2⁻¹¹ (10 bits). Tolerances of
    /// comparisons across precisions are stated in multiples of it.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F32 => 2f64.powi(-24),
            Precision::Bf16 => 2f64.powi(-8),
            Precision::Fp16 => 2f64.powi(-11),
        }
    }

    /// Whether this is a half type.
    pub fn is_half(self) -> bool {
        self != Precision::F32
    }

    /// Whether `B` computes in this precision on `device` (Burn's `supports_dtype`).
    pub fn supported<B: Backend>(self, device: &B::Device) -> bool {
        B::supports_dtype(device, self.dtype().into())
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::Fp16),
            other => Err(format!(
                "unknown precision {other:?}: expected f32, bf16 or fp16"
            )),
        }
    }
}

/// `x` in `dtype`; `x` itself when it has it already (no graph node).
pub fn cast_to<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        return x;
    }
    x.cast(FloatDType::from(dtype))
}

/// `x · W + b` with the weights cast to `x`'s dtype (Note [Autocast]; the copies cast
/// together where a scope holds them, Note [Weights cast together] in `weight_casts.rs`), the
/// parameters' gradients in their own dtype (Note [Weight gradients in f32] in
/// `ember-backend-ext`'s `linear.rs`).
///
/// # Shapes
/// - `x`: `[..., in]`; output `[..., out]`
pub fn dense_as<B: FusedOps, const D: usize>(linear: &Linear<B>, x: Tensor<B, D>) -> Tensor<B, D> {
    dense_parts(x, &linear.weight, linear.bias.as_ref())
}

/// [`dense_as`] of a weight and an optional bias: [`ember_backend_ext::dense_of_masters`] of
/// them and their copies in `x`'s dtype (where they are in it, the op is
/// [`ember_backend_ext::dense`] of them).
pub(crate) fn dense_parts<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    weight: &Param<Tensor<B, 2>>,
    bias: Option<&Param<Tensor<B, 1>>>,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    let (weight, weight_copy) = param_pair(weight, dtype);
    let bias = bias.map(|b| param_pair(b, dtype));
    ember_backend_ext::dense_of_masters(x, weight, weight_copy, bias)
}

/// LayerNorm with its statistics, γ and β in f32, the result in `x`'s dtype.
pub fn layer_norm_f32<B: Backend, const D: usize>(
    norm: &LayerNorm<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    let dtype = x.dtype();
    cast_to(norm.forward(cast_to(x, DType::F32)), dtype)
}

/// Softmax over `dim` computed in f32, the result in `x`'s dtype.
pub fn softmax_f32<B: Backend, const D: usize>(x: Tensor<B, D>, dim: usize) -> Tensor<B, D> {
    let dtype = x.dtype();
    cast_to(
        burn::tensor::activation::softmax(cast_to(x, DType::F32), dim),
        dtype,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_ndarray_has_no_half_type() {
        assert_eq!("bf16".parse::<Precision>(), Ok(Precision::Bf16));
        assert_eq!("fp16".parse::<Precision>(), Ok(Precision::Fp16));
        assert!(
            "fp8"
                .parse::<Precision>()
                .unwrap_err()
                .contains("f32, bf16 or fp16")
        );
        type N = burn::backend::NdArray;
        let device = Default::default();
        assert!(Precision::F32.supported::<N>(&device));
        assert!(!Precision::Bf16.supported::<N>(&device));
        assert!(!Precision::Fp16.supported::<N>(&device));
    }

    /// u is half the gap above 1: 1 + u rounds to 1 (ties to even), 1 + 2u is the next value.
    #[test]
    fn unit_roundoff_is_half_the_gap_above_one() {
        use burn::tensor::{bf16, f16};
        let u = Precision::Bf16.unit_roundoff();
        assert_eq!(bf16::from_f64(1.0 + u).to_f64(), 1.0);
        assert_eq!(bf16::from_f64(1.0 + 2.0 * u).to_f64(), 1.0 + 2.0 * u);
        let u = Precision::Fp16.unit_roundoff();
        assert_eq!(f16::from_f64(1.0 + u).to_f64(), 1.0);
        assert_eq!(f16::from_f64(1.0 + 2.0 * u).to_f64(), 1.0 + 2.0 * u);
        let u = Precision::F32.unit_roundoff();
        assert_eq!((1.0 + u) as f32, 1.0);
        assert_eq!((1.0 + 2.0 * u) as f32 as f64, 1.0 + 2.0 * u);
    }
}
