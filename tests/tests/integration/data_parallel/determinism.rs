//! Same seed, same run. It holds the data-parallel tests' lock (`serial()`) because NdArray's
//! random generator is process-wide: a test running in parallel would draw from it between
//! steps (nextest runs each test in a process of its own; `cargo test` runs this binary one
//! test at a time, .ci/run).

use ember_trainer::{RunOptions, train};

use super::{B, serial};

#[test]
fn same_seed_gives_the_same_loss_sequence() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, seed: u64| {
        let mut config = ember_tests::dropout_and_masks_config(&dir.path().join(name));
        config.train.steps = 6;
        config.train.batch_size = 4;
        config.train.eval_every = Some(6);
        config.train.eval_samples = 8;
        config.train.seed = seed;
        train::<B>(&config, &Default::default(), RunOptions::default()).unwrap()
    };
    let (a, b, c) = (run("a", 1), run("b", 1), run("c", 2));
    // Dropout is on (0.1), so this also checks that dropout masks come from the seed.
    // Note [Bitwise determinism]: the losses have so far always been bitwise equal, but the
    // final weights of two same-seed runs in one process differed in the last bit of a few
    // entries in 2 of 3 tries (Burn 0.21 NdArray; the order in which autodiff sums a node's
    // incoming gradients is the suspect). Adam divides by sqrt(v), so a last-bit difference in
    // a near-zero gradient entry can move its weight by far more than a last bit (CI once saw
    // 9.4e-9 on a LayerNorm bias whose largest entry is ~1e-3). So losses are checked to 1e-6
    // relative and weights to 1e-6 absolute (weights are O(0.02..1)): far below any effect of a
    // different seed (the losses of seed 2 differ in the first decimal).
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs());
    assert_eq!(a.losses.len(), 6);
    for (step, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        assert!(
            close(*x, *y),
            "step {step}: losses {x} and {y} with the same seed"
        );
    }
    assert_eq!(a.eval.mlm_accuracy, b.eval.mlm_accuracy);
    assert_ne!(a.losses, c.losses, "another seed gave the same losses");
    // The final weights are identical too, tensor by tensor (to 1e-6 · max(1, largest entry)).
    let (a, b) = (
        dir.path().join("a/model.safetensors"),
        dir.path().join("b/model.safetensors"),
    );
    assert_eq!(
        ember_tests::read_safetensors(&a).len(),
        46,
        "every parameter of the 2-layer model"
    );
    ember_tests::assert_same_weights(&a, &b, 1e-6);
}

/// The CPU's GEMM setting does not change the run beyond f32 rounding: with each dense GEMM
/// split over rayon's threads (`model.gemm_threads = "rayon"`, the default) or run as one
/// call on OpenBLAS's threads (`blas`), the same seed gives the same losses and weights to the
/// tolerances of Note [Bitwise determinism] above (the split products agree with the whole
/// ones to rounding, `backend-ext/src/host_gemm.rs`).
#[test]
fn gemm_threads_do_not_change_the_run() {
    use ember_trainer::blas::GemmThreads;
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let run = |threads: GemmThreads| {
        let mut config =
            ember_tests::dropout_and_masks_config(&dir.path().join(threads.to_string()));
        config.model.gemm_threads = threads;
        config.train.steps = 6;
        config.train.batch_size = 4;
        config.train.eval_every = Some(6);
        config.train.eval_samples = 8;
        train::<B>(&config, &Default::default(), RunOptions::default()).unwrap()
    };
    let (rayon, blas) = (run(GemmThreads::Rayon), run(GemmThreads::Blas));
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs());
    assert_eq!(rayon.losses.len(), 6);
    for (step, (x, y)) in rayon.losses.iter().zip(&blas.losses).enumerate() {
        assert!(close(*x, *y), "step {step}: rayon {x}, blas {y}");
    }
    assert_eq!(rayon.eval.mlm_accuracy, blas.eval.mlm_accuracy);
    ember_tests::assert_same_weights(
        &dir.path().join("rayon/model.safetensors"),
        &dir.path().join("blas/model.safetensors"),
        1e-6,
    );
}
