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
