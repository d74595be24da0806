//! The multi-tensor optimizer ops on the kernels (apex's `multi_tensor_apply`): AdamW and
//! LAMB steps, squared norms and LAMB's apply over a list of tensors, against the reference
//! bodies applied tensor by tensor.

use burn::tensor::Tensor;
use ember_backend_ext::{FusedOps, reference};

use super::common::{assert_close, random};
use super::{BWD, FWD};

/// Sizes of the optimizer tests' tensor list: one element, odd sizes, more elements than the
/// 1024 cubes × 256 units of one tensor's grid (strided), and 40 tensors in all, more than
/// one launch takes (32), so the list is split into launches.
fn optimizer_sizes() -> Vec<usize> {
    let mut sizes = vec![1, 1000, 300_001, 768, 3];
    sizes.extend((0..35).map(|i| 1 + i * 37 % 301));
    sizes
}

/// Multi-tensor Adam-family steps, squared norms and LAMB's apply against the reference
/// bodies applied tensor by tensor.
pub fn check_optimizer_ops<B: FusedOps>(device: &B::Device) {
    use ember_backend_ext::{AdamHyper, AdamKind, AdamTensors, lamb_multi_tensor};
    let prim = |t: &Tensor<B, 1>| t.clone().into_primitive().tensor();
    let tensor = |p| Tensor::<B, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(p));
    let sizes = optimizer_sizes();
    let inputs: Vec<[Tensor<B, 1>; 4]> = sizes
        .iter()
        .map(|&n| {
            [
                random::<B, 1>([n], device),
                random::<B, 1>([n], device) * 0.1,
                random::<B, 1>([n], device) * 0.01,
                random::<B, 1>([n], device).abs() * 0.001,
            ]
        })
        .collect();
    let list = || -> Vec<AdamTensors<B>> {
        inputs
            .iter()
            .map(|[param, grad, moment_1, moment_2]| AdamTensors {
                param: prim(param),
                grad: prim(grad),
                moment_1: prim(moment_1),
                moment_2: prim(moment_2),
            })
            .collect()
    };
    let hyper = AdamHyper {
        lr: 1e-3,
        beta_1: 0.9,
        beta_2: 0.999,
        epsilon: 1e-6,
        weight_decay: 0.01,
        step: 3,
    };
    for (kind, tolerance) in [(AdamKind::AdamW, FWD), (AdamKind::LambUpdate, BWD)] {
        let fused = B::adam_multi_tensor(list(), hyper, kind);
        assert_eq!(fused.len(), sizes.len());
        for ((out, [param, grad, moment_1, moment_2]), n) in
            fused.into_iter().zip(&inputs).zip(&sizes)
        {
            let expected = reference::adam_step(
                param.clone(),
                grad.clone(),
                moment_1.clone(),
                moment_2.clone(),
                hyper,
                kind,
            );
            for (name, f, e) in [
                ("param", out.param, expected.param),
                ("moment_1", out.moment_1, expected.moment_1),
                ("moment_2", out.moment_2, expected.moment_2),
            ] {
                assert_close(
                    &format!("{kind:?} {name} n={n}"),
                    tensor(f),
                    tensor(e),
                    tolerance,
                );
            }
        }
    }

    // Squared norms: f32 sums of n terms in another order.
    let params: Vec<_> = inputs.iter().map(|[p, ..]| p.clone()).collect();
    let sums = tensor(B::sum_squares_multi_tensor(
        params.iter().map(prim).collect(),
    ));
    let expected = Tensor::cat(params.iter().map(|p| p.clone().square().sum()).collect(), 0);
    assert_close("sum_squares_multi_tensor", sums, expected, (1e-5, 1e-5));

    // A whole LAMB step: update, both norms and the trust-ratio step.
    let fused = lamb_multi_tensor::<B>(list(), hyper);
    for ((out, [param, grad, moment_1, moment_2]), n) in fused.into_iter().zip(&inputs).zip(&sizes)
    {
        let update = reference::adam_step(
            param.clone(),
            grad.clone(),
            moment_1.clone(),
            moment_2.clone(),
            hyper,
            AdamKind::LambUpdate,
        );
        let update = tensor(update.param);
        let expected = reference::lamb_apply(
            param.clone(),
            update.clone(),
            param.clone().square().sum(),
            update.square().sum(),
            hyper.lr,
        );
        assert_close(
            &format!("LAMB step n={n}"),
            tensor(out.param),
            expected,
            FWD,
        );
    }

    // A zero update keeps the trust ratio at 1 (and the parameter where it is).
    let param = random::<B, 1>([5], device);
    let zero = Tensor::<B, 1>::zeros([5], device);
    let applied = B::lamb_apply_multi_tensor(
        vec![prim(&param)],
        vec![prim(&zero)],
        B::sum_squares_multi_tensor(vec![prim(&param)]),
        B::sum_squares_multi_tensor(vec![prim(&zero)]),
        1.0,
    );
    let applied = tensor(applied.into_iter().next().unwrap());
    assert_close("lamb_apply with a zero update", applied, param, (0.0, 0.0));
}
