//! One step of the compression stage (the formulas are in `optimizer.rs`'s module docs), on
//! the host: the parameters and local gradients are read, the momenta averaged by the
//! compressed allreduce, and the new parameters written back.

use std::collections::HashMap;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate};
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;

use super::allreduce::BytesSent;
use super::optimizer::{OnebitKind, OnebitOptimizer, OnebitStep, ReadHost, WriteHost};
use crate::onebit::{OnebitLambCoeff, OnebitVariance};
use crate::parallel::CommError;
use ember_backend_ext::host_norm::norm;

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> OnebitOptimizer<M, B> {
    /// The compression stage's step (see the module docs of `optimizer.rs`).
    pub(crate) fn compressed_step(
        &mut self,
        lr: LearningRate,
        module: M,
        mut grads: GradientsParams,
    ) -> Result<(M, OnebitStep), CommError> {
        let started = std::time::Instant::now();
        let values = self
            .stage
            .as_ref()
            .expect("the compression stage")
            .params
            .iter()
            .filter(|p| p.w.is_empty())
            .map(|p| p.id)
            .collect();
        let mut read = ReadHost::<B> {
            grads: &mut grads,
            values,
            out: HashMap::new(),
            backend: std::marker::PhantomData,
        };
        module.visit(&mut read);
        let mut host = read.out;
        let lamb = self.kind == OnebitKind::Lamb;
        let fresh = self.tracks_fresh_variance();
        let floor = self.settings.variance == Some(OnebitVariance::FrozenOrFresh);
        let bounded = self.settings.variance == Some(OnebitVariance::FrozenBounded);
        let (b1, b2, eps) = (self.hyper.beta1, self.hyper.beta2, self.hyper.epsilon);
        let weight_decay = self.hyper.weight_decay;
        let s = self.settings.clone();
        let stage = self.stage.as_mut().expect("the compression stage");
        stage.time += 1;
        self.steps += 1;

        let read_s = started.elapsed().as_secs_f64();
        // 1. Each rank's momentum from its local gradient (no gradient: a zero one).
        let mut previous = Vec::new();
        for p in &mut stage.params {
            if fresh {
                previous.push(p.m.clone());
            }
            match host.get(&p.id).and_then(|(_, g)| g.as_ref()) {
                Some(g) => {
                    for (m, &g) in p.m.iter_mut().zip(g) {
                        *m = b1 * *m + (1.0 - b1) * g;
                    }
                }
                None => p.m.iter_mut().for_each(|m| *m *= b1),
            }
            if lamb {
                p.m.iter_mut().for_each(|m| *m *= p.scaling_coeff);
            }
        }

        let momentum_s = started.elapsed().as_secs_f64();
        // 2. The compressed average: one segment per tensor (Adam), one for all (LAMB).
        let values: Vec<Vec<f32>> = match self.kind {
            OnebitKind::Adam => stage
                .params
                .iter_mut()
                .map(|p| std::mem::take(&mut p.m))
                .collect(),
            // Copied back to back (each `p.m` keeps its buffer for the average below).
            OnebitKind::Lamb => {
                let total = stage.params.iter().map(|p| p.m.len()).sum();
                let mut flat = Vec::with_capacity(total);
                for p in &stage.params {
                    flat.extend_from_slice(&p.m);
                }
                vec![flat]
            }
        };
        let allreduce = stage
            .allreduce
            .take()
            .expect("error feedback between steps");
        let (allreduce, values, bytes) = match &self.comm {
            Some(comm) => comm.call(move |c| {
                let (mut allreduce, mut values) = (allreduce, values);
                let sent = allreduce.run(c, &mut values)?;
                Ok((allreduce, values, sent))
            })?,
            None => (allreduce, values, BytesSent::default()),
        };
        stage.allreduce = Some(allreduce);
        let mut values = values.into_iter();
        match self.kind {
            OnebitKind::Adam => {
                for (p, v) in stage.params.iter_mut().zip(values) {
                    p.m = v;
                }
            }
            OnebitKind::Lamb => {
                let flat = values.next().expect("one segment");
                let mut offset = 0;
                for p in &mut stage.params {
                    let n = p.m.len();
                    p.m.copy_from_slice(&flat[offset..offset + n]);
                    offset += n;
                }
            }
        }

        let allreduce_s = started.elapsed().as_secs_f64();
        // 3. The update with the frozen variance.
        let bc1 = 1.0 - b1.powi(stage.time as i32);
        let bc2 = 1.0 - b2.powi(stage.frozen_time as i32);
        let bc2_fresh = 1.0 - b2.powi(stage.time as i32);
        let lr = lr as f32;
        let mut updated = HashMap::new();
        for (k, p) in stage.params.iter_mut().enumerate() {
            if lamb {
                p.m.iter_mut().for_each(|m| *m /= p.scaling_coeff);
            }
            if let Some(mask) = &stage.masks[k] {
                for (m, &masked) in p.m.iter_mut().zip(mask) {
                    if masked {
                        *m = 0.0;
                    }
                }
            }
            if let Some((Some(value), _)) = host.remove(&p.id) {
                p.w = value;
            }
            let w = &mut p.w;
            let decay = if p.decay { weight_decay } else { 0.0 };
            if fresh {
                // The gradient the averaged momenta imply, into the fresh variance.
                for ((f, &m), &prev) in p.v_fresh.iter_mut().zip(&p.m).zip(&previous[k]) {
                    let g = (m - b1 * prev) / (1.0 - b1);
                    *f = b2 * *f + (1.0 - b2) * g * g;
                }
            }
            let den = Denominator {
                bc1,
                bc2,
                bc2_fresh,
                eps,
                floor,
                bounded,
            };
            if !lamb {
                // Adam: one pass, no temporaries; zipped slices without an index (bounds
                // checks kept the loop scalar), the same operations in the same order.
                let apply = |w: &mut f32, m: f32, v: f32, f: f32| {
                    let u = (m / bc1) / den.of(v, f, m) + decay * *w;
                    *w -= lr * u;
                };
                if p.v_fresh.is_empty() {
                    for ((w, &m), &v) in w.iter_mut().zip(&p.m).zip(&p.v) {
                        apply(w, m, v, 0.0);
                    }
                } else {
                    for (((w, &m), &v), &f) in w.iter_mut().zip(&p.m).zip(&p.v).zip(&p.v_fresh) {
                        apply(w, m, v, f);
                    }
                }
                updated.insert(p.id, w.clone());
                continue;
            }
            // The preliminary update `m̂ / denom` and each denominator
            // ([`prelim_and_denominators`]); then, with a fresh variance, the largest ratio of
            // the frozen denominator to the fresh one ([`largest_ratio`]).
            let n = p.m.len();
            let zeros;
            let fresh: &[f32] = if p.v_fresh.is_empty() {
                zeros = vec![0.0; n];
                &zeros
            } else {
                &p.v_fresh
            };
            let (mut prelim, mut denoms) = (vec![0.0f32; n], vec![0.0f32; n]);
            prelim_and_denominators(den, &p.m, &p.v, fresh, &mut prelim, &mut denoms);
            let mut factor = if p.v_fresh.is_empty() {
                f32::MIN
            } else {
                largest_ratio(&denoms, &p.v_fresh, bc2_fresh, eps)
            };
            let update: Vec<f32> = prelim
                .iter()
                .zip(w.iter())
                .map(|(&u, &w)| u + decay * w)
                .collect();
            // ‖u‖ once: the weight decay's share below and the trust ratio use it.
            let update_norm = norm(&update);
            if decay > 0.0 {
                let ratio = if update_norm > 0.0 {
                    (norm(&prelim) / update_norm).min(1.0) as f32
                } else {
                    1.0
                };
                factor = factor * ratio + (1.0 - ratio);
            }
            factor = factor.clamp(s.factor_min, s.factor_max).clamp(
                p.last_factor * (1.0 - s.factor_threshold),
                p.last_factor * (1.0 + s.factor_threshold),
            );
            p.last_factor = factor;
            let coeff = if s.lamb_coeff == OnebitLambCoeff::Computed {
                let (w_norm, u_norm) = (norm(w), update_norm);
                if w_norm > 0.0 && u_norm > 0.0 {
                    (w_norm / u_norm) as f32
                } else {
                    1.0
                }
            } else {
                p.coeff_freeze * factor
            };
            let step = lr * coeff;
            for (w, u) in w.iter_mut().zip(&update) {
                *w -= step * u;
            }
            updated.insert(p.id, w.clone());
        }
        let update_s = started.elapsed().as_secs_f64();
        let module = module.map(&mut WriteHost(updated));
        tracing::debug!(
            read_s,
            momentum_s = momentum_s - read_s,
            allreduce_s = allreduce_s - momentum_s,
            update_s = update_s - allreduce_s,
            write_s = started.elapsed().as_secs_f64() - update_s,
            "1-bit step phases"
        );
        Ok((
            module,
            OnebitStep {
                compressed: true,
                bytes,
            },
        ))
    }
}

/// The constants of the compression stage's update denominators.
#[derive(Debug, Clone, Copy)]
struct Denominator {
    /// `1 − β₁ᵗ`.
    bc1: f32,
    /// `1 − β₂ᵗ` at the freeze.
    bc2: f32,
    /// `1 − β₂ᵗ` now (the fresh variance's correction).
    bc2_fresh: f32,
    eps: f32,
    /// `variance = frozen-or-fresh`: the larger of the frozen and the fresh variance.
    floor: bool,
    /// `variance = frozen-bounded`: at least `|m̂|`.
    bounded: bool,
}

impl Denominator {
    /// `√v̂ + ε` of the frozen variance `v` (or of the larger of it and the fresh one `f`), at
    /// least `|m̂| + ε` when bounded.
    #[inline(always)]
    fn of(&self, v: f32, f: f32, m: f32) -> f32 {
        let v = v / self.bc2;
        let d = if self.floor {
            v.max(f / self.bc2_fresh)
        } else {
            v
        }
        .sqrt();
        if self.bounded {
            d.max((m / self.bc1).abs()) + self.eps
        } else {
            d + self.eps
        }
    }
}

/// 1-bit LAMB's preliminary update `prelim_i = (m_i / bc1) / d_i` and its denominators
/// `d_i = den.of(v_i, fresh_i, m_i)` (`fresh`: the fresh variance, or zeros). The settings'
/// branches are taken once, outside the loop, and the loop runs over chunks of 8 lanes: a
/// zipped loop with them inside stayed scalar, and its square roots and divisions were most
/// of the 1-bit LAMB step's update phase. The operations are those of the scalar form.
fn prelim_and_denominators(
    den: Denominator,
    m: &[f32],
    v: &[f32],
    fresh: &[f32],
    prelim: &mut [f32],
    denoms: &mut [f32],
) {
    #[inline(always)]
    fn lanes<const FLOOR: bool, const BOUNDED: bool>(
        den: Denominator,
        m: &[f32],
        v: &[f32],
        fresh: &[f32],
        prelim: &mut [f32],
        denoms: &mut [f32],
    ) {
        const LANES: usize = 8;
        let den = Denominator {
            floor: FLOOR,
            bounded: BOUNDED,
            ..den
        };
        let one = |m: f32, v: f32, f: f32, u: &mut f32, d: &mut f32| {
            *d = den.of(v, f, m);
            *u = (m / den.bc1) / *d;
        };
        let (m_chunks, m_tail) = m.as_chunks::<LANES>();
        let (v_chunks, v_tail) = v.as_chunks::<LANES>();
        let (f_chunks, f_tail) = fresh.as_chunks::<LANES>();
        let (u_chunks, u_tail) = prelim.as_chunks_mut::<LANES>();
        let (d_chunks, d_tail) = denoms.as_chunks_mut::<LANES>();
        for ((((m, v), f), u), d) in m_chunks
            .iter()
            .zip(v_chunks)
            .zip(f_chunks)
            .zip(u_chunks)
            .zip(d_chunks)
        {
            for lane in 0..LANES {
                one(m[lane], v[lane], f[lane], &mut u[lane], &mut d[lane]);
            }
        }
        for ((((&m, &v), &f), u), d) in m_tail
            .iter()
            .zip(v_tail)
            .zip(f_tail)
            .zip(u_tail)
            .zip(d_tail)
        {
            one(m, v, f, u, d);
        }
    }
    let n = m.len();
    assert!(
        [v.len(), fresh.len(), prelim.len(), denoms.len()] == [n; 4],
        "one value of each per element"
    );
    match (den.floor, den.bounded) {
        (false, false) => lanes::<false, false>(den, m, v, fresh, prelim, denoms),
        (true, false) => lanes::<true, false>(den, m, v, fresh, prelim, denoms),
        (false, true) => lanes::<false, true>(den, m, v, fresh, prelim, denoms),
        (true, true) => lanes::<true, true>(den, m, v, fresh, prelim, denoms),
    }
}

/// `max_i d_i / (√(f_i / bc2) + ε)`, `f32::MIN` for no elements: 1-bit LAMB's ratio of the frozen
/// denominators `d` to the fresh variance's. Eight lane-wise maxima, then their maximum: a
/// maximum is exact, so this is the element-order fold's value (NaN ratios skipped, as
/// `f32::max` skips them), and the loop vectorizes.
fn largest_ratio(d: &[f32], fresh: &[f32], bc2: f32, eps: f32) -> f32 {
    const LANES: usize = 8;
    let ratio = |d: f32, f: f32| d / ((f / bc2).sqrt() + eps);
    let (d_chunks, d_tail) = d.as_chunks::<LANES>();
    let (f_chunks, f_tail) = fresh.as_chunks::<LANES>();
    let mut lanes = [f32::MIN; LANES];
    for (d, f) in d_chunks.iter().zip(f_chunks) {
        for lane in 0..LANES {
            lanes[lane] = lanes[lane].max(ratio(d[lane], f[lane]));
        }
    }
    let tail = d_tail.iter().zip(f_tail).map(|(&d, &f)| ratio(d, f));
    lanes.into_iter().chain(tail).fold(f32::MIN, f32::max)
}

#[cfg(test)]
mod tests {
    /// The chunked preliminary update equals the element-by-element formula bit for bit, for
    /// every variance setting, with a tail.
    #[test]
    fn prelim_and_denominators_equal_the_formula() {
        let n = 29;
        let m: Vec<f32> = (0..n)
            .map(|i| ((i * 7) % 13) as f32 * 1e-3 - 6e-3)
            .collect();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i * 5) % 11) as f32 * 1e-6 + 1e-8)
            .collect();
        let f: Vec<f32> = (0..n).map(|i| ((i * 3) % 17) as f32 * 1e-6).collect();
        for (floor, bounded) in [(false, false), (true, false), (false, true), (true, true)] {
            let den = super::Denominator {
                bc1: 0.41,
                bc2: 0.02,
                bc2_fresh: 0.03,
                eps: 1e-6,
                floor,
                bounded,
            };
            let (mut u, mut d) = (vec![0.0; n], vec![0.0; n]);
            super::prelim_and_denominators(den, &m, &v, &f, &mut u, &mut d);
            for i in 0..n {
                let frozen = v[i] / den.bc2;
                let mut want = if floor {
                    frozen.max(f[i] / den.bc2_fresh)
                } else {
                    frozen
                }
                .sqrt();
                if bounded {
                    want = want.max((m[i] / den.bc1).abs());
                }
                let want = want + den.eps;
                assert_eq!(d[i].to_bits(), want.to_bits(), "{floor} {bounded} d[{i}]");
                let prelim = (m[i] / den.bc1) / want;
                assert_eq!(u[i].to_bits(), prelim.to_bits(), "{floor} {bounded} u[{i}]");
            }
        }
    }

    /// The lane-wise maximum equals the element-order fold, NaN ratios skipped, with and
    /// without a tail.
    #[test]
    fn largest_ratio_equals_the_fold() {
        for n in [0, 3, 8, 61] {
            let d: Vec<f32> = (0..n)
                .map(|i| 1e-3 + ((i * 37) % 11) as f32 * 1e-4)
                .collect();
            let mut fresh: Vec<f32> = (0..n).map(|i| ((i * 13) % 7) as f32 * 1e-7).collect();
            if n > 5 {
                fresh[5] = f32::NAN;
            }
            let fold = d
                .iter()
                .zip(&fresh)
                .map(|(&d, &f)| d / ((f / 0.3).sqrt() + 1e-6))
                .fold(f32::MIN, f32::max);
            assert_eq!(super::largest_ratio(&d, &fresh, 0.3, 1e-6), fold, "n = {n}");
        }
    }
}
