//! The `model.kernels` setting: which implementation of the fused ops a model uses.

use crate::FusedOps;

/// Which implementation of the fused ops a model uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kernels {
    /// [`Kernels::Fused`] where the backend has kernels or NdArray's host loops
    /// ([`FusedOps::FUSED_BY_DEFAULT`]), else [`Kernels::Reference`].
    #[default]
    Auto,
    /// The [`FusedOps`] ops (kernels and their custom backward passes).
    Fused,
    /// The composition of Burn ops, differentiated by Burn's autodiff.
    Reference,
}

impl Kernels {
    /// Whether backend `B` runs the fused ops under this choice.
    pub fn fused<B: FusedOps>(self) -> bool {
        match self {
            Kernels::Auto => B::FUSED_BY_DEFAULT,
            Kernels::Fused => true,
            Kernels::Reference => false,
        }
    }

    /// Whether the optimizer steps through the multi-tensor ops on backend `B` under this
    /// choice: `auto` where the backend has its own ([`FusedOps::HAS_MULTI_TENSOR`]: the
    /// kernels, and NdArray's fused host loop), `fused` always, `reference` never (Burn's
    /// `AdamW` and ember's `Lamb`, tensor by tensor).
    pub fn multi_tensor<B: FusedOps>(self) -> bool {
        match self {
            Kernels::Auto => B::HAS_MULTI_TENSOR,
            Kernels::Fused => true,
            Kernels::Reference => false,
        }
    }
}

impl std::str::FromStr for Kernels {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Kernels::Auto),
            "fused" => Ok(Kernels::Fused),
            "reference" => Ok(Kernels::Reference),
            other => Err(format!(
                "unknown kernels `{other}` (expected auto, fused or reference)"
            )),
        }
    }
}
