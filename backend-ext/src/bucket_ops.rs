//! The [`BucketOps`] trait: the flat gradient buckets of data parallelism, made of many
//! tensors ([`BucketOps::flatten_multi_tensor`]), clipped by a norm on the device
//! ([`BucketOps::clip_multi_tensor`]) and taken apart again
//! ([`BucketOps::unflatten_multi_tensor`]).
//!
//! Note [Clipped in one launch]: clipping a bucket by its squared norm `s` (a `[1]` tensor on
//! the device, never read by the host) was Burn's composition of the coefficient
//! `min(1, max_norm / (√s + 1e-6))` (`sqrt`, `add`, `recip`, `mul`, and `clamp_max` as a
//! comparison and a masked fill: six launches of one element each) and a multiplication of the
//! bucket: seven launches per bucket in `bucket` mode, where each bucket is clipped by its own
//! norm (a BERT-large step has about 55 buckets of 25 MB), and the coefficient plus one
//! multiplication per bucket in `global` mode. The CubeCL kernel computes the coefficient in
//! every unit from `s` (the same f32 operations in the same order, `clamp_max`'s NaN included,
//! so the same bits) and scales up to 32 buckets in one launch, in place where the bucket's
//! memory is its own, as PyTorch's `clip_grad_norm_` scales all gradients
//! with one `_foreach_mul_` by the clamped coefficient (apex's `multi_tensor_scale`).
//!
//! Note [Clipped by its own norm]: in `bucket` mode each bucket is clipped by its own norm
//! as soon as it is complete (Samsung's bucket-wise clipping, before its allreduce): its
//! squared norm took two launches (partial sums of `x²` per cube, then their sum in a fixed
//! order) and the clip a third. [`FusedOps::clip_by_own_norm`](crate::FusedOps::clip_by_own_norm) on CubeCL backends leaves the
//! sum to the clip's launch: each of its cubes adds the partial sums (at most 1,024) in the
//! order of the sum's own kernel, so every unit holds the same squared norm, the same bits,
//! and cube 0 writes it out for the logged gradient norm. Two launches per bucket instead of
//! three (a BERT-large step has about 55 buckets at the default 25 MiB cap). Each cube also
//! reads the partials (at most 4 KB, from cache) where it scales at least 256 of the
//! bucket's elements (about 6,400 of a 25 MiB bucket's).
//! Where the bucket's memory is shared, the sum and [`BucketOps::clip_multi_tensor`] take
//! their own launches.
//!
//! Note [A bucket's writes, awaited]: a bucket is written on the compute thread's CubeCL
//! stream and reduced by the communication thread, whose commands run on a stream of its own
//! (CubeCL 0.10 gives each thread one). On CUDA, CubeCL orders a stream after another only
//! for memory allocated since the two last met (wgpu's runtime submits every stream a command
//! names first, and runs them in one queue): a command names the buffer, and the stream
//! waits for the buffer's stream if their last meeting is older than the buffer's allocation
//! (`cubecl-runtime`'s `MultiStream::update_shared_bindings`: the slice's cursor is set when
//! it is bound, never by later writes). Writes into a buffer in place after its allocation
//! are not seen: the gradients of later micro-batches added into the first one's bucket, the
//! bucket-wise clip, each bucket's writes once the communication thread met the compute
//! stream for an earlier bucket. NCCL (or the in-process ranks' sum) could then read a bucket
//! before those kernels ran, and average partial gradients; on one rank nothing shows, since
//! an allreduce of one leaves the bucket as it is. So the communication thread first waits
//! for the bucket's writes on the host: the compute thread makes a one-element marker after
//! the bucket's last write ([`BucketOps::writes_marker`]), whose allocation is newer than
//! every write, and hands it over with the bucket; the communication thread names the marker
//! in a command of its own stream, which CubeCL then makes wait for the compute stream, and
//! waits for its own stream ([`BucketOps::await_marker`]). The compute thread never waits,
//! and NCCL starts once the device has run what the compute thread had enqueued by then, as
//! the alignment would have made it. The wait is on the host, not only the stream's, so that
//! another thread's stream may read the bucket too (the in-process ranks' sum).
//!
//! Note [Unflattened by views]: after the allreduce, each parameter's averaged gradient is a
//! part of its bucket, and the optimizer reads it as a tensor of its own. On Burn's CubeCL
//! backends a slice is a view of the bucket's memory only where its start and its distance to
//! the end are multiples of the device's memory alignment (`burn_cubecl::kernel::slice`; 512
//! bytes on CUDA); every other slice launches a copy kernel of its own. One odd-sized
//! parameter shifts the rest of its bucket off the alignment: BERT's MLM output bias (30,522
//! values) and NSP bias (2) misalign every part of the buckets that hold them. So
//! [`BucketOps::unflatten_multi_tensor`] gives the aligned parts as views, as `slice` does, and
//! copies the misaligned ones together, up to 32 per launch: the same values, one launch per
//! run of up to 32 adjacent misaligned parts instead of one per part. PyTorch's
//! `_unflatten_dense_tensors` (what apex's DDP uses) returns views of the flat buffer; DDP's
//! `gradient_as_bucket_view` makes every gradient such a view. A PyTorch tensor views its
//! storage at any element offset (`storage_offset`); a CubeCL tensor's view is a sub-range of
//! a memory binding, which must start on the device's alignment. Padding each part to the alignment, as the other way, would change
//! the bucket's bytes that the 1-bit compressors and the host buckets read.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorMetadata};

use crate::{float, prim};

/// The clip coefficient `min(1, max_norm / (√sq_norm + 1e-6))` of a squared norm, on the
/// device (no host read), by Burn's ops: PyTorch's `clip_grad_norm_` (`max_norm / (total_norm +
/// 1e-6)`, clamped to 1). The trainer's `clip_coefficient_device` and the default body of
/// [`BucketOps::clip_multi_tensor`].
///
/// # Shapes
/// `sq_norm` `[1]` → `[1]`
pub fn clip_coefficient<B: Backend>(sq_norm: Tensor<B, 1>, max_norm: f32) -> Tensor<B, 1> {
    sq_norm
        .sqrt()
        .add_scalar(1e-6)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0)
}

/// The ops of flat gradient buckets (Note [Bucket storage] in ember-trainer's
/// `parallel/buckets.rs`); part of [`crate::FusedOps`], whose supertrait it is. The default
/// bodies are Burn's `cat` and `slice`; CubeCL backends override both.
pub trait BucketOps: Backend {
    /// Many tensors flattened into one, back to back: `[Σ n_i]`, tensor i's elements (in
    /// row-major order) from `Σ_{j<i} n_j` on. What a gradient bucket is made of (PyTorch
    /// DDP's flat buckets, apex's `multi_tensor_scale` copying gradients into them). The
    /// default body is Burn's `cat` of the flattened tensors; CubeCL backends copy up to 32
    /// tensors per launch instead of one per tensor. Each element is multiplied by `scale`
    /// unless it is 1 (the division by the loss scale, Note [Unscaled per bucket] in
    /// ember-trainer's `parallel/buckets.rs`): Burn's `mul_scalar` of the flat tensor, the
    /// same bits, in the same launch on CubeCL (apex's `multi_tensor_scale`).
    ///
    /// # Shapes
    /// `xs` (not empty, one dtype), any shapes → `[Σ numel(x_i)]`
    ///
    /// # Panics
    /// If `xs` is empty or mixes dtypes.
    fn flatten_multi_tensor(xs: Vec<FloatTensor<Self>>, scale: f32) -> FloatTensor<Self> {
        assert!(!xs.is_empty(), "flatten_multi_tensor of no tensors");
        let flat = xs
            .into_iter()
            .map(|x| {
                let n = x.shape().num_elements();
                float::<Self, 1>(Self::float_reshape(x, Shape::new([n])))
            })
            .collect();
        let flat = Tensor::cat(flat, 0);
        prim(if scale == 1.0 {
            flat
        } else {
            flat.mul_scalar(scale)
        })
    }

    /// Each of `xs` times the clip coefficient of the squared norm `sq_norm`,
    /// `min(1, max_norm / (√sq_norm + 1e-6))` ([`clip_coefficient`]), read on the device:
    /// gradient clipping by a norm (PyTorch's `clip_grad_norm_`), of one bucket (`bucket`
    /// mode) or of all (`global`). The default body is [`clip_coefficient`] and a
    /// multiplication per tensor; CubeCL backends scale up to 32 tensors per launch with the
    /// coefficient computed in the kernel, the same bits (Note [Clipped in one launch]).
    ///
    /// # Shapes
    /// `xs` flat `[n_i]` (one dtype), `sq_norm` `[1]` → `[n_i]` each
    fn clip_multi_tensor(
        xs: Vec<FloatTensor<Self>>,
        sq_norm: FloatTensor<Self>,
        max_norm: f32,
    ) -> Vec<FloatTensor<Self>> {
        let coefficient = clip_coefficient(float::<Self, 1>(sq_norm), max_norm);
        xs.into_iter()
            .map(|x| prim(float::<Self, 1>(x) * coefficient.clone()))
            .collect()
    }

    /// A marker of the kernels enqueued so far by the calling thread, to hand to another
    /// thread with a tensor they wrote (Note [A bucket's writes, awaited]): on CubeCL backends
    /// a buffer of one element of `x`'s dtype allocated now on the calling thread's stream;
    /// `None` on a backend that computes as it is called (the default, as NdArray).
    fn writes_marker(x: &FloatTensor<Self>) -> Option<FloatTensor<Self>> {
        let _ = x;
        None
    }

    /// Blocks the calling thread until the device has run every kernel that `marker`
    /// ([`BucketOps::writes_marker`], made on another thread) marks, and on CubeCL backends
    /// whatever else that thread had enqueued when this call names it: on CubeCL backends a
    /// command of this thread naming the marker, which makes this thread's stream wait for the
    /// marker's stream from the marker's allocation on, then a wait for this thread's stream.
    /// The default does nothing.
    ///
    /// # Errors
    /// The device's error, as text.
    fn await_marker(marker: FloatTensor<Self>) -> Result<(), String> {
        let _ = marker;
        Ok(())
    }

    /// The parts `flat[r]` for each range `r` of `parts`, as flat tensors: each parameter's
    /// gradient out of its bucket (PyTorch's `_unflatten_dense_tensors`). The default body is
    /// Burn's `slice` of each part (views on NdArray); CubeCL backends give the parts that
    /// `slice` can view as views and copy the others, up to 32 adjacent parts per launch
    /// (Note [Unflattened by views]). The values are the same bits either way.
    ///
    /// # Shapes
    /// `flat` `[n]`, `parts` ranges within `0..n` (any order; may leave gaps; may be empty)
    /// → `[r.len()]` each
    ///
    /// # Panics
    /// If a range ends past `n` or starts after its end.
    fn unflatten_multi_tensor(
        flat: FloatTensor<Self>,
        parts: &[Range<usize>],
    ) -> Vec<FloatTensor<Self>> {
        let flat = float::<Self, 1>(flat);
        parts
            .iter()
            .map(|r| prim(flat.clone().slice([r.clone()])))
            .collect()
    }
}
