//! The reducer: PyTorch DDP's bucketed gradient allreduce, with the clipping modes of MLPerf
//! BERT submissions.
//!
//! Parameters are grouped into buckets in reverse order (the order backward makes their
//! gradients final); a bucket launches when all of its gradients have arrived, strictly in
//! bucket order, and its allreduce runs on a communication thread while backward continues.
//! Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
//! (VLDB 2020), §3.2; `torch/nn/parallel/distributed.py`, `_compute_bucket_assignment_by_size`.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::collective::{Collective, CommError, ReduceOp};
use super::hooks::{GradCallback, HookGradients};

/// How gradients are clipped in data-parallel training. `max_norm` is
/// `optimizer.max_grad_norm`; 0 turns every mode off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClipMode {
    /// No clipping.
    None,
    /// Clip by the norm of the averaged gradient, after the allreduce:
    /// `g ← g · min(1, max_norm / (‖mean_r g_r‖ + 1e-6))`. Exact (what one rank with the whole
    /// batch computes, `torch.nn.utils.clip_grad_norm_`); the clip waits for every bucket.
    #[default]
    Global,
    /// Each rank clips its whole local gradient before the allreduce:
    /// `g_r ← g_r · min(1, max_norm / (‖g_r‖ + 1e-6))`, then averages. NVIDIA's MLPerf BERT
    /// default (clipping inside the LAMB/Adam step, before the gradient allreduce); no overlap:
    /// the local norm needs every gradient, so buckets launch after backward.
    LocalGlobal,
    /// Each rank clips each bucket b by that bucket's own local norm, to
    /// `max_norm / sqrt(number of buckets)`:
    /// `g_{r,b} ← g_{r,b} · min(1, (max_norm/√K) / (‖g_{r,b}‖ + 1e-6))`, then that bucket's
    /// allreduce starts at once. The whole gradient's norm stays ≤ max_norm and nothing waits
    /// for a global norm (Samsung's MLPerf Training v1.1 BERT submission).
    Bucket,
}

impl std::fmt::Display for ClipMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ClipMode::None => "none",
            ClipMode::Global => "global",
            ClipMode::LocalGlobal => "local-global",
            ClipMode::Bucket => "bucket",
        })
    }
}

impl std::str::FromStr for ClipMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(ClipMode::None),
            "global" => Ok(ClipMode::Global),
            "local-global" => Ok(ClipMode::LocalGlobal),
            "bucket" => Ok(ClipMode::Bucket),
            other => Err(format!(
                "unknown clip mode {other:?} (expected none, global, local-global or bucket)"
            )),
        }
    }
}

/// One parameter's place in a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedParam {
    /// Dotted path (`bert.encoder.layer.1.output.dense.weight`).
    pub name: String,
    /// The parameter.
    pub id: ParamId,
    /// Shape of the parameter (Burn's layout).
    pub shape: Vec<usize>,
    /// Offset of its first element in the bucket's flat buffer.
    pub offset: usize,
}

impl PlannedParam {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A contiguous run of parameters (in reverse model order) reduced as one flat f32 buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Its parameters, in the order they sit in the buffer.
    pub params: Vec<PlannedParam>,
    /// Total elements.
    pub numel: usize,
}

impl Bucket {
    /// Size of the flat f32 buffer in bytes.
    pub fn bytes(&self) -> usize {
        self.numel * 4
    }
}

/// The assignment of parameters to buckets: identical on every rank for the same model and
/// caps (checked at start-up, [`BucketPlan::describe`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    /// Buckets in launch order.
    pub buckets: Vec<Bucket>,
}

const MB: f64 = 1024.0 * 1024.0;

impl BucketPlan {
    /// Assigns `params` (`(path, id, shape)`, in the order their gradients become ready:
    /// reverse model order, see [`super::hooks::ready_order`]) to buckets in that order.
    /// A bucket is closed once it holds at least its cap: `first_bucket_mb` for the first,
    /// `bucket_cap_mb` for the others (MiB of f32 gradients; PyTorch DDP's defaults are 1 and
    /// 25). A parameter is never split, so a bucket can exceed its cap by its last parameter.
    pub fn new(
        params: &[(String, ParamId, Vec<usize>)],
        first_bucket_mb: f64,
        bucket_cap_mb: f64,
    ) -> Self {
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            numel: 0,
        };
        for (name, id, shape) in params {
            let numel: usize = shape.iter().product();
            current.params.push(PlannedParam {
                name: name.clone(),
                id: *id,
                shape: shape.clone(),
                offset: current.numel,
            });
            current.numel += numel;
            let cap = if buckets.is_empty() {
                first_bucket_mb
            } else {
                bucket_cap_mb
            };
            if current.bytes() as f64 >= cap * MB {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        numel: 0,
                    },
                ));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Self { buckets }
    }

    /// One line per parameter, `bucket <k> <name> <shape>`: what ranks compare at start-up
    /// (parameter ids are per-process and left out).
    pub fn describe(&self) -> String {
        let mut text = String::new();
        for (k, bucket) in self.buckets.iter().enumerate() {
            for p in &bucket.params {
                text.push_str(&format!("bucket {k} {} {:?}\n", p.name, p.shape));
            }
        }
        text
    }

    /// FNV-1a hash of [`BucketPlan::describe`], for logs.
    pub fn fingerprint(&self) -> u64 {
        self.describe().bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// `"K buckets: a, b, … MiB"`.
    pub fn summary(&self) -> String {
        let sizes: Vec<String> = self
            .buckets
            .iter()
            .map(|b| format!("{:.2}", b.bytes() as f64 / MB))
            .collect();
        format!("{} buckets: {} MiB", self.buckets.len(), sizes.join(", "))
    }

    /// Total number of gradient elements.
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }
}

/// The first line where two plan descriptions differ, for the start-up error.
pub fn first_difference(ours: &str, theirs: &str) -> Option<(usize, String, String)> {
    let (mut a, mut b) = (ours.lines(), theirs.lines());
    for line in 1.. {
        match (a.next(), b.next()) {
            (None, None) => return None,
            (x, y) if x == y => {}
            (x, y) => {
                return Some((
                    line,
                    x.unwrap_or("(end of plan)").to_string(),
                    y.unwrap_or("(end of plan)").to_string(),
                ));
            }
        }
    }
    unreachable!()
}

type Job = Box<dyn FnOnce(&mut dyn Collective) -> bool + Send>;

/// The thread that owns the communicator; collectives run on it in the order submitted.
pub struct CommThread {
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
    world_size: usize,
    name: &'static str,
}

impl CommThread {
    /// Moves `comm` onto a new thread.
    pub fn spawn(comm: Box<dyn Collective>) -> Self {
        let (rank, world_size, name) = (comm.rank(), comm.world_size(), comm.name());
        let (jobs, queue) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("ember-comm-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                // A job returns false after a failure: later jobs would only wait for ranks
                // that are gone, so the thread stops and drops the communicator, which tells
                // the other ranks.
                for job in queue {
                    if !job(comm.as_mut()) {
                        break;
                    }
                }
            })
            .expect("spawning the communication thread");
        Self {
            jobs: Some(jobs),
            thread: Some(thread),
            rank,
            world_size,
            name,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The communicator's name (`in-process`, `mpi`, …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Runs `f` on the communication thread (after everything submitted before) and returns
    /// its result without waiting for it.
    pub fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T, CommError> + Send + 'static,
    ) -> Receiver<Result<T, CommError>> {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |comm| {
            let result = f(comm);
            let ok = result.is_ok();
            let _ = tx.send(result);
            ok
        });
        if let Some(jobs) = &self.jobs {
            // If the thread has stopped, `rx` reports a closed channel.
            let _ = jobs.send(job);
        }
        rx
    }

    /// Runs `f` on the communication thread and waits for its result.
    ///
    /// # Errors
    /// `f`'s error, or [`CommError::Backend`] if the thread stopped after an earlier failure.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        receive(&self.submit(f))
    }
}

fn receive<T>(rx: &Receiver<Result<T, CommError>>) -> Result<T, CommError> {
    rx.recv().unwrap_or_else(|_| {
        Err(CommError::Backend {
            backend: "comm thread",
            message: "stopped after an earlier collective failed".into(),
        })
    })
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn sq_norm(values: &[f32]) -> f64 {
    values.iter().map(|&x| f64::from(x) * f64::from(x)).sum()
}

fn scale(values: &mut [f32], factor: f64) {
    let factor = factor as f32;
    values.iter_mut().for_each(|x| *x *= factor);
}

/// The factor that brings a norm down to `max_norm` (PyTorch's `clip_grad_norm_`, with its
/// 1e-6), or 1 when it is already within.
fn clip_factor(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

#[derive(Default)]
struct StepState {
    /// One flat buffer per bucket (empty while its allreduce is in flight).
    buffers: Vec<Vec<f32>>,
    /// Gradients that arrived in the current micro-batch, per bucket.
    arrived: Vec<usize>,
    /// Whether each parameter's gradient arrived in the current micro-batch.
    seen: Vec<Vec<bool>>,
    /// The first micro-batch of a step overwrites the buffers, later ones add.
    first_micro_batch: bool,
    /// The last micro-batch of a step: full buckets launch.
    last_micro_batch: bool,
    /// Next bucket to launch.
    next_launch: usize,
    /// Squared local norm of each bucket, measured before clipping.
    local_sq_norms: Vec<f64>,
    /// Pending allreduce results, in bucket order.
    in_flight: Vec<(usize, Receiver<Result<Vec<f32>, CommError>>)>,
    /// A gradient that arrived twice or for an unknown parameter: a bug, reported by `finish`.
    error: Option<String>,
    /// When the last bucket was launched.
    last_launch: Option<Instant>,
}

/// Timings of one step's communication, for benchmarks and logs.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimings {
    /// From the end of backward (`finish` called) until every bucket was averaged.
    pub wait_after_backward: Duration,
    /// From the last bucket's launch until every bucket was averaged.
    pub tail: Duration,
}

/// What [`Reducer::finish`] reports.
#[derive(Debug, Clone, Copy)]
pub struct ReducedStep {
    /// The norm the clip mode measured, before clipping: the averaged gradient's (`global`,
    /// `none`) or this rank's local gradient's (`local-global`, `bucket`).
    pub grad_norm: f64,
    /// Communication timings.
    pub timings: StepTimings,
}

/// Buckets, clipping and asynchronous allreduce for one rank.
///
/// Per step: [`Reducer::begin_micro_batch`] before each micro-batch's backward; gradients
/// arrive through [`Reducer::callback`] (from hooks, during backward) and
/// [`Reducer::deliver`] (after backward); then [`Reducer::finish`] waits for the averaged
/// buckets and [`Reducer::gradients`] hands them to the optimizer.
pub struct Reducer {
    plan: Arc<BucketPlan>,
    /// Parameter → (bucket, index in bucket).
    index: Arc<HashMap<ParamId, (usize, usize)>>,
    clip: ClipMode,
    max_norm: f64,
    state: Arc<Mutex<StepState>>,
    comm: Arc<CommThread>,
}

impl Reducer {
    /// A reducer for `plan` that communicates through `comm`.
    pub fn new(plan: BucketPlan, clip: ClipMode, max_norm: f64, comm: Arc<CommThread>) -> Self {
        let mut index = HashMap::new();
        for (k, bucket) in plan.buckets.iter().enumerate() {
            for (i, p) in bucket.params.iter().enumerate() {
                index.insert(p.id, (k, i));
            }
        }
        let state = StepState {
            buffers: plan.buckets.iter().map(|b| vec![0.0; b.numel]).collect(),
            arrived: vec![0; plan.buckets.len()],
            seen: plan
                .buckets
                .iter()
                .map(|b| vec![false; b.params.len()])
                .collect(),
            local_sq_norms: vec![0.0; plan.buckets.len()],
            first_micro_batch: true,
            ..StepState::default()
        };
        Self {
            plan: Arc::new(plan),
            index: Arc::new(index),
            clip,
            max_norm,
            state: Arc::new(Mutex::new(state)),
            comm,
        }
    }

    /// The bucket plan.
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    fn lock(&self) -> MutexGuard<'_, StepState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a micro-batch. `first`: the first of its step (buffers are overwritten, not
    /// added to); `last`: the last (buckets launch as they fill). Gradient accumulation over
    /// K micro-batches communicates only in the last one.
    pub fn begin_micro_batch(&self, first: bool, last: bool) {
        let mut state = self.lock();
        state.first_micro_batch = first;
        state.last_micro_batch = last;
        state.arrived.iter_mut().for_each(|a| *a = 0);
        state.seen.iter_mut().for_each(|s| s.fill(false));
        if first {
            state.next_launch = 0;
            state.local_sq_norms.fill(0.0);
            state.error = None;
            state.last_launch = None;
        }
    }

    /// The callback for [`super::GradHooks`]: adds delivered gradients to their buckets and
    /// launches the buckets that are complete.
    pub fn callback(&self) -> GradCallback {
        let (plan, index, state, comm) = (
            self.plan.clone(),
            self.index.clone(),
            self.state.clone(),
            self.comm.clone(),
        );
        let (clip, max_norm) = (self.clip, self.max_norm);
        GradCallback(Arc::new(move |_group, grads| {
            let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
            add_gradients(&plan, &index, &mut state, grads);
            launch_ready(&plan, &mut state, &comm, clip, max_norm);
        }))
    }

    /// Adds gradients that did not come through a hook (the embeddings, after backward).
    pub fn deliver(&self, grads: HookGradients) {
        let mut state = self.lock();
        add_gradients(&self.plan, &self.index, &mut state, grads);
        launch_ready(&self.plan, &mut state, &self.comm, self.clip, self.max_norm);
    }

    /// Parameters whose gradient has not arrived in this micro-batch.
    pub fn missing(&self) -> Vec<ParamId> {
        let state = self.lock();
        self.plan
            .buckets
            .iter()
            .zip(&state.seen)
            .flat_map(|(b, seen)| {
                b.params
                    .iter()
                    .zip(seen)
                    .filter(|(_, s)| !**s)
                    .map(|(p, _)| p.id)
            })
            .collect()
    }

    /// After the last micro-batch's backward: launches what is left (all buckets in
    /// `local-global` mode, after clipping by the local norm), waits for every averaged
    /// bucket, and applies `global` clipping.
    ///
    /// # Errors
    /// [`CommError`] from any bucket's allreduce; [`CommError::Mismatch`] if a gradient
    /// arrived twice or never (a bug in the hooks, not a user error).
    pub fn finish(&self) -> Result<ReducedStep, CommError> {
        let backward_done = Instant::now();
        let mut state = self.lock();
        if let Some(error) = state.error.take() {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: error,
            });
        }
        if state
            .arrived
            .iter()
            .zip(&self.plan.buckets)
            .any(|(&a, b)| a != b.params.len())
        {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: format!("gradients never arrived: {}", self.missing_names(&state)),
            });
        }
        let mut grad_norm = None;
        if self.clip == ClipMode::LocalGlobal {
            let sq: f64 = state.buffers.iter().map(|b| sq_norm(b)).sum();
            let norm = sq.sqrt();
            let factor = clip_factor(norm, self.max_norm);
            if factor != 1.0 {
                state.buffers.iter_mut().for_each(|b| scale(b, factor));
            }
            grad_norm = Some(norm);
            force_launch_all(&self.plan, &mut state, &self.comm);
        }
        let in_flight = std::mem::take(&mut state.in_flight);
        let last_launch = state.last_launch;
        drop(state);
        let mut results = Vec::with_capacity(in_flight.len());
        for (k, rx) in in_flight {
            results.push((k, receive(&rx)?));
        }
        let done = Instant::now();
        let mut state = self.lock();
        for (k, averaged) in results {
            state.buffers[k] = averaged;
        }
        let grad_norm = match self.clip {
            ClipMode::LocalGlobal => grad_norm.unwrap(),
            ClipMode::Bucket => state.local_sq_norms.iter().sum::<f64>().sqrt(),
            ClipMode::None | ClipMode::Global => {
                let norm = state.buffers.iter().map(|b| sq_norm(b)).sum::<f64>().sqrt();
                let factor = clip_factor(norm, self.max_norm);
                if self.clip == ClipMode::Global && factor != 1.0 {
                    state.buffers.iter_mut().for_each(|b| scale(b, factor));
                }
                norm
            }
        };
        Ok(ReducedStep {
            grad_norm,
            timings: StepTimings {
                wait_after_backward: done - backward_done,
                tail: last_launch.map_or(Duration::ZERO, |t| done.saturating_duration_since(t)),
            },
        })
    }

    fn missing_names(&self, state: &StepState) -> String {
        let names: Vec<&str> = self
            .plan
            .buckets
            .iter()
            .zip(&state.seen)
            .flat_map(|(b, seen)| b.params.iter().zip(seen).filter(|(_, s)| !**s))
            .map(|(p, _)| p.name.as_str())
            .collect();
        names.join(", ")
    }

    /// The averaged (and clipped) gradients of the last [`Reducer::finish`], as Burn
    /// gradients of `module`'s parameters on `device`.
    pub fn gradients<B: AutodiffBackend, M: AutodiffModule<B>>(
        &self,
        module: &M,
        device: &B::Device,
    ) -> GradientsParams {
        struct WriteBack<'a, B: AutodiffBackend> {
            plan: &'a BucketPlan,
            index: &'a HashMap<ParamId, (usize, usize)>,
            buffers: &'a [Vec<f32>],
            device: &'a B::Device,
            grads: GradientsParams,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for WriteBack<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let Some(&(k, i)) = self.index.get(&param.id) else {
                    return;
                };
                let p = &self.plan.buckets[k].params[i];
                let values = self.buffers[k][p.offset..p.offset + p.numel()].to_vec();
                let grad = Tensor::<B::InnerBackend, D>::from_data(
                    TensorData::new(values, p.shape.clone()),
                    self.device,
                );
                self.grads.register(param.id, grad);
            }
        }
        let state = self.lock();
        let mut write = WriteBack::<B> {
            plan: &self.plan,
            index: &self.index,
            buffers: &state.buffers,
            device,
            grads: GradientsParams::new(),
        };
        module.visit(&mut write);
        write.grads
    }

    /// The flat buffer of bucket `k` as it stands (after [`Reducer::finish`]: averaged).
    pub fn bucket_values(&self, k: usize) -> Vec<f32> {
        self.lock().buffers[k].clone()
    }
}

fn add_gradients(
    plan: &BucketPlan,
    index: &HashMap<ParamId, (usize, usize)>,
    state: &mut StepState,
    grads: HookGradients,
) {
    for (id, data) in grads {
        let Some(&(k, i)) = index.get(&id) else {
            state
                .error
                .get_or_insert_with(|| format!("a gradient for unplanned parameter {id}"));
            continue;
        };
        let p = &plan.buckets[k].params[i];
        if state.seen[k][i] {
            state
                .error
                .get_or_insert_with(|| format!("the gradient of {} arrived twice", p.name));
            continue;
        }
        state.seen[k][i] = true;
        state.arrived[k] += 1;
        let values = data.as_slice::<f32>().expect("hooks deliver f32 gradients");
        let target = &mut state.buffers[k][p.offset..p.offset + p.numel()];
        if state.first_micro_batch {
            target.copy_from_slice(values);
        } else {
            target.iter_mut().zip(values).for_each(|(t, v)| *t += v);
        }
    }
}

fn launch(state: &mut StepState, comm: &CommThread, k: usize) {
    let data = std::mem::take(&mut state.buffers[k]);
    let rx = comm.submit(move |c| {
        let mut data = data;
        c.allreduce(&mut data, ReduceOp::Average).map(|()| data)
    });
    state.in_flight.push((k, rx));
    state.last_launch = Some(Instant::now());
}

/// Launches complete buckets in order, clipping each first in `bucket` mode.
fn launch_ready(
    plan: &BucketPlan,
    state: &mut StepState,
    comm: &CommThread,
    clip: ClipMode,
    max_norm: f64,
) {
    if !state.last_micro_batch || clip == ClipMode::LocalGlobal {
        return;
    }
    let cap = max_norm / (plan.buckets.len() as f64).sqrt();
    while state.next_launch < plan.buckets.len()
        && state.arrived[state.next_launch] == plan.buckets[state.next_launch].params.len()
    {
        let k = state.next_launch;
        let sq = sq_norm(&state.buffers[k]);
        state.local_sq_norms[k] = sq;
        if clip == ClipMode::Bucket {
            let factor = clip_factor(sq.sqrt(), cap);
            if factor != 1.0 {
                scale(&mut state.buffers[k], factor);
            }
        }
        launch(state, comm, k);
        state.next_launch += 1;
    }
}

fn force_launch_all(plan: &BucketPlan, state: &mut StepState, comm: &CommThread) {
    while state.next_launch < plan.buckets.len() {
        let k = state.next_launch;
        launch(state, comm, k);
        state.next_launch += 1;
    }
}
