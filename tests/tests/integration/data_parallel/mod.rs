//! Data-parallel training: in-process ranks against one rank with the whole batch and
//! gradient accumulation (here), hooks (`hooks.rs`), clipping (`clipping.rs`), loss
//! normalisation and dropout keys (`details.rs`), start-up agreement and failing ranks
//! (`failures.rs`), 1-bit Adam and LAMB (`onebit.rs`), mixed precision (`precision.rs`), init
//! passes (`init_passes.rs`); and same seed, same run (`determinism.rs`). Runs must start from
//! bit-identical initial weights, drawn from NdArray's process-wide generator, and compare
//! runs bit for bit under process-wide settings (the GEMMs' split of the cores,
//! `ember_trainer::blas::share_cores`; the dropout seed). Under nextest every test has a
//! process of its own. Under `cargo test` the tests of this binary share one, so `.ci/run`'s
//! fallback runs it one test at a time (`--test-threads 1`); the runs draw their weights under
//! the trainer's initialisation lock and the models built here under the same lock
//! ([`tiny_model`]), and each test holds [`serial`] besides.

mod clipping;
mod details;
mod determinism;
mod failures;
mod hooks;
mod init_passes;
mod onebit;
mod precision;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::TensorData;
use burn::tensor::ops::FloatTensorOps;
use ember_data::{Batch, InstanceLoader};
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_tests::{assert_same_weights, max_abs, max_abs_diff};
use ember_trainer::grads::{named_params, take_grads};
use ember_trainer::parallel::{
    BucketStorage, ClipMode, Collective, CommError, CommThread, Communicator, DECODER_WEIGHT,
    GradCallback, GradHooks, InProcess, ReduceOp, Reducer, TiedEmbedding, WORD_EMBEDDINGS,
    check_agreement, check_parameters_agree, hook_group, ready_order,
};
use ember_trainer::{
    PreparedData, RunOptions, TrainConfig, TrainError, bucket_plan, prepare_data,
    train_in_process_with_data, train_rank,
};

type B = Autodiff<NdArray>;

/// One data-parallel test at a time in a process (see the module's documentation).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn small_config(out: &Path) -> TrainConfig {
    ember_tests::data_parallel_config(out)
}

fn shared_data() -> Arc<PreparedData> {
    static DATA: Mutex<Option<Arc<PreparedData>>> = Mutex::new(None);
    let mut data = DATA.lock().unwrap();
    data.get_or_insert_with(|| Arc::new(prepare_data(&small_config(Path::new("unused"))).unwrap()))
        .clone()
}

fn run(config: &TrainConfig, world_size: usize) -> std::path::PathBuf {
    let summary = train_in_process_with_data::<B>(
        config,
        world_size,
        &Default::default(),
        RunOptions::default(),
        Some(shared_data()),
    )
    .unwrap();
    assert_eq!(summary.world_size, world_size);
    summary.checkpoint
}

/// The summary of a run of `config` by `world_size` in-process ranks on `data`.
fn summary(
    config: &TrainConfig,
    world_size: usize,
    data: Arc<PreparedData>,
) -> ember_trainer::TrainSummary {
    train_in_process_with_data::<B>(
        config,
        world_size,
        &Default::default(),
        RunOptions::default(),
        Some(data),
    )
    .unwrap()
}

fn first_grad_norm(metrics: &Path) -> f64 {
    let text = std::fs::read_to_string(metrics).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["event"] == "train")
        .unwrap()["grad_norm"]
        .as_f64()
        .unwrap()
}

#[test]
fn ranks_together_equal_one_rank_with_the_whole_batch() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for clip in [ClipMode::None, ClipMode::Global] {
        let mut one = small_config(&dir.path().join(format!("{clip}-1")));
        one.parallel.clip = clip;
        one.train.batch_size = 4;
        let reference = run(&one, 1);
        if clip == ClipMode::Global {
            // Clipping must be active for the test to mean something.
            let norm = first_grad_norm(&dir.path().join(format!("{clip}-1/metrics.jsonl")));
            assert!(norm > one.optimizer.max_grad_norm, "grad norm {norm}");
        }
        for world_size in [2, 4] {
            let mut many = one.clone();
            many.train.batch_size = 4 / world_size;
            many.train.out = dir.path().join(format!("{clip}-{world_size}"));
            let checkpoint = run(&many, world_size);
            let worst = assert_same_weights(&reference, &checkpoint, 1e-5);
            eprintln!("clip {clip}, {world_size} ranks: largest difference {worst:e}");
        }
        // The tied embedding's gradient as one (`auto` splits it with several ranks).
        let mut whole = one.clone();
        whole.train.batch_size = 2;
        whole.parallel.tied_embedding = TiedEmbedding::Whole;
        whole.train.out = dir.path().join(format!("{clip}-2-whole"));
        let worst = assert_same_weights(&reference, &run(&whole, 2), 1e-5);
        eprintln!("clip {clip}, 2 ranks, tied embedding whole: largest difference {worst:e}");
        // Device buckets (on NdArray: Burn tensors reduced by Burn ops), 2 ranks.
        let mut device = one.clone();
        device.train.batch_size = 2;
        device.parallel.buckets = BucketStorage::Device;
        device.train.out = dir.path().join(format!("{clip}-2-device"));
        let checkpoint = run(&device, 2);
        let worst = assert_same_weights(&reference, &checkpoint, 1e-5);
        eprintln!("clip {clip}, 2 ranks, device buckets: largest difference {worst:e}");
    }
}

/// Note [Tied embedding split]: with the split, local-global clipping measures the same local
/// norm (the shares' cross term added), so it ends where the unsplit reduction ends.
#[test]
fn a_split_tied_embedding_changes_no_clip_mode_but_bucket() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut whole = small_config(&dir.path().join("whole"));
    whole.parallel.clip = ClipMode::LocalGlobal;
    whole.train.batch_size = 2;
    whole.parallel.tied_embedding = TiedEmbedding::Whole;
    let reference = run(&whole, 2);
    let norm = first_grad_norm(&dir.path().join("whole/metrics.jsonl"));
    assert!(norm > whole.optimizer.max_grad_norm, "grad norm {norm}");
    let mut split = whole.clone();
    split.parallel.tied_embedding = TiedEmbedding::Split;
    split.train.out = dir.path().join("split");
    assert_same_weights(&reference, &run(&split, 2), 1e-5);
    let split_norm = first_grad_norm(&dir.path().join("split/metrics.jsonl"));
    assert!(
        (split_norm - norm).abs() <= 1e-5 * norm,
        "local norm {split_norm} vs {norm}"
    );
}

#[test]
fn gradient_accumulation_equals_one_step_on_the_whole_batch() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut one = small_config(&dir.path().join("one"));
    one.train.batch_size = 4;
    let reference = run(&one, 1);
    let mut accumulated = one.clone();
    accumulated.train.batch_size = 2;
    accumulated.parallel.grad_accum = 2;
    accumulated.train.out = dir.path().join("accum");
    assert_same_weights(&reference, &run(&accumulated, 1), 1e-5);
    // Two ranks, two micro-batches of one sample each: the same four samples per step.
    accumulated.train.batch_size = 1;
    accumulated.train.out = dir.path().join("accum-2-ranks");
    assert_same_weights(&reference, &run(&accumulated, 2), 1e-5);
}

/// The tiny model with `layers` layers and dropout off, from generator seed 7, its parameters
/// drawn under the trainer's initialisation lock.
fn tiny_model(layers: usize) -> BertForPreTraining<B> {
    let mut config = BertConfig::preset(Preset::Tiny);
    config.num_hidden_layers = layers;
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    crate::fused_training::seeded_model(&config, 7, &Default::default())
}

fn batches(n: usize, batch_size: usize) -> Vec<Batch<B>> {
    let data = shared_data();
    let loader = InstanceLoader::new(data.eval.clone(), batch_size, 64, 0, "eval").unwrap();
    loader
        .sequential_batches()
        .take(n)
        .map(|b| b.to_device::<B>(&Default::default()))
        .collect()
}

fn plain_gradients(model: &BertForPreTraining<B>, batch: Batch<B>) -> HashMap<ParamId, Vec<f32>> {
    let (_, loss) = ember_trainer::eval::forward_loss(model, batch);
    let mut grads = GradientsParams::from_grads(loss.total.backward(), model);
    let ids: Vec<ParamId> = named_params::<B, _>(model)
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    take_grads(model, &mut grads, &ids)
        .into_iter()
        .map(|(id, g)| (id, host(g)))
        .collect()
}

/// The parameters' ids in the order backward delivers their gradients (the reverse of the
/// model's), the order the bucket plans of these tests follow.
fn backward_order(model: &BertForPreTraining<B>) -> Vec<ParamId> {
    named_params::<B, _>(model)
        .into_iter()
        .rev()
        .map(|(_, id)| id)
        .collect()
}

/// [`plain_gradients`] of `model` on each of `batches`.
fn gradients_of(
    model: &BertForPreTraining<B>,
    batches: Vec<Batch<B>>,
) -> Vec<HashMap<ParamId, Vec<f32>>> {
    batches
        .into_iter()
        .map(|b| plain_gradients(model, b))
        .collect()
}

/// A gradient of the inner backend as f32 values on the host.
fn host(grad: burn::tensor::ops::FloatTensor<NdArray>) -> Vec<f32> {
    burn::tensor::Tensor::<NdArray, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(grad))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

/// Runs `body(rank, comm)` on `world_size` threads joined by in-process collectives.
fn on_ranks<T: Send>(
    world_size: usize,
    timeout: Duration,
    body: impl Fn(usize, InProcess) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = InProcess::group(world_size, timeout)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let body = &body;
                scope.spawn(move || body(rank, comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn norm(values: &[f64]) -> f64 {
    values.iter().map(|x| x * x).sum::<f64>().sqrt()
}
