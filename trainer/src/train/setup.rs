//! A rank's model and what trains it: initialisation, the start-up probe of gradient order,
//! the bucket plan the ranks agree on, rank 0's parameters, the reducer, the optimizer and the
//! schedule.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use ember_data::InstanceLoader;
use ember_model::{BertConfig, BertForPreTraining, Precision};

use crate::loss_scale::LossScaler;
use crate::optim::PreTrainingOptimizer;
use crate::parallel::{
    AllreduceDtype, CommThread, GradHookBackend, Reducer, bucket_plan, check_agreement, ready_order,
};
use crate::schedule::WarmupPolyDecay;
use crate::{LossNormalization, TrainConfig, TrainError};

/// Serialises model initialisation across in-process ranks: Burn's NdArray random generator
/// is process-wide, so ranks initialising at once would interleave their draws. (Rank 0's
/// parameters are broadcast anyway; this makes rank 0's equal a one-rank run's.)
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// What trains one rank's model replica.
pub(crate) struct Trainer<B: GradHookBackend> {
    pub bert_config: BertConfig,
    pub reducer: Reducer<B::InnerBackend>,
    /// Parameters whose gradients the hooks deliver; the others (`late`) are delivered after
    /// backward (Note [Late gradients] in `parallel/hooks.rs`).
    pub hooked: HashSet<ParamId>,
    pub late: Vec<ParamId>,
    /// The id the decoder's share of the tied gradient is delivered under, when split (Note
    /// [Tied embedding split]).
    pub decoder: Option<ParamId>,
    pub optimizer: PreTrainingOptimizer<BertForPreTraining<B>, B>,
    pub schedule: WarmupPolyDecay,
    /// This rank and the run's seed: the keys of the dropout masks.
    pub rank: usize,
    pub seed: u64,
    pub loss_normalization: LossNormalization,
    /// Steps between re-checks of the hooks' gradients (Note [Re-checking late gradients]).
    pub check_gradients_every: u64,
    /// Dynamic loss scaling, when `loss_scale.mode` asks for it.
    pub loss_scaler: Option<LossScaler>,
    /// The dtype the model computes in.
    pub precision: Precision,
}

impl<B: GradHookBackend> Trainer<B> {
    /// Initialises the model (seeded), finds which gradients the hooks can deliver with one
    /// probe backward on the first held-out batch, plans the buckets, checks that every rank
    /// has the same plan, takes rank 0's parameters, and builds reducer and optimizer. Returns
    /// the trainer and the model.
    ///
    /// # Errors
    /// [`TrainError::Model`] for a bad model configuration; [`TrainError::InvalidSetting`] for
    /// `parallel.buckets = device` without device collectives; [`TrainError::RankMismatch`]
    /// for ranks with different plans; [`TrainError::Comm`].
    pub(crate) fn new(
        config: &TrainConfig,
        device: &B::Device,
        vocab_size: usize,
        eval: &InstanceLoader,
        comm: &Arc<CommThread<B::InnerBackend>>,
    ) -> Result<(Self, BertForPreTraining<B>), TrainError> {
        let bert_config = config.bert_config(vocab_size);
        bert_config.validate()?;
        let on_device = config
            .parallel
            .buckets
            .on_device(comm.has_device_collectives())
            .map_err(|reason| TrainError::InvalidSetting {
                field: "parallel.buckets",
                reason,
            })?;
        if on_device
            && config.parallel.allreduce_dtype == AllreduceDtype::Bf16
            && !B::supports_dtype(device, burn::tensor::DType::BF16)
        {
            return Err(TrainError::InvalidSetting {
                field: "parallel.allreduce_dtype",
                reason: "bf16 device buckets need a backend with bf16 (CUDA); this one has none \
                         (NdArray has no half type, WGSL no bf16): set parallel.buckets = \
                         \"host\", or keep allreduce_dtype = \"f32\""
                    .into(),
            });
        }
        let precision = choose_precision::<B>(config.train.precision, device)?;
        let loss_scaler = LossScaler::new(&config.loss_scale, Some(precision));
        let mut model = init_model::<B>(config, &bert_config, device);
        model.set_precision(precision);
        let probe = eval
            .sequential_batches()
            .next()
            .expect("the evaluation set is not empty");
        // Note [Tied embedding split]: the decoder's share of the tied gradient gets an id of
        // its own.
        let decoder = config
            .parallel
            .tied_embedding
            .split(comm.world_size())
            .then(ParamId::new);
        let order = ready_order(&model, probe.to_device::<B>(device), decoder);
        let plan = bucket_plan::<B, _>(
            &model,
            &order.params(),
            decoder,
            config.parallel.first_bucket_mb,
            config.parallel.bucket_cap_mb,
        );
        check_agreement(comm, "bucket plan", plan.describe())?;
        let model = broadcast_parameters::<B, _>(model, comm)?;
        let reducer = Reducer::new(
            plan,
            config.parallel.clip,
            config.optimizer.max_grad_norm,
            on_device,
            comm.clone(),
        )
        .with_bucket_clip_count(config.parallel.bucket_clip_count)
        .with_allreduce_dtype(config.parallel.allreduce_dtype)
        .with_overflow_check(loss_scaler.is_some());
        let fused = config.model.kernels.multi_tensor::<B>();
        let mut optimizer_config = config.optimizer.clone();
        if optimizer_config.name.is_onebit() {
            optimizer_config.onebit.freeze_step = Some(config.freeze_step());
        }
        let optimizer =
            PreTrainingOptimizer::new(&optimizer_config, &model, fused).with_comm(comm.clone());
        let schedule = WarmupPolyDecay::new(
            config.optimizer.lr,
            config.warmup_steps(),
            config.schedule.decay_steps.unwrap_or(config.train.steps),
            &config.schedule,
        );
        let trainer = Self {
            bert_config,
            reducer,
            hooked: order.hooked_set(),
            late: order.late,
            decoder,
            optimizer,
            schedule,
            rank: comm.rank(),
            seed: config.train.seed,
            loss_normalization: config.train.loss_normalization,
            check_gradients_every: config.parallel.check_gradients_every,
            loss_scaler,
            precision,
        };
        Ok((trainer, model))
    }
}

impl<B: GradHookBackend> Trainer<B> {
    /// The last warm-up step of a 1-bit optimizer (`u64::MAX` for the others).
    pub(crate) fn optimizer_freeze_step(&self) -> u64 {
        self.optimizer
            .onebit()
            .map_or(u64::MAX, |o| o.freeze_step())
    }
}

/// The model of `bert_config`, initialised from `train.seed` with every parameter drawn now.
/// `train.precision`, or its default: bf16 where the backend has it, else f32.
///
/// # Errors
/// [`TrainError::InvalidSetting`] for a precision the backend does not have.
fn choose_precision<B: GradHookBackend>(
    asked: Option<Precision>,
    device: &B::Device,
) -> Result<Precision, TrainError> {
    match asked {
        None if Precision::Bf16.supported::<B>(device) => Ok(Precision::Bf16),
        None => Ok(Precision::F32),
        Some(p) if p.supported::<B>(device) => Ok(p),
        Some(p) => Err(TrainError::InvalidSetting {
            field: "train.precision",
            reason: format!(
                "this backend has no {p} (NdArray on the CPU computes in f32 only; WGSL, so \
                 wgpu, has no bf16: use fp16 there, or bf16 on CUDA)"
            ),
        }),
    }
}

/// Holds the lock under which runs seed a backend's generator and draw their initial weights:
/// code of another thread that seeds or draws from the same generator (a test building its
/// own model on a shared device) holds it too, so that neither changes the other's weights.
pub fn initialisation_lock() -> std::sync::MutexGuard<'static, ()> {
    INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The model a run of `config` starts from before rank 0's parameters are broadcast: seeded
/// with `train.seed`, every parameter drawn now, with the configured kernels and precision.
/// Initialisations are serialised across threads (the backends' generators are per device
/// or per process), so a test or tool may build one while runs train in other threads
/// without changing their weights.
///
/// # Errors
/// [`TrainError::Model`] for a bad model configuration; [`TrainError::InvalidSetting`] for a
/// precision the backend does not have.
pub fn initial_model<B: GradHookBackend>(
    config: &TrainConfig,
    vocab_size: usize,
    device: &B::Device,
) -> Result<BertForPreTraining<B>, TrainError> {
    let bert_config = config.bert_config(vocab_size);
    bert_config.validate()?;
    let precision = choose_precision::<B>(config.train.precision, device)?;
    let mut model = init_model::<B>(config, &bert_config, device);
    model.set_precision(precision);
    Ok(model)
}

fn init_model<B: GradHookBackend>(
    config: &TrainConfig,
    bert_config: &BertConfig,
    device: &B::Device,
) -> BertForPreTraining<B> {
    let _guard = INIT_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    B::seed(device, config.train.seed);
    ember_backend_ext::reseed_dropout(config.train.seed);
    let mut model = bert_config
        .init_for_pretraining(device)
        .with_kernels(config.model.kernels);
    model
        .bert
        .encoder
        .set_qkv_projections(config.model.qkv_projections);
    model.set_reference_ops(config.model.reference_ops);
    model.set_unpad(config.model.unpad);
    // Burn initialises parameters lazily, at their first use: draw them all now, in module
    // order, while this rank holds the generator.
    struct Materialize;
    impl<B: AutodiffBackend> ModuleVisitor<B> for Materialize {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    model.visit(&mut Materialize);
    model
}

/// Replaces `module`'s parameters with rank 0's (PyTorch DDP does the same at construction),
/// through host memory (once, at start-up), in broadcasts of about 25 MiB: parameters in
/// module order, which every rank shares.
fn broadcast_parameters<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: M,
    comm: &CommThread<B::InnerBackend>,
) -> Result<M, TrainError> {
    if comm.world_size() == 1 {
        return Ok(module);
    }
    struct Read(Vec<(ParamId, Vec<f32>)>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0
                .push((param.id, data.into_vec::<f32>().expect("f32 data")));
        }
    }
    let mut read = Read(Vec::new());
    module.visit(&mut read);
    const CHUNK: usize = 25 << 18; // 25 MiB of f32
    let mut values: HashMap<ParamId, Vec<f32>> = HashMap::new();
    let mut params = read.0.into_iter().peekable();
    while params.peek().is_some() {
        let mut chunk = Vec::new();
        let mut flat = Vec::new();
        while let Some((id, v)) = params.next_if(|_| flat.len() < CHUNK) {
            flat.extend_from_slice(&v);
            chunk.push((id, v.len()));
        }
        let flat = comm.call(move |c| {
            let mut flat = flat;
            c.broadcast(&mut flat, 0).map(|()| flat)
        })?;
        let mut offset = 0;
        for (id, n) in chunk {
            values.insert(id, flat[offset..offset + n].to_vec());
            offset += n;
        }
    }
    struct Write(HashMap<ParamId, Vec<f32>>);
    impl<B: AutodiffBackend> ModuleMapper<B> for Write {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let Some(values) = self.0.remove(&param.id) else {
                return param;
            };
            param.map(|tensor| {
                let shape = tensor.shape();
                Tensor::from_data(TensorData::new(values, shape), &tensor.device()).require_grad()
            })
        }
    }
    Ok(module.map(&mut Write(values)))
}

/// Every rank loads the same weights file (so they start equal without a broadcast); rank 0
/// logs what it initialised instead. Weights of the tokenizer's `vocab_size` tokens load into
/// a model whose vocabulary `model.make_vocab_size_divisible_by` padded, with zero padding
/// rows (Note [Padded vocabulary] in `ember-model`'s `vocab_padding.rs`).
pub(super) fn init_from<B: GradHookBackend>(
    model: ember_model::BertForPreTraining<B>,
    from: &std::path::Path,
    vocab_size: usize,
    rank: usize,
) -> Result<(ember_model::BertForPreTraining<B>, ember_model::LoadReport), TrainError> {
    let file = ember_model::WeightsFile::find(from)?;
    let (model, report) = model.load_pretrained_padded(&file, vocab_size)?;
    if rank == 0 {
        tracing::info!(
            from = %file.path().display(),
            loaded = report.loaded.len(),
            initialised = report.initialised.len(),
            "starting from pre-trained weights with a fresh optimizer and schedule"
        );
        if !report.initialised.is_empty() {
            tracing::warn!(
                "not in {}, initialised: {}",
                file.path().display(),
                report.initialised.join(", ")
            );
        }
        // The weights' own config.json names the GELU they were trained with (Note [Two
        // GELUs]): training them with the other form is allowed (the forms differ by at most
        // 4.7e-4), but not silently.
        // Only `hidden_act` is read, and nothing about it stops the run.
        let source = file.path().with_file_name("config.json");
        let named = std::fs::read_to_string(&source)
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|json| json.get("hidden_act")?.as_str().map(str::to_owned));
        let runs = model.bert.encoder.layer.first().map(|l| l.hidden_act);
        if let (Some(named), Some(runs)) = (named, runs)
            && ember_model::Gelu::from_hidden_act(&named) != Some(runs)
        {
            tracing::warn!(
                "{} says hidden_act = {named:?}; this run trains with {runs} \
                 (model.hidden_act; ember implements gelu and gelu_new)",
                source.display()
            );
        }
    }
    Ok((model, report))
}
