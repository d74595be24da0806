//! 1-bit Adam and 1-bit LAMB through the trainer: the warm-up is the exact optimizer bit for
//! bit, the compression stage leaves the gradients local and sends over 16× fewer bytes, and
//! it trains (the convergence comparison on the embedded corpus is `onebit_convergence` in
//! `xtask/tests/train_cli.rs`, and docs/parallel.md's table).

use super::*;
use ember_trainer::config::OptimizerKind;

#[test]
fn warm_up_is_the_exact_optimizer_and_compression_sends_over_16_times_fewer_bytes() {
    let _serial = serial();
    for (exact, onebit) in [
        (OptimizerKind::AdamW, OptimizerKind::OnebitAdam),
        (OptimizerKind::Lamb, OptimizerKind::OnebitLamb),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut config = small_config(dir.path());
        config.train.steps = 8;
        config.train.eval_every = Some(8);
        config.train.batch_size = 2;
        config.optimizer.name = exact;
        // 1-bit LAMB adapts every tensor (DeepSpeed's `OnebitLamb`): its exact optimizer is
        // NVLAMB (the setting is LAMB's only; 1-bit LAMB always adapts).
        config.optimizer.nvlamb = exact == OptimizerKind::Lamb;
        let reference = summary(&config, 2, shared_data());
        config.optimizer.nvlamb = false;
        config.optimizer.name = onebit;
        config.optimizer.onebit.freeze_step = Some(4);
        let compressed = summary(&config, 2, shared_data());
        // Warm-up (steps 1-4) and the step after it: the loss of step 5 is computed before
        // its update, from weights the exact optimizer made.
        assert_eq!(
            &compressed.losses[..5],
            &reference.losses[..5],
            "{onebit:?}: the warm-up differs from {exact:?}"
        );
        assert_ne!(
            &compressed.losses[5..],
            &reference.losses[5..],
            "{onebit:?}: the compression stage changed nothing"
        );
        for loss in &compressed.losses {
            assert!(loss.is_finite(), "{onebit:?}: {:?}", compressed.losses);
        }
        // The last loss stays close to the exact run's (a few steps of compressed momenta).
        let (a, b) = (compressed.losses[7], reference.losses[7]);
        assert!((a - b).abs() < 0.05 * b, "{onebit:?}: {a} vs {b}");
        // Bytes: the warm-up's gradients (a ring allreduce's share of the buckets and of the
        // step's rows of the tied table, which vary), then compressed momenta.
        assert_eq!(&compressed.comm_bytes[..4], &reference.comm_bytes[..4]);
        let warmup = *reference.comm_bytes.iter().min().unwrap();
        for &bytes in &compressed.comm_bytes[4..] {
            assert!(
                bytes > 0 && warmup as f64 / bytes as f64 > 16.0,
                "{onebit:?}: {warmup} bytes per warm-up step, {bytes} compressed"
            );
        }
    }
}

/// Convergence of an exact optimizer and its 1-bit version at learning rate `lr` on the smoke
/// run's recipe (`configs/tiny-cpu.toml`: the embedded corpus, tiny
/// model; AdamW at 2e-3, the recipe's rate until it became 1e-3 for its 2000 steps, LAMB at
/// 5e-3) with 2 in-process ranks × batch 4 (docs/parallel.md's
/// measurements: 4 ranks × batch 2, the same global batch; 2 ranks take half the time on 2
/// cores, this test having been the slowest of the suite at about 15 minutes) and the freeze
/// at 20% of the steps, 1-bit settings at their defaults: both learn (above the unigram
/// baseline by a point), and the 1-bit optimizer ends within 1.5 points of held-out
/// masked-LM accuracy of its exact optimizer. The target, 1 point, is met on every run
/// measured (docs/parallel.md: gaps 0.6–0.9 over three seeds; this test's own run here: AdamW 0.0930 /
/// 1-bit Adam 0.0874, LAMB 0.0890 / 1-bit LAMB 0.0798); the half point of margin is for
/// another CPU's arithmetic (a different GEMM kernel takes another trajectory; seed to seed
/// the exact optimizers moved by 0.5–0.7 points). DeepSpeed's exact settings (`variance =
/// frozen`, `scale_block = 0`) fail it: 1-bit Adam ended at the baseline, 3.1 points below.
fn onebit_reaches_the_accuracy_of(exact: OptimizerKind, onebit: OptimizerKind, lr: f64) {
    const STEPS: u64 = 600;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny-cpu.toml");
    let mut config = TrainConfig::load(&recipe).unwrap();
    config.train.batch_size = 4;
    config.train.steps = STEPS;
    config.train.eval_every = Some(STEPS);
    config.train.out = dir.path().to_path_buf();
    let data = Arc::new(prepare_data(&config).unwrap());
    let mut accuracy = Vec::new();
    for name in [exact, onebit] {
        config.optimizer.name = name;
        // 1-bit LAMB adapts every tensor, as DeepSpeed's: compared with LAMB that does too.
        config.optimizer.nvlamb = name == OptimizerKind::Lamb;
        config.optimizer.lr = lr;
        let run = summary(&config, 2, data.clone());
        assert_eq!(run.steps, STEPS);
        let baseline = run.unigram_baseline;
        assert!(
            run.eval.mlm_accuracy > baseline + 0.01,
            "{name:?} did not learn: {} (baseline {baseline})",
            run.eval.mlm_accuracy
        );
        accuracy.push(run.eval.mlm_accuracy);
    }
    eprintln!(
        "held-out masked-LM accuracy after {STEPS} steps: {exact:?} {:.4} / {onebit:?} {:.4}",
        accuracy[0], accuracy[1]
    );
    assert!(
        (accuracy[0] - accuracy[1]).abs() <= 0.015,
        "{onebit:?} {:.4} vs {exact:?} {:.4}",
        accuracy[1],
        accuracy[0]
    );
}

// The two pairs are two tests, so that a test runner runs them side by side: one run of both
// was the suite's critical path (1,062 s of its 1,061 on 2 cores, docs/testing.md).
#[test]
fn onebit_adam_reaches_the_accuracy_of_adamw() {
    onebit_reaches_the_accuracy_of(OptimizerKind::AdamW, OptimizerKind::OnebitAdam, 2e-3);
}

#[test]
fn onebit_lamb_reaches_the_accuracy_of_lamb() {
    onebit_reaches_the_accuracy_of(OptimizerKind::Lamb, OptimizerKind::OnebitLamb, 5e-3);
}
