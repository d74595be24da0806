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
            // √v̂ + ε of the frozen variance (or of the larger of it and the fresh one), at
            // least |m̂| + ε when bounded.
            let denom = |v: f32, f: f32, m: f32| {
                let v = v / bc2;
                let d = if floor { v.max(f / bc2_fresh) } else { v }.sqrt();
                if bounded {
                    d.max((m / bc1).abs()) + eps
                } else {
                    d + eps
                }
            };
            if !lamb {
                // Adam: one pass, no temporaries; zipped slices without an index (bounds
                // checks kept the loop scalar), the same operations in the same order.
                let apply = |w: &mut f32, m: f32, v: f32, f: f32| {
                    let u = (m / bc1) / denom(v, f, m) + decay * *w;
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
            // One pass over zipped slices (no index: bounds checks kept the loop scalar) for
            // the preliminary update `m̂ / denom` and, with a fresh variance, the largest
            // ratio of the frozen denominator to the fresh one (the maximum in element order,
            // as a fold).
            let mut factor = f32::MIN;
            let prelim: Vec<f32> = if p.v_fresh.is_empty() {
                p.m.iter()
                    .zip(&p.v)
                    .map(|(&m, &v)| (m / bc1) / denom(v, 0.0, m))
                    .collect()
            } else {
                p.m.iter()
                    .zip(&p.v)
                    .zip(&p.v_fresh)
                    .map(|((&m, &v), &f)| {
                        let d = denom(v, f, m);
                        factor = factor.max(d / ((f / bc2_fresh).sqrt() + eps));
                        (m / bc1) / d
                    })
                    .collect()
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
