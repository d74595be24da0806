//! Note [Packed QKV]: the self-attention's three projections as one dense layer.
//!
//! Hugging Face's `BertSelfAttention` runs `query`, `key` and `value` as three dense layers of
//! the same input. NVIDIA's and Samsung's MLPerf BERT (`fused QKV`, ../shared/REFERENCES.md)
//! run one, with the three weights side by side (`[H, 3·H]`, columns Q | K | V) and the three
//! biases likewise, and apex's fused attention (`fmha`) takes its output packed. Per encoder
//! layer that turns three forward GEMMs into one, the six backward products (`dx`, `dW` of
//! each) into two, three bias adds and three bias-gradient sums into one each, and the two
//! additions that summed the three `dx` away. The attention op reads the packed output as
//! three head-strided views ([`split_heads`]: no copy; the op makes each contiguous as it did
//! Q, K and V apart) and writes its gradient packed ([`FusedOps::merge_qkv_heads`]: dQ, dK and
//! dV into one `[B, S, 3·H]` tensor, what the three head merges of the separate path wrote).
//!
//! ember keeps Hugging Face's parameters (`query`, `key`, `value`: checkpoints, names and
//! weight decay are Hugging Face's) and packs them at each forward (`ember_model`'s
//! `BertSelfAttention::packed_qkv`, or the layer's cast scope under autodiff in a half
//! precision: [`FusedOps::concat_columns`]), whose backward hands each
//! weight its slice of the packed gradient ([`FusedOps::split_columns`]). Where ember differs
//! from NVIDIA's recipe, which stores the packed weight: the copy per forward (3·H² values
//! per layer, one launch for all three weights and one for the biases on CubeCL; a half
//! precision casts the two concatenations with the layer's other parameters, Note [Packed QKV
//! cast once] in `ember_model`'s `weight_casts.rs`) keeps every checkpoint and user of the
//! module on Hugging Face's layout.
//!
//! Measured (2026-12-05, 2-core Xeon): on lavapipe 54 → 44 kernel launches per encoder layer
//! (`bench step --device wgpu`); on NdArray the packed step took 1.04–1.08× the CPU time of
//! the separate one (BERT-base, batch 8 × 128), so `model.qkv_projections = "auto"`
//! ([`crate::QkvProjections`]) packs on the CubeCL backends only.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Slice, TensorMetadata};
use burn_ndarray::NdArrayTensor;
use ndarray::{ArrayView4, Axis, Ix4, s};
use rayon::prelude::*;

use crate::FusedOps;

/// Q, K and V of `qkv` as `[B, nh, S, hd]` views (head-strided; no copy on NdArray and
/// CubeCL).
///
/// # Shapes
/// `qkv` `[B, S, 3·nh·hd]` (contiguous), `heads` nh → three `[B, nh, S, hd]`
///
/// # Panics
/// If `qkv` is not of rank 3 or its last dimension is not a multiple of `3 · heads`.
pub(crate) fn split_heads<B: FusedOps>(qkv: FloatTensor<B>, heads: usize) -> [FloatTensor<B>; 3] {
    let [batch, seq_len, head_dim] = packed_dims(&qkv.shape(), heads);
    // [B, S, 3·nh, hd] → [B, 3·nh, S, hd]: Q's heads first, then K's, then V's.
    let heads_first = B::float_swap_dims(
        B::reshape_contiguous(qkv, Shape::new([batch, seq_len, 3 * heads, head_dim])),
        1,
        2,
    );
    [0, 1, 2].map(|part| {
        let start = (part * heads) as isize;
        let slices = [
            Slice::from(..),
            Slice::new(start, Some(start + heads as isize), 1),
            Slice::from(..),
            Slice::from(..),
        ];
        B::float_slice(heads_first.clone(), &slices)
    })
}

/// `[B, S, hd]` of a packed `[B, S, 3·nh·hd]` shape with `heads` nh.
///
/// # Panics
/// If `shape` is not of rank 3 or its width not a multiple of `3 · heads`.
pub(crate) fn packed_dims(shape: &Shape, heads: usize) -> [usize; 3] {
    assert_eq!(
        shape.num_dims(),
        3,
        "packed QKV of shape {shape:?}: not [B, S, 3·H]"
    );
    let [batch, seq_len, width] = [shape[0], shape[1], shape[2]];
    assert!(
        heads > 0 && width.is_multiple_of(3 * heads),
        "packed QKV of width {width}: not a multiple of 3 × {heads} heads"
    );
    [batch, seq_len, width / (3 * heads)]
}

/// The default body of [`FusedOps::merge_qkv_heads`]: each part's heads merged
/// (`[B, S, nh, hd]` views) and concatenated, `[B, S, 3·nh, hd]`, then viewed as
/// `[B, S, 3·nh·hd]`.
pub(crate) fn reference_merge_heads<B: FusedOps>(parts: [FloatTensor<B>; 3]) -> FloatTensor<B> {
    let shape = parts[0].shape();
    let [batch, heads, seq_len, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
    let merged = parts
        .into_iter()
        .map(|x| B::float_swap_dims(x, 1, 2))
        .collect();
    B::reshape_contiguous(
        B::float_cat(merged, 2),
        Shape::new([batch, seq_len, 3 * heads * head_dim]),
    )
}

/// NdArray's [`FusedOps::merge_qkv_heads`]: one pass writing each row `[b, s]` of the output
/// from the three parts' `[b, ·, s, ·]` lanes, rows split over rayon's threads. `None` for
/// dtypes other than f32 or parts of different shapes (the caller falls back to the
/// reference).
pub(crate) fn ndarray_merge_heads(parts: &[NdArrayTensor; 3]) -> Option<NdArrayTensor> {
    let views: Vec<ArrayView4<'_, f32>> = parts
        .iter()
        .map(|part| match part {
            NdArrayTensor::F32(storage) => storage.view().into_dimensionality::<Ix4>().ok(),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let dims = views[0].dim();
    if views.iter().any(|v| v.dim() != dims) {
        return None;
    }
    let (batch, heads, seq_len, head_dim) = dims;
    let row = 3 * heads * head_dim;
    let mut out = vec![0.0f32; batch * seq_len * row];
    out.par_chunks_mut(row.max(1))
        .enumerate()
        .for_each(|(index, out_row)| {
            let (b, position) = (index / seq_len, index % seq_len);
            let mut lanes = out_row.chunks_exact_mut(head_dim.max(1));
            for view in &views {
                let rows = view.index_axis(Axis(0), b); // [nh, S, hd]
                for head in 0..heads {
                    let lane = rows.slice(s![head, position, ..]);
                    let out = lanes.next().expect("one output lane per part and head");
                    match lane.as_slice() {
                        Some(values) => out.copy_from_slice(values),
                        None => out.iter_mut().zip(lane.iter()).for_each(|(o, &v)| *o = v),
                    }
                }
            }
        });
    let array = ndarray::Array::from_shape_vec(ndarray::IxDyn(&[batch, seq_len, row]), out)
        .expect("the output has B·S·3·nh·hd values");
    Some(NdArrayTensor::from(array.into_shared()))
}

/// NdArray's [`FusedOps::concat_columns`]: each output row written from the parts' rows,
/// rows split over rayon's threads (Burn 0.21 NdArray's `cat` concatenates on one thread and
/// then copies the result again to row-major order). `None` for dtypes other than f32 or
/// parts whose leading dimensions differ (the caller falls back to the reference).
pub(crate) fn ndarray_concat_columns(xs: &[NdArrayTensor]) -> Option<NdArrayTensor> {
    let views: Vec<ndarray::ArrayViewD<'_, f32>> = xs
        .iter()
        .map(|x| match x {
            NdArrayTensor::F32(storage) => Some(storage.view()),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let lead = &views.first()?.shape()[..views[0].ndim().checked_sub(1)?];
    if views
        .iter()
        .any(|v| v.ndim() != lead.len() + 1 || &v.shape()[..lead.len()] != lead)
    {
        return None;
    }
    let rows: usize = lead.iter().product();
    let widths: Vec<usize> = views.iter().map(|v| v.shape()[lead.len()]).collect();
    let total: usize = widths.iter().sum();
    let matrices: Vec<_> = views
        .iter()
        .zip(&widths)
        .map(|(v, &w)| {
            crate::linear::standard_layout(v.view())
                .into_shape_with_order((rows, w))
                .expect("a standard-layout array reshapes to [rows, width]")
        })
        .collect();
    let mut out = vec![0.0f32; rows * total];
    out.par_chunks_mut(total.max(1))
        .enumerate()
        .for_each(|(row, out_row)| {
            let mut at = 0;
            for (matrix, &width) in matrices.iter().zip(&widths) {
                let source = matrix.row(row);
                let source = source.as_slice().expect("rows of a standard-layout matrix");
                out_row[at..at + width].copy_from_slice(source);
                at += width;
            }
        });
    let mut shape = lead.to_vec();
    shape.push(total);
    let array = ndarray::Array::from_shape_vec(ndarray::IxDyn(&shape), out)
        .expect("the output has rows · total values");
    Some(NdArrayTensor::from(array.into_shared()))
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    use crate::FusedOps;

    type B = NdArray;

    fn prim<const D: usize>(x: Tensor<B, D>) -> burn::tensor::ops::FloatTensor<B> {
        x.into_primitive().tensor()
    }

    fn tensor<const D: usize>(x: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
        Tensor::from_primitive(TensorPrimitive::Float(x))
    }

    /// The packed layout against its definition: Q is columns `0..H` of `qkv`, K `H..2H`, V
    /// `2H..3H`, head h of each its columns `h·hd..(h+1)·hd`; the merge is the split's
    /// inverse, in NdArray's host pass and in the reference composition (bit for bit: both
    /// only move values). Odd sizes (2 samples, 3 positions, 2 heads of 5 columns).
    #[test]
    fn split_and_merge_follow_the_packed_layout() {
        let device = Default::default();
        let (batch, seq_len, heads, head_dim) = (2, 3, 2, 5);
        let hidden = heads * head_dim;
        let qkv = Tensor::<B, 3>::random(
            [batch, seq_len, 3 * hidden],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let parts = super::split_heads::<B>(prim(qkv.clone()), heads);
        for (part, split) in parts.iter().enumerate() {
            let split: Tensor<B, 4> = tensor(split.clone());
            assert_eq!(split.dims(), [batch, heads, seq_len, head_dim]);
            let expected = qkv
                .clone()
                .slice([0..batch, 0..seq_len, part * hidden..(part + 1) * hidden])
                .reshape([batch, seq_len, heads, head_dim])
                .swap_dims(1, 2);
            assert_eq!(
                split.into_data().to_vec::<f32>().unwrap(),
                expected.into_data().to_vec::<f32>().unwrap(),
                "part {part}"
            );
        }
        // Contiguous parts, as the attention's products return them, and the head-strided
        // views themselves (the host pass's element-wise lanes).
        let contiguous = parts.clone().map(|p| {
            let p: Tensor<B, 4> = tensor(p);
            prim(Tensor::<B, 4>::from_data(p.into_data(), &device))
        });
        let original = qkv.into_data().to_vec::<f32>().unwrap();
        for parts in [contiguous, parts] {
            let host = <B as FusedOps>::merge_qkv_heads(parts.clone());
            let reference = super::reference_merge_heads::<B>(parts);
            for merged in [host, reference] {
                let merged: Tensor<B, 3> = tensor(merged);
                assert_eq!(merged.dims(), [batch, seq_len, 3 * hidden]);
                assert_eq!(merged.into_data().to_vec::<f32>().unwrap(), original);
            }
        }
    }
}
