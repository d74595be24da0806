//! The report of `cargo xtask bench train-step` (`crate::bench_train_step`): the table on
//! stdout and, as markdown and JSON, in `--out`: per row each side's samples/s and MFU against
//! the GEMM peak of the row's precision, ember's launches per step, each side's device memory.

use std::path::Path;

use anyhow::{Context, Result};
use ember_model::{Precision, Preset};
use ember_trainer::blas::GemmThreads;
use serde_json::{Value, json};

use crate::bench_train_step::{TrainStepArgs, reference_device};

/// One timed configuration.
pub(crate) struct Row {
    pub(crate) preset: Preset,
    pub(crate) precision: Precision,
    /// The CPU's GEMM threads of ember's step (`None` on GPUs).
    pub(crate) gemm_threads: Option<GemmThreads>,
    /// Whether ember's encoder ran on the real tokens alone (`model.unpad`).
    pub(crate) unpad: bool,
    /// The batch's real tokens (B·S without padding).
    pub(crate) real_tokens: usize,
    pub(crate) batch_size: usize,
    pub(crate) seq_len: usize,
    pub(crate) parameters: usize,
    pub(crate) flops: f64,
    pub(crate) ember_s: f64,
    /// Medians of ember's forward, backward and optimizer seconds.
    pub(crate) ember_phases: [f64; 3],
    pub(crate) ember_loss: f64,
    /// Median kernel launches of ember's step, where the runtime counts them.
    pub(crate) ember_launches: Option<u64>,
    /// The most device memory ember's allocator held during the timed steps, bytes.
    pub(crate) ember_reserved: Option<u64>,
    pub(crate) references: Vec<ReferenceResult>,
}

/// A reference's results for one row.
#[derive(Clone)]
pub(crate) struct ReferenceResult {
    pub(crate) name: String,
    /// Median step, seconds.
    pub(crate) step_s: f64,
    pub(crate) first_loss: f64,
    /// `torch.cuda.max_memory_reserved` (None on the CPU).
    pub(crate) reserved: Option<u64>,
}

/// Writes the report of `rows`: `ember_gemms` are ember's GEMM rates (precision, GFLOP/s,
/// what ran it), `reference_gemm` PyTorch's; `versions` the reference's `ready` message.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write(
    args: &TrainStepArgs,
    threads: usize,
    backend: &str,
    rows: &[Row],
    references: &[(&str, bool)],
    versions: &Value,
    ember_gemms: &[(Precision, f64, String)],
    reference_gemm: &[(Precision, f64)],
) -> Result<()> {
    // The peak of each precision: the faster of ember's and PyTorch's GEMM in it.
    let peak = |precision: Precision| {
        let ember = ember_gemms
            .iter()
            .filter(|(p, _, _)| *p == precision)
            .map(|(_, g, _)| *g)
            .fold(0.0, f64::max);
        let reference = reference_gemm
            .iter()
            .find(|(p, _)| *p == precision)
            .map_or(0.0, |(_, g)| *g);
        ember.max(reference)
    };
    let mut names: Vec<&str> = ember_gemms.iter().map(|(_, _, n)| n.as_str()).collect();
    names.dedup();
    let gemm_rates = args
        .precision
        .iter()
        .map(|&precision| {
            let ember = ember_gemms
                .iter()
                .filter(|(p, _, _)| *p == precision)
                .map(|(_, g, _)| format!("{g:.0}"))
                .collect::<Vec<_>>()
                .join(" / ");
            let reference = reference_gemm
                .iter()
                .find(|(p, _)| *p == precision)
                .map_or(String::new(), |(_, g)| format!(", PyTorch {g:.0}"));
            format!("{precision}: ember {ember}{reference}")
        })
        .collect::<Vec<_>>()
        .join("; ");
    let mut markdown = format!(
        "Training step, {} on {threads} thread(s): ember ({}, {}) against {}; GEMM {n}³ GFLOP/s, {gemm_rates}; MFU against the faster of the two in the row's precision.\n\n",
        args.device,
        backend,
        names.join("; "),
        if references.is_empty() {
            "no reference".to_string()
        } else {
            format!(
                "PyTorch {} + transformers {} ({} attention, {}) on {}",
                versions["torch"].as_str().unwrap_or("?"),
                versions["transformers"].as_str().unwrap_or("?"),
                versions["attn_implementation"].as_str().unwrap_or("?"),
                versions["optimizer"].as_str().unwrap_or("AdamW"),
                reference_device(&args.device)
            )
        },
        n = args.gemm_size,
    );
    if args.lengths != crate::bench_reference::Lengths::Full {
        let (real, padded) = rows
            .first()
            .map_or((0, 0), |r| (r.real_tokens, r.batch_size * r.seq_len));
        markdown.push_str(&format!(
            "Samples of `--lengths {}`: {real} real tokens of the first row's {padded} ({:.0}%), \
             padded for both sides; step FLOPs count the padded batch, as PyTorch computes it \
             (an unpadded row's MFU is that work over its time).\n\n",
            args.lengths.name(),
            100.0 * real as f64 / padded.max(1) as f64
        ));
    }
    if args.make_vocab_size_divisible_by > 1 {
        markdown.push_str(&format!(
            "Both models' vocabulary padded to a multiple of {} (`--make-vocab-size-divisible-by`; \
             FLOPs count the padded rows).\n\n",
            args.make_vocab_size_divisible_by
        ));
    }
    markdown.push_str(&header(references));
    for row in rows {
        markdown.push_str(&row_line(row, Some(peak(row.precision))));
        markdown.push('\n');
    }
    markdown.push_str("\nember's step by phase (medians, ms): forward and losses / backward / optimizer\n\n| model | precision | batch × seq | GEMM threads | unpad | forward | backward | optimizer |\n|---|---|---|---|---|---|---|---|\n");
    for row in rows {
        let [f, b, o] = row.ember_phases.map(|s| s * 1e3);
        markdown.push_str(&format!(
            "| {} | {} | {} × {} | {} | {} | {f:.1} | {b:.1} | {o:.1} |\n",
            row.preset,
            row.precision,
            row.batch_size,
            row.seq_len,
            gemm_label(row),
            row.unpad
        ));
    }
    println!("\n{markdown}");
    let base = crate::bench_reference::results_base(
        args.out.as_deref(),
        &format!("train-step-{}", args.device),
    )?;
    let json_rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            let peak = peak(row.precision);
            json!({
                "preset": row.preset.name(),
                "precision": row.precision.to_string(),
                "gemm_threads": row.gemm_threads.map(|m| m.to_string()),
                "unpad": row.unpad,
                "lengths": args.lengths.name(),
                "real_tokens": row.real_tokens,
                "batch_size": row.batch_size,
                "seq_len": row.seq_len,
                "parameters": row.parameters,
                "step_flops": row.flops,
                "gemm_peak_gflops": peak,
                "ember": {"step_s": row.ember_s, "forward_s": row.ember_phases[0], "backward_s": row.ember_phases[1], "optimizer_s": row.ember_phases[2], "samples_per_s": row.batch_size as f64 / row.ember_s, "mfu": row.flops / row.ember_s / (peak * 1e9), "first_loss": row.ember_loss, "launches_per_step": row.ember_launches, "reserved_bytes": row.ember_reserved},
                "references": row.references.iter().map(|r| json!({"name": r.name, "step_s": r.step_s, "samples_per_s": row.batch_size as f64 / r.step_s, "mfu": row.flops / r.step_s / (peak * 1e9), "first_loss": r.first_loss, "ratio": r.step_s / row.ember_s, "reserved_bytes": r.reserved})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let summary = json!({
        "device": args.device,
        "threads": threads,
        "ember_gemm": names.join("; "),
        "gemm_size": args.gemm_size,
        "make_vocab_size_divisible_by": args.make_vocab_size_divisible_by,
        "gemm_gflops": {
            "ember_by_setting": ember_gemms.iter().map(|(p, g, name)| json!({"precision": p.to_string(), "gemm": name, "gflops": g})).collect::<Vec<_>>(),
            "pytorch": reference_gemm.iter().map(|(p, g)| json!({"precision": p.to_string(), "gflops": g})).collect::<Vec<_>>(),
        },
        "reference": versions,
        "rows": json_rows,
    });
    write_atomically(&base.with_extension("md"), markdown.as_bytes())?;
    write_atomically(
        &base.with_extension("json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    println!("ember: wrote {}.{{md,json}}", base.display());
    Ok(())
}

pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = ember_model::checkpoint::temp_path(path);
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| path.display().to_string())
}

fn header(references: &[(&str, bool)]) -> String {
    let mut head = "| model | params | precision | batch × seq | GEMM threads | unpad | step GFLOP | ember samples/s | ember MFU | ember launches/step | ember GiB reserved |"
        .to_string();
    let mut rule = "|---|---|---|---|---|---|---|---|---|---|---|".to_string();
    for (name, _) in references {
        head.push_str(&format!(
            " {name} samples/s | {name} MFU | {name} GiB reserved | ember / {name} |"
        ));
        rule.push_str("---|---|---|---|");
    }
    format!("{head}\n{rule}\n")
}

/// The row's GEMM setting for the tables (`–` on GPUs).
fn gemm_label(row: &Row) -> String {
    row.gemm_threads.map_or("–".to_string(), |m| m.to_string())
}

/// Bytes as GiB for the tables (`–` where not measured).
pub(crate) fn gib(bytes: Option<u64>) -> String {
    bytes.map_or("–".to_string(), |b| {
        format!("{:.1}", b as f64 / (1u64 << 30) as f64)
    })
}

pub(crate) fn row_line(row: &Row, peak: Option<f64>) -> String {
    let mfu = |s: f64| {
        peak.map_or("–".to_string(), |p| {
            format!("{:.0}%", 100.0 * row.flops / s / (p * 1e9))
        })
    };
    let mut line = format!(
        "| {} | {:.1} M | {} | {} × {} | {} | {} | {:.1} | {:.2} | {} | {} | {} |",
        row.preset,
        row.parameters as f64 / 1e6,
        row.precision,
        row.batch_size,
        row.seq_len,
        gemm_label(row),
        row.unpad,
        row.flops / 1e9,
        row.batch_size as f64 / row.ember_s,
        mfu(row.ember_s),
        row.ember_launches
            .map_or("–".to_string(), |n| n.to_string()),
        gib(row.ember_reserved),
    );
    for r in &row.references {
        line.push_str(&format!(
            " {:.2} | {} | {} | {:.2}× |",
            row.batch_size as f64 / r.step_s,
            mfu(r.step_s),
            gib(r.reserved),
            r.step_s / row.ember_s
        ));
    }
    line
}
