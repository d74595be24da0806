//! The `model.reference_ops` setting: fused ops the fused path runs as their reference
//! composition instead (Note [Fused where it pays]).
//!
//! Note [Fused where it pays]: the GPU-speed issue asks that every fused op be at least as
//! fast as its composed reference, forward and forward + backward at BERT-large shapes, or not
//! be used there. `model.kernels` chooses for the whole model; this setting takes single ops
//! out of the fused path, each replaced by the composition the reference path runs for it:
//!
//! - `bias_gelu`: the dense layer with its bias, then GELU (the FFN's intermediate layer and
//!   the masked-LM head's transform);
//! - `layer_norm`: bias + dropout + residual + LayerNorm as the dense layer with its bias,
//!   dropout (the keyed dropout op), the residual's sum and Burn's `LayerNorm` in f32 (both
//!   of every encoder layer's, the embeddings' and the head's);
//! - `attention`: the attention core as Q·Kᵀ, the masked softmax in f32, dropout and P·V,
//!   after three dense layers for Q, K and V (packing serves the fused op alone: slicing the
//!   packed output would cost a zero-filled gradient and a copy per slice backward);
//! - `cross_entropy`: the losses as Burn's `log_softmax` in f32, the labels' entries and
//!   their mean, where the fused op is used even under `kernels = "reference"`.
//!
//! The compositions are `ember_model::composed`'s. `bench kernels` times each op against the
//! same composition and ends with the list for its device (`slower fused:`);
//! `scripts/gpu-check.sh run bench-kernels` then times a BERT-large step with that list against
//! the fused default (which also sees what composing `attention` costs the projections: three
//! dense layers instead of the packed one). The names are `bench kernels --ops`'s. The dropout masks are the
//! fused ops' (keyed by sample and position), so a step's values are the same either way
//! within rounding. NVIDIA's MLPerf BERT turns its fused kernels on and off one by one the
//! same way (`--fused_gelu_bias`, `--fused_mha`, `--fused_dropout_add`).

use crate::FusedOps;
use crate::Kernels;

/// An op of `ember-backend-ext` that the fused path can run as its reference composition
/// (Note [Fused where it pays]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedOp {
    /// `GELU(x + bias)`, with the dense layer before it.
    BiasGelu,
    /// `LayerNorm(residual + dropout(x + bias))`, with the dense layer before it.
    LayerNorm,
    /// `dropout(softmax(Q·Kᵀ·scale + mask_bias))·V`.
    Attention,
    /// The losses' mean cross-entropy.
    CrossEntropy,
}

impl FusedOp {
    /// Every op, in the order of their bits.
    pub const ALL: [FusedOp; 4] = [
        FusedOp::BiasGelu,
        FusedOp::LayerNorm,
        FusedOp::Attention,
        FusedOp::CrossEntropy,
    ];

    /// The op's name in `model.reference_ops` and `bench kernels --ops`.
    pub fn name(self) -> &'static str {
        match self {
            FusedOp::BiasGelu => "bias_gelu",
            FusedOp::LayerNorm => "layer_norm",
            FusedOp::Attention => "attention",
            FusedOp::CrossEntropy => "cross_entropy",
        }
    }

    fn bit(self) -> u8 {
        1 << FusedOp::ALL.iter().position(|&op| op == self).unwrap_or(0)
    }
}

/// The set of ops the fused path runs as their reference composition (`model.reference_ops`;
/// Note [Fused where it pays]). Empty by default. Written as the ops' names separated by
/// commas (`"attention,layer_norm"`; `""` or `"none"` for none) on the command line, a list of
/// names in TOML.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReferenceOps(u8);

impl ReferenceOps {
    /// No op: every op fused where the model's kernels are.
    pub const NONE: ReferenceOps = ReferenceOps(0);

    /// Whether `op` runs as its reference composition.
    pub fn contains(self, op: FusedOp) -> bool {
        self.0 & op.bit() != 0
    }

    /// This set and `op`.
    pub fn with(self, op: FusedOp) -> Self {
        ReferenceOps(self.0 | op.bit())
    }

    /// The ops in the set, in [`FusedOp::ALL`]'s order.
    pub fn ops(self) -> impl Iterator<Item = FusedOp> {
        FusedOp::ALL
            .into_iter()
            .filter(move |&op| self.contains(op))
    }

    /// Whether backend `B` runs `op` fused under `kernels` and this set: not in the set, and
    /// `kernels` fused for `B` ([`Kernels::fused`]), except for the losses' cross-entropy,
    /// which both of the model's paths run fused.
    pub fn runs_fused<B: FusedOps>(self, op: FusedOp, kernels: Kernels) -> bool {
        !self.contains(op) && (op == FusedOp::CrossEntropy || kernels.fused::<B>())
    }
}

impl FromIterator<FusedOp> for ReferenceOps {
    fn from_iter<I: IntoIterator<Item = FusedOp>>(ops: I) -> Self {
        ops.into_iter().fold(ReferenceOps::NONE, ReferenceOps::with)
    }
}

impl std::fmt::Display for ReferenceOps {
    /// The names separated by commas, or `none`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == ReferenceOps::NONE {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.ops().map(FusedOp::name).collect();
        f.write_str(&names.join(","))
    }
}

impl std::str::FromStr for FusedOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FusedOp::ALL
            .into_iter()
            .find(|op| op.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown fused op `{s}` (expected bias_gelu, layer_norm, attention or \
                     cross_entropy)"
                )
            })
    }
}

impl std::str::FromStr for ReferenceOps {
    type Err = String;
    /// `"attention,layer_norm"`; `""` and `"none"` are the empty set.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() || s == "none" {
            return Ok(ReferenceOps::NONE);
        }
        s.split(',').map(|name| name.trim().parse()).collect()
    }
}

impl serde::Serialize for ReferenceOps {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.ops().map(FusedOp::name))
    }
}

impl<'de> serde::Deserialize<'de> for ReferenceOps {
    /// A list of names (`["attention", "layer_norm"]`), or one string as the command line
    /// takes it.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Form {
            List(Vec<String>),
            One(String),
        }
        let parse = |s: &str| s.parse::<ReferenceOps>().map_err(serde::de::Error::custom);
        match Form::deserialize(deserializer)? {
            Form::One(s) => parse(&s),
            Form::List(names) => names.iter().try_fold(ReferenceOps::NONE, |set, name| {
                let op = name.parse::<FusedOp>().map_err(serde::de::Error::custom)?;
                Ok(set.with(op))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{FusedOp, ReferenceOps};
    use crate::Kernels;

    #[test]
    fn names_parse_print_and_round_trip() {
        let set: ReferenceOps = "attention, layer_norm".parse().unwrap();
        assert!(set.contains(FusedOp::Attention) && set.contains(FusedOp::LayerNorm));
        assert!(!set.contains(FusedOp::BiasGelu) && !set.contains(FusedOp::CrossEntropy));
        assert_eq!(set.to_string(), "layer_norm,attention");
        assert_eq!(set.to_string().parse(), Ok(set));
        for empty in ["", "none", " none "] {
            assert_eq!(empty.parse(), Ok(ReferenceOps::NONE), "{empty:?}");
        }
        assert_eq!(ReferenceOps::NONE.to_string(), "none");
        let all: ReferenceOps = FusedOp::ALL.into_iter().collect();
        assert_eq!(all.ops().collect::<Vec<_>>(), FusedOp::ALL);
        assert_eq!(
            all.to_string(),
            "bias_gelu,layer_norm,attention,cross_entropy"
        );
        let error = "attention,softmax".parse::<ReferenceOps>().unwrap_err();
        assert!(
            error.contains("`softmax`") && error.contains("cross_entropy"),
            "{error}"
        );
    }

    /// TOML holds a list of names; a single string is read as the command line reads it.
    #[test]
    fn toml_takes_a_list_or_a_string() {
        #[derive(serde::Deserialize, serde::Serialize, PartialEq, Debug)]
        struct Section {
            reference_ops: ReferenceOps,
        }
        let list: Section =
            toml::from_str("reference_ops = [\"bias_gelu\", \"cross_entropy\"]").unwrap();
        let expected: ReferenceOps = [FusedOp::BiasGelu, FusedOp::CrossEntropy]
            .into_iter()
            .collect();
        assert_eq!(list.reference_ops, expected);
        let written = toml::to_string(&list).unwrap();
        assert_eq!(toml::from_str::<Section>(&written).unwrap(), list);
        let one: Section = toml::from_str("reference_ops = \"attention\"").unwrap();
        assert_eq!(
            one.reference_ops,
            ReferenceOps::NONE.with(FusedOp::Attention)
        );
        let empty: Section = toml::from_str("reference_ops = []").unwrap();
        assert_eq!(empty.reference_ops, ReferenceOps::NONE);
        let error = toml::from_str::<Section>("reference_ops = [\"gelu\"]")
            .unwrap_err()
            .to_string();
        assert!(error.contains("`gelu`"), "{error}");
    }

    /// An op in the set never runs fused; one outside it as `kernels` says, except the
    /// cross-entropy, fused on both of the model's paths.
    #[test]
    fn runs_fused_follows_the_set_and_the_kernels() {
        type Cpu = burn::backend::NdArray;
        let set = ReferenceOps::NONE.with(FusedOp::Attention);
        for kernels in [Kernels::Auto, Kernels::Fused, Kernels::Reference] {
            assert!(!set.runs_fused::<Cpu>(FusedOp::Attention, kernels));
            assert!(set.runs_fused::<Cpu>(FusedOp::CrossEntropy, kernels));
            assert_eq!(
                set.runs_fused::<Cpu>(FusedOp::LayerNorm, kernels),
                kernels != Kernels::Reference
            );
        }
        let losses = ReferenceOps::NONE.with(FusedOp::CrossEntropy);
        assert!(!losses.runs_fused::<Cpu>(FusedOp::CrossEntropy, Kernels::Fused));
    }
}
