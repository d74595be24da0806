//! The losses' cross-entropy (`FusedOps::cross_entropy` and its backward) against an f64
//! computation on the host, on the masked-LM width (30,522 classes), the next-sentence width
//! (2), one class, rows offset by up to 300 (the log-sum-exp's shift matters), rows longer
//! than a cube's units hold at once, more rows than one grid dimension holds, and more elements
//! than one grid dimension of the backward holds (BERT-large's masked-LM shape); labels at 0,
//! at C − 1 and repeated. Note [Cross-entropy in one pass] in backend-ext's
//! `cube/cross_entropy.rs`.

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::common::{random, values};

/// `[N, C]` and the offset added to row `i` (`offset · i`).
const CASES: [(usize, usize, f32); 8] = [
    (7, 301, 50.0),
    (40, 30_522, 0.0),
    (32, 2, 0.0),
    (3, 1, 0.0),
    (5, 1_000, -20.0),
    // 65,535 rows: Burn's `mean` on lavapipe takes 65,535 ones to 0.9999695 (3e-5 off, more
    // than the loss's tolerance; with Burn's mean in the op this case failed, on one draw);
    // the op's mean is its own.
    (65_535, 3, 0.0),
    // More rows than one grid dimension holds (65,535 cubes).
    (70_000, 2, 0.0),
    // BERT-large's masked-LM rows at seq 128, batch 32: the backward's 19.5M elements take
    // more cubes than one grid dimension holds on wgpu (at most 256 units a cube: 76,000 and
    // more), so its grid is 2-D and some cubes end past the last element.
    (640, 30_522, 0.0),
];

/// Labels of `n` rows of `c` classes: 0, C − 1 and others, repeated.
fn labels<B: Backend>(n: usize, c: usize, device: &B::Device) -> Tensor<B, 1, Int> {
    let values: Vec<i64> = (0..n)
        .map(|i| match i % 4 {
            0 => c as i64 - 1,
            1 => 0,
            _ => ((i * 7919) % c) as i64,
        })
        .collect();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// Logits `[n, c]`: normal values times 3, row `i` offset by `offset · i`.
fn logits<B: Backend>(n: usize, c: usize, offset: f32, device: &B::Device) -> Tensor<B, 2> {
    let shift: Vec<f32> = (0..n).map(|i| offset * i as f32).collect();
    random::<B, 2>([n, c], device) * 3.0
        + Tensor::<B, 1>::from_data(TensorData::new(shift, [n]), device).reshape([n, 1])
}

/// The loss `mean_i(lse_i − x_i[label_i])` and its gradient for the logits, `(softmax −
/// onehot) · scale / N`, in f64 on the host from `x`'s values.
fn host_cross_entropy(x: &[f32], labels: &[i64], c: usize, scale: f64) -> (f64, Vec<f64>) {
    let n = labels.len();
    let mut total = 0.0;
    let mut grad = vec![0.0; n * c];
    for (i, &label) in labels.iter().enumerate() {
        let row = &x[i * c..(i + 1) * c];
        let max = row.iter().fold(f64::MIN, |m, &v| m.max(f64::from(v)));
        let lse = row
            .iter()
            .map(|&v| (f64::from(v) - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        total += lse - f64::from(row[label as usize]);
        for (j, &v) in row.iter().enumerate() {
            let onehot = if j as i64 == label { 1.0 } else { 0.0 };
            grad[i * c + j] = ((f64::from(v) - lse).exp() - onehot) * scale / n as f64;
        }
    }
    (total / n as f64, grad)
}

/// Loss and gradient of the op (under autodiff, the loss scaled by 3 so that the incoming
/// gradient is not 1) against the host's f64 [`host_cross_entropy`]. Loss: 2e-5 relative.
/// Gradient: 1e-4 relative. The entries away from the label, `p · 3/N` (down to about 1e-13
/// at C = 30,522), have an absolute floor of 1e-30 only: a floor relative to the largest
/// entry (3/N) would wave most of them through. The kernel's `p` carries the log-sum-exp's
/// rounding (≤ 3e-5 relative at lse ≈ 300) and the device's `exp` error. At the label,
/// `(p − 1) · 3/N` loses f32's bits of `p` near 1 to the cancellation: a floor of 1e-6 · 3/N
/// there (8 units of f32's last place at 1).
///
/// The oracle is the host, not Burn's composition: on lavapipe the composition's loss at
/// 70,000 rows is 1.7106 where the host and the fused kernel give 1.8241.
pub fn check_cross_entropy<B: AutodiffBackend + FusedOps>(device: &B::Device) {
    for (n, c, offset) in CASES {
        let x = logits::<B>(n, c, offset, device).require_grad();
        let labels = labels::<B>(n, c, device);
        let loss = ember_backend_ext::cross_entropy(x.clone(), labels.clone());
        let grads = (loss.clone() * 3.0).backward();
        let grad = values(x.grad(&grads).unwrap());
        let labels: Vec<i64> = labels.into_data().convert::<i64>().to_vec().unwrap();
        let (loss_host, grad_host) = host_cross_entropy(&values(x), &labels, c, 3.0);

        let what = format!("cross-entropy [{n}, {c}], offset {offset}");
        let loss = values(loss)[0];
        assert!(
            (f64::from(loss) - loss_host).abs() <= 2e-5 * loss_host.abs().max(1e-6),
            "{what}: loss {loss}, host {loss_host}"
        );
        for (k, (&g, &h)) in grad.iter().zip(&grad_host).enumerate() {
            let floor = if k % c == labels[k / c] as usize {
                1e-6 * 3.0 / n as f64
            } else {
                1e-30
            };
            assert!(
                (f64::from(g) - h).abs() <= 1e-4 * h.abs() + floor,
                "{what}: d logits [{}, {}] is {g}, host {h}",
                k / c,
                k % c
            );
        }
    }
}

/// A label outside `0..C` (−1, C) makes the loss NaN, not a number read from past the row.
pub fn check_out_of_range_labels<B: FusedOps>(device: &B::Device) {
    let x = logits::<B>(4, 10, 0.0, device);
    for bad in [-1i64, 10] {
        let labels =
            Tensor::<B, 1, Int>::from_data(TensorData::new(vec![3, bad, 0, 9], [4]), device);
        let loss = values(ember_backend_ext::cross_entropy(x.clone(), labels));
        assert!(
            loss[0].is_nan(),
            "label {bad} of 10 classes: loss {}",
            loss[0]
        );
    }
}

/// The fused loss takes 2 launches forward (the rows, the fixed-order mean) and 1 backward, where the
/// composition takes at least 8 and 6 (with the same values), at the masked-LM width.
pub fn check_cross_entropy_launches() {
    use ember_backend_ext::HostSyncs;
    type B = crate::Wgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let (n, c) = (20, 30_522);
    let x = logits::<B>(n, c, 0.0, &device);
    let labels = labels::<B>(n, c, &device);
    let grad = Tensor::<B, 1>::from_data(TensorData::new(vec![3.0f32], [1]), &device);
    let float = |t| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t));
    // The launches of `f`, its outputs read (reading a contiguous tensor launches nothing).
    let count = |f: &dyn Fn() -> Vec<Vec<f32>>| {
        let first = f(); // compile first
        let before = HostSyncs::now();
        let again = f();
        assert_eq!(first, again, "the same values again");
        (HostSyncs::now().since(before).launches, again)
    };
    let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
    let fused_forward = count(&|| {
        let out = B::cross_entropy(prim(x.clone()), labels.clone().into_primitive());
        vec![values(float(out.loss)), values(float(out.log_sum_exp))]
    });
    let reference_forward = count(&|| {
        let out = ember_backend_ext::reference::cross_entropy_forward::<B>(
            prim(x.clone()),
            labels.clone().into_primitive(),
        );
        vec![values(float(out.loss)), values(float(out.log_sum_exp))]
    });
    let lse = B::cross_entropy(prim(x.clone()), labels.clone().into_primitive()).log_sum_exp;
    let backward = |fused: bool| {
        let (x, labels, lse, grad) = (
            prim(x.clone()),
            labels.clone().into_primitive(),
            lse.clone(),
            grad.clone().into_primitive().tensor(),
        );
        let d = if fused {
            B::cross_entropy_backward(x, labels, lse, grad)
        } else {
            ember_backend_ext::reference::cross_entropy_backward::<B>(x, labels, lse, grad)
        };
        vec![values(Tensor::<B, 2>::from_primitive(
            TensorPrimitive::Float(d),
        ))]
    };
    let fused_backward = count(&|| backward(true));
    let reference_backward = count(&|| backward(false));
    assert_eq!(
        (fused_forward.0, fused_backward.0),
        (2, 1),
        "launches of the fused forward, backward"
    );
    assert!(
        reference_forward.0 >= 8 && reference_backward.0 >= 6,
        "the composition launched {} forward, {} backward",
        reference_forward.0,
        reference_backward.0
    );
    let close = |a: &[f32], b: &[f32], tol: f32| {
        a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
    };
    assert!(
        close(&fused_forward.1[0], &reference_forward.1[0], 2e-5),
        "loss"
    );
    assert!(
        close(&fused_forward.1[1], &reference_forward.1[1], 2e-5),
        "log-sum-exp"
    );
    assert!(
        close(&fused_backward.1[0], &reference_backward.1[0], 1e-6),
        "d logits"
    );
}

/// Half logits (`dtype`: f16 on wgpu, bf16 on CUDA) read as they are: the loss is f32 and has
/// the bits of the loss of the same values cast to f32 first (the model's casts before), and
/// the gradient has the bits of that loss's f32 gradient cast to the half type (the cast's
/// backward), at the masked-LM width and at the next-sentence width.
pub fn check_cross_entropy_of_half_logits<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: burn::tensor::FloatDType,
) {
    use burn::tensor::{DType, FloatDType};
    for (n, c) in [(24, 30_522), (8, 2)] {
        let half = logits::<B>(n, c, 0.0, device).cast(dtype);
        let labels = labels::<B>(n, c, device);
        let run = |x: Tensor<B, 2>| {
            let x = x.detach().require_grad();
            let loss = ember_backend_ext::cross_entropy(x.clone(), labels.clone());
            let grads = (loss.clone() * 3.0).backward();
            (loss, x.grad(&grads).unwrap())
        };
        let (loss, grad) = run(half.clone());
        let (loss_f32, grad_f32) = run(half.clone().cast(FloatDType::F32));
        let what = format!("[{n}, {c}] in {dtype:?}");
        assert_eq!(loss.dtype(), DType::F32, "{what}: the loss's dtype");
        assert_eq!(grad.dtype(), half.dtype(), "{what}: the gradient's dtype");
        let bits = |t: Tensor<B::InnerBackend, 2>| -> Vec<u32> {
            values(t.cast(FloatDType::F32))
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(
            values(loss)[0].to_bits(),
            values(loss_f32)[0].to_bits(),
            "{what}: the loss"
        );
        assert!(
            bits(grad) == bits(grad_f32.cast(dtype)),
            "{what}: the gradient differs from the f32 gradient cast"
        );
    }
}
