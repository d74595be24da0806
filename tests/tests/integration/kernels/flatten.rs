//! Bucket flattening (`BucketOps::flatten_multi_tensor`): the same elements, in the same order,
//! as Burn's `cat` of the flattened tensors (times the loss scale's inverse as Burn's
//! `mul_scalar` multiplies, where one is given), and on CubeCL a launch per 32 tensors instead
//! of one per tensor, the multiplication included.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::common::{random, values};

/// 41 tensors, more than one launch takes (32): one element, one larger than a tensor's grid
/// of 1024 cubes × 256 units, odd sizes, and a transposed (strided) one.
fn inputs<B: Backend>(device: &B::Device) -> Vec<Tensor<B, 2>> {
    let mut xs = vec![
        random::<B, 2>([1, 1], device),
        random::<B, 2>([3, 100_001], device),
        random::<B, 2>([7, 13], device).transpose(),
        random::<B, 2>([768, 3], device),
    ];
    xs.extend((0..37).map(|i| random::<B, 2>([1 + i * 37 % 301, 2], device)));
    xs
}

/// The flattened tensors equal `cat` of their flattened views, bit for bit (a copy); with a
/// scale, `cat` times it by Burn's `mul_scalar`, bit for bit: 1/3 (every product rounded) and
/// 1/65,536 (a loss scale's inverse: exact).
pub fn check_flatten<B: FusedOps>(device: &B::Device) {
    let xs = inputs::<B>(device);
    let cat = Tensor::cat(
        xs.iter()
            .map(|x| x.clone().reshape([x.shape().num_elements()]))
            .collect(),
        0,
    );
    for scale in [1.0, 1.0 / 3.0, 1.0 / 65_536.0] {
        let expected: Vec<f32> = values(cat.clone().mul_scalar(scale));
        let got = values(flatten(&xs, scale));
        assert_eq!(got.len(), expected.len());
        let first_difference = got
            .iter()
            .zip(&expected)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(
            first_difference, None,
            "flattened at scale {scale} differs from cat · scale"
        );
    }
    // One tensor alone is itself, flattened.
    let one = values(flatten(&xs[2..3], 1.0));
    assert_eq!(one, values(xs[2].clone().reshape([91])));
}

pub fn flatten<B: FusedOps>(xs: &[Tensor<B, 2>], scale: f32) -> Tensor<B, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(B::flatten_multi_tensor(
        xs.iter()
            .map(|x| x.clone().into_primitive().tensor())
            .collect(),
        scale,
    )))
}

/// On the counting wgpu runtime: 41 tensors take 2 launches where `cat` takes one per tensor,
/// scaled by 0.5 (a loss scale's inverse) in the same launches; the launches by kernel
/// (`KernelLaunches`) add up to the launch count and name the kernels.
pub fn check_flatten_launches() {
    use ember_backend_ext::{HostSyncs, KernelLaunches};
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let xs = inputs::<B>(&device);
    // Compile first (and make the transposed input's contiguous copy part of the count below).
    // Scaled: the division by the loss scale takes no launch of its own.
    let _ = values(flatten(&xs, 0.5));
    KernelLaunches::record(true);
    let by_kernel_before = KernelLaunches::now();
    let before = HostSyncs::now();
    let flat = values(flatten(&xs, 0.5));
    let counted = HostSyncs::now().since(before);
    let by_kernel = KernelLaunches::since(&KernelLaunches::now(), &by_kernel_before);
    KernelLaunches::record(false);
    assert_eq!(
        by_kernel.iter().map(|(_, n)| n).sum::<u64>(),
        counted.launches,
        "{by_kernel:?}"
    );
    let flattening = by_kernel
        .iter()
        .find(|(name, _)| name.contains("MultiFlattenKernel"))
        .map(|(_, n)| *n);
    assert!(matches!(flattening, Some(2..=4)), "{by_kernel:?}");
    assert_eq!(
        flat.len(),
        1 + 300_003 + 91 + 2304 + (0..37).map(|i| 2 * (1 + i * 37 % 301)).sum::<usize>()
    );
    // Two launches of at most 32 tensors (the device may bind fewer per launch: at most 4),
    // plus the transposed tensor's copy to contiguous memory.
    assert!(
        (3..=5).contains(&counted.launches),
        "{} launches for 41 tensors",
        counted.launches
    );
    let before = HostSyncs::now();
    let _ = values(Tensor::cat(
        xs.iter()
            .map(|x| x.clone().reshape([x.shape().num_elements()]))
            .collect(),
        0,
    ));
    let by_cat = HostSyncs::now().since(before).launches;
    assert!(by_cat >= 41, "cat launched {by_cat}");
}

/// A bucket of 4,096 values and its parts: two whose ends are both aligned for any alignment
/// up to 512 bytes (views), a run of three adjacent parts off every alignment of 8 bytes or
/// more, a lone misaligned part after a gap, and an aligned part at the end.
const PARTS: [std::ops::Range<usize>; 7] = [
    0..512,
    512..1024,
    1024..1025,
    1025..1501,
    1501..2048,
    3001..3003,
    3072..4096,
];

/// Note [Unflattened by views]: every part of `unflatten_multi_tensor` holds the bucket's
/// values at its range, bit for bit, whether viewed or copied; and the bucket is unchanged.
/// Also the parts in reverse order (no two adjacent), and 40 adjacent parts of 3 values (off
/// every alignment: more than one launch takes) with an empty one among them.
pub fn check_unflatten<B: FusedOps>(device: &B::Device) {
    let flat = random::<B, 1>([4096], device);
    let expected = values(flat.clone());
    let reversed: Vec<_> = PARTS.iter().rev().cloned().collect();
    let mut many: Vec<_> = (0..40).map(|i| 1 + 3 * i..4 + 3 * i).collect();
    many.insert(7, 22..22);
    for parts in [&PARTS[..], &reversed, &many, &[0..4096]] {
        let got = unflatten(&flat, parts);
        assert_eq!(got.len(), parts.len());
        for (r, part) in parts.iter().zip(got) {
            assert_eq!(part.dims(), [r.len()], "part {r:?}");
            let got = values(part);
            let same = got
                .iter()
                .zip(&expected[r.clone()])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "part {r:?} differs from the bucket's values");
        }
    }
    assert_eq!(values(flat), expected, "the bucket itself changed");
}

pub fn unflatten<B: FusedOps>(
    flat: &Tensor<B, 1>,
    parts: &[std::ops::Range<usize>],
) -> Vec<Tensor<B, 1>> {
    B::unflatten_multi_tensor(flat.clone().into_primitive().tensor(), parts)
        .into_iter()
        .map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
        .collect()
}

/// On a counting CubeCL runtime: the aligned parts are views (no launch), the run of three
/// adjacent misaligned parts one launch and the lone one another, where Burn's `slice` of each
/// part launches a copy per misaligned part (4).
pub fn check_unflatten_launches<B: FusedOps>(device: &B::Device) {
    use ember_backend_ext::{HostSyncs, KernelLaunches};
    let flat = random::<B, 1>([4096], device);
    // Compile first.
    let _ = unflatten(&flat, &PARTS).into_iter().map(values).count();
    let _ = values(flat.clone());
    KernelLaunches::record(true);
    let by_kernel_before = KernelLaunches::now();
    let before = HostSyncs::now();
    // Launches are counted as they run: the reads make them run.
    let parts: Vec<_> = unflatten(&flat, &PARTS).into_iter().map(values).collect();
    let counted = HostSyncs::now().since(before);
    let by_kernel = KernelLaunches::since(&KernelLaunches::now(), &by_kernel_before);
    KernelLaunches::record(false);
    assert_eq!(counted.launches, 2, "{by_kernel:?}");
    // Every launch is the copy kernel's (and recorded: the by-kernel counts add up).
    assert_eq!(
        by_kernel.iter().map(|(_, n)| n).sum::<u64>(),
        counted.launches,
        "{by_kernel:?}"
    );
    assert!(
        by_kernel
            .iter()
            .all(|(name, _)| name.contains("MultiSplitColumnsKernel")),
        "{by_kernel:?}"
    );
    let before = HostSyncs::now();
    let sliced: Vec<_> = PARTS
        .iter()
        .map(|r| values(flat.clone().slice([r.clone()])))
        .collect();
    let by_slice = HostSyncs::now().since(before).launches;
    assert_eq!(by_slice, 4, "Burn's slice of each part");
    assert_eq!(parts, sliced);
}
