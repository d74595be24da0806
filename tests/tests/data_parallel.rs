//! Data-parallel training: hooks, buckets, clipping modes, in-process ranks against one rank
//! with the whole batch, gradient accumulation, start-up agreement and failing ranks.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, NdArray};
use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::TensorData;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use ember_data::{Batch, InstanceLoader};
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_tests::{assert_same_weights, max_abs, max_abs_diff};
use ember_trainer::grads::{named_params, take_grads};
use ember_trainer::parallel::{
    BucketStorage, ClipMode, Collective, CommError, CommThread, Communicator, DECODER_WEIGHT,
    GradCallback, GradHooks, InProcess, ReduceOp, Reducer, TiedEmbedding, WORD_EMBEDDINGS,
    check_agreement, hook_group, ready_order,
};
use ember_trainer::{
    PreparedData, RunOptions, TrainConfig, TrainError, bucket_plan, prepare_data,
    train_in_process_with_data, train_rank,
};

type B = Autodiff<NdArray>;

/// NdArray's random generator is process-wide: a test that seeds it while another test's ranks
/// initialise their models would change those models. Each test holds this lock.
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

fn tiny_model(layers: usize) -> BertForPreTraining<B> {
    let device = Default::default();
    let mut config = BertConfig::preset(Preset::Tiny);
    config.num_hidden_layers = layers;
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    B::seed(&device, 7);
    config.init_for_pretraining(&device)
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

/// What hooks delivered: `(group, [(parameter, gradient on the host)])` in firing order.
type Fired = Arc<Mutex<Vec<(usize, Vec<(ParamId, Vec<f32>)>)>>>;

/// Hooks on `model` that record what they deliver (the tied table split with `decoder`).
fn recording_hooks(
    model: &BertForPreTraining<B>,
    decoder: Option<ParamId>,
) -> (GradHooks<B>, Fired) {
    let fired: Fired = Arc::default();
    let record = fired.clone();
    let hooks = GradHooks::new(
        model,
        GradCallback(Arc::new(move |group, grads| {
            let grads = grads.into_iter().map(|(id, g)| (id, host(g))).collect();
            record.lock().unwrap().push((group, grads))
        })),
        None,
    )
    .with_decoder(decoder);
    (hooks, fired)
}

/// A gradient of the inner backend as f32 values on the host.
fn host(grad: burn::tensor::ops::FloatTensor<NdArray>) -> Vec<f32> {
    burn::tensor::Tensor::<NdArray, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(grad))
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap()
}

#[test]
fn hooks_fire_deepest_layer_first_with_final_gradients() {
    let _serial = serial();
    let layers = 3;
    let model = tiny_model(layers);
    let batch = batches(1, 4).remove(0);
    let names: HashMap<ParamId, String> = named_params::<B, _>(&model)
        .into_iter()
        .map(|(name, id)| (id, name))
        .collect();
    let (hooks, fired) = recording_hooks(&model, None);
    let output = model.forward_hooked(
        batch.input_ids.clone(),
        batch.segment_ids.clone(),
        batch.input_mask.clone(),
        batch.masked_lm_flat_positions.clone(),
        &hooks,
    );
    let loss = model.loss(
        &output,
        batch.masked_lm_labels.clone(),
        batch.next_sentence_labels.clone(),
    );
    assert!(fired.lock().unwrap().is_empty(), "nothing fires in forward");
    let _ = loss.total.backward();
    // Every hook has fired by the time backward returns, deepest first: heads (0), then
    // layers 2, 1, 0 (groups 1, 2, 3).
    let fired = std::mem::take(&mut *fired.lock().unwrap());
    let groups: Vec<usize> = fired.iter().map(|(g, _)| *g).collect();
    assert_eq!(groups, vec![0, 1, 2, 3]);

    let plain = plain_gradients(&model, batch.clone());
    for (group, grads) in &fired {
        let delivered: BTreeMap<&str, &Vec<f32>> = grads
            .iter()
            .map(|(id, d)| (names[id].as_str(), d))
            .collect();
        for (id, name) in &names {
            if hook_group(name, layers) != *group {
                continue;
            }
            // Note [Late gradients]: LayerNorm parameters and the MLM output bias reach their
            // layer through a reshape that Burn differentiates last.
            let late = name.contains("layer_norm") || name == "cls.predictions.bias";
            match (late, delivered.get(name.as_str())) {
                (true, None) => {}
                (true, Some(_)) => {
                    panic!("{name} arrived at its hook; update Note [Late gradients]")
                }
                (false, None) => panic!("{name} was not delivered by hook {group}"),
                (false, Some(data)) => {
                    let ours: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
                    let theirs: Vec<f64> = plain[id].iter().map(|&x| f64::from(x)).collect();
                    let diff = max_abs_diff(&ours, &theirs);
                    assert!(
                        diff <= 1e-6 * max_abs(&theirs),
                        "{name}: differs by {diff:e}"
                    );
                    assert!(max_abs(&theirs) > 0.0, "{name} has a zero gradient");
                }
            }
        }
    }
    // The probe the trainer runs finds the same split.
    let order = ready_order(&model, batch, None);
    assert_eq!(
        order.hooked.iter().map(|(g, _)| *g).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    let late: Vec<&str> = order.late.iter().map(|id| names[id].as_str()).collect();
    assert!(
        late.iter().all(|n| n.starts_with("bert.embeddings.")
            || n.contains("layer_norm")
            || *n == "cls.predictions.bias"),
        "{late:?}"
    );
    assert!(late.contains(&"bert.embeddings.word_embeddings.weight"));
    assert_eq!(order.params().len(), names.len());
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

#[test]
fn clipping_modes_follow_their_formulas() {
    let _serial = serial();
    let model = tiny_model(2);
    let rank_batches = batches(2, 4);
    let rank_grads: Vec<HashMap<ParamId, Vec<f32>>> = rank_batches
        .into_iter()
        .map(|b| plain_gradients(&model, b))
        .collect();
    let order: Vec<ParamId> = named_params::<B, _>(&model)
        .into_iter()
        .rev()
        .map(|(_, id)| id)
        .collect();
    // Small caps, so the plan has several buckets.
    let plan = bucket_plan::<B, _>(&model, &order, None, 0.25, 0.5);
    let k = plan.buckets.len();
    assert!(k >= 4, "{}", plan.summary());
    // Each rank's gradient, bucket by bucket, as f64.
    let flat: Vec<Vec<Vec<f64>>> = rank_grads
        .iter()
        .map(|grads| {
            plan.buckets
                .iter()
                .map(|b| {
                    b.params
                        .iter()
                        .flat_map(|p| grads[&p.id].iter().map(|&x| f64::from(x)))
                        .collect()
                })
                .collect()
        })
        .collect();
    let local_norms: Vec<f64> = flat.iter().map(|r| norm(&r.concat())).collect();
    let max_norm = 0.5 * local_norms.iter().copied().fold(f64::INFINITY, f64::min);

    // Host buckets, and device buckets (on NdArray: Burn tensors reduced by Burn ops).
    for (clip, on_device) in [
        ClipMode::None,
        ClipMode::Global,
        ClipMode::LocalGlobal,
        ClipMode::Bucket,
    ]
    .into_iter()
    .flat_map(|clip| [(clip, false), (clip, true)])
    {
        let results = on_ranks(2, Duration::from_secs(60), |rank, comm| {
            let comm = Arc::new(CommThread::spawn(if on_device {
                Communicator::<NdArray>::Device(Box::new(comm))
            } else {
                Communicator::Host(Box::new(comm))
            }));
            let reducer = Reducer::new(plan.clone(), clip, max_norm, on_device, comm);
            reducer.prepare_backward(true, true);
            let grads = plan
                .buckets
                .iter()
                .flat_map(|b| &b.params)
                .map(|p| {
                    let data = TensorData::new(rank_grads[rank][&p.id].clone(), p.shape.clone());
                    (
                        p.id,
                        <NdArray as FloatTensorOps<NdArray>>::float_from_data(
                            data,
                            &Default::default(),
                        ),
                    )
                })
                .collect::<Vec<_>>();
            reducer.mark_params_ready(grads);
            let step = reducer.finalize_backward().unwrap();
            let buckets: Vec<Vec<f64>> = (0..k)
                .map(|b| {
                    reducer
                        .bucket_values(b)
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect()
                })
                .collect();
            (step.grad_norm.value(), buckets)
        });
        // The formulas, by hand, in f64 (ClipMode's docs).
        let factor = |n: f64, c: f64| if n > c { c / (n + 1e-6) } else { 1.0 };
        let expected: Vec<Vec<f64>> = (0..k)
            .map(|b| {
                let per_rank: Vec<Vec<f64>> = (0..2)
                    .map(|r| {
                        let g = &flat[r][b];
                        let f = match clip {
                            ClipMode::LocalGlobal => factor(local_norms[r], max_norm),
                            ClipMode::Bucket => factor(norm(g), max_norm / (k as f64).sqrt()),
                            ClipMode::None | ClipMode::Global => 1.0,
                        };
                        g.iter().map(|x| x * f).collect()
                    })
                    .collect();
                per_rank[0]
                    .iter()
                    .zip(&per_rank[1])
                    .map(|(a, b)| (a + b) / 2.0)
                    .collect()
            })
            .collect();
        let averaged_norm = norm(&expected.concat());
        let expected: Vec<Vec<f64>> = if clip == ClipMode::Global {
            let f = factor(averaged_norm, max_norm);
            expected
                .into_iter()
                .map(|b| b.into_iter().map(|x| x * f).collect())
                .collect()
        } else {
            expected
        };
        let scale = expected.iter().map(|b| max_abs(b)).fold(0.0, f64::max);
        for (rank, (grad_norm, buckets)) in results.iter().enumerate() {
            for b in 0..k {
                let diff = max_abs_diff(&buckets[b], &expected[b]);
                assert!(
                    diff <= 1e-5 * scale,
                    "{clip}, device buckets {on_device}, rank {rank}, bucket {b}: differs by \
                     {diff:e} (scale {scale:e})"
                );
            }
            let expected_norm = match clip {
                ClipMode::None | ClipMode::Global => averaged_norm,
                ClipMode::LocalGlobal | ClipMode::Bucket => local_norms[rank],
            };
            assert!(
                (grad_norm - expected_norm).abs() <= 1e-4 * expected_norm,
                "{clip}: norm {grad_norm} vs {expected_norm}"
            );
        }
        let total = norm(&results[0].1.concat());
        match clip {
            ClipMode::None => assert!(total > max_norm),
            ClipMode::Global | ClipMode::LocalGlobal | ClipMode::Bucket => {
                assert!(
                    total <= max_norm * (1.0 + 1e-5),
                    "{clip}: norm {total} > {max_norm}"
                )
            }
        }
    }
}

#[test]
fn ranks_that_disagree_are_refused_at_start_up() {
    let _serial = serial();
    // Bucket plans: the same model bucketed with different caps.
    let model = tiny_model(2);
    let order: Vec<ParamId> = named_params::<B, _>(&model)
        .into_iter()
        .rev()
        .map(|(_, id)| id)
        .collect();
    let plans = [
        bucket_plan::<B, _>(&model, &order, None, 1.0, 25.0),
        bucket_plan::<B, _>(&model, &order, None, 0.25, 25.0),
    ];
    let errors = on_ranks(2, Duration::from_secs(30), |rank, comm| {
        let comm = CommThread::<NdArray>::host(Box::new(comm));
        check_agreement(&comm, "bucket plan", plans[rank].describe())
            .unwrap_err()
            .to_string()
    });
    for e in &errors {
        assert!(
            e.contains("rank 1 disagrees with rank 0 on the bucket plan, line"),
            "{e}"
        );
        assert!(e.contains("bucket 1"), "{e}");
    }

    // Configurations: rank 1 has another learning rate.
    let dir = tempfile::tempdir().unwrap();
    let errors = on_ranks(2, Duration::from_secs(60), |rank, comm| {
        let mut config = small_config(dir.path());
        config.train.batch_size = 2;
        if rank == 1 {
            config.optimizer.lr = 5e-4;
        }
        let error = train_rank::<B>(
            &config,
            &Default::default(),
            RunOptions::default(),
            Communicator::Host(Box::new(comm)),
            Some(shared_data()),
        )
        .unwrap_err();
        assert!(
            matches!(
                error,
                TrainError::RankMismatch {
                    what: "configuration",
                    rank: 1,
                    ..
                }
            ),
            "{error}"
        );
        error.to_string()
    });
    assert!(
        errors[0].contains("lr = 0.001") && errors[0].contains("lr = 0.0005"),
        "{}",
        errors[0]
    );
}

/// A communicator that works for `calls` collectives, then fails: `die` drops the rank's
/// communicator at once (as a killed process), otherwise it stalls until released.
struct Failing {
    inner: Option<Box<dyn Collective>>,
    calls: usize,
    stall: Option<Arc<AtomicBool>>,
}

impl Failing {
    fn next(&mut self) -> Result<&mut Box<dyn Collective>, CommError> {
        if self.calls == 0 {
            if let Some(released) = &self.stall {
                let started = Instant::now();
                while !released.load(Ordering::SeqCst)
                    && started.elapsed() < Duration::from_secs(60)
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            self.inner = None;
            return Err(CommError::Backend {
                backend: "test",
                message: "rank killed".into(),
            });
        }
        self.calls -= 1;
        Ok(self.inner.as_mut().unwrap())
    }
}

impl Collective for Failing {
    fn rank(&self) -> usize {
        1
    }
    fn world_size(&self) -> usize {
        2
    }
    fn name(&self) -> &'static str {
        "failing"
    }
    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.next()?.allreduce(data, op)
    }
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        self.next()?.broadcast(data, root)
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.next()?.allgather(data)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.next()?.barrier()
    }
}

#[test]
fn a_rank_that_dies_or_stalls_stops_the_others_with_its_name() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut config = small_config(dir.path());
    config.train.batch_size = 2;
    config.train.steps = 20;
    config.train.eval_every = 20;
    config.parallel.timeout_s = 3.0;
    for stall in [false, true] {
        let released = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        // Start-up takes a few collectives (configuration, plan, parameters); 12 calls end
        // in the middle of the training steps.
        let results = on_ranks(
            2,
            Duration::from_secs_f64(config.parallel.timeout_s),
            |rank, comm| {
                let comm: Box<dyn Collective> = if rank == 1 {
                    Box::new(Failing {
                        inner: Some(Box::new(comm)),
                        calls: 12,
                        stall: stall.then(|| released.clone()),
                    })
                } else {
                    Box::new(comm)
                };
                let result = train_rank::<B>(
                    &config,
                    &Default::default(),
                    RunOptions::default(),
                    Communicator::Host(comm),
                    Some(shared_data()),
                );
                if rank == 0 {
                    released.store(true, Ordering::SeqCst);
                }
                result.map(|_| ()).unwrap_err().to_string()
            },
        );
        let rank0 = &results[0];
        if stall {
            assert!(
                rank0.contains("timed out") && rank0.contains("rank(s) [1]"),
                "{rank0}"
            );
        } else {
            assert!(rank0.contains("rank 1 left the job"), "{rank0}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}",
            started.elapsed()
        );
    }
}

/// Note [Tied embedding split]: the decoder op delivers the decoder's share of the tied
/// table's gradient among the heads' gradients (before any encoder layer's), the table's own
/// gradient is then the lookup's share, and the two add up to the gradient of plain backward.
#[test]
fn the_tied_tables_two_shares_add_up_to_its_gradient() {
    let _serial = serial();
    let model = tiny_model(2);
    let batch = batches(1, 4).remove(0);
    let table = named_params::<B, _>(&model)
        .into_iter()
        .find(|(name, _)| name == WORD_EMBEDDINGS)
        .unwrap()
        .1;
    let decoder = ParamId::new();
    let (hooks, fired) = recording_hooks(&model, Some(decoder));
    let (_, loss) = ember_trainer::eval::forward_loss_hooked(&model, batch.clone(), &hooks);
    let mut grads = GradientsParams::from_grads(loss.total.backward(), &model);
    drop(hooks);
    let lookup = host(take_grads(&model, &mut grads, &[table]).remove(0).1);
    let fired = std::mem::take(&mut *fired.lock().unwrap());
    // First the decoder op (group 0), then the heads' hook (group 0), then layers 1, 0.
    assert_eq!(
        fired.iter().map(|(g, _)| *g).collect::<Vec<_>>(),
        vec![0, 0, 1, 2]
    );
    assert_eq!(fired[0].1.len(), 1);
    assert_eq!(fired[0].1[0].0, decoder);
    let share = &fired[0].1[0].1;
    let whole = &plain_gradients(&model, batch.clone())[&table];
    let sum: Vec<f64> = share
        .iter()
        .zip(&lookup)
        .map(|(a, b)| f64::from(*a) + f64::from(*b))
        .collect();
    let whole: Vec<f64> = whole.iter().map(|&x| f64::from(x)).collect();
    let diff = max_abs_diff(&sum, &whole);
    assert!(
        diff <= 1e-6 * max_abs(&whole),
        "shares differ from the whole by {diff:e}"
    );
    // The lookup's share lives in the batch's rows only.
    let hidden = lookup.len() / 30522;
    let ids: std::collections::BTreeSet<usize> =
        batch_ids(&batch).into_iter().map(|i| i as usize).collect();
    for (row, values) in lookup.chunks(hidden).enumerate() {
        if !ids.contains(&row) {
            assert!(
                values.iter().all(|&x| x == 0.0),
                "row {row} is not in the batch"
            );
        }
    }
    // The start-up probe plans the decoder's share with the heads, the table after backward.
    let order = ready_order(&model, batch, Some(decoder));
    assert_eq!(order.hooked[0], (0, vec![decoder]));
    assert!(order.late.contains(&table));
    let plan = bucket_plan::<B, _>(&model, &order.params(), Some(decoder), 1.0, 25.0);
    assert_eq!(plan.buckets[0].params[0].name, DECODER_WEIGHT);
    assert!(
        plan.buckets
            .iter()
            .all(|b| b.params.iter().all(|p| p.id != table)),
        "the table is reduced by rows"
    );
    assert!(plan.describe().ends_with(&format!(
        "rows of {WORD_EMBEDDINGS} [30522, 128] after bucket {}\n",
        plan.buckets.len() - 1
    )));
}

fn batch_ids(batch: &Batch<B>) -> Vec<i64> {
    batch
        .input_ids
        .clone()
        .into_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .unwrap()
}
