//! Where the reducer keeps its buckets, and the few operations it does on them.
//!
//! Note [Bucket storage]: a bucket is one flat f32 buffer holding the gradients of its
//! parameters back to back ([`super::plan::Bucket`]). On a GPU it must stay on the device: the
//! first version of the reducer read every gradient to host memory as its hook delivered it,
//! which is a device synchronisation per layer inside backward (the GPU drains its queue and
//! idles while the host copies) and leaves nothing for the allreduce to overlap. So:
//!
//! - **device buckets** ([`BucketStorage::Device`]): the hook hands over the gradient tensors
//!   (handles, no copy); a complete bucket is concatenated on the device, its norm and clip
//!   coefficient are computed there ([`FusedOps::sum_squares_multi_tensor`],
//!   [`super::clip::clip_coefficient_device`]), the allreduce runs on the device buffer (NCCL in
//!   place; the in-process hub by Burn ops), and each parameter's averaged gradient is a part
//!   of the bucket (a view where the device allows, Note [Unflattened by views] in
//!   ember-backend-ext). Nothing reads device memory to the host until the step logs.
//! - **host buckets** ([`BucketStorage::Host`]): gradients are copied into a `Vec<f32>` as they
//!   arrive and reduced by a host collective (in-process, MPI). This is the CPU's case, where
//!   the device *is* the host (NdArray: the copy is a memcpy, and MPI needs host memory), and
//!   the reference the device path is tested against.
//!
//! [`BucketStorage::Auto`] picks device buckets when the communicator reduces device buffers
//! (NCCL, in-process ranks on a GPU backend), host buckets otherwise.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{ElementConversion, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};
use ember_backend_ext::FusedOps;
use serde::{Deserialize, Serialize};

use super::clip::clip_coefficient;

/// Where the reducer keeps gradient buckets (`parallel.buckets`; Note [Bucket storage]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BucketStorage {
    /// Device buckets when the communicator reduces device buffers, else host buckets.
    #[default]
    Auto,
    /// Host memory (`Vec<f32>`), reduced by host collectives.
    Host,
    /// The device of the rank's backend, reduced by device collectives.
    Device,
}

impl BucketStorage {
    /// Whether buckets live on the device, given whether the communicator has device
    /// collectives.
    ///
    /// # Errors
    /// A message for `parallel.buckets` when `Device` is asked of a host-only communicator.
    pub fn on_device(self, device_collectives: bool) -> Result<bool, String> {
        match self {
            BucketStorage::Auto => Ok(device_collectives),
            BucketStorage::Host => Ok(false),
            BucketStorage::Device if device_collectives => Ok(true),
            BucketStorage::Device => Err("device buckets need device collectives (NCCL, or \
                 in-process ranks), but this run's communicator reduces host buffers only"
                .into()),
        }
    }
}

impl std::fmt::Display for BucketStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BucketStorage::Auto => "auto",
            BucketStorage::Host => "host",
            BucketStorage::Device => "device",
        })
    }
}

impl std::str::FromStr for BucketStorage {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BucketStorage::Auto),
            "host" => Ok(BucketStorage::Host),
            "device" => Ok(BucketStorage::Device),
            other => Err(format!(
                "unknown bucket storage {other:?} (expected auto, host or device)"
            )),
        }
    }
}

/// A number the reducer computes: on the host (host buckets) or as a `[1]` tensor on the
/// device (device buckets), read only when someone asks for its value.
#[derive(Debug, Clone)]
pub enum Scalar<B: Backend> {
    /// On the host.
    Host(f64),
    /// On the device, `[1]`.
    Device(Tensor<B, 1>),
}

impl<B: Backend> Scalar<B> {
    /// The value; for [`Scalar::Device`] a read of the device (a host synchronisation).
    pub fn value(&self) -> f64 {
        match self {
            Scalar::Host(x) => *x,
            Scalar::Device(t) => t.clone().into_scalar().elem::<f64>(),
        }
    }

    /// The square root.
    pub(crate) fn sqrt(self) -> Self {
        match self {
            Scalar::Host(x) => Scalar::Host(x.sqrt()),
            Scalar::Device(t) => Scalar::Device(t.sqrt()),
        }
    }

    /// The sum of `values`, all of one kind, in a fixed order (Note [Ranks stay one model]). A
    /// device value may hold several numbers (`[n]`, in order), all of which are summed.
    pub(crate) fn sum(values: Vec<Self>) -> Self
    where
        B: FusedOps,
    {
        let mut host = 0.0;
        let mut device = Vec::new();
        for v in values {
            match v {
                Scalar::Host(x) => host += x,
                Scalar::Device(t) => device.push(t),
            }
        }
        let all = match device.len() {
            0 => return Scalar::Host(host),
            1 => device.pop().expect("one value"),
            // One launch per 32 values on CubeCL (Burn's `cat` launched one per value).
            _ => ember_backend_ext::concat_columns(device),
        };
        if all.dims()[0] == 1 {
            // Σ of one number is itself.
            Scalar::Device(all)
        } else {
            Scalar::Device(ember_backend_ext::sum_ordered(all))
        }
    }
}

/// A bucket's flat buffer, `[numel]` f32.
#[derive(Debug, Clone)]
pub enum Buffer<B: Backend> {
    /// Host memory.
    Host(Vec<f32>),
    /// A tensor on the device.
    Device(Tensor<B, 1>),
}

impl<B: FusedOps> Buffer<B> {
    /// Number of f32 elements.
    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(values) => values.len(),
            Buffer::Device(tensor) => tensor.dims()[0],
        }
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The gradients of a bucket's parameters, in bucket order, as one flat buffer, each
    /// element times `inv_loss_scale`: on the device by
    /// [`BucketOps::flatten_multi_tensor`](ember_backend_ext::BucketOps::flatten_multi_tensor)
    /// (a launch per 32 gradients on CubeCL backends, where a `cat` launched one per
    /// gradient, the division by the loss scale in the same launch), or on the host (each
    /// gradient read from the device: the host path's cost, Note [Bucket storage]).
    ///
    /// Note [Unscaled per bucket]: the gradients of a scaled loss are divided by the scale
    /// as their bucket is flattened, not one by one as they arrive: the same f32 product of
    /// each element (bit for bit), no launch of its own on CubeCL backends (one per bucket
    /// before, and one per parameter before that: 16 per BERT encoder layer), as apex's `amp`
    /// unscales with one `multi_tensor_scale` over all gradients and PyTorch's
    /// `GradScaler.unscale_` with one `_amp_foreach_non_finite_check_and_unscale_` per device
    /// and dtype.
    pub(crate) fn flatten(
        on_device: bool,
        grads: Vec<FloatTensor<B>>,
        inv_loss_scale: f32,
    ) -> Self {
        if on_device {
            return Buffer::Device(Tensor::from_primitive(TensorPrimitive::Float(
                B::flatten_multi_tensor(grads, inv_loss_scale),
            )));
        }
        // One allocation for the bucket (no regrowth copies). The reshape stays Burn's, whose
        // copy on NdArray is a fresh array that `into_data` then moves out: a gradient handed
        // over here is still shared, and a shared array's `into_data` (through the view of
        // `reshape_contiguous`) reads element by element, which made a tiny 2-rank step 5%
        // slower (2026-12-07).
        let total = grads.iter().map(|g| g.shape().num_elements()).sum();
        let mut values = Vec::with_capacity(total);
        for g in grads {
            let n = g.shape().num_elements();
            let g = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(
                g,
                Shape::new([n]),
            )));
            let data = g.into_data().convert::<f32>();
            values.extend_from_slice(data.as_slice::<f32>().expect("f32 after convert"));
        }
        if inv_loss_scale != 1.0 {
            values.iter_mut().for_each(|x| *x *= inv_loss_scale);
        }
        Buffer::Host(values)
    }

    /// `self + other`, element-wise (gradient accumulation over micro-batches).
    pub(crate) fn add(self, other: Self) -> Self {
        match (self, other) {
            (Buffer::Host(mut a), Buffer::Host(b)) => {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                Buffer::Host(a)
            }
            (Buffer::Device(a), Buffer::Device(b)) => Buffer::Device(a + b),
            _ => unreachable!("one reducer keeps its buckets in one place"),
        }
    }

    /// The squared L2 norm, `Σ x²` (the multi-tensor norm kernel on CubeCL backends).
    pub(crate) fn sq_norm(&self) -> Scalar<B> {
        match self {
            Buffer::Host(values) => Scalar::Host(ember_backend_ext::host_norm::sum_squares(values)),
            Buffer::Device(t) => {
                let sums = B::sum_squares_multi_tensor(vec![t.clone().into_primitive().tensor()]);
                Scalar::Device(Tensor::from_primitive(TensorPrimitive::Float(sums)))
            }
        }
    }

    /// `self` clipped by the squared norm `sq`: times `min(1, max_norm / (√sq + 1e-6))` (Note
    /// [Clip coefficient]). On the device one launch of
    /// [`BucketOps::clip_multi_tensor`](ember_backend_ext::BucketOps::clip_multi_tensor),
    /// in place where Burn can (a reduced bucket is this rank's own buffer, under NCCL and the
    /// in-process hub alike: Note [CubeCL streams and in-place writes]).
    pub(crate) fn clip(self, sq: &Scalar<B>, max_norm: f64) -> Self {
        Self::clip_all(vec![self], sq, max_norm)
            .pop()
            .expect("one buffer in, one out")
    }

    /// `self` clipped by its own squared norm (`bucket` mode: Note [Clip coefficient]), and that
    /// squared norm (what [`Buffer::sq_norm`] gives). On the device
    /// [`FusedOps::clip_by_own_norm`]: two
    /// launches on CubeCL backends, the norm finished inside the clip's (Note [Clipped by its
    /// own norm] in ember-backend-ext's `bucket_ops.rs`).
    pub(crate) fn clip_by_own_norm(self, max_norm: f64) -> (Self, Scalar<B>) {
        match self {
            Buffer::Device(t) if max_norm > 0.0 => {
                let (clipped, sq) =
                    B::clip_by_own_norm(t.into_primitive().tensor(), max_norm as f32);
                (
                    Buffer::Device(Tensor::from_primitive(TensorPrimitive::Float(clipped))),
                    Scalar::Device(Tensor::from_primitive(TensorPrimitive::Float(sq))),
                )
            }
            buffer => {
                let sq = buffer.sq_norm();
                (buffer.clip(&sq, max_norm), sq)
            }
        }
    }

    /// Every buffer of `buffers` clipped by the one squared norm `sq` ([`Buffer::clip`]): on
    /// the device, up to 32 buffers per launch (Note [Clipped in one launch] in
    /// ember-backend-ext's `bucket_ops.rs`).
    pub(crate) fn clip_all(buffers: Vec<Self>, sq: &Scalar<B>, max_norm: f64) -> Vec<Self> {
        if max_norm <= 0.0 {
            return buffers;
        }
        match sq {
            Scalar::Host(sq) => {
                let c = clip_coefficient(sq.sqrt(), max_norm);
                buffers
                    .into_iter()
                    .map(|b| match b {
                        Buffer::Host(mut values) => {
                            if c != 1.0 {
                                let c = c as f32;
                                values.iter_mut().for_each(|x| *x *= c);
                            }
                            Buffer::Host(values)
                        }
                        Buffer::Device(_) => {
                            unreachable!("one reducer keeps its numbers in one place")
                        }
                    })
                    .collect()
            }
            Scalar::Device(sq) => {
                let tensors = buffers
                    .into_iter()
                    .map(|b| match b {
                        Buffer::Device(t) => t.into_primitive().tensor(),
                        Buffer::Host(_) => {
                            unreachable!("one reducer keeps its numbers in one place")
                        }
                    })
                    .collect();
                let sq = sq.clone().into_primitive().tensor();
                B::clip_multi_tensor(tensors, sq, max_norm as f32)
                    .into_iter()
                    .map(|t| Buffer::Device(Tensor::from_primitive(TensorPrimitive::Float(t))))
                    .collect()
            }
        }
    }

    /// The squared L2 norms of `buffers` summed, `Σ_b Σ x²`, in a fixed order: on the device
    /// one multi-tensor launch for up to 32 buffers ([`FusedOps::sum_squares_multi_tensor`])
    /// and one for their sum, where a launch per buffer and a `cat` of their norms took two
    /// per buffer; `extra` (another squared norm, same storage) is added last.
    pub(crate) fn sum_sq_norms(buffers: &[&Self], extra: Option<Scalar<B>>) -> Scalar<B> {
        let device: Vec<_> = buffers
            .iter()
            .filter_map(|b| match b {
                Buffer::Device(t) => Some(t.clone().into_primitive().tensor()),
                Buffer::Host(_) => None,
            })
            .collect();
        let mut parts: Vec<Scalar<B>> = if device.is_empty() {
            buffers.iter().map(|b| b.sq_norm()).collect()
        } else {
            let norms = B::sum_squares_multi_tensor(device);
            vec![Scalar::Device(Tensor::from_primitive(
                TensorPrimitive::Float(norms),
            ))]
        };
        parts.extend(extra);
        Scalar::sum(parts)
    }

    /// `⟨d, l⟩`: the dot product of the rows `ids` of the `[V, H]` part `d` of this buffer at
    /// `offset` with `lookup` (`[n · H]`, row i of it belonging to `ids[i]`; `rows` holds the
    /// same ids on the device).
    pub(crate) fn rows_dot(
        &self,
        offset: usize,
        [v, h]: [usize; 2],
        ids: &[i64],
        rows: &Tensor<B, 1, burn::tensor::Int>,
        lookup: &Buffer<B>,
    ) -> Scalar<B> {
        match (self, lookup) {
            (Buffer::Host(d), Buffer::Host(l)) => Scalar::Host(
                ids.iter()
                    .zip(l.chunks_exact(h))
                    .map(|(&id, l)| {
                        let d = &d[offset + id as usize * h..][..h];
                        d.iter()
                            .zip(l)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                    })
                    .sum(),
            ),
            (Buffer::Device(d), Buffer::Device(l)) => {
                let d = d
                    .clone()
                    .slice([offset..offset + v * h])
                    .reshape([v, h])
                    .select(0, rows.clone()); // [n, H]
                Scalar::Device(ember_backend_ext::sum_ordered(
                    d * l.clone().reshape([ids.len(), h]),
                ))
            }
            _ => unreachable!("one reducer keeps its buckets in one place"),
        }
    }

    /// The values on the host (a device read for device buffers): for tests and dumps.
    pub fn to_vec(&self) -> Vec<f32> {
        match self {
            Buffer::Host(values) => values.clone(),
            Buffer::Device(t) => t
                .clone()
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .expect("f32 after convert"),
        }
    }

    /// The `[offset, offset + Π shape)` part as a tensor of `shape` on `device`: a slice of the
    /// device buffer, or an upload of the host values.
    pub(crate) fn part<const D: usize>(
        &self,
        offset: usize,
        shape: [usize; D],
        device: &B::Device,
    ) -> Tensor<B, D> {
        let n: usize = shape.iter().product();
        let [part] = self
            .parts(&[offset..offset + n], device)
            .try_into()
            .expect("one part");
        part.reshape(shape)
    }

    /// The parts `ranges` as flat tensors on `device`: of a device buffer by
    /// [`BucketOps::unflatten_multi_tensor`](ember_backend_ext::BucketOps::unflatten_multi_tensor) (views where the backend can view them, the others
    /// copied together: Note [Unflattened by views] in ember-backend-ext), or uploads of the
    /// host values.
    pub(crate) fn parts(&self, ranges: &[Range<usize>], device: &B::Device) -> Vec<Tensor<B, 1>> {
        match self {
            Buffer::Host(values) => ranges
                .iter()
                .map(|r| {
                    Tensor::from_data(
                        TensorData::new(values[r.clone()].to_vec(), [r.len()]),
                        device,
                    )
                })
                .collect(),
            Buffer::Device(t) => {
                B::unflatten_multi_tensor(t.clone().into_primitive().tensor(), ranges)
                    .into_iter()
                    .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
                    .collect()
            }
        }
    }
}
