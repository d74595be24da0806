//! One optimizer step of one rank: micro-batches forward and backward with the gradient hooks
//! feeding the reducer, the wait for the averaged buckets, and the optimizer update. Nothing
//! here reads device memory (Note [Reading at log time] in `output.rs`; Note [Bucket storage]
//! in `parallel/buckets.rs`) but, with loss scaling, the one scalar that decides whether the
//! step is skipped (Note [Agreeing on an overflow] in `loss_scale.rs`).

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use ember_backend_ext::DropoutScope;
use ember_data::HostBatch;
use ember_model::BertForPreTraining;

use super::output::{HostSyncCounts, StepRecord};
use super::setup::Trainer;
use crate::eval::forward_loss_hooked;
use crate::grads::{peek_grads, take_grads};
use crate::loss_scale::LossScaler;
use crate::onebit::OnebitStep;
use crate::parallel::{DeliveryCheck, GradHookBackend, GradHooks, allreduce_bytes};
use crate::{LossNormalization, RunOptions, TrainError};

impl<B: GradHookBackend> Trainer<B> {
    /// Whether step `step` (0-based) re-checks the hooks' gradients: the first step and every
    /// `parallel.check_gradients_every` after it; never when that is 0.
    fn checks_gradients(&self, step: u64) -> bool {
        self.check_gradients_every > 0 && step % self.check_gradients_every == 0
    }

    /// A parameter's name (its Hugging Face key) from the bucket plan.
    fn param_name(&self, id: burn::module::ParamId) -> String {
        self.reducer
            .plan()
            .buckets
            .iter()
            .flat_map(|b| &b.params)
            .find(|p| p.id == id)
            .map(|p| p.name.clone())
            .unwrap_or_else(|| format!("parameter {id}"))
    }

    /// Trains `model` on the micro-batches of one step (`step` steps done before it) and
    /// returns the updated model with the step's record. Gradients accumulate in the reducer's
    /// buckets and only the last micro-batch's backward launches allreduces; the micro-batches'
    /// losses are weighted as `train.loss_normalization` says ([`loss_weights`]).
    ///
    /// # Errors
    /// [`TrainError::Comm`] when a bucket's allreduce fails.
    pub(crate) fn step(
        &mut self,
        model: BertForPreTraining<B>,
        step: u64,
        micro_batches: Vec<HostBatch>,
        device: &B::Device,
        options: &RunOptions,
    ) -> Result<(BertForPreTraining<B>, StepRecord<B::InnerBackend>), TrainError> {
        self.pass(model, step, micro_batches, device, options, Update::Apply)
    }

    /// A step's forward and backward passes, the gradient hooks, buckets and allreduces
    /// included, with `update` saying whether the step then updates anything: with
    /// [`Update::None`] (`train.init_passes`, `init_passes.rs`) the loss scaler, the optimizer,
    /// its state and the schedule are left as they were, no fault is injected, no gradient
    /// re-checked, and the reduced gradients wait in the buckets for the next step to
    /// overwrite them.
    pub(crate) fn pass(
        &mut self,
        model: BertForPreTraining<B>,
        step: u64,
        micro_batches: Vec<HostBatch>,
        device: &B::Device,
        options: &RunOptions,
        update: Update,
    ) -> Result<(BertForPreTraining<B>, StepRecord<B::InnerBackend>), TrainError> {
        let updates = update == Update::Apply;
        let started = Instant::now();
        let count = || options.host_sync_counter.map(|count| count());
        let syncs_at_start = count();
        let launches = || options.launch_counter.map(|count| count());
        let launches_at_start = launches();
        let k = micro_batches.len();
        let weights = loss_weights(&micro_batches, self.loss_normalization);
        let mut tokens = 0;
        let mut sample_offset = 0;
        let mut losses: Option<Tensor<B::InnerBackend, 1>> = None;
        let mut backward_seconds = 0.0;
        let mut syncs_at_backward = None;
        let mut checks = Vec::new();
        // 1-bit Adam/LAMB's compression stage averages momenta, not gradients.
        self.reducer.set_local(self.optimizer.compressing());
        let loss_scale = self.loss_scaler.as_ref().map(LossScaler::scale);
        if let Some(scale) = loss_scale {
            self.reducer.set_loss_scale(scale);
        }
        // Tests inject an overflow by a non-finite factor on the loss of a chosen rank and step.
        let fault = match options.loss_fault {
            Some(f) if updates => f64::from(f(step, self.rank)),
            _ => 1.0,
        };
        let factor = loss_scale.unwrap_or(1.0) * fault;
        self.reducer.begin_step(
            micro_batches
                .iter()
                .flat_map(|b| b.input_ids.iter().copied()),
        );
        for (micro, host) in micro_batches.into_iter().enumerate() {
            tokens += host.num_tokens();
            let batch = host.to_device::<B>(device);
            self.reducer.prepare_backward(micro == 0, micro + 1 == k);
            // Note [Re-checking late gradients]: every `check_gradients_every` steps.
            let check = (updates && self.checks_gradients(step)).then(DeliveryCheck::default);
            let callback = match &check {
                Some(check) => check.wrap(self.reducer.callback()),
                None => self.reducer.callback(),
            };
            let hooks =
                GradHooks::new(&model, callback, Some(&self.hooked)).with_decoder(self.decoder);
            // Masks keyed by (seed, rank, step, layer) and by the sample's index in the local
            // batch: the micro-batches see the masks of one pass over the whole batch.
            let scope = DropoutScope::enter(self.seed, self.rank, step, sample_offset);
            let (_, loss) = forward_loss_hooked(&model, batch, &hooks);
            drop(scope);
            sample_offset += host.batch_size;
            let (w_mlm, w_nsp) = weights[micro];
            let mlm = weighted(loss.mlm, w_mlm);
            let nsp = weighted(loss.nsp, w_nsp);
            let total = mlm.clone() + nsp.clone();
            let terms = Tensor::cat(vec![total.clone().inner(), mlm.inner(), nsp.inner()], 0); // [3]
            losses = Some(match losses {
                Some(sum) => sum + terms,
                None => terms,
            });
            if options.sync_backward {
                sync::<B>(device);
            }
            if micro == 0 {
                syncs_at_backward = count();
            }
            let backward_started = Instant::now();
            let scaled = if factor == 1.0 {
                total
            } else {
                total.mul_scalar(factor)
            };
            let mut grads = GradientsParams::from_grads(scaled.backward(), &model);
            drop(hooks);
            if let Some(check) = check {
                // Compared on the device now, read after the wait (no read in backward).
                checks.push(check.compare(&peek_grads(&model, &grads, &self.hooked)));
            }
            // The late gradients are final only now (Note [Late gradients]).
            self.reducer
                .mark_params_ready(take_grads(&model, &mut grads, &self.late));
            if options.sync_backward {
                sync::<B>(device);
            }
            backward_seconds += backward_started.elapsed().as_secs_f64();
        }
        let syncs_at_wait = count();
        let reduced = self.reducer.finalize_backward()?;
        let mut skipped = false;
        if let (Some(scaler), true) = (self.loss_scaler.as_mut(), updates) {
            // One read of the averaged gradient's squared norm (Note [Agreeing on an overflow]).
            let sq = reduced
                .reduced_sq_norm
                .as_ref()
                .expect("the reducer checks overflows with a loss scaler")
                .value();
            skipped = scaler.update(!sq.is_finite());
        }
        // An overflowed step's gradients hold inf − inf = NaN, which no re-check can compare.
        if !skipped {
            for check in checks {
                check.result(|id| self.param_name(id)).map_err(|params| {
                    TrainError::GradientAfterHook {
                        step: step + 1,
                        params,
                    }
                })?;
            }
        }
        let lr = self.schedule.lr(step);
        let (model, onebit) = if skipped || !updates {
            (model, OnebitStep::default())
        } else {
            let grads = self.reducer.gradients::<B, _>(&model, device);
            self.optimizer.try_step(lr, model, grads)?
        };
        let comm_bytes = if onebit.compressed {
            onebit.bytes.total()
        } else {
            allreduce_bytes(
                reduced.elements_allreduced,
                self.reducer.comm().world_size(),
                self.reducer.allreduce_dtype(),
            )
        };
        let host_syncs = match (syncs_at_start, syncs_at_backward, syncs_at_wait, count()) {
            (Some(start), Some(backward), Some(wait), Some(end)) => Some(HostSyncCounts {
                backward: wait - backward,
                step: end - start,
            }),
            _ => None,
        };
        let kernel_launches = launches_at_start
            .zip(launches())
            .map(|(start, end)| end - start);
        let record = StepRecord {
            step: step + 1,
            losses: losses.expect("a step has at least one micro-batch"),
            grad_norm: reduced.grad_norm,
            lr,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
            backward_seconds,
            comm_wait_s: reduced.timings.wait_after_backward.as_secs_f64(),
            host_syncs,
            kernel_launches,
            comm_bytes,
            compressed: onebit.compressed,
            data_wait_s: 0.0,
            loss_scale,
            skipped_steps: self
                .loss_scaler
                .as_ref()
                .map_or(0, |s| s.state().skipped_steps),
            skipped,
        };
        Ok((model, record))
    }
}

/// Whether a [`Trainer::pass`] updates the model (a training step) or only runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Update {
    /// A step: the loss scaler, the optimizer and the schedule move on.
    Apply,
    /// Forward and backward only (`train.init_passes`).
    None,
}

/// Waits for `device` (for timing backward: [`RunOptions::sync_backward`]).
fn sync<B: AutodiffBackend>(device: &B::Device) {
    // A failed sync shows again at the next read, with the device's error.
    let _ = <B::InnerBackend as Backend>::sync(device);
}

/// The factors of each micro-batch's (mean MLM loss, mean NSP loss) in the step's loss.
///
/// `MicroBatch`: `1/K` each, the mean of the micro-batches' means (NVIDIA's and Samsung's
/// rule). `Batch`: `n_k / N` and `b_k / B_local`, with `n_k` the micro-batch's masked tokens, N
/// the local batch's, `b_k` its samples and `B_local` the local batch's, so that the sum is the
/// whole local batch's mean losses (Hugging Face's `num_items_in_batch`). Counted on the host:
/// no device read.
pub fn loss_weights(
    micro_batches: &[HostBatch],
    normalization: LossNormalization,
) -> Vec<(f64, f64)> {
    let k = micro_batches.len().max(1) as f64;
    match normalization {
        LossNormalization::MicroBatch => vec![(1.0 / k, 1.0 / k); micro_batches.len()],
        LossNormalization::Batch => {
            let masked: usize = micro_batches.iter().map(|b| b.num_masked_tokens()).sum();
            let samples: usize = micro_batches.iter().map(|b| b.batch_size).sum();
            micro_batches
                .iter()
                .map(|b| {
                    (
                        b.num_masked_tokens() as f64 / masked.max(1) as f64,
                        b.batch_size as f64 / samples.max(1) as f64,
                    )
                })
                .collect()
        }
    }
}

/// `loss · weight`, the loss itself for a weight of 1 (one micro-batch: the graph of a plain
/// step).
fn weighted<B: AutodiffBackend>(loss: Tensor<B, 1>, weight: f64) -> Tensor<B, 1> {
    if weight == 1.0 {
        loss
    } else {
        loss.mul_scalar(weight)
    }
}
