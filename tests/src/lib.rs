//! Shared helpers of the workspace tests: fixture paths and golden-file reading.

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A tensor of a golden file, converted to f64, with its shape.
#[derive(Debug, Clone)]
pub struct Golden {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl Golden {
    /// The values as i64 (for integer inputs).
    pub fn ints(&self) -> Vec<i64> {
        self.values.iter().map(|&v| v as i64).collect()
    }
}

/// Reads every tensor of a safetensors file written by a fixture script (f32 or i64).
pub fn read_goldens(path: &std::path::Path) -> std::collections::HashMap<String, Golden> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes).expect("a safetensors golden file");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect(),
                Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            (
                name,
                Golden {
                    shape: view.shape().to_vec(),
                    values,
                },
            )
        })
        .collect()
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Largest absolute value of a slice.
pub fn max_abs(a: &[f64]) -> f64 {
    a.iter().map(|x| x.abs()).fold(0.0, f64::max)
}

/// Every tensor of a safetensors file as f64 values, by name.
pub fn read_safetensors(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.names()
        .into_iter()
        .map(|name| {
            let values = file
                .tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                .collect();
            (name.to_string(), values)
        })
        .collect()
}

/// Asserts that two checkpoints hold the same tensors, each within `tol · max(1, max|a|)`
/// (weights are O(0.02..1), so this is an absolute bound for most). Returns the largest
/// difference seen.
pub fn assert_same_weights(a: &std::path::Path, b: &std::path::Path, tol: f64) -> f64 {
    let (x, y) = (read_safetensors(a), read_safetensors(b));
    assert_eq!(
        x.keys().collect::<Vec<_>>(),
        y.keys().collect::<Vec<_>>(),
        "the same tensors"
    );
    let mut worst = 0f64;
    let mut failures = Vec::new();
    for (name, values) in &x {
        let diff = max_abs_diff(values, &y[name]);
        let bound = tol * max_abs(values).max(1.0);
        if diff > bound {
            failures.push(format!("{name}: differ by {diff:e} (bound {bound:e})"));
        }
        worst = worst.max(diff);
    }
    failures.sort();
    assert!(
        failures.is_empty(),
        "{} and {} differ in {} of {} tensors:\n{}",
        a.display(),
        b.display(),
        failures.len(),
        x.len(),
        failures.join("\n")
    );
    worst
}

/// The training configuration of the data-parallel tests: the tiny model without dropout, 3
/// steps of sequences of at most 64 tokens, every step logged, output in `out`.
/// `max_predictions_per_seq = 1` gives every sample exactly one masked token, so each rank's
/// mean loss weighs its samples as the whole batch's mean does: the per-rank means then average
/// to the global mean exactly, and N ranks can equal one rank with the whole batch.
pub fn data_parallel_config(out: &std::path::Path) -> ember_trainer::TrainConfig {
    let mut config = ember_trainer::TrainConfig::default();
    config.model.hidden_dropout_prob = Some(0.0);
    config.model.attention_probs_dropout_prob = Some(0.0);
    config.instances.max_seq_length = 64;
    config.instances.max_predictions_per_seq = 1;
    config.instances.dupe_factor = 1;
    config.train.steps = 3;
    config.train.eval_every = Some(3);
    config.train.eval_samples = 16;
    config.train.log_every = 1;
    config.train.out = out.to_path_buf();
    config
}

/// [`data_parallel_config`] with what an equivalence test must keep on when the runs it
/// compares need not be exact splits of one batch: the presets' dropout (0.1) and up to 8
/// masked positions per sample.
pub fn dropout_and_masks_config(out: &std::path::Path) -> ember_trainer::TrainConfig {
    let mut config = data_parallel_config(out);
    config.model.hidden_dropout_prob = Some(0.1);
    config.model.attention_probs_dropout_prob = Some(0.1);
    config.instances.max_predictions_per_seq = 8;
    config
}
