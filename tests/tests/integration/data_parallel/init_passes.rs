//! `train.init_passes` (Note [Init passes] in `trainer/src/train/init_passes.rs`): Samsung's
//! forward and backward passes on a dummy batch before the timed run update nothing, so the
//! run that makes them trains bit for bit as the run that does not.

use ember_trainer::loss_scale::LossScaleMode;

use super::*;

/// `config` trained by two in-process ranks, then again with `passes` init passes (its output
/// in `dir/passes`).
fn without_and_with_passes(
    config: &TrainConfig,
    passes: u32,
    dir: &Path,
) -> (ember_trainer::TrainSummary, ember_trainer::TrainSummary) {
    let data = Arc::new(prepare_data(config).unwrap());
    let plain = summary(config, 2, data.clone());
    let mut with_passes = config.clone();
    with_passes.train.init_passes = passes;
    with_passes.train.out = dir.join("passes");
    (plain, summary(&with_passes, 2, data))
}

/// Two in-process ranks, two micro-batches a step, bucket-wise clipping, dropout on and up to
/// 8 masked positions a sample: 3 init passes change no loss and no weight of a 4-step run;
/// each pass computes a real loss (an untrained model's, near ln V + ln 2), the same in every
/// pass (the weights, dropout masks and batch stay), and rank 0's metrics record them.
#[test]
fn init_passes_update_nothing_and_compute_the_dummy_batchs_loss() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut config = ember_tests::dropout_and_masks_config(&dir.path().join("plain"));
    config.train.steps = 4;
    config.train.eval_every = Some(4);
    config.train.batch_size = 4;
    config.parallel.grad_accum = 2;
    config.parallel.clip = ClipMode::Bucket;
    let (plain, passed) = without_and_with_passes(&config, 3, dir.path());
    assert!(plain.init_pass_losses.is_empty());

    assert_eq!(
        passed.losses, plain.losses,
        "the init passes changed the run"
    );
    let worst = assert_same_weights(&plain.checkpoint, &passed.checkpoint, 0.0);
    assert_eq!(worst, 0.0);
    let losses = &passed.init_pass_losses;
    assert_eq!(losses.len(), 3);
    let ln_v = (30522f64).ln() + 2f64.ln();
    assert!(
        losses.iter().all(|l| (l - ln_v).abs() < 1.5),
        "an untrained model's loss on the dummy batch: {losses:?} (ln V + ln 2 = {ln_v:.2})"
    );
    assert!(
        losses.iter().all(|l| *l == losses[0]),
        "a pass changed what the next one computes: {losses:?}"
    );
    let metrics = std::fs::read_to_string(&passed.metrics).unwrap();
    let record: serde_json::Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["event"] == "init_passes")
        .expect("an init_passes record");
    assert_eq!(record["passes"], 3);
    // Two micro-batches a pass (`grad_accum` 2), each pass's buckets allreduced: about a
    // step's bytes (the tied table's rows of the step's tokens vary; the dummy has one id).
    assert_eq!(record["micro_batches"], 2);
    let bytes: Vec<u64> = record["comm_bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect();
    assert_eq!(bytes.len(), 3);
    assert!(
        bytes
            .iter()
            .all(|&b| b == bytes[0] && b * 2 > plain.comm_bytes[0]),
        "bytes allreduced by the passes {bytes:?}, by the first step {}",
        plain.comm_bytes[0]
    );
    let logged: Vec<f64> = record["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_f64().unwrap())
        .collect();
    assert_eq!(&logged, losses);
}

/// With dynamic loss scaling (doubling after every clean step), the passes leave the scale
/// where it was: the runs with and without them scale every step alike and train alike.
#[test]
fn init_passes_leave_the_loss_scale() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut config = ember_tests::dropout_and_masks_config(&dir.path().join("plain"));
    config.train.steps = 3;
    config.train.eval_every = Some(3);
    config.train.batch_size = 2;
    config.loss_scale.mode = LossScaleMode::Dynamic;
    config.loss_scale.init_scale = 1024.0;
    config.loss_scale.growth_interval = 1;
    let (plain, passed) = without_and_with_passes(&config, 2, dir.path());
    let scales = |summary: &ember_trainer::TrainSummary| -> Vec<f64> {
        std::fs::read_to_string(&summary.metrics)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["event"] == "train")
            .map(|r| r["loss_scale"].as_f64().unwrap())
            .collect()
    };
    // 1024 at the first step, doubled after each clean one.
    assert_eq!(scales(&plain), [1024.0, 2048.0, 4096.0]);
    assert_eq!(scales(&passed), scales(&plain));
    assert_eq!(passed.loss_scale, plain.loss_scale);
    assert_eq!(passed.losses, plain.losses);
    assert_eq!(passed.init_pass_losses.len(), 2);
}
