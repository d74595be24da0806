//! The reducer's launch side, run by the gradient hooks' callback during backward: gradients
//! reach their buckets, a complete bucket is flattened (and divided by the loss scale), clipped in
//! `bucket` mode and handed to the communication thread, in bucket order, the tied table's
//! rows last; and the scaling of every bucket that the clip modes needing all of them apply.

use std::time::Instant;

use ember_backend_ext::FusedOps;

use super::super::bf16::{AllreduceDtype, allreduce_bf16};
use super::super::buckets::{Buffer, Scalar};
use super::super::clip::{ClipMode, bucket_clip_cap};
use super::super::collective::{CommError, ReduceOp};
use super::super::hooks::HookGradients;
use super::{InFlight, Shared, StepState};

impl<B: FusedOps> Shared<B> {
    /// Adds delivered gradients to their buckets; flattens the buckets they complete; in the
    /// last micro-batch, launches complete buckets in order.
    pub(super) fn mark_params_ready(&self, state: &mut StepState<B>, grads: HookGradients<B>) {
        for (id, grad) in grads {
            if let Some(tied) = state.tied.as_mut().filter(|t| t.table == id) {
                let first = state.first_micro_batch;
                if let Err(e) = tied.add(grad, self.on_device, first, state.inv_loss_scale) {
                    state.error.get_or_insert(e);
                }
                continue;
            }
            let Some(&(k, i)) = self.index.get(&id) else {
                state
                    .error
                    .get_or_insert_with(|| format!("a gradient for unplanned parameter {id}"));
                continue;
            };
            if state.seen[k][i] {
                let name = &self.plan.buckets[k].params[i].name;
                state
                    .error
                    .get_or_insert_with(|| format!("the gradient of {name} arrived twice"));
                continue;
            }
            state.seen[k][i] = true;
            state.pending[k][i] = Some(grad);
            state.arrived[k] += 1;
            if state.arrived[k] == self.plan.buckets[k].params.len() {
                self.mark_bucket_ready(state, k);
            }
        }
        if state.last_micro_batch && self.clip != ClipMode::LocalGlobal {
            // Complete in this micro-batch (earlier micro-batches' buffers exist already).
            while state.next_launch < self.plan.buckets.len()
                && state.arrived[state.next_launch]
                    == self.plan.buckets[state.next_launch].params.len()
            {
                let k = state.next_launch;
                self.all_reduce_bucket(state, k);
            }
            self.all_reduce_rows(state);
        }
    }

    /// Bucket `k`'s gradients have all arrived in this micro-batch: flattens them into its
    /// buffer (adding to the earlier micro-batches').
    fn mark_bucket_ready(&self, state: &mut StepState<B>, k: usize) {
        let grads = state.pending[k]
            .iter_mut()
            .map(|g| g.take().expect("the bucket is complete"))
            .collect();
        // Divided by the loss scale as the bucket is flattened (Note [Unscaled per bucket]).
        let flat = Buffer::flatten(self.on_device, grads, state.inv_loss_scale);
        let buffer = match state.buffers[k].take() {
            Some(earlier) if !state.first_micro_batch => earlier.add(flat),
            _ => flat,
        };
        state.buffers[k] = Some(buffer);
    }

    /// Clips bucket `k` (`bucket` mode) and hands it to the communication thread.
    pub(super) fn all_reduce_bucket(&self, state: &mut StepState<B>, k: usize) {
        let buffer = state.buffers[k].take().expect("a complete bucket");
        let buffer = self.bucket_clip(state, buffer);
        if !self.local {
            state.elements_allreduced += buffer.len();
        }
        let rx = self.submit(buffer);
        state.in_flight.push((k, rx));
        state.last_launch = Some(Instant::now());
        state.next_launch += 1;
    }

    /// After the last bucket, the tied table's rows, once they arrived in the step's last
    /// micro-batch (Note [Tied embedding split]).
    pub(super) fn all_reduce_rows(&self, state: &mut StepState<B>) {
        let ready = state.next_launch == self.plan.buckets.len()
            && state
                .tied
                .as_ref()
                .is_some_and(|t| t.arrived && t.in_flight.is_none() && t.buffer.is_some());
        if !ready {
            return;
        }
        let buffer = state
            .tied
            .as_mut()
            .and_then(|t| t.buffer.take())
            .expect("checked");
        let buffer = self.bucket_clip(state, buffer);
        if !self.local {
            state.elements_allreduced += buffer.len();
        }
        let rx = self.submit(buffer);
        state.tied.as_mut().expect("checked").in_flight = Some(rx);
        state.last_launch = Some(Instant::now());
    }

    /// In `bucket` mode, clips a bucket by its own norm to max_norm/√K (Note [Clip
    /// coefficient]; ClipMode::Bucket).
    fn bucket_clip(&self, state: &mut StepState<B>, buffer: Buffer<B>) -> Buffer<B> {
        if self.clip != ClipMode::Bucket {
            return buffer;
        }
        let count = self
            .bucket_clip_count
            .unwrap_or_else(|| self.plan.num_reductions());
        let cap = bucket_clip_cap(self.max_norm, count);
        let (clipped, sq) = buffer.clip_by_own_norm(cap);
        state.local_sq_norms.push(sq);
        clipped
    }

    /// Hands a buffer to the communication thread for its average over the ranks.
    fn submit(&self, buffer: Buffer<B>) -> InFlight<B> {
        if self.local {
            let (tx, rx) = std::sync::mpsc::channel();
            let _ = tx.send(Ok(buffer));
            return rx;
        }
        match buffer {
            Buffer::Host(values) => {
                let dtype = self.allreduce_dtype;
                self.comm.submit(move |c| {
                    let mut values = values;
                    match dtype {
                        AllreduceDtype::F32 => c.allreduce(&mut values, ReduceOp::Average),
                        AllreduceDtype::Bf16 => allreduce_bf16(c, &mut values, ReduceOp::Average),
                    }
                    .map(|()| Buffer::Host(values))
                })
            }
            Buffer::Device(tensor) => {
                let bf16 =
                    self.allreduce_dtype == AllreduceDtype::Bf16 && self.comm.world_size() > 1;
                // Note [A bucket's writes, awaited]: made after the bucket's last write, awaited
                // before the communication thread's first command on the bucket.
                let marker = B::writes_marker(&tensor.clone().into_primitive().tensor());
                self.comm.submit_device(move |c| {
                    if let Some(marker) = marker {
                        B::await_marker(marker).map_err(|message| CommError::Backend {
                            backend: "device",
                            message,
                        })?;
                    }
                    if bf16 {
                        // The f32 bucket is kept until the allreduce returns (its stream's
                        // pool would otherwise hand its memory to the next tensor of the
                        // compute thread while this thread's cast may still read it).
                        let half = tensor.clone().cast(burn::tensor::FloatDType::BF16);
                        let reduced = c
                            .allreduce_device(half, ReduceOp::Average)
                            .map(|t| Buffer::Device(t.cast(burn::tensor::FloatDType::F32)));
                        drop(tensor);
                        reduced
                    } else {
                        c.allreduce_device(tensor, ReduceOp::Average)
                            .map(Buffer::Device)
                    }
                })
            }
        }
    }
}

/// Clips every bucket (and the tied rows) by the squared norm `sq` of them all (Note [Clip
/// coefficient]): on the device up to 32 buckets per launch ([`Buffer::clip_all`]).
pub(super) fn clip_all<B: FusedOps>(state: &mut StepState<B>, sq: &Scalar<B>, max_norm: f64) {
    let mut buffers: Vec<Buffer<B>> = state
        .buffers
        .iter_mut()
        .map(|b| b.take().expect("every bucket is complete"))
        .collect();
    if let Some(tied) = state.tied.as_mut() {
        buffers.push(tied.buffer.take().expect("the rows arrived"));
    }
    let mut clipped = Buffer::clip_all(buffers, sq, max_norm).into_iter();
    for buffer in &mut state.buffers {
        *buffer = clipped.next();
    }
    if let Some(tied) = state.tied.as_mut() {
        tied.buffer = clipped.next();
    }
}
