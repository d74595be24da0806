//! What several of xtask's test binaries share.

// Each binary uses some of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The JSON result a benchmark wrote in `out`: its path and its contents.
pub fn result_json(out: &Path) -> (PathBuf, Value) {
    let json = std::fs::read_dir(out)
        .expect("the results folder")
        .map(|entry| entry.expect("an entry").path())
        .find(|path| path.extension().is_some_and(|e| e == "json"))
        .expect("a JSON result");
    let results =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    (json, results)
}

/// Samples per batch of [`train_step_bench`].
pub const BATCH: usize = 2;
/// Sequence length of [`train_step_bench`].
pub const SEQ_LEN: usize = 32;
/// Masked positions per sample of [`train_step_bench`].
pub const MAX_PREDICTIONS: usize = 4;

/// `bench train-step` on tiny without a reference, [`BATCH`] × [`SEQ_LEN`] with
/// [`MAX_PREDICTIONS`], two steps of one round, on `device`, its results in `out`, `extra`
/// flags last: what the tests that read its JSON run.
pub fn train_step_bench(device: &str, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args([
            "bench",
            "train-step",
            "--reference",
            "none",
            "--presets",
            "tiny",
        ])
        .args([
            "--batch-size",
            &BATCH.to_string(),
            "--seq-len",
            &SEQ_LEN.to_string(),
        ])
        .args(["--max-predictions", &MAX_PREDICTIONS.to_string()])
        .args(["--steps", "2", "--rounds", "1", "--gemm-size", "128"])
        .args(["--device", device])
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .expect("running xtask")
}
