//! Reduced precision over 2 in-process ranks. Dynamic loss scaling
//! (`trainer/src/loss_scale.rs`): an overflow on one rank skips the step on both, the scale
//! halves and grows again after the interval, never goes below the floor, and consecutive
//! overflows stop the run with an error, never a NaN weight. bf16 buckets
//! (`trainer/src/parallel/bf16.rs`): half the bytes, the f32 run's losses within bf16
//! rounding. Dropout on, several masked positions per sample.

use std::sync::atomic::AtomicU32;

use super::*;
use ember_trainer::loss_scale::LossScaleMode;

/// Tries of the current run on which rank 1 overflowed (step 2) and rank 0 did (step 4), each
/// once; `PERSISTENT`: rank 1 overflows on every try from step 1 on.
static FAULTS: [AtomicU32; 2] = [AtomicU32::new(0), AtomicU32::new(0)];

fn twice(step: u64, rank: usize) -> f32 {
    match (rank, step) {
        (1, 2) if FAULTS[1].fetch_add(1, Ordering::SeqCst) == 0 => f32::INFINITY,
        (0, 4) if FAULTS[0].fetch_add(1, Ordering::SeqCst) == 0 => f32::NAN,
        _ => 1.0,
    }
}

fn persistent(step: u64, rank: usize) -> f32 {
    if rank == 1 && step >= 1 {
        f32::INFINITY
    } else {
        1.0
    }
}

fn config(out: &Path) -> TrainConfig {
    let mut config = ember_tests::dropout_and_masks_config(out);
    config.train.batch_size = 2;
    config.train.steps = 6;
    config.train.eval_every = Some(6);
    config
}

/// [`config`] with dynamic loss scaling from 1024, doubling after 2 clean steps, floor 256.
fn scaled_config(out: &Path) -> TrainConfig {
    let mut config = config(out);
    config.loss_scale.mode = LossScaleMode::Dynamic;
    config.loss_scale.init_scale = 1024.0;
    config.loss_scale.growth_interval = 2;
    config.loss_scale.min_scale = 256.0;
    config
}

fn records(metrics: &Path, event: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["event"] == event)
        .collect()
}

fn run_ranks(
    config: &TrainConfig,
    fault: Option<fn(u64, usize) -> f32>,
) -> Vec<Result<ember_trainer::TrainSummary, TrainError>> {
    for f in &FAULTS {
        f.store(0, Ordering::SeqCst);
    }
    static DATA: std::sync::OnceLock<Arc<PreparedData>> = std::sync::OnceLock::new();
    let data = DATA.get_or_init(|| Arc::new(prepare_data(config).unwrap()));
    on_ranks(2, Duration::from_secs(120), |_, comm| {
        let options = RunOptions {
            loss_fault: fault,
            ..RunOptions::default()
        };
        train_rank::<B>(
            config,
            &Default::default(),
            options,
            Communicator::Host(Box::new(comm)),
            Some(data.clone()),
        )
    })
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let plain = config(&dir.path().join("plain"));
    let reference: Vec<_> = run_ranks(&plain, None)
        .into_iter()
        .map(Result::unwrap)
        .collect();

    let scaled = scaled_config(&dir.path().join("scaled"));
    let summaries: Vec<_> = run_ranks(&scaled, Some(twice))
        .into_iter()
        .map(Result::unwrap)
        .collect();
    // Both ranks skipped both tries (one overflowed on rank 1 only, one on rank 0 only): a
    // rank that had not would have run out of steps first and left the other waiting.
    for s in &summaries {
        assert_eq!(s.steps, 6);
        assert_eq!(s.skipped_steps, 2, "rank {}", s.is_main_rank);
    }
    let metrics = &summaries[0].metrics;
    let skips = records(metrics, "skip");
    let at = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    assert_eq!(skips.len(), 2, "{skips:?}");
    // Steps 1, 2 clean at 1024: the scale doubles; step 3's first try overflows at 2048 and
    // halves; steps 3, 4 clean at 1024, doubled; step 5's first try overflows at 2048.
    assert_eq!(
        (at(&skips[0], "step"), at(&skips[0], "loss_scale")),
        (3.0, 2048.0)
    );
    assert_eq!(at(&skips[0], "next_loss_scale"), 1024.0);
    assert_eq!(
        (at(&skips[1], "step"), at(&skips[1], "loss_scale")),
        (5.0, 2048.0)
    );
    let train = records(metrics, "train");
    let scales: Vec<f64> = train.iter().map(|r| at(r, "loss_scale")).collect();
    assert_eq!(scales, [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 1024.0]);
    let skipped: Vec<f64> = train.iter().map(|r| at(r, "skipped_steps")).collect();
    assert_eq!(skipped, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
    // The schedule did not advance on the skipped tries: every step has the unscaled run's
    // learning rate. Before the first skip the runs are the same batches, and scaling by a
    // power of two is exact in f32: the same losses, bit for bit.
    let plain_train = records(&reference[0].metrics, "train");
    for (a, b) in train.iter().zip(&plain_train) {
        assert_eq!(at(a, "lr"), at(b, "lr"), "step {}", a["step"]);
    }
    assert_eq!(summaries[0].losses[..2], reference[0].losses[..2]);
    assert_ne!(
        summaries[0].losses[2], reference[0].losses[2],
        "step 3 saw the next batch"
    );
    let weights = ember_tests::read_safetensors(&summaries[0].checkpoint);
    assert!(
        weights.values().flatten().all(|x| x.is_finite()),
        "a NaN weight"
    );
    assert_eq!(
        summaries[0].loss_scale,
        Some(2048.0),
        "steps 5, 6 clean: doubled"
    );
    // The checkpoint holds the scaler's state, for --resume.
    let path = summaries[0].last_checkpoint.join("trainer_state.json");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let scaler = &state["loss_scaler"];
    assert_eq!(
        (scaler["scale"].as_f64(), scaler["skipped_steps"].as_u64()),
        (Some(2048.0), Some(2)),
        "{state}"
    );
}

#[test]
fn consecutive_overflows_stop_the_run_at_the_floor() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut scaled = scaled_config(dir.path());
    scaled.loss_scale.max_skipped_steps = 4;
    for result in run_ranks(&scaled, Some(persistent)) {
        let error = result.unwrap_err();
        // 1024 → 512 → 256, then the floor holds it: the fourth try is at 256.
        assert!(
            matches!(
                error,
                TrainError::LossScaleCollapsed {
                    step: 2,
                    skipped: 4,
                    ..
                }
            ),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("step 2")
                && message.contains("4 steps in a row")
                && message.contains("loss scale 256:"),
            "{message}"
        );
    }
    let skips = records(&dir.path().join("metrics.jsonl"), "skip");
    let scales: Vec<f64> = skips
        .iter()
        .map(|r| r["loss_scale"].as_f64().unwrap())
        .collect();
    // Every skip is recorded, the fourth (the error's) too; the floor holds the last two.
    assert_eq!(scales, [1024.0, 512.0, 256.0, 256.0]);
}

#[test]
fn loss_scaling_is_refused_with_one_bit_optimizers() {
    let mut c = config(Path::new("unused"));
    c.loss_scale.mode = LossScaleMode::Dynamic;
    c.optimizer.name = ember_trainer::OptimizerKind::OnebitAdam;
    let error = c.validate().unwrap_err().to_string();
    assert!(
        error.contains("loss_scale.mode") && error.contains("onebit-adam"),
        "{error}"
    );
}

#[test]
fn bf16_buckets_send_half_the_bytes_and_train_as_f32() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let f32_run = config(&dir.path().join("f32"));
    let mut bf16_run = config(&dir.path().join("bf16"));
    bf16_run.parallel.allreduce_dtype = ember_trainer::parallel::AllreduceDtype::Bf16;
    let a: Vec<_> = run_ranks(&f32_run, None)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let b: Vec<_> = run_ranks(&bf16_run, None)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    for (x, y) in a[0].comm_bytes.iter().zip(&b[0].comm_bytes) {
        assert_eq!(*x, 2 * *y, "bf16 sends half the bytes");
    }
    assert!(b[0].comm_bytes.iter().all(|&n| n > 0));
    // The first step's loss is computed before any reduced gradient: equal (so is the second:
    // AdamW's first update is lr · g/|g| up to epsilon, blind to the rounding). The later ones
    // follow weights updated from gradients rounded to 8 significant bits: within 1e-4
    // relative over 6 steps of the tiny model (seen: 1.1e-6).
    assert_eq!(a[0].losses[0], b[0].losses[0]);
    for (step, (x, y)) in a[0].losses.iter().zip(&b[0].losses).enumerate() {
        assert!(
            ((x - y) / x).abs() < 1e-4,
            "step {}: f32 buckets {x}, bf16 buckets {y}",
            step + 1
        );
    }
    assert_ne!(
        a[0].losses, b[0].losses,
        "bf16 rounding changed nothing: not in use?"
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.losses, a[0].losses);
        assert_eq!(y.losses, b[0].losses, "the ranks agree");
    }
}

#[test]
fn half_precision_on_the_cpu_is_refused_naming_the_setting() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path());
    c.train.precision = Some(ember_model::Precision::Fp16);
    let error = run_ranks(&c, None)
        .into_iter()
        .next()
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("train.precision") && error.contains("no fp16"),
        "{error}"
    );
}

/// Rank 0's first try of step 1 overflows.
fn first_try(step: u64, rank: usize) -> f32 {
    match (rank, step) {
        (0, 0) if FAULTS[0].fetch_add(1, Ordering::SeqCst) == 0 => f32::INFINITY,
        _ => 1.0,
    }
}

/// A step whose gradients the hooks' re-check compares (Note [Re-checking late gradients])
/// and that overflows is skipped, not failed: its NaN gradients compare with nothing.
#[test]
fn an_overflow_on_a_re_checked_step_is_skipped() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut scaled = scaled_config(dir.path());
    scaled.parallel.check_gradients_every = 1;
    scaled.train.steps = 2;
    scaled.train.eval_every = Some(2);
    for summary in run_ranks(&scaled, Some(first_try)) {
        let summary = summary.unwrap();
        assert_eq!((summary.steps, summary.skipped_steps), (2, 1));
    }
}

/// Note [Unscaled per bucket] (trainer's `parallel/buckets.rs`): with a loss scale S, the
/// gradients of S·loss reach the buckets divided by S once per micro-batch, before
/// accumulation: each bucket holds, bit for bit, `Σ_mb (S·g_mb)·(1/S)` in f32, on host and
/// device buckets, over two micro-batches. S = 3000 is not a power of two, so a division
/// missed or moved after the accumulation changes bits (checked here), and one repeated
/// divides by S² (the values could not pass). A division per gradient, as before, gives the
/// same bits: the launches it saves are counted by `bench step --top-kernels` (docs).
#[test]
fn loss_scaled_gradients_are_divided_once_per_bucket_before_accumulation() {
    let _serial = serial();
    let model = tiny_model(1);
    let micro_grads = gradients_of(&model, batches(2, 2));
    let order = backward_order(&model);
    let plan = bucket_plan::<B, _>(&model, &order, None, 0.25, 0.5);
    let k = plan.buckets.len();
    assert!(k >= 2, "{}", plan.summary());
    let scale = 3000.0f32;
    let inv = (1.0 / f64::from(scale)) as f32;
    let expected: Vec<Vec<f32>> = plan
        .buckets
        .iter()
        .map(|b| {
            b.params
                .iter()
                .flat_map(|p| {
                    let (first, second) = (&micro_grads[0][&p.id], &micro_grads[1][&p.id]);
                    first
                        .iter()
                        .zip(second)
                        .map(|(a, b)| (a * scale) * inv + (b * scale) * inv)
                        .collect::<Vec<_>>()
                })
                .collect()
        })
        .collect();
    // What a division missed or moved after the accumulation would give, bucket by bucket:
    // each must differ from `expected` somewhere, or the test could not see it.
    let plain_sums = |f: &dyn Fn(f32, f32) -> f32| -> Vec<f32> {
        plan.buckets
            .iter()
            .flat_map(|b| &b.params)
            .flat_map(|p| {
                micro_grads[0][&p.id]
                    .iter()
                    .zip(&micro_grads[1][&p.id])
                    .map(|(&a, &b)| f(a, b))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    for (what, wrong) in [
        ("no division", plain_sums(&|a, b| a * scale + b * scale)),
        (
            "a division after the accumulation",
            plain_sums(&|a, b| (a * scale + b * scale) * inv),
        ),
    ] {
        let differ = expected
            .iter()
            .flatten()
            .zip(&wrong)
            .filter(|(e, w)| e.to_bits() != w.to_bits())
            .count();
        assert!(differ > 0, "{what} changes no bit: the test cannot see it");
    }
    for on_device in [false, true] {
        let buckets = on_ranks(1, Duration::from_secs(60), |_, comm| {
            let comm = Arc::new(CommThread::spawn(if on_device {
                Communicator::<NdArray>::Device(Box::new(comm))
            } else {
                Communicator::Host(Box::new(comm))
            }));
            let reducer = Reducer::new(plan.clone(), ClipMode::None, 1.0, on_device, comm);
            reducer.set_loss_scale(f64::from(scale));
            for (mb, grads) in micro_grads.iter().enumerate() {
                reducer.prepare_backward(mb == 0, mb == 1);
                let scaled = plan
                    .buckets
                    .iter()
                    .flat_map(|b| &b.params)
                    .map(|p| {
                        let values = grads[&p.id].iter().map(|g| g * scale).collect::<Vec<_>>();
                        let data = TensorData::new(values, p.shape.clone());
                        (
                            p.id,
                            <NdArray as FloatTensorOps<NdArray>>::float_from_data(
                                data,
                                &Default::default(),
                            ),
                        )
                    })
                    .collect::<Vec<_>>();
                reducer.mark_params_ready(scaled);
            }
            reducer.finalize_backward().unwrap();
            (0..k).map(|b| reducer.bucket_values(b)).collect::<Vec<_>>()
        });
        for (b, (actual, expected)) in buckets[0].iter().zip(&expected).enumerate() {
            let differ = actual
                .iter()
                .zip(expected)
                .filter(|(a, e)| a.to_bits() != e.to_bits())
                .count();
            assert_eq!(
                differ,
                0,
                "device buckets {on_device}, bucket {b}: {differ} of {} values differ",
                expected.len()
            );
        }
    }
}
