//! The reducer: PyTorch DDP's bucketed gradient allreduce, with the clipping modes of MLPerf
//! BERT submissions, on device or host buckets (Note [Bucket storage]).
//!
//! One step reads as its lifecycle, as PyTorch's c10d reducer (`reducer.cpp`):
//! [`Reducer::begin_step`] with the step's token ids (the tied table's rows, Note [Tied
//! embedding split]); [`Reducer::prepare_backward`] before each micro-batch's backward;
//! gradients arrive from the
//! hooks during backward ([`Reducer::callback`]) and after it ([`Reducer::mark_params_ready`]);
//! a bucket whose gradients have all arrived is flattened (`mark_bucket_ready`) and, in the
//! step's last micro-batch, clipped and handed to the communication thread in bucket order
//! (`all_reduce_bucket`) while backward continues, the tied table's rows last
//! (`all_reduce_rows`); [`Reducer::finalize_backward`] waits for
//! the averaged buckets and applies the clip modes that need them all; and
//! [`Reducer::gradients`] gives the optimizer each parameter's averaged gradient. The launch
//! side (what the hooks' callback runs) is in `reducer/launch.rs`, the hand-over in
//! `reducer/handover.rs`.

mod handover;
mod launch;

use launch::clip_all;

use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::module::ParamId;
use burn::tensor::ops::FloatTensor;
use ember_backend_ext::FusedOps;

use super::bf16::AllreduceDtype;
use super::buckets::{Buffer, Scalar};
use super::clip::ClipMode;
use super::collective::CommError;
use super::comm_thread::{CommThread, receive};
use super::hooks::{GradCallback, HookGradients};
use super::plan::BucketPlan;
use super::tied::TiedRows;

/// Timings of one step's communication, for benchmarks and logs.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimings {
    /// From the end of backward ([`Reducer::finalize_backward`] called) until every bucket was
    /// averaged.
    pub wait_after_backward: Duration,
    /// From the last bucket's launch until every bucket was averaged.
    pub tail: Duration,
}

/// What [`Reducer::finalize_backward`] reports.
#[derive(Debug, Clone)]
pub struct ReducedStep<B: FusedOps> {
    /// The norm the clip mode measured, before clipping: the averaged gradient's (`global`,
    /// `none`) or this rank's local gradient's (`local-global`, `bucket`). On the device for
    /// device buckets: reading it ([`Scalar::value`]) waits for the step.
    pub grad_norm: Scalar<B>,
    /// Communication timings.
    pub timings: StepTimings,
    /// Elements this rank allreduced in the step (0 when the buckets stayed local).
    pub elements_allreduced: usize,
    /// With [`Reducer::with_overflow_check`]: the squared norm of the averaged (unclipped)
    /// gradient, the same on every rank, not finite when any rank's gradient was not
    /// (Note [Agreeing on an overflow] in `loss_scale.rs`).
    pub reduced_sq_norm: Option<Scalar<B>>,
}

/// A bucket's allreduce on the communication thread.
type InFlight<B> = Receiver<Result<Buffer<B>, CommError>>;

/// The reducer's state within one step.
struct StepState<B: FusedOps> {
    /// Gradients of the current micro-batch, per bucket in plan order, held until the bucket
    /// is complete (then flattened into `buffers` and dropped).
    pending: Vec<Vec<Option<FloatTensor<B>>>>,
    /// Whether each parameter's gradient arrived in the current micro-batch.
    seen: Vec<Vec<bool>>,
    /// Gradients of the current micro-batch that arrived, per bucket.
    arrived: Vec<usize>,
    /// Each bucket's flat buffer: the sum over this step's micro-batches so far; `None` before
    /// the bucket is first complete and while its allreduce is in flight.
    buffers: Vec<Option<Buffer<B>>>,
    /// The first micro-batch of a step replaces the buffers, later ones add to them.
    first_micro_batch: bool,
    /// The last micro-batch of a step: complete buckets launch.
    last_micro_batch: bool,
    /// Next bucket to launch (buckets launch strictly in order, as DDP's).
    next_launch: usize,
    /// The current micro-batch of the step, from 0.
    micro_batch: usize,
    /// Squared local norm of each launched bucket before clipping (`bucket` mode).
    local_sq_norms: Vec<Scalar<B>>,
    /// Allreduces in flight, in bucket order.
    in_flight: Vec<(usize, InFlight<B>)>,
    /// Elements handed to the allreduce in this step.
    elements_allreduced: usize,
    /// A gradient that arrived twice or for an unknown parameter: a bug, reported by
    /// `finalize_backward`.
    error: Option<String>,
    /// When the last bucket was launched.
    last_launch: Option<Instant>,
    /// The tied table's rows, when its gradient is split (Note [Tied embedding split]).
    tied: Option<TiedRows<B>>,
    /// Every flattened bucket (and the tied rows) is multiplied by this, once per micro-batch:
    /// 1 / the loss scale (Note [Unscaled per bucket] in `buckets.rs`).
    inv_loss_scale: f32,
}

/// Buckets, clipping and asynchronous allreduce for one rank (see the module docs).
pub struct Reducer<B: FusedOps> {
    plan: Arc<BucketPlan>,
    /// Parameter → (bucket, index in bucket).
    index: Arc<HashMap<ParamId, (usize, usize)>>,
    clip: ClipMode,
    max_norm: f64,
    /// K of the bucket clip mode; the plan's reduction count when unset.
    bucket_clip_count: Option<usize>,
    on_device: bool,
    /// Buckets stay local, not allreduced ([`Reducer::set_local`]).
    local: bool,
    /// The element type host buckets travel in.
    allreduce_dtype: AllreduceDtype,
    /// Measure the averaged gradient's squared norm for the overflow check.
    overflow_check: bool,
    state: Arc<Mutex<StepState<B>>>,
    comm: Arc<CommThread<B>>,
}

/// Everything the hook callback needs, shared with the reducer.
struct Shared<B: FusedOps> {
    plan: Arc<BucketPlan>,
    index: Arc<HashMap<ParamId, (usize, usize)>>,
    clip: ClipMode,
    max_norm: f64,
    bucket_clip_count: Option<usize>,
    on_device: bool,
    local: bool,
    allreduce_dtype: AllreduceDtype,
    comm: Arc<CommThread<B>>,
}

impl<B: FusedOps> Reducer<B> {
    /// A reducer for `plan` that communicates through `comm`, with buckets on the device when
    /// `on_device` (which needs [`CommThread::has_device_collectives`]; see
    /// [`super::BucketStorage::on_device`]).
    ///
    /// # Panics
    /// If `on_device` is asked of a host-only communicator (the caller checks the setting).
    pub fn new(
        plan: BucketPlan,
        clip: ClipMode,
        max_norm: f64,
        on_device: bool,
        comm: Arc<CommThread<B>>,
    ) -> Self {
        assert!(
            !on_device || comm.has_device_collectives(),
            "device buckets need device collectives"
        );
        let mut index = HashMap::new();
        for (k, bucket) in plan.buckets.iter().enumerate() {
            for (i, p) in bucket.params.iter().enumerate() {
                index.insert(p.id, (k, i));
            }
        }
        let n = plan.buckets.len();
        let state = StepState {
            pending: plan
                .buckets
                .iter()
                .map(|b| (0..b.params.len()).map(|_| None).collect())
                .collect(),
            seen: plan
                .buckets
                .iter()
                .map(|b| vec![false; b.params.len()])
                .collect(),
            arrived: vec![0; n],
            buffers: (0..n).map(|_| None).collect(),
            first_micro_batch: true,
            last_micro_batch: true,
            next_launch: 0,
            micro_batch: 0,
            local_sq_norms: Vec::new(),
            in_flight: Vec::new(),
            elements_allreduced: 0,
            error: None,
            last_launch: None,
            tied: plan.tied.as_ref().map(TiedRows::new),
            inv_loss_scale: 1.0,
        };
        Self {
            plan: Arc::new(plan),
            index: Arc::new(index),
            clip,
            max_norm,
            bucket_clip_count: None,
            on_device,
            local: false,
            allreduce_dtype: AllreduceDtype::F32,
            overflow_check: false,
            state: Arc::new(Mutex::new(state)),
            comm,
        }
    }

    /// Leaves the buckets local from the next step on (`true`): flattened and clipped as
    /// always, but not allreduced, so that [`Reducer::gradients`] gives this rank's own
    /// gradient (1-bit Adam's compression stage, which averages momenta instead; DeepSpeed's
    /// `enable_backward_allreduce = False`). The clip modes then measure local norms.
    pub fn set_local(&mut self, local: bool) {
        self.local = local;
    }

    /// The communication thread the reducer allreduces through.
    pub fn comm(&self) -> &Arc<CommThread<B>> {
        &self.comm
    }

    /// Pins K of [`ClipMode::Bucket`] (each bucket clipped to `max_norm/√K`) instead of the
    /// plan's count of reductions (`parallel.bucket_clip_count`; Samsung's code: 22).
    pub fn with_bucket_clip_count(mut self, count: Option<usize>) -> Self {
        self.bucket_clip_count = count;
        self
    }

    /// Buckets travel as `dtype` (`parallel.allreduce_dtype`): host buckets through
    /// `super::bf16` (the sum in f32), device buckets cast to bf16 on the device and reduced
    /// by the device collective (NCCL's ncclBfloat16, which sums in bf16: Note [bf16 device
    /// buckets]), then cast back to f32. With one rank
    /// nothing travels and nothing is rounded. Device buckets need a backend with bf16 (the
    /// caller checks).
    pub fn with_allreduce_dtype(mut self, dtype: AllreduceDtype) -> Self {
        self.allreduce_dtype = dtype;
        self
    }

    /// The element type buckets travel in.
    pub fn allreduce_dtype(&self) -> AllreduceDtype {
        self.allreduce_dtype
    }

    /// Reports the averaged gradient's squared norm in every [`ReducedStep`] (the loss
    /// scaler's overflow check; an extra pass over the buckets in the `bucket` and
    /// `local-global` clip modes, whose norm is the local one).
    pub fn with_overflow_check(mut self, check: bool) -> Self {
        self.overflow_check = check;
        self
    }

    /// Divides every gradient of the next step by `scale` (the loss scale;
    /// `crate::loss_scale`), once per flattened bucket and micro-batch (Note [Unscaled per
    /// bucket] in `buckets.rs`), before accumulation, clipping and the allreduce.
    pub fn set_loss_scale(&self, scale: f64) {
        self.lock().inv_loss_scale = (1.0 / scale) as f32;
    }

    /// The K of [`ClipMode::Bucket`]: the pinned count, else the plan's reductions.
    pub fn bucket_clip_count(&self) -> usize {
        self.bucket_clip_count
            .unwrap_or_else(|| self.plan.num_reductions())
    }

    /// The bucket plan.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Whether the buckets live on the device.
    pub fn on_device(&self) -> bool {
        self.on_device
    }

    fn lock(&self) -> MutexGuard<'_, StepState<B>> {
        lock(&self.state)
    }

    fn shared(&self) -> Shared<B> {
        Shared {
            plan: self.plan.clone(),
            index: self.index.clone(),
            clip: self.clip,
            max_norm: self.max_norm,
            bucket_clip_count: self.bucket_clip_count,
            on_device: self.on_device,
            local: self.local,
            allreduce_dtype: self.allreduce_dtype,
            comm: self.comm.clone(),
        }
    }

    /// Starts a step whose batches hold `token_ids` (all micro-batches' `input_ids`): when the
    /// tied table's gradient is split, starts the exchange of the rows to reduce (Note [Tied
    /// embedding split]); else does nothing.
    pub fn begin_step(&self, token_ids: impl IntoIterator<Item = i64>) {
        let mut state = self.lock();
        if let Some(tied) = state.tied.as_mut() {
            tied.begin_step(&self.comm, token_ids);
        }
    }

    /// Starts a micro-batch. `first`: the first of its step (buffers are replaced, not added
    /// to); `last`: the last (buckets launch as they fill). Gradient accumulation over K
    /// micro-batches communicates only in the last one.
    pub fn prepare_backward(&self, first: bool, last: bool) {
        let mut state = self.lock();
        if first {
            state.micro_batch = 0;
        } else {
            // The micro-batch before must have delivered every gradient: a bucket it left
            // incomplete was never added to the step's sum.
            let missing = self.missing_names(&state);
            if !missing.is_empty() && state.error.is_none() {
                state.error = Some(format!(
                    "gradients never arrived in micro-batch {} of the step: {missing}",
                    state.micro_batch + 1
                ));
            }
            state.micro_batch += 1;
        }
        if let Some(tied) = state.tied.as_mut() {
            tied.prepare_backward(first);
        }
        state.first_micro_batch = first;
        state.last_micro_batch = last;
        state.arrived.iter_mut().for_each(|a| *a = 0);
        for pending in &mut state.pending {
            pending.iter_mut().for_each(|p| *p = None);
        }
        state.seen.iter_mut().for_each(|s| s.fill(false));
        if first {
            state.next_launch = 0;
            state.local_sq_norms.clear();
            state.error = None;
            state.last_launch = None;
            state.buffers.iter_mut().for_each(|b| *b = None);
        }
    }

    /// The callback for [`super::GradHooks`]: marks the delivered gradients ready and launches
    /// the buckets they complete.
    pub fn callback(&self) -> GradCallback<B> {
        let (shared, state) = (self.shared(), self.state.clone());
        GradCallback(Arc::new(move |_group, grads| {
            shared.mark_params_ready(&mut lock(&state), grads);
        }))
    }

    /// Marks gradients that did not come through a hook ready (the late ones, after
    /// backward; Note [Late gradients] in `hooks.rs`).
    pub fn mark_params_ready(&self, grads: HookGradients<B>) {
        self.shared().mark_params_ready(&mut self.lock(), grads);
    }

    /// After the last micro-batch's backward: launches what is left (every bucket in
    /// `local-global` mode, after clipping by the local norm), waits for every averaged
    /// bucket, and applies `global` clipping. Nothing here reads device memory.
    ///
    /// # Errors
    /// [`CommError`] from any bucket's allreduce; [`CommError::Mismatch`] if a gradient
    /// arrived twice or never (a bug in the hooks, not a user error).
    pub fn finalize_backward(&self) -> Result<ReducedStep<B>, CommError> {
        let backward_done = Instant::now();
        let shared = self.shared();
        let mut state = self.lock();
        if let Some(error) = state.error.take() {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: error,
            });
        }
        let missing = self.missing_names(&state);
        if !missing.is_empty() {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: format!("gradients never arrived: {missing}"),
            });
        }
        let mut local_norm = None;
        if self.clip == ClipMode::LocalGlobal {
            // NVIDIA's rule: the whole local gradient's norm, so every bucket waits for it.
            let sq = self.sq_norm(&state);
            clip_all(&mut state, &sq, self.max_norm);
            local_norm = Some(sq.sqrt());
            while state.next_launch < self.plan.buckets.len() {
                let k = state.next_launch;
                shared.all_reduce_bucket(&mut state, k);
            }
            shared.all_reduce_rows(&mut state);
        }
        let in_flight = std::mem::take(&mut state.in_flight);
        let elements_allreduced = std::mem::take(&mut state.elements_allreduced);
        let rows_in_flight = state.tied.as_mut().and_then(|t| t.in_flight.take());
        let last_launch = state.last_launch;
        drop(state);
        let mut results = Vec::with_capacity(in_flight.len());
        for (k, rx) in in_flight {
            results.push((k, receive(&rx)?));
        }
        let rows = rows_in_flight.map(|rx| receive(&rx)).transpose()?;
        let done = Instant::now();
        let mut state = self.lock();
        for (k, averaged) in results {
            state.buffers[k] = Some(averaged);
        }
        if let (Some(tied), Some(rows)) = (state.tied.as_mut(), rows) {
            tied.buffer = Some(rows);
        }
        let reduced_sq_norm;
        let grad_norm = match self.clip {
            ClipMode::LocalGlobal | ClipMode::Bucket => {
                reduced_sq_norm = self.overflow_check.then(|| self.sq_norm(&state));
                match local_norm {
                    Some(norm) => norm,
                    None => Scalar::sum(std::mem::take(&mut state.local_sq_norms)).sqrt(),
                }
            }
            ClipMode::None | ClipMode::Global => {
                let sq = self.sq_norm(&state);
                reduced_sq_norm = self.overflow_check.then(|| sq.clone());
                if self.clip == ClipMode::Global {
                    clip_all(&mut state, &sq, self.max_norm);
                }
                sq.sqrt()
            }
        };
        Ok(ReducedStep {
            grad_norm,
            timings: StepTimings {
                wait_after_backward: done - backward_done,
                tail: last_launch.map_or(Duration::ZERO, |t| done.saturating_duration_since(t)),
            },
            elements_allreduced,
            reduced_sq_norm,
        })
    }

    /// Names of the parameters whose gradient has not arrived in this micro-batch, comma
    /// separated (empty when all have).
    fn missing_names(&self, state: &StepState<B>) -> String {
        let tied = state
            .tied
            .as_ref()
            .filter(|t| !t.arrived)
            .map(|_| super::tied::WORD_EMBEDDINGS);
        let names: Vec<&str> = self
            .plan
            .buckets
            .iter()
            .zip(&state.seen)
            .flat_map(|(b, seen)| {
                b.params
                    .iter()
                    .zip(seen)
                    .filter(|(_, s)| !**s)
                    .map(|(p, _)| p.name.as_str())
            })
            .chain(tied)
            .collect();
        names.join(", ")
    }

    /// The squared norm of the whole gradient in the buckets (and the tied rows, with the
    /// cross term of the table's two shares: Note [Tied embedding split]).
    fn sq_norm(&self, state: &StepState<B>) -> Scalar<B> {
        let mut buffers: Vec<&Buffer<B>> = state
            .buffers
            .iter()
            .map(|b| b.as_ref().expect("every bucket is complete"))
            .collect();
        let mut cross = None;
        if let Some(tied) = &state.tied {
            let (k, offset) = self
                .plan
                .decoder_place()
                .expect("a split plan holds the decoder's share");
            buffers.push(tied.buffer.as_ref().expect("the rows arrived"));
            let decoder_bucket = state.buffers[k].as_ref().expect("every bucket is complete");
            cross = Some(tied.cross_term(decoder_bucket, offset));
        }
        Buffer::sum_sq_norms(&buffers, cross)
    }
}

fn lock<B: FusedOps>(state: &Mutex<StepState<B>>) -> MutexGuard<'_, StepState<B>> {
    // A rank that panicked while holding the lock leaves nothing a later step reads.
    state.lock().unwrap_or_else(|e| e.into_inner())
}
