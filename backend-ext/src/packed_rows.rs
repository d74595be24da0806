//! The [`PackedRowOps`] trait: the ops of packed rows (`model.unpad`, Note [Padding removed] in
//! `ember-model`'s `unpad.rs`), a batch's real tokens taken out of its padded `[B·S, N]` rows
//! into `[T, N]` and put back, and dropout keyed through the map between the two.
//!
//! The map has two forms, both `[.]` integer tensors on the device: `rows` (`[T]`, the padded
//! row `b·S + s` of each packed row, ascending; `ember_data::Batch::real_rows`) and `slots`
//! (`[B·S]`, the packed row of each padded row, T where it is padding: the inverse map, what a
//! pass over the padded rows reads). Gathering is a select by `rows`; scattering writes every
//! padded row once, by `slots`, where a zero fill and a scatter by `rows` (Burn's
//! `select_assign` into zeros) take two launches and write the padded rows twice. Each is the
//! other's backward, so both directions take one launch.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor};

use crate::{DropoutSpec, float, prim, reference};

/// The ops of packed rows; part of [`crate::FusedOps`], whose supertrait it is. The default
/// bodies are Burn's ops (and the host's mask for [`PackedRowOps::dropout_rows`], the host's
/// map for [`PackedRowOps::slots_of_rows`]); CubeCL backends run kernels for the dropout, the
/// scatter and the map (the gather is Burn's `select` there too), and `Autodiff` adds the
/// backward passes.
pub trait PackedRowOps: Backend {
    /// Dropout of packed rows: row `t` of `x` is keyed as row `rows[t]` of a padded `[B·S, N]`
    /// tensor of `dropout.seq_len` = S rows per sample, so each packed row gets the mask
    /// [`crate::FusedOps::dropout`] gives its padded position. One pass, no padded copy. Its
    /// own backward: the same op on the gradient.
    ///
    /// The default reads `rows` back to the host and builds the mask there.
    ///
    /// # Shapes
    /// `x` `[.., N]` of T rows (all dimensions but the last), `rows` `[T]` with values in
    /// `0..B·S` → the shape of `x`
    ///
    /// # Panics
    /// If dropout is on and `dropout.seq_len` is 0.
    fn dropout_rows(
        x: FloatTensor<Self>,
        dropout: DropoutSpec,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::dropout_rows_primitive::<Self>(x, dropout, rows)
    }

    /// The packed rows of padded ones: `out[t] = x[rows[t]]` (NVIDIA's `unpad_input`). Its
    /// backward is [`PackedRowOps::scatter_rows`] of the gradient, which reads `slots`. The
    /// default is Burn's `select`.
    ///
    /// # Shapes
    /// `x` `[R, N]`, `rows` `[T]` with values in `0..R`, `slots` `[R]` (of the same map) →
    /// `[T, N]`
    ///
    /// # Panics
    /// As Burn's `select`: on NdArray, if a row is outside `0..R`.
    fn gather_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = slots;
        prim(float::<Self, 2>(x).select(0, Tensor::<Self, 1, Int>::from_primitive(rows)))
    }

    /// The padded rows of packed ones, zeros at the padding: `out[p] = x[slots[p]]` where
    /// `slots[p] < T`, else 0 (NVIDIA's `pad_input`). One pass over the output on CubeCL
    /// backends. Its backward is [`PackedRowOps::gather_rows`] of the gradient, which reads
    /// `rows`. The default selects by `slots` from `x` with a zero row appended.
    ///
    /// # Shapes
    /// `x` `[T, N]`, `rows` `[T]`, `slots` `[R]` with values in `0..=T` (of the same map) →
    /// `[R, N]`
    ///
    /// # Panics
    /// If `x` is not `[T, N]` with T the length of `rows` (CubeCL), or a slot is above T (the
    /// default).
    fn scatter_rows(
        x: FloatTensor<Self>,
        rows: IntTensor<Self>,
        slots: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let _ = rows;
        let x = float::<Self, 2>(x);
        let [_, n] = x.dims();
        let zero = Tensor::<Self, 2>::zeros([1, n], (&x.device(), x.dtype()));
        let with_zero = Tensor::cat(vec![x, zero], 0);
        prim(with_zero.select(0, Tensor::<Self, 1, Int>::from_primitive(slots)))
    }

    /// The inverse of a row map: `[R]`, the packed row of each of the R = `padded_rows`
    /// padded rows, T where it is padding (the `slots` of the other ops). `rows` must be
    /// distinct and ascending (as `ember_data::Batch::real_rows` and `Unpadding::from_mask`
    /// give them). CubeCL backends run one kernel (a binary search per padded row, no
    /// read-back); the default reads `rows` back to the host and uploads the map.
    ///
    /// # Shapes
    /// `rows` `[T]` with values in `0..R` → `[R]`
    ///
    /// # Panics
    /// The default, if a row is outside `0..padded_rows`.
    fn slots_of_rows(rows: IntTensor<Self>, padded_rows: usize) -> IntTensor<Self> {
        let rows = Tensor::<Self, 1, Int>::from_primitive(rows);
        let device = rows.device();
        let rows = rows.into_data().convert::<i64>();
        let rows = rows.as_slice::<i64>().expect("i64 rows after convert");
        let tokens = rows.len();
        let mut slots = vec![tokens as i64; padded_rows];
        for (t, &row) in rows.iter().enumerate() {
            let row = usize::try_from(row)
                .ok()
                .filter(|&row| row < padded_rows)
                .unwrap_or_else(|| panic!("slots_of_rows: row {row} outside 0..{padded_rows}"));
            slots[row] = t as i64;
        }
        Tensor::<Self, 1, Int>::from_data(
            burn::tensor::TensorData::new(slots, [padded_rows]),
            &device,
        )
        .into_primitive()
    }
}

/// The inverse map of a row map ([`PackedRowOps::slots_of_rows`]), made on the device where
/// the backend has a kernel for it.
///
/// # Shapes
/// `rows` `[T]` → `[padded_rows]`
///
/// # Panics
/// On backends without the kernel (the host's body), if a row is outside `0..padded_rows`.
pub fn slots_of_rows<B: PackedRowOps>(
    rows: &Tensor<B, 1, Int>,
    padded_rows: usize,
) -> Tensor<B, 1, Int> {
    Tensor::from_primitive(B::slots_of_rows(rows.clone().into_primitive(), padded_rows))
}

/// The packed rows of `x` through [`PackedRowOps::gather_rows`] (its backward under autodiff).
///
/// # Shapes
/// `x` `[R, N]`, `rows` `[T]`, `slots` `[R]` → `[T, N]`
pub fn gather_rows<B: PackedRowOps>(
    x: Tensor<B, 2>,
    rows: Tensor<B, 1, Int>,
    slots: Tensor<B, 1, Int>,
) -> Tensor<B, 2> {
    float(B::gather_rows(
        prim(x),
        rows.into_primitive(),
        slots.into_primitive(),
    ))
}

/// The padded rows of packed `x`, zeros at the padding, through [`PackedRowOps::scatter_rows`]
/// (its backward under autodiff).
///
/// # Shapes
/// `x` `[T, N]`, `rows` `[T]`, `slots` `[R]` → `[R, N]`
pub fn scatter_rows<B: PackedRowOps>(
    x: Tensor<B, 2>,
    rows: Tensor<B, 1, Int>,
    slots: Tensor<B, 1, Int>,
) -> Tensor<B, 2> {
    float(B::scatter_rows(
        prim(x),
        rows.into_primitive(),
        slots.into_primitive(),
    ))
}
