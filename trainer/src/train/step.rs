//! One optimizer step of one rank: micro-batches forward and backward with the gradient hooks
//! feeding the reducer, the wait for the averaged buckets, and the optimizer update. Nothing
//! here reads device memory (Note [Reading at log time] in `output.rs`; Note [Bucket storage]
//! in `parallel/buckets.rs`).

use std::time::Instant;

use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use ember_data::HostBatch;
use ember_model::BertForPreTraining;

use super::output::{HostSyncCounts, StepRecord};
use super::setup::Trainer;
use crate::eval::forward_loss_hooked;
use crate::grads::take_grads;
use crate::parallel::{GradHookBackend, GradHooks};
use crate::{RunOptions, TrainError};

impl<B: GradHookBackend> Trainer<B> {
    /// Trains `model` on the micro-batches of one step (`step` steps done before it) and
    /// returns the updated model with the step's record. Gradients accumulate in the reducer's
    /// buckets and only the last micro-batch's backward launches allreduces; each loss is
    /// divided by K, so the step's gradient is the mean over the K micro-batches.
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
        let started = Instant::now();
        let count = || options.host_sync_counter.map(|count| count());
        let syncs_at_start = count();
        let k = micro_batches.len();
        let mut tokens = 0;
        let mut losses: Option<Tensor<B::InnerBackend, 1>> = None;
        let mut backward_seconds = 0.0;
        let mut syncs_at_backward = None;
        self.reducer.begin_step(
            micro_batches
                .iter()
                .flat_map(|b| b.input_ids.iter().copied()),
        );
        for (micro, host) in micro_batches.into_iter().enumerate() {
            tokens += host.num_tokens();
            let batch = host.to_device::<B>(device);
            self.reducer.prepare_backward(micro == 0, micro + 1 == k);
            let hooks = GradHooks::new(&model, self.reducer.callback(), Some(&self.hooked))
                .with_decoder(self.decoder);
            let (_, loss) = forward_loss_hooked(&model, batch, &hooks);
            let terms = Tensor::cat(
                vec![
                    loss.total.clone().inner(),
                    loss.mlm.clone().inner(),
                    loss.nsp.clone().inner(),
                ],
                0,
            )
            .div_scalar(k as f32); // [3]
            losses = Some(match losses {
                Some(sum) => sum + terms,
                None => terms,
            });
            let total = if k > 1 {
                loss.total.div_scalar(k as f32)
            } else {
                loss.total
            };
            if options.sync_backward {
                sync::<B>(device);
            }
            if micro == 0 {
                syncs_at_backward = count();
            }
            let backward_started = Instant::now();
            let mut grads = GradientsParams::from_grads(total.backward(), &model);
            drop(hooks);
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
        let grads = self.reducer.gradients::<B, _>(&model, device);
        let lr = self.schedule.lr(step);
        let model = self.optimizer.step(lr, model, grads);
        let host_syncs = match (syncs_at_start, syncs_at_backward, syncs_at_wait, count()) {
            (Some(start), Some(backward), Some(wait), Some(end)) => Some(HostSyncCounts {
                backward: wait - backward,
                step: end - start,
            }),
            _ => None,
        };
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
        };
        Ok((model, record))
    }
}

/// Waits for `device` (for timing backward: [`RunOptions::sync_backward`]).
fn sync<B: AutodiffBackend>(device: &B::Device) {
    // A failed sync shows again at the next read, with the device's error.
    let _ = <B::InnerBackend as Backend>::sync(device);
}
