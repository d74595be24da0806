//! What the `ember` binary carries besides its code: the shipped training configurations
//! (`configs/*.toml`) and the benchmarks' Python reference scripts (`bench/reference/*.py`),
//! compiled in, so that a binary copied to another machine or installed with `cargo install`
//! never looks for them at the build machine's paths (Note [Embedded files] in
//! `data/src/embedded.rs`; the corpus and vocabulary are `ember_data::embedded`'s).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ember_trainer::TrainConfig;

/// The shipped configurations: name (the file name without `.toml`) and text.
pub const CONFIGS: &[(&str, &str)] = &[
    ("tiny-cpu", include_str!("../../configs/tiny-cpu.toml")),
    (
        "mlperf-bert-large-adam",
        include_str!("../../configs/mlperf-bert-large-adam.toml"),
    ),
    (
        "mlperf-bert-large-lamb",
        include_str!("../../configs/mlperf-bert-large-lamb.toml"),
    ),
];

/// The configuration `train` uses without `--config`.
pub const DEFAULT_CONFIG: &str = "tiny-cpu";

/// The benchmarks' Python references: file name and text.
const SCRIPTS: &[(&str, &str)] = &[
    (
        "train_step.py",
        include_str!("../../bench/reference/train_step.py"),
    ),
    (
        "create_pretraining_data.py",
        include_str!("../../bench/reference/create_pretraining_data.py"),
    ),
    ("embed.py", include_str!("../../bench/reference/embed.py")),
    ("gemm.py", include_str!("../../bench/reference/gemm.py")),
    (
        "attention.py",
        include_str!("../../bench/reference/attention.py"),
    ),
];

/// The shipped configuration a `--config` value names, if it names one: `tiny-cpu`,
/// `tiny-cpu.toml` or `configs/tiny-cpu.toml`.
fn shipped_config(given: &Path) -> Option<(&'static str, &'static str)> {
    let name = given.to_str()?;
    let name = name.strip_prefix("configs/").unwrap_or(name);
    let name = name.strip_suffix(".toml").unwrap_or(name);
    CONFIGS.iter().copied().find(|(n, _)| *n == name)
}

/// The training configuration `--config` asks for: a file when one is there, else the shipped
/// configuration of that name (`tiny-cpu`, `configs/mlperf-bert-large-lamb.toml`, ...); none
/// given, the shipped `tiny-cpu`.
///
/// # Errors
/// A file that does not parse (the parser's message names line and column), or a name that is
/// neither a file nor a shipped configuration (the error lists the shipped ones).
pub fn load_config(given: Option<&Path>) -> Result<TrainConfig> {
    let given = given.unwrap_or(Path::new(DEFAULT_CONFIG));
    if given.is_file() {
        return Ok(TrainConfig::load(given)?);
    }
    let Some((name, text)) = shipped_config(given) else {
        let names: Vec<&str> = CONFIGS.iter().map(|(n, _)| *n).collect();
        bail!(
            "{}: no such configuration file, nor a shipped one (shipped: {})",
            given.display(),
            names.join(", ")
        );
    };
    tracing::debug!("configuration: the shipped {name}");
    Ok(TrainConfig::parse(
        text,
        &Path::new("shipped configs").join(format!("{name}.toml")),
    )?)
}

/// Writes the shipped reference script `name` into `dir` (for `python SCRIPT ...`) and returns
/// its path.
///
/// # Errors
/// When `dir` cannot be written (named).
pub fn write_script(name: &str, dir: &Path) -> Result<PathBuf> {
    let (_, text) = SCRIPTS
        .iter()
        .find(|(n, _)| *n == name)
        .with_context(|| format!("no shipped script {name}"))?;
    let path = dir.join(name);
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}
