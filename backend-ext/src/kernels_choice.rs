//! The `model.kernels` setting: which implementation of the fused ops a model uses; the
//! `model.qkv_projections` setting; how the CubeCL row kernels reduce a row.

use std::sync::atomic::{AtomicU8, Ordering};

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

/// The `model.qkv_projections` setting: how the fused encoder runs each layer's query, key and
/// value projections (Note [Packed QKV] in `qkv.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QkvProjections {
    /// [`QkvProjections::Packed`] where the backend has kernels ([`FusedOps::HAS_KERNELS`]:
    /// cuda and wgpu, where the launches it saves count), else
    /// [`QkvProjections::Separate`] (NdArray: packed took 1.04–1.08× the CPU time of a
    /// BERT-base step, docs/kernels.md).
    #[default]
    Auto,
    /// One dense layer with the three weights side by side (NVIDIA's and Samsung's MLPerf
    /// BERT's fused QKV), read by [`crate::attention_qkv`].
    Packed,
    /// Three dense layers, as Hugging Face's `BertSelfAttention`.
    Separate,
}

impl QkvProjections {
    /// Whether backend `B` runs the packed projections under this choice.
    pub fn packed<B: FusedOps>(self) -> bool {
        match self {
            QkvProjections::Auto => B::HAS_KERNELS,
            QkvProjections::Packed => true,
            QkvProjections::Separate => false,
        }
    }
}

impl std::str::FromStr for QkvProjections {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(QkvProjections::Auto),
            "packed" => Ok(QkvProjections::Packed),
            "separate" => Ok(QkvProjections::Separate),
            other => Err(format!(
                "unknown qkv_projections `{other}` (expected auto, packed or separate)"
            )),
        }
    }
}

/// How the CubeCL row kernels (LayerNorm, masked softmax; forward and backward) reduce a row
/// across a cube (Note [Row reductions] in `cube/reductions.rs`): process-wide, set by
/// [`set_row_reductions`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowReductions {
    /// Planes where the device reports plane operations (CUDA), else the tree.
    #[default]
    Auto,
    /// Plane operations first, then the planes' results in shared memory (two barriers). On a
    /// device without plane operations the kernels fail to compile.
    Planes,
    /// A tree in shared memory (log₂(units) + 1 barriers), what the kernels did before.
    Tree,
}

/// The process's [`RowReductions`] (0: auto, 1: planes, 2: tree).
static CHOICE: AtomicU8 = AtomicU8::new(0);

impl RowReductions {
    /// The choice's name.
    pub fn name(self) -> &'static str {
        match self {
            RowReductions::Auto => "auto",
            RowReductions::Planes => "planes",
            RowReductions::Tree => "tree",
        }
    }
}

impl std::str::FromStr for RowReductions {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(RowReductions::Auto),
            "planes" => Ok(RowReductions::Planes),
            "tree" => Ok(RowReductions::Tree),
            other => Err(format!(
                "unknown row reductions `{other}` (expected auto, planes or tree)"
            )),
        }
    }
}

/// Sets how the row kernels reduce from now on, process-wide (kernels already enqueued keep
/// theirs): `bench kernels --row-reductions` compares the two forms, and the kernel tests force
/// planes on lavapipe.
pub fn set_row_reductions(choice: RowReductions) {
    CHOICE.store(choice as u8, Ordering::Relaxed);
}

/// The process's choice ([`set_row_reductions`]; by default [`RowReductions::Auto`]).
pub fn row_reductions() -> RowReductions {
    match CHOICE.load(Ordering::Relaxed) {
        1 => RowReductions::Planes,
        2 => RowReductions::Tree,
        _ => RowReductions::Auto,
    }
}

#[cfg(test)]
mod tests {
    use super::{QkvProjections, RowReductions, row_reductions, set_row_reductions};

    /// `auto` packs where the backend has kernels (the CubeCL backends) and not on NdArray;
    /// `packed` and `separate` hold everywhere; the TOML names parse and a wrong one is named.
    #[test]
    fn qkv_projections_pack_where_the_backend_has_kernels() {
        type Cpu = burn::backend::NdArray;
        assert!(!QkvProjections::Auto.packed::<Cpu>());
        assert!(QkvProjections::Packed.packed::<Cpu>());
        assert!(!QkvProjections::Separate.packed::<Cpu>());
        #[cfg(feature = "wgpu")]
        {
            type Gpu = burn::backend::Autodiff<crate::CountingWgpu>;
            assert!(QkvProjections::Auto.packed::<Gpu>());
            assert!(!QkvProjections::Separate.packed::<Gpu>());
        }
        assert_eq!("packed".parse(), Ok(QkvProjections::Packed));
        assert_eq!("separate".parse(), Ok(QkvProjections::Separate));
        assert_eq!(QkvProjections::default(), QkvProjections::Auto);
        let error = "fused".parse::<QkvProjections>().unwrap_err();
        assert!(error.contains("`fused`") && error.contains("auto, packed or separate"));
    }

    #[test]
    fn row_reductions_names_parse_and_the_choice_round_trips() {
        for choice in [
            RowReductions::Auto,
            RowReductions::Planes,
            RowReductions::Tree,
        ] {
            assert_eq!(choice.name().parse::<RowReductions>(), Ok(choice));
        }
        let err = "warps".parse::<RowReductions>().unwrap_err();
        assert!(
            err.contains("`warps`") && err.contains("planes or tree"),
            "{err}"
        );
        assert_eq!(row_reductions(), RowReductions::Auto);
        set_row_reductions(RowReductions::Tree);
        assert_eq!(row_reductions(), RowReductions::Tree);
        set_row_reductions(RowReductions::Auto);
    }
}
