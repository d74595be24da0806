//! [`BucketOps`] for `CubeBackend`: the bucket flattened by `multi_tensor::flatten`, and its
//! parts as views where Burn's `slice` can view them, else copied together (Note [Unflattened
//! by views] in `bucket_ops.rs`).

use std::ops::Range;

use burn::tensor::Shape;
use burn_cubecl::kernel::{into_contiguous, slice};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::multi_tensor::{self, split_columns_launch, tensors_per_launch};
use super::{empty_like, numel};
use crate::BucketOps;

impl<R, F, I, BT> BucketOps for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn flatten_multi_tensor(xs: Vec<CubeTensor<R>>, scale: f32) -> CubeTensor<R> {
        multi_tensor::flatten(xs, scale)
    }

    fn unflatten_multi_tensor(flat: CubeTensor<R>, parts: &[Range<usize>]) -> Vec<CubeTensor<R>> {
        unflatten(flat, parts)
    }

    /// A buffer of one element allocated on the calling thread's stream (Note [A bucket's
    /// writes, awaited]).
    fn writes_marker(x: &CubeTensor<R>) -> Option<CubeTensor<R>> {
        Some(empty_like(x, Shape::new([1])))
    }

    /// `get_resource` of the marker from this thread (a command that names it: CubeCL aligns
    /// this thread's stream with the marker's), then this thread's `sync`.
    fn await_marker(marker: CubeTensor<R>) -> Result<(), String> {
        let resource = marker
            .client
            .get_resource(marker.handle.clone())
            .map_err(|e| format!("the bucket's marker: {e:?}"))?;
        drop(resource);
        cubecl::future::block_on(marker.client.sync())
            .map_err(|e| format!("the wait for the bucket's writes: {e:?}"))
    }

    /// In place by [`multi_tensor::clip_in_place`] (Note [Clipped in one launch]); a tensor
    /// whose memory is shared (another handle to it is alive), or of another dtype than
    /// `sq_norm`, is multiplied by the composition's coefficient instead, the same bits.
    fn clip_multi_tensor(
        xs: Vec<CubeTensor<R>>,
        sq_norm: CubeTensor<R>,
        max_norm: f32,
    ) -> Vec<CubeTensor<R>> {
        let sq_norm = into_contiguous(sq_norm);
        let xs: Vec<_> = xs.into_iter().map(into_contiguous).collect();
        let (own, shared): (Vec<_>, Vec<_>) = xs
            .iter()
            .map(|x| x.can_mut() && x.dtype == sq_norm.dtype)
            .enumerate()
            .partition(|&(_, own)| own);
        let own: Vec<_> = own.into_iter().map(|(i, _)| xs[i].clone()).collect();
        multi_tensor::clip_in_place(&own, &sq_norm, max_norm);
        drop(own);
        if shared.is_empty() {
            return xs;
        }
        let coefficient = crate::clip_coefficient(
            burn::tensor::Tensor::<Self, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(
                sq_norm,
            )),
            max_norm,
        );
        let mut xs: Vec<Option<CubeTensor<R>>> = xs.into_iter().map(Some).collect();
        for (i, _) in shared {
            let x = xs[i].take().expect("each index once");
            let x = burn::tensor::Tensor::<Self, 1>::from_primitive(
                burn::tensor::TensorPrimitive::Float(x),
            );
            xs[i] = Some((x * coefficient.clone()).into_primitive().tensor());
        }
        xs.into_iter().map(|x| x.expect("every tensor")).collect()
    }
}

/// [`crate::FusedOps::clip_by_own_norm`]: the partial sums of `x²`
/// ([`multi_tensor::sum_squares_partials`]), then, where `x`'s memory is its own, one launch
/// that finishes the squared norm and scales `x` in place ([`multi_tensor::clip_by_partials`],
/// Note [Clipped by its own norm] in `bucket_ops.rs`); else the ordered sum of the partials and
/// [`BucketOps::clip_multi_tensor`]. The same bits either way.
pub(super) fn clip_by_own_norm<R, F, I, BT>(
    x: CubeTensor<R>,
    max_norm: f32,
) -> (CubeTensor<R>, CubeTensor<R>)
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let x = into_contiguous(x);
    let partials = multi_tensor::sum_squares_partials(vec![x.clone()]);
    if x.can_mut() {
        let sq_norm = multi_tensor::clip_by_partials(&x, partials, max_norm);
        return (x, sq_norm);
    }
    let sq_norm = super::sum_rows_ordered(partials);
    let clipped = CubeBackend::<R, F, I, BT>::clip_multi_tensor(vec![x], sq_norm.clone(), max_norm)
        .pop()
        .expect("one tensor in, one out");
    (clipped, sq_norm)
}

/// Whether Burn's `slice` of `r` out of a contiguous flat tensor of `n` elements of `bytes`
/// each is a view: its start and its distance to the end are multiples of `alignment` bytes
/// (the test in `burn_cubecl::kernel::slice`).
pub(super) fn is_view(r: &Range<usize>, n: usize, bytes: usize, alignment: u64) -> bool {
    ((r.start * bytes) as u64).is_multiple_of(alignment)
        && (((n - r.end) * bytes) as u64).is_multiple_of(alignment)
}

/// Runs of adjacent parts (each part starting where the one before it ends), as indices into
/// `parts`, of the parts `copied` picks, each run at most `per_launch` long.
pub(super) fn copy_runs(
    parts: &[Range<usize>],
    copied: impl Fn(&Range<usize>) -> bool,
    per_launch: usize,
) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for (i, r) in parts.iter().enumerate().filter(|(_, r)| copied(r)) {
        match runs.last_mut() {
            Some(run)
                if run.len() < per_launch
                    && parts[*run.last().expect("runs are not empty")].end == r.start =>
            {
                run.push(i)
            }
            _ => runs.push(vec![i]),
        }
    }
    runs
}

/// [`BucketOps::unflatten_multi_tensor`]: views for the parts `slice` views, one launch of
/// the column split ([`split_columns_launch`]) per run of adjacent other parts.
///
/// # Panics
/// If a part ends past `flat`'s length, or starts after its end.
fn unflatten<R: CubeRuntime>(flat: CubeTensor<R>, parts: &[Range<usize>]) -> Vec<CubeTensor<R>> {
    let flat = into_contiguous(flat);
    let n = numel(&flat);
    for r in parts {
        assert!(
            r.start <= r.end && r.end <= n,
            "unflatten_multi_tensor: part {r:?} of a bucket of {n} elements"
        );
    }
    let bytes = flat.dtype.size();
    let alignment = flat.client.properties().memory.alignment;
    // An empty part (a parameter of no elements) is an empty tensor, copied by no launch.
    let copied = |r: &Range<usize>| !r.is_empty() && !is_view(r, n, bytes, alignment);
    let mut out: Vec<Option<CubeTensor<R>>> = parts
        .iter()
        .map(|r| match r.is_empty() {
            true => Some(empty_like(&flat, Shape::new([0]))),
            false => (!copied(r)).then(|| slice(flat.clone(), std::slice::from_ref(r))),
        })
        .collect();
    let per_launch = tensors_per_launch(&flat, 1, 1);
    for run in copy_runs(parts, copied, per_launch) {
        let outputs: Vec<_> = run
            .iter()
            .map(|&i| empty_like(&flat, Shape::new([parts[i].len()])))
            .collect();
        // One row of `n` columns: part t is columns `first + Σ_{s<t} len_s ..`.
        split_columns_launch(&flat, &outputs, n, parts[run[0]].start);
        for (&i, o) in run.iter().zip(outputs) {
            out[i] = Some(o);
        }
    }
    out.into_iter()
        .map(|t| t.expect("every part is a view or a copy"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CUDA's 512-byte alignment, f32: 128 elements.
    const CUDA: u64 = 512;

    #[test]
    fn a_part_is_a_view_where_both_its_ends_are_aligned() {
        assert!(is_view(&(0..128), 256, 4, CUDA));
        assert!(is_view(&(128..256), 256, 4, CUDA));
        assert!(is_view(&(0..256), 256, 4, CUDA));
        // Aligned start, misaligned distance to the end (and the reverse).
        assert!(!is_view(&(0..128), 258, 4, CUDA));
        assert!(!is_view(&(2..130), 130, 4, CUDA));
        // bf16: 256 elements make 512 bytes.
        assert!(is_view(&(256..512), 512, 2, CUDA));
        assert!(!is_view(&(128..512), 512, 2, CUDA));
    }

    #[test]
    fn adjacent_copied_parts_share_a_launch_up_to_its_limit() {
        // BERT's NSP bias (2) first: every part after it is off the alignment.
        let parts = [
            0..2,
            2..2050,
            2050..2178,
            4096..4100,
            4100..4104,
            4104..4108,
        ];
        let all = copy_runs(&parts, |_| true, 32);
        // The gap between 2178 and 4096 breaks the run.
        assert_eq!(all, vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(
            copy_runs(&parts, |_| true, 2),
            vec![vec![0, 1], vec![2], vec![3, 4], vec![5]]
        );
        // A viewed part in between breaks the run too.
        assert_eq!(
            copy_runs(&parts, |r| r.start != 2, 32),
            vec![vec![0], vec![2], vec![3, 4, 5]]
        );
        assert!(copy_runs(&parts, |_| false, 32).is_empty());
    }
}
