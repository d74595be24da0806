//! The optimizers' formulas with one rank (the compressed average of one rank is its own
//! momentum, as DeepSpeed's `size == 1`): the warm-up equals AdamW/LAMB, the compression
//! stage equals the formulas of `optimizer.rs` evaluated here by hand.

use burn::backend::{Autodiff, NdArray};
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::{OptimizerConfig, OptimizerKind};
use crate::onebit::{OnebitLambCoeff, OnebitVariance};
use crate::optim::PreTrainingOptimizer;

type B = Autodiff<NdArray>;

fn values(t: Tensor<NdArray, 2>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().unwrap()
}

fn grads(model: &Linear<B>, step: usize) -> GradientsParams {
    let device = Default::default();
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(
            (0..8)
                .map(|i| ((i * 5 + step * 3) % 7) as f32 - 3.0)
                .collect(),
            [2, 4],
        ),
        &device,
    );
    let loss = model.forward(x).powf_scalar(2.0).sum();
    GradientsParams::from_grads(loss.backward(), model)
}

fn bias_values(model: &Linear<B>) -> Vec<f32> {
    let bias = model.bias.as_ref().unwrap().val().inner();
    bias.into_data().to_vec::<f32>().unwrap()
}

/// The weight's and the bias's gradients, flat.
fn host_grads(model: &Linear<B>, step: usize) -> (Vec<f32>, Vec<f32>) {
    let mut g = grads(model, step);
    let w = g.remove::<NdArray, 2>(model.weight.id).unwrap();
    let b = g
        .remove::<NdArray, 1>(model.bias.as_ref().unwrap().id)
        .unwrap();
    (values(w), b.into_data().to_vec::<f32>().unwrap())
}

/// A `Linear(4, 3)` (seeded, both parameters drawn), with the 1-bit optimizer `kind` freezing
/// at `freeze` and the exact optimizer of its warm-up, weight decay 0.1.
fn setup(
    kind: OptimizerKind,
    freeze: u64,
    seed: u64,
    variance: OnebitVariance,
    lamb_coeff: OnebitLambCoeff,
) -> (
    Linear<B>,
    PreTrainingOptimizer<Linear<B>, B>,
    PreTrainingOptimizer<Linear<B>, B>,
) {
    let device = Default::default();
    let config = OptimizerConfig {
        name: kind,
        weight_decay: 0.1,
        onebit: crate::config::OnebitConfig {
            freeze_step: Some(freeze),
            variance: Some(variance),
            lamb_coeff,
            ..Default::default()
        },
        ..Default::default()
    };
    // 1-bit LAMB adapts every tensor (DeepSpeed's): its exact optimizer is NVLAMB.
    let exact_config = OptimizerConfig {
        name: kind.exact(),
        nvlamb: kind == OptimizerKind::OnebitLamb,
        ..config.clone()
    };
    B::seed(&device, seed);
    let model: Linear<B> = LinearConfig::new(4, 3).init(&device);
    let _ = (model.weight.val(), model.bias.as_ref().unwrap().val());
    let onebit = PreTrainingOptimizer::new(&config, &model, false);
    let exact = PreTrainingOptimizer::new(&exact_config, &model, false);
    (model, onebit, exact)
}

/// `frozen`: Adam dividing by the variance at the freeze. `frozen-or-fresh`: by the larger of
/// it and the variance of the gradients the momenta imply (one rank: the gradients).
/// `frozen-bounded`: by the larger of the frozen √v̂ and |m̂|.
#[test]
fn onebit_adam_on_one_rank_is_adamw_then_adam_with_the_variance_frozen() {
    for variance in [
        OnebitVariance::Frozen,
        OnebitVariance::FrozenOrFresh,
        OnebitVariance::FrozenBounded,
    ] {
        adam_on_one_rank(variance);
    }
}

fn adam_on_one_rank(variance: OnebitVariance) {
    let freeze = 3;
    let lr = 1e-2;
    let (model, mut onebit, mut exact) = setup(
        OptimizerKind::OnebitAdam,
        freeze,
        5,
        variance,
        OnebitLambCoeff::Computed,
    );
    let (mut a, mut b) = (model.clone(), model);
    for step in 0..freeze as usize {
        let (ga, gb) = (grads(&a, step), grads(&b, step));
        a = exact.step(lr, a, ga);
        b = onebit.step(lr, b, gb);
        assert_eq!(
            values(a.weight.val().inner()),
            values(b.weight.val().inner()),
            "warm-up step {step}"
        );
    }
    assert!(onebit.compressing());
    // The moments at the freeze, by hand from here on.
    let state = onebit.state(&b);
    let mut m_w = state["weight"].moment_1.to_vec::<f32>().unwrap();
    let v_w = state["weight"].moment_2.to_vec::<f32>().unwrap();
    let mut m_b = state["bias"].moment_1.to_vec::<f32>().unwrap();
    let v_b = state["bias"].moment_2.to_vec::<f32>().unwrap();
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-6f32);
    let mut w = values(b.weight.val().inner());
    let mut bias = bias_values(&b);
    let (mut f_w, mut f_b) = (v_w.clone(), v_b.clone());
    let mut fresh_won = false;
    let mut bound_won = false;
    for step in freeze as usize..freeze as usize + 3 {
        let (g_w, g_b) = host_grads(&b, step);
        let g = grads(&b, step);
        b = onebit.step(lr, b, g);
        let t = step as i32 + 1;
        let bc1 = 1.0 - b1.powi(t);
        let bc2 = 1.0 - b2.powi(freeze as i32);
        let bc2_fresh = 1.0 - b2.powi(t);
        for (m, v, f, g, x, decay) in [
            (&mut m_w, &v_w, &mut f_w, &g_w, &mut w, 0.1f32),
            (&mut m_b, &v_b, &mut f_b, &g_b, &mut bias, 0.0),
        ] {
            for k in 0..m.len() {
                let previous = m[k];
                m[k] = b1 * m[k] + (1.0 - b1) * g[k];
                let rebuilt = (m[k] - b1 * previous) / (1.0 - b1);
                f[k] = b2 * f[k] + (1.0 - b2) * rebuilt * rebuilt;
                let mut second = v[k] / bc2;
                if variance == OnebitVariance::FrozenOrFresh && f[k] / bc2_fresh > second {
                    second = f[k] / bc2_fresh;
                    fresh_won = true;
                }
                let mut root = second.sqrt();
                if variance == OnebitVariance::FrozenBounded && (m[k] / bc1).abs() > root {
                    root = (m[k] / bc1).abs();
                    bound_won = true;
                }
                let u = (m[k] / bc1) / (root + eps) + decay * x[k];
                x[k] -= lr as f32 * u;
            }
        }
        let got_w = values(b.weight.val().inner());
        let got_b = bias_values(&b);
        for (got, want) in [(&got_w, &w), (&got_b, &bias)] {
            for (x, y) in got.iter().zip(want.iter()) {
                assert!((x - y).abs() < 1e-6, "step {step}: {got:?} vs {want:?}");
            }
        }
    }
    // Frozen: the variance did not move; the momentum did.
    let after = onebit.state(&b);
    assert_eq!(after["weight"].moment_2.to_vec::<f32>().unwrap(), v_w);
    assert_eq!(after["weight"].moment_1.to_vec::<f32>().unwrap(), m_w);
    assert_eq!(after["weight"].time, freeze as usize + 3);
    // The gradients grow as the weights do: the fresh variance took over somewhere.
    assert_eq!(fresh_won, variance == OnebitVariance::FrozenOrFresh);
    // ... and the momentum outgrew the frozen variance somewhere.
    assert_eq!(bound_won, variance == OnebitVariance::FrozenBounded);
}

/// ‖x‖₂ in f64.
fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt()
}

/// DeepSpeed's formulas (`frozen-factor`: the warm-up's averaged trust ratio times the
/// clamped factor), and `computed` (each step's ‖w‖/‖u‖), by hand.
#[test]
fn onebit_lamb_on_one_rank_follows_deepspeeds_formulas() {
    for lamb_coeff in [OnebitLambCoeff::FrozenFactor, OnebitLambCoeff::Computed] {
        lamb_on_one_rank(lamb_coeff);
    }
}

fn lamb_on_one_rank(lamb_coeff: OnebitLambCoeff) {
    let freeze = 3usize;
    let lr = 1e-2;
    let wd = 0.1f32;
    // DeepSpeed's formulas: the frozen variance in the update.
    let (model, mut onebit, mut exact) = setup(
        OptimizerKind::OnebitLamb,
        freeze as u64,
        6,
        OnebitVariance::Frozen,
        lamb_coeff,
    );
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-6f32);
    let (mut a, mut b) = (model.clone(), model);
    // Warm-up: exact LAMB, and the averaged clipped trust ratio of each tensor by hand.
    let mut coeff = [0.0f32; 2];
    for step in 0..freeze {
        let before = [values(a.weight.val().inner()), bias_values(&a)];
        let (ga, gb) = (grads(&a, step), grads(&b, step));
        a = exact.step(lr, a, ga);
        b = onebit.step(lr, b, gb);
        assert_eq!(
            values(a.weight.val().inner()),
            values(b.weight.val().inner())
        );
        let state = exact.state(&a);
        for (k, (path, decay)) in [("weight", wd), ("bias", 0.0)].into_iter().enumerate() {
            let m = state[path].moment_1.to_vec::<f32>().unwrap();
            let v = state[path].moment_2.to_vec::<f32>().unwrap();
            let t = step as i32 + 1;
            let u: Vec<f32> = (0..m.len())
                .map(|i| {
                    (m[i] / (1.0 - b1.powi(t))) / ((v[i] / (1.0 - b2.powi(t))).sqrt() + eps)
                        + decay * before[k][i]
                })
                .collect();
            let ratio = (norm(&before[k]) / norm(&u)).clamp(0.01, 10.0) as f32;
            if ratio != 1.0 {
                coeff[k] = 0.9 * coeff[k] + 0.1 * ratio;
            }
        }
    }
    // The freeze: scaling coefficients from the momenta's RMS.
    let state = onebit.state(&b);
    let mut m: Vec<Vec<f32>> = ["weight", "bias"]
        .iter()
        .map(|p| state[*p].moment_1.to_vec::<f32>().unwrap())
        .collect();
    let v: Vec<Vec<f32>> = ["weight", "bias"]
        .iter()
        .map(|p| state[*p].moment_2.to_vec::<f32>().unwrap())
        .collect();
    let rms = |x: &[f32]| (norm(x) / (x.len() as f64).sqrt()) as f32;
    let scales = [rms(&m[0]), rms(&m[1])];
    let united = (scales[0] + scales[1]) / 2.0;
    let mut v_fresh = v.clone();
    let mut last_factor = [1.0f32; 2];
    let mut w = [values(b.weight.val().inner()), bias_values(&b)];
    let mut factors_seen = Vec::new();
    for step in freeze..freeze + 4 {
        let g = host_grads(&b, step);
        let g = [g.0, g.1];
        let gb = grads(&b, step);
        b = onebit.step(lr, b, gb);
        let t = step as i32 + 1;
        for k in 0..2 {
            let decay = if k == 0 { wd } else { 0.0 };
            let scaling = united / scales[k];
            let previous = m[k].clone();
            // Momentum, scaled, "compressed" (one rank: itself), unscaled.
            for i in 0..m[k].len() {
                m[k][i] = (b1 * m[k][i] + (1.0 - b1) * g[k][i]) * scaling / scaling;
            }
            let mut prelim = Vec::new();
            let mut update = Vec::new();
            let mut factor = f32::MIN;
            for i in 0..m[k].len() {
                let rebuilt = (m[k][i] - b1 * previous[i]) / (1.0 - b1);
                v_fresh[k][i] = b2 * v_fresh[k][i] + (1.0 - b2) * rebuilt * rebuilt;
                let denom = (v[k][i] / (1.0 - b2.powi(freeze as i32))).sqrt() + eps;
                let fresh = (v_fresh[k][i] / (1.0 - b2.powi(t))).sqrt() + eps;
                factor = factor.max(denom / fresh);
                prelim.push((m[k][i] / (1.0 - b1.powi(t))) / denom);
                update.push(prelim[i] + decay * w[k][i]);
            }
            if decay > 0.0 {
                let ratio = (norm(&prelim) / norm(&update)).min(1.0) as f32;
                factor = factor * ratio + (1.0 - ratio);
            }
            factor = factor
                .clamp(0.5, 4.0)
                .clamp(last_factor[k] * 0.9, last_factor[k] * 1.1);
            last_factor[k] = factor;
            factors_seen.push(factor);
            let scaling = match lamb_coeff {
                OnebitLambCoeff::FrozenFactor => coeff[k] * factor,
                OnebitLambCoeff::Computed => (norm(&w[k]) / norm(&update)) as f32,
            };
            for i in 0..w[k].len() {
                w[k][i] -= lr as f32 * scaling * update[i];
            }
        }
        let got = [values(b.weight.val().inner()), bias_values(&b)];
        for k in 0..2 {
            for (x, y) in got[k].iter().zip(&w[k]) {
                assert!(
                    (x - y).abs() < 1e-5,
                    "step {step}, tensor {k}: {:?} vs {:?}",
                    got[k],
                    w[k]
                );
            }
        }
    }
    // The factors did something (not all 1), and the averaged ratios are real.
    assert!(
        factors_seen.iter().any(|&f| (f - 1.0).abs() > 1e-3),
        "{factors_seen:?}"
    );
    assert!(coeff.iter().all(|&c| c > 0.0), "{coeff:?}");
}
