//! Gradient clipping of buckets by a squared norm (`BucketOps::clip_multi_tensor`, Note [Clipped
//! in one launch] in backend-ext's `bucket_ops.rs`): bit for bit Burn's composition of the
//! coefficient `min(1, max_norm / (√s + 1e-6))` and a multiplication per bucket, in place
//! only where a bucket's memory is its own; on CubeCL one launch for up to 32 buckets.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::common::{random, values};

/// 43 flat buckets: one element, one longer than a tensor's grid of 1024 cubes × 256 units,
/// one of 4,096, and 40 small ones (more than one launch takes).
fn buckets<B: Backend>(device: &B::Device) -> Vec<Tensor<B, 1>> {
    let mut xs = vec![
        random::<B, 1>([1], device),
        random::<B, 1>([300_001], device),
        random::<B, 1>([4_096], device),
    ];
    xs.extend((0..40).map(|i| random::<B, 1>([1 + i * 37 % 301], device)));
    xs
}

/// `clip_multi_tensor` of `xs` by `sq_norm`.
fn clip<B: FusedOps>(
    xs: Vec<Tensor<B, 1>>,
    sq_norm: Tensor<B, 1>,
    max_norm: f32,
) -> Vec<Tensor<B, 1>> {
    B::clip_multi_tensor(
        xs.into_iter()
            .map(|x| x.into_primitive().tensor())
            .collect(),
        sq_norm.into_primitive().tensor(),
        max_norm,
    )
    .into_iter()
    .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
    .collect()
}

/// For a norm above `max_norm` (coefficient below 1), below it (coefficient 1), a zero, a NaN
/// and an infinite norm: every clipped bucket equals `x · clip_coefficient(s, max_norm)` of
/// Burn's ops, bit for bit (any NaN for a NaN). Two buckets whose memory another handle also holds are clipped as well, and those
/// handles still read the unclipped values (no write in place through a shared buffer).
pub fn check_clip<B: FusedOps>(device: &B::Device) {
    let xs = buckets::<B>(device);
    let sq = ember_backend_ext::sum_ordered(Tensor::cat(
        xs.iter().map(|x| x.clone().powi_scalar(2)).collect(),
        0,
    ));
    for (what, sq_norm, max_norm) in [
        ("norm above max_norm", sq.clone(), 1.0f32),
        ("norm below max_norm", sq.clone(), 1e6),
        ("a bucket cap", sq.clone(), 1.0 / 43f32.sqrt()),
        ("zero norm", sq.zeros_like(), 1.0),
        // 0/0 computed on the device (WGSL has no NaN literal): Burn's `clamp_max` keeps the
        // NaN coefficient, so every bucket becomes NaN.
        ("a NaN norm", sq.zeros_like().div_scalar(0.0), 1.0),
        ("an infinite norm", sq.ones_like().div_scalar(0.0), 1.0),
    ] {
        let coefficient = ember_backend_ext::clip_coefficient(sq_norm.clone(), max_norm);
        let expected: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| values(x.clone() * coefficient.clone()))
            .collect();
        let before: Vec<Vec<f32>> = xs.iter().map(|x| values(x.clone())).collect();
        // Copies with buffers of their own (`+ 0` allocates; −0.0 does not occur in normal
        // draws), except buckets 1 and 5, whose original handles stay alive beside them.
        let inputs: Vec<Tensor<B, 1>> = xs
            .iter()
            .enumerate()
            .map(|(i, x)| {
                if i == 1 || i == 5 {
                    x.clone()
                } else {
                    x.clone().add_scalar(0.0)
                }
            })
            .collect();
        let got = clip(inputs, sq_norm, max_norm);
        assert_eq!(got.len(), xs.len(), "{what}");
        for (i, (got, expected)) in got.into_iter().zip(&expected).enumerate() {
            let got = values(got);
            let first_difference = got
                .iter()
                .zip(expected)
                .position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()));
            assert_eq!(
                first_difference, None,
                "{what}: bucket {i} differs from the composition"
            );
        }
        for i in [1, 5] {
            assert_eq!(
                values(xs[i].clone()),
                before[i],
                "{what}: bucket {i}'s other handle sees a write"
            );
        }
    }
}

/// On the counting wgpu runtime: 3 buckets clipped in one launch (the composition: the
/// coefficient's six launches and a multiplication per bucket), with the same values.
pub fn check_clip_launches() {
    use ember_backend_ext::HostSyncs;
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let xs: Vec<Tensor<B, 1>> = buckets::<B>(&device).into_iter().take(3).collect();
    let sq = ember_backend_ext::sum_ordered(Tensor::cat(
        xs.iter().map(|x| x.clone().powi_scalar(2)).collect(),
        0,
    ));
    let own = |xs: &[Tensor<B, 1>]| -> Vec<Tensor<B, 1>> {
        xs.iter().map(|x| x.clone().add_scalar(0.0)).collect()
    };
    // Compile first.
    let _ = clip(own(&xs), sq.clone(), 1.0);
    // The launches of `f`, its outputs read (reading a contiguous tensor launches nothing).
    let count = |f: &dyn Fn(Vec<Tensor<B, 1>>) -> Vec<Tensor<B, 1>>| {
        let inputs = own(&xs);
        B::sync(&device).expect("the device's queue");
        let before = HostSyncs::now();
        let out: Vec<Vec<f32>> = f(inputs).into_iter().map(values).collect();
        (HostSyncs::now().since(before).launches, out)
    };
    let (launches, clipped) = count(&|inputs| clip(inputs, sq.clone(), 1.0));
    let (composed_launches, composed) = count(&|inputs| {
        let coefficient = ember_backend_ext::clip_coefficient(sq.clone(), 1.0);
        inputs
            .into_iter()
            .map(|x| x * coefficient.clone())
            .collect()
    });
    assert_eq!(launches, 1, "launches of clipping 3 buckets");
    assert!(
        composed_launches >= 8,
        "the composition launched {composed_launches}"
    );
    assert_eq!(clipped, composed);
}

/// `clip_by_own_norm` of `x` by `max_norm`: the clipped tensor and its squared norm.
fn clip_by_own_norm<B: FusedOps>(x: Tensor<B, 1>, max_norm: f32) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let (clipped, sq) = B::clip_by_own_norm(x.into_primitive().tensor(), max_norm);
    (
        Tensor::from_primitive(TensorPrimitive::Float(clipped)),
        Tensor::from_primitive(TensorPrimitive::Float(sq)),
    )
}

/// Whether two vectors hold the same bits (any NaN for a NaN).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
}

/// Note [Clipped by its own norm]: `clip_by_own_norm` gives the squared norm of
/// `sum_squares_multi_tensor` and the bucket of `clip_multi_tensor` by it, bit for bit, for
/// buckets of 1, 255, 4,096 and 65,537 elements (1, 1, 16 and 257 partial sums: fewer and more
/// than a cube's 256 units) and of 300,001 (1,024 partial sums, each cube summing four), with
/// the norm above and below `max_norm`, and for a NaN; a bucket whose memory another handle
/// holds is clipped too, and that handle still reads the unclipped values.
pub fn check_clip_by_own_norm<B: FusedOps>(device: &B::Device) {
    for n in [1, 255, 4_096, 65_537, 300_001] {
        let x = random::<B, 1>([n], device);
        let nan = x.clone().div_scalar(0.0).mul_scalar(0.0); // every element 0/0: NaN
        for (what, x, max_norm) in [
            ("norm above max_norm", x.clone(), 1e-3f32),
            ("norm below max_norm", x.clone(), 1e6),
            ("a NaN norm", nan, 1.0),
        ] {
            let sq = B::sum_squares_multi_tensor(vec![x.clone().into_primitive().tensor()]);
            let sq = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sq));
            let expected =
                values(clip(vec![x.clone().add_scalar(0.0)], sq.clone(), max_norm).remove(0));
            // Its own memory (`+ 0` allocates), and shared with a live handle.
            for shared in [false, true] {
                let input = if shared {
                    x.clone()
                } else {
                    x.clone().add_scalar(0.0)
                };
                let before = values(x.clone());
                let (clipped, got_sq) = clip_by_own_norm(input, max_norm);
                assert!(
                    same_bits(&values(got_sq), &values(sq.clone())),
                    "{n} elements, {what}, shared {shared}: the squared norm differs"
                );
                assert!(
                    same_bits(&values(clipped), &expected),
                    "{n} elements, {what}, shared {shared}: the bucket differs from the clip"
                );
                assert!(
                    same_bits(&values(x.clone()), &before),
                    "{n} elements, {what}: the other handle sees a write"
                );
            }
        }
    }
}

/// On the counting wgpu runtime: a bucket clipped by its own norm takes two launches (the
/// partial sums, then the clip finishing them), where the norm and the clip took three, with
/// the same values.
pub fn check_clip_by_own_norm_launches() {
    use ember_backend_ext::HostSyncs;
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let x = random::<B, 1>([300_001], &device);
    let count = |f: &dyn Fn(Tensor<B, 1>) -> (Tensor<B, 1>, Tensor<B, 1>)| {
        let input = x.clone().add_scalar(0.0);
        B::sync(&device).expect("the device's queue");
        let before = HostSyncs::now();
        let (clipped, sq) = f(input);
        let out = (values(clipped), values(sq));
        (HostSyncs::now().since(before).launches, out)
    };
    let fused = |x: Tensor<B, 1>| clip_by_own_norm(x, 1e-3);
    let separate = |x: Tensor<B, 1>| {
        let sq = B::sum_squares_multi_tensor(vec![x.clone().into_primitive().tensor()]);
        let sq = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sq));
        (clip(vec![x], sq.clone(), 1e-3).remove(0), sq)
    };
    // Compile first.
    let _ = count(&fused);
    let _ = count(&separate);
    let (launches, clipped) = count(&fused);
    let (separate_launches, expected) = count(&separate);
    assert_eq!(launches, 2, "launches of clipping a bucket by its own norm");
    assert_eq!(separate_launches, 3, "the norm, then the clip");
    assert_eq!(clipped, expected);
}
