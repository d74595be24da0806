//! The reference bodies of [`FusedOps::concat_columns`] and [`FusedOps::split_columns`]
//! (the packed QKV weight and bias, and their gradients: Note [Packed QKV] in `qkv.rs`).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Slice, TensorMetadata};

use crate::FusedOps;

/// Burn's `cat` along the last dimension.
///
/// # Shapes
/// `xs` `[.., w_t]` (the same leading dimensions) → `[.., Σ w_t]`
///
/// # Panics
/// If `xs` is empty, mixes dtypes or the leading dimensions differ.
pub(crate) fn reference_concat_columns<B: FusedOps>(xs: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    assert!(!xs.is_empty(), "concat_columns of no tensors");
    let last = xs[0].shape().num_dims() - 1;
    B::float_cat(xs, last)
}

/// Burn's `slice` of each part of the last dimension: views (strided where the parts are not
/// the whole rows).
///
/// # Shapes
/// `x` `[.., Σ w_t]` → `[.., w_t]` for each of `widths`
///
/// # Panics
/// If `widths` do not add up to `x`'s last dimension.
pub(crate) fn reference_split_columns<B: FusedOps>(
    x: FloatTensor<B>,
    widths: &[usize],
) -> Vec<FloatTensor<B>> {
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    assert_eq!(
        widths.iter().sum::<usize>(),
        shape[last],
        "split_columns of {} columns into {widths:?}",
        shape[last]
    );
    let mut start = 0;
    widths
        .iter()
        .map(|&width| {
            let mut slices = vec![Slice::from(..); last + 1];
            slices[last] = Slice::new(start as isize, Some((start + width) as isize), 1);
            start += width;
            B::float_slice(x.clone(), &slices)
        })
        .collect()
}
