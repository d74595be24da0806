//! The packed QKV projections (Note [Packed QKV] in backend-ext/src/qkv.rs), bit for bit
//! against Burn's ops (every op here only moves values):
//! - `FusedOps::concat_columns` and `FusedOps::split_columns` (the packed weight and bias, and
//!   their gradients) are Burn's `cat` along the last dimension and its slices, and under
//!   autodiff each part's gradient is its slice of the output's gradient;
//! - `FusedOps::unpack_qkv_heads` and `FusedOps::merge_qkv_heads` (Q, K and V out of the
//!   packed projections, and their gradients back) are the head split and merge of the
//!   packed tensor's column blocks.
//!
//! On CubeCL each takes one launch, where Burn's ops take one per part.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::common::{random, values};

fn bits(x: Vec<f32>) -> Vec<u32> {
    x.into_iter().map(f32::to_bits).collect()
}

fn split<B: FusedOps, const D: usize>(x: Tensor<B, D>, widths: &[usize]) -> Vec<Tensor<B, D>> {
    B::split_columns(x.into_primitive().tensor(), widths)
        .into_iter()
        .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
        .collect()
}

/// Three `[7, w]` weights of odd widths, three biases, and 40 vectors (more than one launch
/// binds): the concatenation equals `cat`, the split returns the parts; under autodiff the
/// parts' gradients are the slices of a loss's gradient that weights every element
/// differently.
pub fn check_columns<B: AutodiffBackend + FusedOps>(device: &B::Device)
where
    B::InnerBackend: FusedOps,
{
    type Inner<B> = <B as AutodiffBackend>::InnerBackend;
    let widths = [5, 3, 9];
    let weights: Vec<Tensor<Inner<B>, 2>> =
        widths.iter().map(|&w| random([7, w], device)).collect();
    let packed = ember_backend_ext::concat_columns(weights.clone());
    assert_eq!(packed.dims(), [7, 17]);
    assert_eq!(
        bits(values(packed.clone())),
        bits(values(Tensor::cat(weights.clone(), 1)))
    );
    for (part, weight) in split(packed, &widths).into_iter().zip(&weights) {
        assert_eq!(bits(values(part)), bits(values(weight.clone())));
    }

    let vectors: Vec<Tensor<Inner<B>, 1>> = (0..40).map(|i| random([1 + i % 7], device)).collect();
    let lengths: Vec<usize> = (0..40).map(|i| 1 + i % 7).collect();
    let packed = ember_backend_ext::concat_columns(vectors.clone());
    assert_eq!(
        bits(values(packed.clone())),
        bits(values(Tensor::cat(vectors.clone(), 0)))
    );
    for (part, vector) in split(packed, &lengths).into_iter().zip(&vectors) {
        assert_eq!(bits(values(part)), bits(values(vector.clone())));
    }

    let tracked: Vec<Tensor<B, 2>> = weights
        .iter()
        .map(|w| Tensor::from_inner(w.clone()).require_grad())
        .collect();
    let probe = random::<B::InnerBackend, 2>([7, 17], device);
    let packed = ember_backend_ext::concat_columns(tracked.clone());
    let loss = (packed * Tensor::from_inner(probe.clone())).sum();
    let grads = loss.backward();
    let mut start = 0;
    for (x, width) in tracked.iter().zip(widths) {
        let grad = x.grad(&grads).expect("each part has a gradient");
        let expected = probe.clone().slice([0..7, start..start + width]);
        assert_eq!(bits(values(grad)), bits(values(expected)));
        start += width;
    }
}

fn tensor<B: FusedOps, const D: usize>(x: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// Q, K and V of a `[2, 3, 3·2·5]` packed tensor (odd sizes: 2 heads of 5 columns) are its
/// column blocks `0..10`, `10..20`, `20..30`, each split into heads (`[B, nh, S, hd]`); the
/// merge of the three parts is the packed tensor again.
pub fn check_qkv_packing<B: FusedOps>(device: &B::Device) {
    let (batch, seq_len, heads, head_dim) = (2, 3, 2, 5);
    let hidden = heads * head_dim;
    let qkv = random::<B, 3>([batch, seq_len, 3 * hidden], device);
    let parts = B::unpack_qkv_heads(qkv.clone().into_primitive().tensor(), heads);
    for (index, part) in parts.iter().enumerate() {
        let part: Tensor<B, 4> = tensor(part.clone());
        let expected = qkv
            .clone()
            .slice([0..batch, 0..seq_len, index * hidden..(index + 1) * hidden])
            .reshape([batch, seq_len, heads, head_dim])
            .swap_dims(1, 2);
        assert_eq!(part.dims(), [batch, heads, seq_len, head_dim]);
        assert_eq!(bits(values(part)), bits(values(expected)), "part {index}");
    }
    let merged: Tensor<B, 3> = tensor(B::merge_qkv_heads(parts));
    assert_eq!(merged.dims(), [batch, seq_len, 3 * hidden]);
    assert_eq!(bits(values(merged)), bits(values(qkv)));
}

/// On the counting wgpu runtime: three parts concatenated in one launch and split in one,
/// where Burn's `cat` takes a launch per part; Q, K and V unpacked in one launch and merged in
/// one.
pub fn check_packing_launches() {
    use ember_backend_ext::HostSyncs;
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let parts: Vec<Tensor<B, 2>> = [64, 64, 64]
        .iter()
        .map(|&w| random([64, w], &device))
        .collect();
    // The launches of `f` and of reading its outputs (a read flushes the queued launches to
    // the counting runtime and launches nothing itself for a contiguous tensor).
    let count = |f: &dyn Fn() -> Vec<Tensor<B, 2>>| {
        let _ = f().into_iter().map(values).count(); // compile first
        let before = HostSyncs::now();
        let _ = f().into_iter().map(values).count();
        HostSyncs::now().since(before).launches
    };
    let concat = count(&|| vec![ember_backend_ext::concat_columns(parts.clone())]);
    let by_cat = count(&|| vec![Tensor::cat(parts.clone(), 1)]);
    let packed = Tensor::cat(parts.clone(), 1);
    let splits = count(&|| split(packed.clone(), &[64, 64, 64]));
    assert_eq!(
        (concat, splits),
        (1, 1),
        "launches to concatenate, to split"
    );
    assert!(by_cat >= 3, "Burn's cat launched {by_cat}");

    let qkv = random::<B, 3>([2, 16, 3 * 64], &device);
    let count_4 = |f: &dyn Fn() -> Vec<Tensor<B, 4>>| {
        let _ = f().into_iter().map(values).count();
        let before = HostSyncs::now();
        let _ = f().into_iter().map(values).count();
        HostSyncs::now().since(before).launches
    };
    let unpack = count_4(&|| {
        B::unpack_qkv_heads(qkv.clone().into_primitive().tensor(), 4)
            .into_iter()
            .map(tensor)
            .collect()
    });
    let parts = B::unpack_qkv_heads(qkv.clone().into_primitive().tensor(), 4);
    let merge = count(&|| vec![packed_as_matrix(tensor(B::merge_qkv_heads(parts.clone())))]);
    assert_eq!(
        (unpack, merge),
        (1, 1),
        "launches to unpack Q, K and V, to merge"
    );
}

/// A `[B, S, N]` tensor as `[B·S, N]` (a view of a contiguous tensor: no launch).
fn packed_as_matrix<B: FusedOps>(x: Tensor<B, 3>) -> Tensor<B, 2> {
    let [b, s, n] = x.dims();
    x.reshape([b * s, n])
}
