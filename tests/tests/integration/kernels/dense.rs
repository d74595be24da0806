//! The dense layer's backward (`FusedOps::dense_backward`) against Burn's `linear` under
//! autodiff: the rows flattened into one GEMM per gradient give Burn's per-sample products
//! summed, for a rank-3 input, a transposed weight (the tied decoder) and with or without bias.

use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;

use super::common::{assert_close, random};

pub fn check_dense<B: AutodiffBackend + FusedOps>(device: &B::Device) {
    let ([b, s, i, o], tolerance) = ([3, 37, 70, 50], (1e-4, 1e-4));
    for (transposed, with_bias) in [(false, true), (true, true), (false, false), (true, false)] {
        let x0 = random::<B::InnerBackend, 3>([b, s, i], device);
        let w0 = random::<B::InnerBackend, 2>(if transposed { [o, i] } else { [i, o] }, device);
        let b0 = random::<B::InnerBackend, 1>([o], device);
        let probe = random::<B::InnerBackend, 3>([b, s, o], device);
        let run = |ours: bool| {
            let x = Tensor::<B, 3>::from_inner(x0.clone()).require_grad();
            let w = Tensor::<B, 2>::from_inner(w0.clone()).require_grad();
            let bias = Tensor::<B, 1>::from_inner(b0.clone()).require_grad();
            let weight = if transposed {
                w.clone().transpose()
            } else {
                w.clone()
            };
            let used_bias = with_bias.then(|| bias.clone());
            let y = if ours {
                ember_backend_ext::dense(x.clone(), weight, used_bias)
            } else {
                burn::tensor::module::linear(x.clone(), weight, used_bias)
            };
            let grads = (y.clone() * Tensor::from_inner(probe.clone()))
                .sum()
                .backward();
            (
                y.inner(),
                x.grad(&grads).expect("x has a gradient"),
                w.grad(&grads).expect("the weight has a gradient"),
                bias.grad(&grads),
            )
        };
        let (y, dx, dw, db) = run(true);
        let (y_ref, dx_ref, dw_ref, db_ref) = run(false);
        let what = format!("transposed {transposed}, bias {with_bias}");
        assert_close(&format!("{what}: output"), y, y_ref, tolerance);
        assert_close(&format!("{what}: dx"), dx, dx_ref, tolerance);
        assert_close(&format!("{what}: dweight"), dw, dw_ref, tolerance);
        match (db, db_ref) {
            (Some(db), Some(db_ref)) => {
                assert_close(&format!("{what}: dbias"), db, db_ref, tolerance)
            }
            (None, None) => assert!(!with_bias),
            (db, db_ref) => panic!(
                "{what}: a bias gradient on one side only ({} vs {})",
                db.is_some(),
                db_ref.is_some()
            ),
        }
    }
}

/// Note [Weight gradients in f32] (backend-ext's `linear.rs`): the dense op of f32 master
/// parameters and their half copies (`dtype`: f16 on wgpu, bf16 on CUDA) gives `dx` in the half
/// type and the masters' gradients in f32, `dW` written by the GEMM from its f32 accumulator:
/// within f32 rounding of the f64 product of the same half inputs (`dW = xᵀ·g`, g the half
/// gradient of the output), and not rounded to the half type (most entries carry bits the
/// half type has not); `db` is the half gradient's column sum written in f32, within f32
/// rounding of the f64 sum (Note [Parameter gradients in f32]). Its backward takes at least one
/// launch fewer than the dense op of cast copies, whose casts' backward cast `dW` and `db`
/// back (the launches counted by the counting runtime).
pub fn check_dense_of_masters<A: AutodiffBackend + FusedOps>(
    device: &A::Device,
    dtype: burn::tensor::DType,
) where
    A::InnerBackend: FusedOps,
{
    use burn::tensor::{DType, TensorData};
    use ember_backend_ext::HostSyncs;
    let (b, s, i, o) = (3, 37, 70, 50);
    let x0 = random::<A::InnerBackend, 3>([b, s, i], device).cast(dtype);
    let w0 = random::<A::InnerBackend, 2>([i, o], device);
    let b0 = random::<A::InnerBackend, 1>([o], device);
    let probe = random::<A::InnerBackend, 3>([b, s, o], device);
    let host = |t: Tensor<A::InnerBackend, 2>| -> Vec<f64> {
        t.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    // One step of each; `masters`: the op of masters and copies, else the dense op of copies.
    let step = |masters: bool| {
        let x = Tensor::<A, 3>::from_inner(x0.clone()).require_grad();
        let w = Tensor::<A, 2>::from_inner(w0.clone()).require_grad();
        let bias = Tensor::<A, 1>::from_inner(b0.clone()).require_grad();
        let (w_half, b_half) = (w.clone().cast(dtype), bias.clone().cast(dtype));
        let y = if masters {
            ember_backend_ext::dense_of_masters(
                x.clone(),
                w.clone(),
                w_half,
                Some((bias.clone(), b_half)),
            )
        } else {
            ember_backend_ext::dense(x.clone(), w_half, Some(b_half))
        };
        assert_eq!(y.dtype(), dtype, "the output in the half type");
        let loss = (y.cast(DType::F32) * Tensor::from_inner(probe.clone())).sum();
        A::sync(device).unwrap(); // the forward's launches counted before the mark
        let forward_done = HostSyncs::now();
        let grads = loss.backward();
        let (dx, dw, db) = (
            x.grad(&grads).unwrap(),
            w.grad(&grads).unwrap(),
            bias.grad(&grads).unwrap(),
        );
        let _ = (
            dx.clone().into_data(),
            dw.clone().into_data(),
            db.clone().into_data(),
        );
        let launches = HostSyncs::now().since(forward_done).launches;
        (dx, dw, db, launches)
    };
    let _ = (step(true), step(false)); // compile first
    let (dx, dw, db, launches) = step(true);
    let (_, dw_copies, _, launches_copies) = step(false);
    assert_eq!(dx.dtype(), dtype, "dx in the half type");
    assert_eq!(dw.dtype(), DType::F32, "dW in the masters' dtype");
    assert_eq!(db.dtype(), DType::F32, "db in the masters' dtype");

    // The reference in f64 from the same half values: x and g = the probe rounded to `dtype`.
    let rows = b * s;
    let x = host(x0.reshape([rows, i]));
    let g = host(probe.cast(dtype).reshape([rows, o]));
    let mut dw_ref = vec![0.0f64; i * o];
    let mut db_ref = vec![0.0f64; o];
    for r in 0..rows {
        for c in 0..o {
            let gv = g[r * o + c];
            db_ref[c] += gv;
            for k in 0..i {
                dw_ref[k * o + c] += x[r * i + k] * gv;
            }
        }
    }
    let dw = host(dw);
    let scale = dw_ref.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = dw
        .iter()
        .zip(&dw_ref)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "dW: {worst:e} from the f64 product (largest {scale})"
    );
    // Bits beyond the half type: rounding to it changes most entries.
    let rounded = host(
        Tensor::<A::InnerBackend, 1>::from_data(
            TensorData::new(dw.iter().map(|&v| v as f32).collect::<Vec<f32>>(), [i * o]),
            device,
        )
        .cast(dtype)
        .reshape([1, i * o]),
    );
    let changed = dw.iter().zip(&rounded).filter(|(a, b)| a != b).count();
    assert!(
        changed * 2 > dw.len(),
        "dW carries no more than the half type: {changed} of {} entries change when rounded",
        dw.len()
    );
    // The copies' path rounds dW to the half type; the same values within that rounding.
    let dw_copies = host(dw_copies);
    let half_u = if dtype == DType::BF16 {
        2f64.powi(-8)
    } else {
        2f64.powi(-11)
    };
    for (a, b) in dw_copies.iter().zip(&dw) {
        assert!(
            (a - b).abs() <= 2.0 * half_u * b.abs() + 1e-6 * scale,
            "{a} vs {b}"
        );
    }
    let db = host(db.reshape([1, o]));
    let db_scale = db_ref.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (c, (a, b)) in db.iter().zip(&db_ref).enumerate() {
        // Summed from half values in f32 and written in f32 (Note [Parameter gradients in
        // f32]), not rounded to the half type.
        assert!((a - b).abs() <= 1e-5 * db_scale, "db[{c}]: {a} vs {b}");
    }
    assert!(
        launches < launches_copies,
        "backward launches: {launches} with the masters, {launches_copies} with cast copies"
    );
}
