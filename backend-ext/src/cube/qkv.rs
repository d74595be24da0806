//! The packed QKV layout on CubeCL (Note [Packed QKV] in `qkv.rs`): Q, K and V out of one
//! `[B, S, 3·nh·hd]` tensor into three contiguous `[B, nh, S, hd]` tensors, and their
//! gradients back, one launch each way, where the composition takes a copy (forward) or a
//! slice assignment (backward) per part.

use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{elemwise_launch, empty_like, storage};

/// Where element `i` of a `[B, nh, S, hd]` part lies in the packed `[B, S, 3, nh, hd]`
/// tensor (Q's; K's and V's follow at `+ nh·hd` and `+ 2·nh·hd`).
#[cube]
fn packed_index(i: usize, heads: usize, seq_len: usize, head_dim: usize) -> usize {
    let d = i % head_dim;
    let position = (i / head_dim) % seq_len;
    let head = (i / (head_dim * seq_len)) % heads;
    let sample = i / (head_dim * seq_len * heads);
    (sample * seq_len + position) * 3 * heads * head_dim + head * head_dim + d
}

/// `q`, `k`, `v` (`[B, nh, S, hd]`) from the packed `qkv`; one unit per element of a part.
#[cube(launch)]
fn unpack_qkv_kernel<F: Float>(
    qkv: &Tensor<F>,
    q: &mut Tensor<F>,
    k: &mut Tensor<F>,
    v: &mut Tensor<F>,
    heads: usize,
    seq_len: usize,
    head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= q.len() {
        terminate!();
    }
    let at = packed_index(i, heads, seq_len, head_dim);
    let width = heads * head_dim;
    q[i] = qkv[at];
    k[i] = qkv[at + width];
    v[i] = qkv[at + 2 * width];
}

/// The packed `qkv` from `q`, `k`, `v` (`[B, nh, S, hd]`, contiguous).
#[cube(launch)]
fn pack_qkv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    qkv: &mut Tensor<F>,
    heads: usize,
    seq_len: usize,
    head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= q.len() {
        terminate!();
    }
    let at = packed_index(i, heads, seq_len, head_dim);
    let width = heads * head_dim;
    qkv[at] = q[i];
    qkv[at + width] = k[i];
    qkv[at + 2 * width] = v[i];
}

/// `FusedOps::unpack_qkv_heads`: three contiguous `[B, nh, S, hd]` tensors in one launch.
///
/// # Panics
/// If `qkv` is not `[B, S, 3·nh·hd]` with a width that `3 · heads` divides.
pub(super) fn unpack<R: CubeRuntime>(qkv: CubeTensor<R>, heads: usize) -> [CubeTensor<R>; 3] {
    let [batch, seq_len, head_dim] = crate::qkv::packed_dims(&qkv.shape(), heads);
    let qkv = into_contiguous(qkv);
    let part = Shape::new([batch, heads, seq_len, head_dim]);
    let parts = [0, 1, 2].map(|_| empty_like(&qkv, part.clone()));
    let n = part.num_elements();
    let (count, dim) = elemwise_launch(&qkv, n);
    unpack_qkv_kernel::launch::<R>(
        &qkv.client,
        count,
        dim,
        qkv.clone().into_tensor_arg(),
        parts[0].clone().into_tensor_arg(),
        parts[1].clone().into_tensor_arg(),
        parts[2].clone().into_tensor_arg(),
        heads,
        seq_len,
        head_dim,
        storage(qkv.dtype),
    );
    parts
}

/// `FusedOps::merge_qkv_heads`: the packed `[B, S, 3·nh·hd]` tensor in one launch.
///
/// # Panics
/// If the parts' shapes differ or are not of rank 4.
pub(super) fn pack<R: CubeRuntime>(parts: [CubeTensor<R>; 3]) -> CubeTensor<R> {
    let shape = parts[0].shape();
    assert!(
        shape.num_dims() == 4 && parts.iter().all(|p| p.shape() == shape),
        "merge_qkv_heads of parts of shapes {:?}",
        parts.each_ref().map(|p| p.shape())
    );
    let [batch, heads, seq_len, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
    let [q, k, v] = parts.map(into_contiguous);
    let qkv = empty_like(&q, Shape::new([batch, seq_len, 3 * heads * head_dim]));
    let (count, dim) = elemwise_launch(&q, shape.num_elements());
    pack_qkv_kernel::launch::<R>(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        qkv.clone().into_tensor_arg(),
        heads,
        seq_len,
        head_dim,
        storage(q.dtype),
    );
    qkv
}
