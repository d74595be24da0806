//! NdArray's [`FusedOps::adam_multi_tensor`](crate::FusedOps::adam_multi_tensor): one pass over
//! each tensor, as apex's `multi_tensor_adam` kernel, on the CPU's threads; and the rest of a
//! LAMB step, [`FusedOps::sum_squares_multi_tensor`](crate::FusedOps::sum_squares_multi_tensor)
//! (apex's `multi_tensor_l2norm`) and
//! [`FusedOps::lamb_apply_multi_tensor`](crate::FusedOps::lamb_apply_multi_tensor) (its
//! `multi_tensor_lamb` stage 2), each one pass per tensor instead of the reference's
//! composition (a cast to f64, a square and a sum, each a whole-tensor copy; then three ops for
//! `w − lr·r·u`): LAMB's step cost 1.5× AdamW's on the tiny model before (docs/performance.md).
//!
//! The reference composition (and Burn's `AdamW`) computes a step as about a dozen whole-tensor
//! ops, each a single-threaded pass that allocates its result: BERT-base's AdamW step took
//! 0.7 s of a 4.0 s CPU training step (batch 8 × 128, 2 cores). Here each element's moments,
//! direction and new value are computed in one fused loop, split over rayon's threads. The
//! arithmetic is the reference's, operation by operation in f32 with the same f32 constants
//! (`hyper`'s f64 values rounded once, as Burn's scalar ops round them), so it equals the
//! reference to f32 rounding (the unit test holds it to 1 ulp-scale tolerance). The step
//! writes into the parameter's and moments' own buffers when no other tensor holds them
//! (copy-on-write otherwise): allocating and zeroing three fresh outputs per step was a fifth
//! of BERT-base's optimizer time.

use burn_ndarray::NdArrayTensor;
use ndarray::{ArcArray, Array1, ArrayView1, Ix1, IxDyn};
use rayon::prelude::*;

/// Elements per task of rayon's threads.
const CHUNK: usize = 1 << 16;

use crate::{AdamHyper, AdamKind, AdamTensors};

/// The f32 constants of one step, rounded from `hyper` as Burn's scalar ops round them.
#[derive(Clone, Copy)]
struct Constants {
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    correction_1: f32,
    correction_2: f32,
    epsilon: f32,
    lr: f32,
    weight_decay: f32,
    decay_factor: f32,
}

impl Constants {
    fn new(hyper: &AdamHyper) -> Self {
        let (c1, c2) = hyper.corrections();
        Self {
            beta_1: hyper.beta_1 as f32,
            one_minus_beta_1: (1.0 - hyper.beta_1) as f32,
            beta_2: hyper.beta_2 as f32,
            one_minus_beta_2: (1.0 - hyper.beta_2) as f32,
            correction_1: c1 as f32,
            correction_2: c2 as f32,
            epsilon: hyper.epsilon as f32,
            lr: hyper.lr as f32,
            weight_decay: hyper.weight_decay as f32,
            decay_factor: (1.0 - hyper.lr * hyper.weight_decay) as f32,
        }
    }
}

/// One element: `(new parameter or LAMB update, m, v)`, the reference's ops in its order.
#[inline(always)]
fn element(c: Constants, kind: AdamKind, decays: bool, p: f32, g: f32, m: f32, v: f32) -> [f32; 3] {
    let m = m * c.beta_1 + g * c.one_minus_beta_1;
    let v = v * c.beta_2 + (g * g) * c.one_minus_beta_2;
    let direction = (m / c.correction_1) / ((v / c.correction_2).sqrt() + c.epsilon);
    let out = match (kind, decays) {
        (AdamKind::AdamW, false) => p - direction * c.lr,
        (AdamKind::AdamW, true) => p * c.decay_factor - direction * c.lr,
        (AdamKind::LambUpdate, false) => direction,
        (AdamKind::LambUpdate, true) => direction + p * c.weight_decay,
    };
    [out, m, v]
}

fn flat(x: &NdArrayTensor) -> Option<ArrayView1<'_, f32>> {
    match x {
        NdArrayTensor::F32(storage) => storage.view().into_dimensionality::<Ix1>().ok(),
        _ => None,
    }
}

/// `x`'s f32 array to write the step's result into: `x`'s own buffer when nothing else holds
/// it (the optimizer's moments, a parameter whose module copy was dropped), else a copy
/// (copy-on-write), so that no other tensor sees the update.
pub(crate) fn writable(x: NdArrayTensor) -> Option<ArcArray<f32, IxDyn>> {
    match x {
        NdArrayTensor::F32(storage) => {
            let mut array = storage.into_owned();
            if !array.is_standard_layout() {
                array = array.as_standard_layout().into_owned().into_shared();
            }
            Some(array)
        }
        _ => None,
    }
}

/// One tensor's step, in place where the buffers are not shared (see [`writable`]);
/// `tensors` is given back unless all four are flat f32 arrays of one length (the caller then
/// runs the reference).
pub(crate) fn adam_step<B>(
    tensors: AdamTensors<B>,
    hyper: &AdamHyper,
    kind: AdamKind,
) -> Result<[NdArrayTensor; 3], Box<AdamTensors<B>>>
where
    B: burn::tensor::backend::Backend<FloatTensorPrimitive = NdArrayTensor>,
{
    let n = match flat(&tensors.param) {
        Some(p) => p.len(),
        None => return Err(Box::new(tensors)),
    };
    let fits = [&tensors.grad, &tensors.moment_1, &tensors.moment_2]
        .iter()
        .all(|x| flat(x).is_some_and(|x| x.len() == n));
    if !fits {
        return Err(Box::new(tensors));
    }
    let AdamTensors {
        param,
        grad,
        moment_1,
        moment_2,
    } = tensors;
    let c = Constants::new(hyper);
    let decays = hyper.weight_decay != 0.0;
    let g = flat(&grad).expect("checked above");
    let g = g.as_standard_layout();
    let g = g.as_slice().expect("a standard-layout view is one slice");
    let (Some(mut p), Some(mut m), Some(mut v)) =
        (writable(param), writable(moment_1), writable(moment_2))
    else {
        unreachable!("checked above: all three are f32")
    };
    {
        let (ps, ms, vs) = (
            p.as_slice_mut().expect("standard layout"),
            m.as_slice_mut().expect("standard layout"),
            v.as_slice_mut().expect("standard layout"),
        );
        ps.par_chunks_mut(CHUNK)
            .zip(ms.par_chunks_mut(CHUNK))
            .zip(vs.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(chunk, ((ps, ms), vs))| {
                let start = chunk * CHUNK;
                for i in 0..ps.len() {
                    [ps[i], ms[i], vs[i]] =
                        element(c, kind, decays, ps[i], g[start + i], ms[i], vs[i]);
                }
            });
    }
    Ok([p, m, v].map(NdArrayTensor::from))
}

/// `Σ x²` of each flat f32 tensor, accumulated in f64 as the reference does (`host_norm`'s
/// fixed lanes, then rounded to f32), the tensors on rayon's threads; `None` (the caller runs
/// the reference) unless every tensor is flat f32.
///
/// # Shapes
/// `xs`, each `[n_i]` → `[xs.len()]`
pub(crate) fn sum_squares(xs: &[NdArrayTensor]) -> Option<NdArrayTensor> {
    let views = xs.iter().map(flat).collect::<Option<Vec<_>>>()?;
    let sums: Vec<f32> = views
        .par_iter()
        .map(|x| {
            let x = x.as_standard_layout();
            let x = x.as_slice().expect("a standard-layout view is one slice");
            crate::host_norm::sum_squares(x) as f32
        })
        .collect();
    Some(NdArrayTensor::from(
        Array1::from(sums).into_dyn().into_shared(),
    ))
}

/// LAMB's trust ratio from squared norms, as [`reference::lamb_apply`](crate::reference::lamb_apply)
/// computes it in f32: `‖w‖ / max(‖u‖, f32::MIN_POSITIVE)`, 1 where either norm is ≤ 0.
fn trust_ratio(param_sq: f32, update_sq: f32) -> f32 {
    let (w, u) = (param_sq.sqrt(), update_sq.sqrt());
    // Burn's `clamp_min` (`x < min ? min : x`: NaN stays NaN), then the two masks.
    let clamped = if u < f32::MIN_POSITIVE {
        f32::MIN_POSITIVE
    } else {
        u
    };
    if u <= 0.0 || w <= 0.0 {
        1.0
    } else {
        w / clamped
    }
}

/// `w_i ← w_i − u_i · (r_i · lr)` for each tensor (the reference's f32 operations in its
/// order, so its bits), in the parameter's buffer when nothing else holds it; `params` given
/// back (the caller runs the reference) unless every tensor is flat f32 of its update's length.
pub(crate) fn lamb_apply(
    params: Vec<NdArrayTensor>,
    updates: &[NdArrayTensor],
    param_sq: &NdArrayTensor,
    update_sq: &NdArrayTensor,
    lr: f64,
) -> Result<Vec<NdArrayTensor>, Vec<NdArrayTensor>> {
    let squares = |x: &NdArrayTensor| flat(x).map(|x| x.to_vec());
    let (Some(param_sq), Some(update_sq)) = (squares(param_sq), squares(update_sq)) else {
        return Err(params);
    };
    let fits = param_sq.len() == params.len()
        && update_sq.len() == params.len()
        && updates.len() == params.len()
        && params
            .iter()
            .zip(updates)
            .all(|(p, u)| matches!((flat(p), flat(u)), (Some(p), Some(u)) if p.len() == u.len()));
    if !fits {
        return Err(params);
    }
    let lr = lr as f32;
    Ok(params
        .into_iter()
        .zip(updates)
        .enumerate()
        .map(|(i, (param, update))| {
            let step = trust_ratio(param_sq[i], update_sq[i]) * lr;
            let u = flat(update).expect("checked above");
            let u = u.as_standard_layout();
            let u = u.as_slice().expect("a standard-layout view is one slice");
            let mut w = writable(param).expect("checked above: f32");
            w.as_slice_mut()
                .expect("standard layout")
                .par_chunks_mut(CHUNK)
                .zip(u.par_chunks(CHUNK))
                .for_each(|(w, u)| {
                    for (w, &u) in w.iter_mut().zip(u) {
                        *w -= u * step;
                    }
                });
            NdArrayTensor::from(w)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Tensor};

    use crate::{AdamHyper, AdamKind, AdamTensors, FusedOps, reference};

    /// A flat f32 primitive's values.
    fn data(x: burn::tensor::ops::FloatTensor<NdArray>) -> Vec<f32> {
        Tensor::<NdArray, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(x))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    }

    /// The fused loop against the reference composition, AdamW and LAMB's update, with and
    /// without weight decay, at step 1 and a later step (other bias corrections).
    #[test]
    fn ndarray_adam_equals_the_reference_composition() {
        let device = Default::default();
        let t = |seed: f64| {
            Tensor::<NdArray, 1>::random([1031], Distribution::Normal(seed, 1.0), &device)
        };
        let (p, g, m) = (t(0.0), t(0.1), t(-0.2));
        let v = t(0.0).abs();
        for kind in [AdamKind::AdamW, AdamKind::LambUpdate] {
            for (weight_decay, step) in [(0.0, 1), (0.01, 1), (0.01, 37)] {
                let hyper = AdamHyper {
                    lr: 2e-3,
                    beta_1: 0.9,
                    beta_2: 0.999,
                    epsilon: 1e-6,
                    weight_decay,
                    step,
                };
                let ours = <NdArray as FusedOps>::adam_multi_tensor(
                    vec![AdamTensors {
                        param: p.clone().into_primitive().tensor(),
                        grad: g.clone().into_primitive().tensor(),
                        moment_1: m.clone().into_primitive().tensor(),
                        moment_2: v.clone().into_primitive().tensor(),
                    }],
                    hyper,
                    kind,
                )
                .remove(0);
                let reference = reference::adam_step::<NdArray>(
                    p.clone(),
                    g.clone(),
                    m.clone(),
                    v.clone(),
                    hyper,
                    kind,
                );
                for (what, a, b) in [
                    ("param", ours.param, reference.param),
                    ("m", ours.moment_1, reference.moment_1),
                    ("v", ours.moment_2, reference.moment_2),
                ] {
                    // AdamW's `p·(1 − lrλ) − lr·d` may cancel: its rounding is relative to
                    // the terms (|p| + |update|), not to the small result.
                    let scale = data(p.clone().into_primitive().tensor());
                    for (i, (x, y)) in data(a).iter().zip(data(b)).enumerate() {
                        let magnitude = if what == "param" {
                            y.abs() + scale[i].abs() + 1e-2
                        } else {
                            y.abs()
                        };
                        assert!(
                            (x - y).abs() <= 2.0 * f32::EPSILON * magnitude.max(1e-30),
                            "{kind:?} wd {weight_decay} step {step} {what}[{i}]: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }

    /// The step writes into buffers nobody else holds, and copies the ones another tensor
    /// still holds (that tensor keeps its values).
    #[test]
    fn ndarray_adam_updates_in_place_only_unshared_buffers() {
        let device = Default::default();
        let values = |x: &Tensor<NdArray, 1>| x.clone().into_data().to_vec::<f32>().unwrap();
        let t = |mean: f64| {
            Tensor::<NdArray, 1>::random([300], Distribution::Normal(mean, 1.0), &device)
        };
        let (p, g, m) = (t(0.0), t(0.1), t(-0.2));
        let v = t(0.0).abs();
        let hyper = AdamHyper {
            lr: 1e-2,
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-6,
            weight_decay: 0.01,
            step: 3,
        };
        let expected = reference::adam_step::<NdArray>(
            p.clone(),
            g.clone(),
            m.clone(),
            v.clone(),
            hyper,
            AdamKind::AdamW,
        );
        let (p_before, m_before) = (values(&p), values(&m));
        // `p` and `m` stay held here (shared: copied); `v` is handed over (unique: in place).
        let v_copy = Tensor::<NdArray, 1>::from_data(v.to_data(), &device);
        let out = <NdArray as FusedOps>::adam_multi_tensor(
            vec![AdamTensors {
                param: p.clone().into_primitive().tensor(),
                grad: g.into_primitive().tensor(),
                moment_1: m.clone().into_primitive().tensor(),
                moment_2: v_copy.into_primitive().tensor(),
            }],
            hyper,
            AdamKind::AdamW,
        )
        .remove(0);
        assert_eq!(values(&p), p_before, "a shared parameter keeps its values");
        assert_eq!(values(&m), m_before, "a shared moment keeps its values");
        for (what, a, b) in [
            ("param", out.param, expected.param),
            ("m", out.moment_1, expected.moment_1),
            ("v", out.moment_2, expected.moment_2),
        ] {
            for (i, (x, y)) in data(a).iter().zip(data(b)).enumerate() {
                assert!(
                    (x - y).abs() <= 4.0 * f32::EPSILON * (1.0 + y.abs()),
                    "{what}[{i}]: {x} vs {y}"
                );
            }
        }
    }

    /// NdArray's LAMB second half and norms against the reference composition: the squared
    /// norms to f32 rounding of the f64 sum, the new parameters bit for bit (same f32
    /// operations), including a zero update (trust ratio 1) and a parameter another tensor
    /// still holds (copied, keeping its values).
    #[test]
    fn ndarray_lamb_apply_and_norms_equal_the_reference() {
        let device = Default::default();
        let t = |n: usize, mean: f64| {
            Tensor::<NdArray, 1>::random([n], Distribution::Normal(mean, 1.0), &device)
        };
        let params = vec![t(1031, 0.0), t(17, 0.5), t(300, -0.1)];
        let updates = vec![t(1031, 0.1), Tensor::zeros([17], &device), t(300, 0.2)];
        let prim = |x: &Tensor<NdArray, 1>| x.clone().into_primitive().tensor();
        let xs: Vec<_> = params.iter().chain(&updates).map(prim).collect();
        let ours = data(<NdArray as FusedOps>::sum_squares_multi_tensor(xs.clone()));
        for (i, x) in params.iter().chain(&updates).enumerate() {
            let exact: f64 = x
                .clone()
                .into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum();
            assert_eq!(ours[i], exact as f32, "tensor {i}");
        }
        let squares =
            Tensor::<NdArray, 1>::from_data(burn::tensor::TensorData::new(ours, [6]), &device);
        let (param_sq, update_sq) = (squares.clone().slice(0..3), squares.slice(3..6));
        let before = data(prim(&params[0]));
        let held = params[0].clone();
        let new = <NdArray as FusedOps>::lamb_apply_multi_tensor(
            params.iter().map(prim).collect(),
            updates.iter().map(prim).collect(),
            prim(&param_sq),
            prim(&update_sq),
            2e-3,
        );
        assert_eq!(
            data(prim(&held)),
            before,
            "a shared parameter keeps its values"
        );
        for (i, new) in new.into_iter().enumerate() {
            let expected = reference::lamb_apply(
                params[i].clone(),
                updates[i].clone(),
                param_sq.clone().slice(i..i + 1),
                update_sq.clone().slice(i..i + 1),
                2e-3,
            );
            assert_eq!(
                data(new),
                data(expected.into_primitive().tensor()),
                "tensor {i}"
            );
        }
    }
}
