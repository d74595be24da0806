//! Device-resident gradient buckets on wgpu (Mesa's lavapipe in CI), through the real training
//! loop: two in-process ranks with device buckets end three steps with the weights of one rank
//! with the whole batch where the clip mode makes that exact (`none`, `global`; host buckets
//! equal one rank there in `tests/tests/integration/data_parallel/mod.rs`), and with the weights of two
//! ranks with host buckets where it does not (`local-global`, `bucket`); and a step with device
//! buckets never makes the host wait for the device, counted by the CubeCL runtime wrapper of
//! `ember-backend-ext`.
//!
//! Tolerance: weights within 1e-5 (relative to the tensor's largest entry, at least 1): the
//! device path sums the ranks' buckets and the norms in f32 on the device, the host path in
//! f32 and f64 on the host.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use ember_backend_ext::HostSyncs;
use ember_tests::assert_same_weights;
use ember_trainer::parallel::{BucketStorage, ClipMode};
use ember_trainer::{PreparedData, RunOptions, TrainConfig, prepare_data};

type B = Autodiff<crate::Wgpu>;

/// The data-parallel tests' configuration ([`ember_tests::data_parallel_config`]) with 4
/// samples a step and small buckets, so that the plan has several and bucket clipping means
/// something.
fn config(out: &Path) -> TrainConfig {
    let mut config = ember_tests::data_parallel_config(out);
    config.train.eval_samples = 8;
    config.train.batch_size = 4;
    config.parallel.first_bucket_mb = 0.25;
    config.parallel.bucket_cap_mb = 0.5;
    config
}

fn data() -> Arc<PreparedData> {
    static DATA: OnceLock<Arc<PreparedData>> = OnceLock::new();
    DATA.get_or_init(|| Arc::new(prepare_data(&config(Path::new("unused"))).unwrap()))
        .clone()
}

fn counter() -> u64 {
    HostSyncs::now().total()
}

/// Trains `config` on `world_size` in-process ranks on lavapipe and returns the metrics'
/// records.
fn run(config: &TrainConfig, world_size: usize) -> (PathBuf, Vec<serde_json::Value>) {
    let options = RunOptions {
        host_sync_counter: Some(counter),
        launch_counter: Some(|| HostSyncs::now().launches),
        ..RunOptions::default()
    };
    let summary = ember_trainer::train_in_process_with_data::<B>(
        config,
        world_size,
        &WgpuDevice::DefaultDevice,
        options,
        Some(data()),
    )
    .unwrap();
    let records = std::fs::read_to_string(&summary.metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (summary.checkpoint, records)
}

fn train_records(records: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    records.iter().filter(|r| r["event"] == "train").collect()
}

#[test]
fn device_buckets_equal_one_rank_or_host_buckets_for_every_clip_mode() {
    let dir = tempfile::tempdir().unwrap();
    // Per clip mode, the last step's kernel launches; and the plan's bucket count.
    let mut launches: Vec<(ClipMode, u64)> = Vec::new();
    let mut buckets = 0;
    for clip in [
        ClipMode::None,
        ClipMode::Global,
        ClipMode::LocalGlobal,
        ClipMode::Bucket,
    ] {
        let mut two = config(&dir.path().join(format!("{clip}-device")));
        two.parallel.clip = clip;
        // Buckets of 50 KiB: tens of them, as a large model has at the default cap, so that
        // what clipping launches per bucket shows.
        two.parallel.first_bucket_mb = 0.05;
        two.parallel.bucket_cap_mb = 0.05;
        two.train.batch_size = 2;
        two.parallel.buckets = BucketStorage::Device;
        let (device, records) = run(&two, 2);
        assert_eq!(records[0]["bucket_storage"], "device");
        // "K buckets: a, b, … MiB, then the batch's rows of …"
        let plan = records[0]["buckets"].as_str().unwrap();
        buckets = plan.split(' ').next().unwrap().parse::<u64>().unwrap();
        launches.push((
            clip,
            train_records(&records).last().unwrap()["kernel_launches_step"]
                .as_u64()
                .unwrap(),
        ));
        let norms: Vec<f64> = train_records(&records)
            .iter()
            .map(|r| r["grad_norm"].as_f64().unwrap())
            .collect();
        if clip != ClipMode::None {
            // Clipping must be active for the comparison to mean something.
            assert!(
                norms[0] > two.optimizer.max_grad_norm,
                "{clip}: grad norm {norms:?}"
            );
        }

        if matches!(clip, ClipMode::None | ClipMode::Global) {
            // Exact splits of one batch: the reference is one rank (one run fewer on lavapipe
            // than host buckets and one rank both).
            let mut one = two.clone();
            one.train.batch_size = 4;
            one.train.out = dir.path().join(format!("{clip}-one"));
            let (reference, _) = run(&one, 1);
            let worst = assert_same_weights(&reference, &device, 1e-5);
            eprintln!("{clip}: 2 ranks vs 1 rank, largest difference {worst:e}");
        } else {
            let mut host = two.clone();
            host.parallel.buckets = BucketStorage::Host;
            host.train.out = dir.path().join(format!("{clip}-host"));
            let (host_checkpoint, records) = run(&host, 2);
            assert_eq!(records[0]["bucket_storage"], "host");
            let worst = assert_same_weights(&host_checkpoint, &device, 1e-5);
            eprintln!("{clip}: device vs host buckets, largest difference {worst:e}");
        }
    }
    // Note [Clipped in one launch]: what clipping adds to a step's launches (`none` computes
    // the norm too, for the log). `global`: one kernel scales every bucket and the tied rows,
    // up to 32 a launch (lavapipe binds 4 or 5: 4–5 launches), where Burn's composition took
    // six launches for the coefficient and one per bucket (measured: 22 more than `none`).
    // `bucket`: per bucket the partial sums of its norm and the clip that finishes them (two
    // launches, Note [Clipped by its own norm]), where the norm took two and the clip one
    // (measured: 48 more at 17 buckets, the tied rows an 18th clip) and the composition nine
    // (120 more); now 29 more. A step's count is taken without waiting for the device, so a
    // few launches can move between steps: the bounds leave room.
    let of = |clip| launches.iter().find(|(c, _)| *c == clip).unwrap().1 as i64;
    let none = of(ClipMode::None);
    eprintln!("{buckets} buckets; launches per step by clip mode: {launches:?}");
    assert!(buckets >= 10, "{buckets} buckets: too few to tell");
    let extra = |clip| of(clip) - none;
    assert!(
        extra(ClipMode::Global) <= 12,
        "global clipping added {} launches to {none} ({buckets} buckets)",
        extra(ClipMode::Global)
    );
    assert!(
        extra(ClipMode::Bucket) <= 2 * (buckets as i64 + 1) + 2,
        "bucket clipping added {} launches to {none} ({buckets} buckets)",
        extra(ClipMode::Bucket)
    );
}

#[test]
fn a_step_with_device_buckets_never_waits_for_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let mut device = config(&dir.path().join("device"));
    device.train.batch_size = 2;
    device.parallel.clip = ClipMode::Global;
    // Steps 1 and 3 re-check the hooks' gradients (Note [Re-checking late gradients]: one
    // small read after the wait for the buckets, none in backward); step 2 is a plain step.
    device.parallel.check_gradients_every = 2;
    let (_, records) = run(&device, 2);
    assert_eq!(
        records[0]["bucket_storage"], "device",
        "auto picks the device"
    );
    let steps = train_records(&records);
    assert_eq!(steps.len(), 3);
    for r in &steps {
        assert_eq!(r["host_syncs_backward"], 0, "reads during backward: {r}");
    }
    // Each step's kernels are counted: hundreds for two layers (forward, backward, the
    // buckets, the optimizer). Step 1 autotunes
    // besides what step 3 does (both re-check the hooks' gradients); step 2, a plain step,
    // launches fewer than step 3 (a launch counted late moves from step 2 into step 3).
    let launches: Vec<u64> = steps
        .iter()
        .map(|r| r["kernel_launches_step"].as_u64().unwrap())
        .collect();

    assert!(launches.iter().all(|&n| n > 100), "{launches:?}");
    assert!(launches[2] <= launches[0], "{launches:?}");
    assert!(
        launches[1] < launches[2],
        "the re-check launches kernels: {launches:?}"
    );

    let plain = &steps[1];
    assert_eq!(plain["host_syncs_step"], 0, "reads in the step: {plain}");
    for checked in [&steps[0], &steps[2]] {
        let reads = checked["host_syncs_step"].as_u64().unwrap();
        assert!(
            reads >= 1,
            "the re-check reads its result after the wait: {checked}"
        );
        assert_eq!(reads, steps[0]["host_syncs_step"].as_u64().unwrap());
    }

    // The counter sees the host path's reads: a read per bucket during backward.
    let mut host = device.clone();
    host.parallel.buckets = BucketStorage::Host;
    host.train.out = dir.path().join("host");
    let (_, records) = run(&host, 2);
    for r in train_records(&records) {
        assert!(
            r["host_syncs_backward"].as_u64().unwrap() > 0,
            "the host path reads gradients in backward: {r}"
        );
    }
}

/// Note [CubeCL streams and in-place writes] in the trainer's `collective.rs`: each rank's
/// bucket comes from a kernel (written in place) on the rank's thread, is reduced on a
/// communication thread, and the result is read on the ranks' threads: every stage must see
/// the previous one's writes.
#[test]
fn in_process_device_allreduce_sees_every_threads_writes() {
    const TRIES: usize = 50;
    use burn::tensor::{Tensor, TensorData};
    use ember_trainer::parallel::{CommThread, Communicator, InProcess, ReduceOp};
    let device = WgpuDevice::DefaultDevice;
    // The race this guards against (a rank writing the shared result in place while another
    // rank's read of it is still queued) showed in about one CI run in forty with one try:
    // many tries make it show at nearly every run of a broken hub.
    for op in [ReduceOp::Average, ReduceOp::Sum].repeat(TRIES) {
        let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = InProcess::group(2, std::time::Duration::from_secs(30))
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let device = device.clone();
                    scope.spawn(move || {
                        // [1, 2, 3, 4] on rank 0, [3, 5, 7, 9] on rank 1, by in-place kernels.
                        let bucket = Tensor::<crate::Wgpu, 1>::from_data(
                            TensorData::from([1.0f32, 2.0, 3.0, 4.0]),
                            &device,
                        )
                        .mul_scalar((rank + 1) as f32)
                        .add_scalar(rank as f32);
                        let thread =
                            CommThread::<crate::Wgpu>::spawn(Communicator::Device(Box::new(comm)));
                        let reduced = thread
                            .submit_device(move |c| c.allreduce_device(bucket, op))
                            .recv()
                            .unwrap()
                            .unwrap();
                        reduced.add_scalar(1.0).into_data().to_vec::<f32>().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let expected = match op {
            ReduceOp::Average => vec![3.0, 4.5, 6.0, 7.5],
            ReduceOp::Sum => vec![5.0, 8.0, 11.0, 14.0],
        };
        assert_eq!(results, vec![expected.clone(), expected], "{op:?}");
    }
}

/// The counting runtime counts each kernel launch on the thread that launched it: an addition
/// and an exponential are two launches here and none on another thread's count. The server
/// counts a launch when it takes it from the queue, so the count is complete after a read.
#[test]
fn kernel_launches_are_counted_per_thread() {
    use burn::tensor::{Tensor, TensorData};
    let device = WgpuDevice::DefaultDevice;
    let a = Tensor::<crate::Wgpu, 1>::from_data(TensorData::from([1.0f32, 2.0, 3.0]), &device);
    let b = Tensor::<crate::Wgpu, 1>::from_data(TensorData::from([0.5f32, 0.5, 0.5]), &device);
    let _warm = (a.clone() + b.clone()).exp().into_data();
    let before = HostSyncs::now();
    let sum = a.clone() + b.clone();
    let values = sum.exp().into_data().to_vec::<f32>().unwrap();
    let counted = HostSyncs::now().since(before);
    assert_eq!((counted.launches, counted.reads), (2, 1), "{counted:?}");
    assert!((values[0] - 1.5f32.exp()).abs() < 1e-5, "{values:?}");
    let other = std::thread::spawn(|| HostSyncs::now().launches)
        .join()
        .unwrap();
    assert_eq!(other, 0, "a thread that launched nothing counts nothing");
}
