//! `cargo xtask bench summary DIR`: one table of what a GPU check measured against the
//! GPU-speed issue's targets, from the files its parts left in `DIR` (Note [One table per
//! GPU check]).
//!
//! Note [One table per GPU check]: a lent GPU machine runs `scripts/gpu-check.sh run` once,
//! inside one call of at most 10 minutes, and what it prints last is what the session sees
//! first. The parts write their own tables; this reads them back into one:
//! - `parts.tsv` (the script's): each part with its seconds and how it ended (`ok`, `failed
//!   (exit N)`, `cut at the deadline`, both (`failed (exit N); cut at the deadline`),
//!   `skipped: the deadline`), so that the next session knows which parts to run again;
//! - `kernels.log`: the CUDA kernel tests passed and failed, the failures by name;
//! - every `train-step-*.json` (`bench train-step`'s results) anywhere up to two folders down:
//!   a row per configuration with ember's samples/s, MFU, launches per step and reserved
//!   memory, its ratio to each reference of the same run, and the targets each row misses.
//!
//! The targets are the issue's, for BERT-large: ember at least 1.0× every reference of its run
//! (PyTorch eager and `torch.compile`; the goal at seq 128, batch 32, bf16 is 1.3×
//! eager), at most 1,500 kernel launches per step, and no more reserved GPU memory than the
//! reference. Smaller models' rows are listed without targets.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use serde_json::Value;

use crate::bench_train_step_report::gib;

/// The ceiling on kernel launches per BERT-large training step.
pub const MAX_LAUNCHES_PER_STEP: u64 = 1_500;

/// Flags of `bench summary`.
#[derive(Args, Debug)]
pub struct SummaryArgs {
    /// The folder a GPU check wrote (`$OUT`, or `gpu-check/out`): its `parts.tsv`,
    /// `kernels.log` and the `train-step-*.json` below it; `summary.md` is written there
    dir: PathBuf,
}

/// Prints the summary of `args.dir` and writes it to `summary.md` there.
///
/// # Errors
/// If `summary.md` cannot be written (the summary is printed first).
pub fn run(args: SummaryArgs) -> Result<()> {
    let markdown = summary(&args.dir);
    println!("{markdown}");
    crate::bench_train_step_report::write_atomically(
        &args.dir.join("summary.md"),
        markdown.as_bytes(),
    )?;
    Ok(())
}

/// The summary of a GPU check's folder as markdown (Note [One table per GPU check]). What is
/// missing or unreadable is said in its place (a `train-step-*.json` that is not valid JSON
/// gets a row naming it and the error): the summary is what a cut run must still print.
pub(crate) fn summary(dir: &Path) -> String {
    let mut out = format!("# GPU check summary ({})\n\n", dir.display());
    // nvidia-smi's CSV: a header line, then the GPU's.
    let gpu = std::fs::read_to_string(dir.join("gpu.txt")).unwrap_or_default();
    if let Some(line) = gpu.lines().rev().find(|l| !l.trim().is_empty()) {
        out.push_str(&format!("GPU: {}\n\n", line.trim()));
    }
    out.push_str(&parts_table(dir));
    out.push('\n');
    out.push_str(&kernel_tests(dir));
    out.push('\n');
    out.push_str(&train_step_table(dir));
    out
}

/// The parts' table from `parts.tsv` (`part<TAB>seconds<TAB>result` per line).
fn parts_table(dir: &Path) -> String {
    let Ok(tsv) = std::fs::read_to_string(dir.join("parts.tsv")) else {
        return "No parts.tsv: not written by `scripts/gpu-check.sh run`.\n".to_string();
    };
    let mut table = "| part | seconds | result |\n|---|---:|---|\n".to_string();
    for line in tsv.lines().filter(|l| !l.trim().is_empty()) {
        let mut cells = line.splitn(3, '\t');
        let (part, seconds, result) = (
            cells.next().unwrap_or(""),
            cells.next().unwrap_or(""),
            cells.next().unwrap_or(""),
        );
        table.push_str(&format!("| {part} | {seconds} | {result} |\n"));
    }
    table
}

/// The kernel tests' count from libtest's lines in `kernels.log` (`test NAME ... ok`).
fn kernel_tests(dir: &Path) -> String {
    let Ok(log) = std::fs::read_to_string(dir.join("kernels.log")) else {
        return "Kernel tests on CUDA: not run (no kernels.log).\n".to_string();
    };
    let mut passed = 0;
    let mut failed = Vec::new();
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("test ") else {
            continue;
        };
        if rest.ends_with(" ... ok") {
            passed += 1;
        } else if let Some(name) = rest.strip_suffix(" ... FAILED") {
            failed.push(name.to_string());
        }
    }
    let finished = log.lines().any(|l| l.starts_with("test result:"));
    let mut text = format!(
        "Kernel tests on CUDA: {passed} passed, {} failed{}",
        failed.len(),
        if finished {
            ""
        } else {
            " (the run did not finish: no `test result` line)"
        }
    );
    if !failed.is_empty() {
        text.push_str(&format!(": {}", failed.join(", ")));
    }
    text.push('\n');
    text
}

/// Every `train-step-*.json` up to two folders below `dir`, sorted by path.
fn train_step_results(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut folders = vec![(dir.to_path_buf(), 0)];
    while let Some((folder, depth)) = folders.pop() {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for path in entries.flatten().map(|e| e.path()) {
            if path.is_dir() && depth < 2 {
                folders.push((path, depth + 1));
            } else if path.extension().is_some_and(|e| e == "json")
                && path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("train-step-"))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The training-step rows of every result file, with the targets each BERT-large row misses.
fn train_step_table(dir: &Path) -> String {
    let files = train_step_results(dir);
    if files.is_empty() {
        return "Training step: no `bench train-step` results (train-step-*.json).\n".into();
    }
    let mut table = "| results | model | precision | batch × seq | unpad | ember samples/s | ember MFU | launches/step | GiB reserved | ember / reference | targets missed |\n|---|---|---|---|---|---:|---:|---:|---:|---|---|\n".to_string();
    for file in &files {
        let name = file.strip_prefix(dir).unwrap_or(file).display().to_string();
        let results = std::fs::read_to_string(file)
            .context("unreadable")
            .and_then(|text| serde_json::from_str::<Value>(&text).context("not valid JSON"));
        match results {
            Ok(results) => {
                for row in results["rows"].as_array().into_iter().flatten() {
                    table.push_str(&row_line(&name, row));
                }
            }
            Err(e) => table.push_str(&format!(
                "| {name} | {} | | | | | | | | | |\n",
                format!("{e:#}").replace('|', "/").replace('\n', " ")
            )),
        }
    }
    table
}

fn row_line(file: &str, row: &Value) -> String {
    let ember = &row["ember"];
    let references: Vec<String> = row["references"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            format!(
                "{:.2}× {}",
                r["ratio"].as_f64().unwrap_or(f64::NAN),
                r["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    let missed = if row["preset"] == "large" {
        let misses = targets_missed(row);
        if misses.is_empty() {
            "none".to_string()
        } else {
            misses.join("; ")
        }
    } else {
        "–".to_string()
    };
    format!(
        "| {file} | {} | {} | {} × {} | {} | {:.1} | {} | {} | {} | {} | {missed} |\n",
        row["preset"].as_str().unwrap_or("?"),
        row["precision"].as_str().unwrap_or("?"),
        row["batch_size"],
        row["seq_len"],
        row["unpad"].as_bool().unwrap_or(false),
        ember["samples_per_s"].as_f64().unwrap_or(f64::NAN),
        ember["mfu"]
            .as_f64()
            .map_or("–".to_string(), |m| format!("{:.0}%", 100.0 * m)),
        ember["launches_per_step"]
            .as_u64()
            .map_or("–".to_string(), |n| n.to_string()),
        gib(ember["reserved_bytes"].as_u64()),
        if references.is_empty() {
            "–".to_string()
        } else {
            references.join(", ")
        },
    )
}

/// What a row of `bench train-step`'s JSON (one element of its `rows`) misses of the issue's
/// targets, for the caller to apply to BERT-large's rows only: below 1.0× a reference, more
/// than [`MAX_LAUNCHES_PER_STEP`] launches, more reserved memory than a reference. Reads
/// `ember.launches_per_step`, `ember.reserved_bytes` and `references[].{name, ratio,
/// reserved_bytes}`; a field that is missing (not measured) misses nothing.
fn targets_missed(row: &Value) -> Vec<String> {
    let ember = &row["ember"];
    let mut missed = Vec::new();
    for reference in row["references"].as_array().into_iter().flatten() {
        let name = reference["name"].as_str().unwrap_or("?");
        if let Some(ratio) = reference["ratio"].as_f64()
            && ratio < 1.0
        {
            missed.push(format!("{ratio:.2}× {name} < 1.0×"));
        }
        if let (Some(ours), Some(theirs)) = (
            ember["reserved_bytes"].as_u64(),
            reference["reserved_bytes"].as_u64(),
        ) && ours > theirs
        {
            missed.push(format!(
                "{} GiB reserved > {name}'s {}",
                gib(Some(ours)),
                gib(Some(theirs))
            ));
        }
    }
    if let Some(launches) = ember["launches_per_step"].as_u64()
        && launches > MAX_LAUNCHES_PER_STEP
    {
        missed.push(format!("{launches} launches > {MAX_LAUNCHES_PER_STEP}"));
    }
    missed
}
