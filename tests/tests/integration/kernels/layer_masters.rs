//! Note [Parameter gradients in f32] (backend-ext's `masters.rs`): the fused bias + GELU and
//! bias + dropout + residual + LayerNorm of f32 master parameters and their half copies
//! (`dtype`: f16 on wgpu, bf16 on CUDA), against the same ops of the cast copies.
//!
//! - The outputs and the activations' gradients are the same bits (the same kernels read the
//!   same copies).
//! - The masters' gradients are f32, and most carry bits the half type has not. GELU's bias
//!   gradient is within f32 rounding of the f64 column sums of the half rows it sums (the
//!   gradient at GELU's input, which is `dx`).
//! - The LayerNorm's bias, γ and β gradients are those of the copies' path before its
//!   rounding: the copies' path writes the same f32 sums in the half type, then casts them
//!   back, so rounding ours to the half type gives its values bit for bit.
//! - Backward takes fewer launches than the copies' path, whose cast nodes cast each
//!   parameter's gradient back (the launches counted by the counting runtime).

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOps, Gelu, HostSyncs};

use super::common::{random, values};

/// `Σ_r rows[r, c]` in f64 of a `[.., N]` tensor's values.
fn column_sums_f64(rows: &[f32], n: usize) -> Vec<f64> {
    let mut sums = vec![0.0f64; n];
    for (i, v) in rows.iter().enumerate() {
        sums[i % n] += f64::from(*v);
    }
    sums
}

/// Asserts `actual` (f32) within f32 rounding of the f64 `expected`, and that most entries
/// change when rounded to `dtype` (they carry more than the half type).
fn assert_f32_sums<A: AutodiffBackend>(
    what: &str,
    actual: Tensor<A::InnerBackend, 1>,
    expected: &[f64],
    dtype: DType,
) {
    assert_eq!(actual.dtype(), DType::F32, "{what}: in the masters' dtype");
    let rounded = values(actual.clone().cast(dtype));
    let actual = values(actual);
    let scale = expected.iter().fold(1.0f64, |m, v| m.max(v.abs()));
    for (c, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (f64::from(*a) - e).abs() <= 1e-5 * scale,
            "{what}[{c}]: {a} but the f64 column sum is {e}"
        );
    }
    let changed = actual.iter().zip(&rounded).filter(|(a, r)| a != r).count();
    assert!(
        changed * 2 > actual.len(),
        "{what}: no more than the half type: {changed} of {} entries change when rounded",
        actual.len()
    );
}

pub fn check_layer_ops_of_masters<A: AutodiffBackend + FusedOps>(device: &A::Device, dtype: DType)
where
    A::InnerBackend: FusedOps,
{
    let (b, s, n) = (3, 37, 96);
    let x0 = random::<A::InnerBackend, 3>([b, s, n], device).cast(dtype);
    let residual0 = random::<A::InnerBackend, 3>([b, s, n], device).cast(dtype);
    let vectors0: Vec<_> = (0..3)
        .map(|k| {
            random::<A::InnerBackend, 1>([n], device).add_scalar(if k == 1 { 1.0 } else { 0.0 })
        })
        .collect();
    let probe = random::<A::InnerBackend, 3>([b, s, n], device);
    let dropout = DropoutSpec::new(0.1, 7);

    // One forward and backward of GELU(x + bias) fed into LayerNorm(residual + dropout(h +
    // bias)) · γ + β; `masters`: the ops of masters, else the ops of the cast copies.
    let step = |masters: bool| {
        let x = Tensor::<A, 3>::from_inner(x0.clone()).require_grad();
        let residual = Tensor::<A, 3>::from_inner(residual0.clone()).require_grad();
        let params: Vec<Tensor<A, 1>> = vectors0
            .iter()
            .map(|v| Tensor::from_inner(v.clone()).require_grad())
            .collect();
        let gelu_bias = Tensor::<A, 1>::from_inner(vectors0[2].clone() * 0.5).require_grad();
        let copies: Vec<Tensor<A, 1>> = params.iter().map(|p| p.clone().cast(dtype)).collect();
        let gelu_copy = gelu_bias.clone().cast(dtype);
        let hidden = if masters {
            ember_backend_ext::bias_gelu_of_master(
                x.clone(),
                gelu_bias.clone(),
                gelu_copy,
                Gelu::Tanh,
            )
        } else {
            ember_backend_ext::bias_gelu(x.clone(), gelu_copy, Gelu::Tanh)
        };
        let y = if masters {
            ember_backend_ext::bias_dropout_add_layer_norm_of_masters(
                hidden.clone(),
                (params[0].clone(), copies[0].clone()),
                residual.clone(),
                (
                    (params[1].clone(), copies[1].clone()),
                    (params[2].clone(), copies[2].clone()),
                ),
                dropout,
                1e-12,
            )
        } else {
            ember_backend_ext::bias_dropout_add_layer_norm(
                hidden.clone(),
                copies[0].clone(),
                residual.clone(),
                copies[1].clone(),
                copies[2].clone(),
                dropout,
                1e-12,
            )
        };
        assert_eq!(y.dtype(), dtype, "the output in the half type");
        let loss = (y.clone().cast(DType::F32) * Tensor::from_inner(probe.clone())).sum();
        A::sync(device).unwrap(); // the forward's launches counted before the mark
        let forward_done = HostSyncs::now();
        let grads = loss.backward();
        let grad = |t: &Tensor<A, 1>| t.grad(&grads).expect("a parameter's gradient");
        let param_grads: Vec<_> = params.iter().map(grad).collect();
        let gelu_grad = grad(&gelu_bias);
        let dx = x.grad(&grads).expect("x's gradient");
        let dresidual = residual.grad(&grads).expect("the residual's gradient");
        for g in &param_grads {
            let _ = g.clone().into_data();
        }
        let _ = (gelu_grad.clone().into_data(), dx.clone().into_data());
        let launches = HostSyncs::now().since(forward_done).launches;
        (y.inner(), dx, dresidual, param_grads, gelu_grad, launches)
    };
    let _ = (step(true), step(false)); // compile first
    let (y, dx, dresidual, grads, gelu_grad, launches) = step(true);
    let (y_c, dx_c, dresidual_c, grads_c, _, launches_c) = step(false);

    assert_eq!(values(y), values(y_c), "outputs");
    assert_eq!(dx.dtype(), dtype, "dx in the half type");
    assert_eq!(values(dx.clone()), values(dx_c), "dx");
    assert_eq!(
        values(dresidual),
        values(dresidual_c),
        "the residual's gradient"
    );

    // GELU's bias sums the gradient at GELU's input, which is dx.
    let dx_values = values(dx);
    assert_f32_sums::<A>(
        "bias_gelu's bias gradient",
        gelu_grad,
        &column_sums_f64(&dx_values, n),
        dtype,
    );
    // The LayerNorm's bias sums the gradient at its input, which is GELU's output's; γ's and
    // β's sums are checked against the copies' path, rounded.
    for (name, (ours, copies)) in ["bias", "gamma", "beta"]
        .into_iter()
        .zip(grads.into_iter().zip(grads_c))
    {
        assert_eq!(ours.dtype(), DType::F32, "{name}: in the masters' dtype");
        assert_eq!(
            values(ours.clone().cast(dtype)),
            values(copies),
            "{name}: ours rounded to the half type is the copies' path"
        );
        let rounded = values(ours.clone().cast(dtype));
        let ours = values(ours);
        let changed = ours.iter().zip(&rounded).filter(|(a, r)| a != r).count();
        assert!(
            changed * 2 > ours.len(),
            "{name}: no more than the half type ({changed} of {} change)",
            ours.len()
        );
    }
    assert!(
        launches < launches_c,
        "backward launches: {launches} with the masters, {launches_c} with cast copies"
    );
}
