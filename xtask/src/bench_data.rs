//! `cargo xtask bench data`: pre-training example creation (text in, MLPerf HDF5 shard out)
//! against Google's `create_pretraining_data.py` algorithm in plain Python
//! (`bench/reference/create_pretraining_data.py`), on the same slice of the corpus, in the same
//! run: tokens/s, seconds and peak memory of each, ember with 1 and more worker threads, and
//! the ratio against the reference. Both sides run as child processes (`ember prepare-data` and
//! the script), so that each one's peak memory is its own; rounds alternate, medians are kept.
//! The reference's shard is read back through ember's validating reader: the same work, a valid
//! shard, about as many samples and tokens (the two draw from different generators).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_data::{default_corpus_path, default_vocab_path};
use serde_json::{Value, json};

/// Flags of `bench data`.
#[derive(Args, Debug)]
pub struct DataBenchArgs {
    /// Documents of the corpus to process (the first N) [default: all]
    #[arg(long)]
    documents: Option<usize>,
    /// Corpus file [default: the embedded Wikipedia corpus]
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Longest sample in tokens (S)
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Most masked positions per sample (P)
    #[arg(long, default_value_t = 20)]
    max_pred: usize,
    /// Passes over the documents with fresh masks
    #[arg(long, default_value_t = 1)]
    dupe_factor: usize,
    /// ember's worker threads, one measurement each
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    jobs: Vec<usize>,
    /// Rounds, alternating ember and the reference (medians reported)
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The reference's Python, with numpy and h5py [default: ~/.cache/ember/reference-venv/bin/python]
    #[arg(long)]
    python: Option<PathBuf>,
    /// Folder of the markdown and JSON results
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One side's run: samples, tokens, seconds, peak MiB.
#[derive(Debug, Clone, Copy)]
struct Measured {
    samples: usize,
    tokens: usize,
    seconds: f64,
    peak_mib: f64,
}

/// The number after `key` in `text` (digits, `.`, `,` thousands separators dropped). Public for
/// `xtask/tests/data_cli.rs`, which reads a real `prepare-data` summary with it.
#[doc(hidden)]
pub fn number_after(text: &str, key: &str) -> Option<f64> {
    let rest = &text[text.find(key)? + key.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ',')
        .filter(|c| *c != ',')
        .collect();
    digits.parse().ok()
}

/// `ember prepare-data` on `corpus` with `jobs` threads, from its summary lines.
fn ember_run(corpus: &Path, dir: &Path, args: &DataBenchArgs, jobs: usize) -> Result<Measured> {
    let out = dir.join(format!("ember-{jobs}"));
    let _ = std::fs::remove_dir_all(&out);
    let exe = std::env::current_exe().context("the ember binary")?;
    let output = Command::new(exe)
        .arg("prepare-data")
        .arg("--corpus")
        .arg(corpus)
        .arg("--out")
        .arg(&out)
        .args(["--seq-len", &args.seq_len.to_string()])
        .args(["--max-pred", &args.max_pred.to_string()])
        .args(["--dupe-factor", &args.dupe_factor.to_string()])
        .args([
            "--jobs",
            &jobs.to_string(),
            "--num-shards",
            &jobs.max(4).to_string(),
        ])
        .args(["--holdout-documents", "0"])
        .env("RUST_LOG", "warn")
        .output()
        .context("running ember prepare-data")?;
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    if !output.status.success() {
        bail!(
            "ember prepare-data failed: {text}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let parsed = || -> Option<Measured> {
        let tokens = number_after(&text, "samples,")?;
        let rate = number_after(&text, "throughput:")?;
        Some(Measured {
            samples: number_after(&text, "→")? as usize,
            tokens: tokens as usize,
            seconds: tokens / rate,
            peak_mib: number_after(&text, "peak memory")?,
        })
    };
    parsed().with_context(|| format!("ember prepare-data's summary not understood: {text}"))
}

/// The Python reference on `corpus`; its shard is read back through ember's reader.
fn reference_run(
    python: &Path,
    corpus: &Path,
    dir: &Path,
    args: &DataBenchArgs,
) -> Result<Measured> {
    let script = crate::shipped::write_script("create_pretraining_data.py", dir)?;
    let shard = dir.join("reference.hdf5");
    let output = Command::new(python)
        .arg(&script)
        .arg("--input")
        .arg(corpus)
        .arg("--vocab")
        .arg(default_vocab_path()?)
        .arg("--output")
        .arg(&shard)
        .args(["--max-seq-length", &args.seq_len.to_string()])
        .args(["--max-predictions", &args.max_pred.to_string()])
        .args(["--dupe-factor", &args.dupe_factor.to_string()])
        .output()
        .with_context(|| format!("running {}", python.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed (it needs numpy and h5py): {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let line: Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("{}'s output", script.display()))?;
    let field = |k: &str| {
        line[k]
            .as_f64()
            .with_context(|| format!("no `{k}` in {line}"))
    };
    let samples = ember_data::shard::read_shard(&shard, 30522)
        .with_context(|| format!("the reference's shard {}", shard.display()))?;
    if samples.len() != field("instances")? as usize {
        bail!(
            "the reference wrote {} samples but reported {}",
            samples.len(),
            line
        );
    }
    Ok(Measured {
        samples: samples.len(),
        tokens: field("tokens")? as usize,
        seconds: field("seconds")?,
        peak_mib: field("peak_rss_mib")?,
    })
}

fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    runs[runs.len() / 2]
}

pub fn run(args: DataBenchArgs) -> Result<()> {
    if args.rounds == 0 || args.jobs.iter().any(|&j| j == 0) || args.jobs.is_empty() {
        bail!("--rounds and every --jobs value must be at least 1");
    }
    let python = crate::bench_reference::reference_python(args.python.as_deref())?;
    let tmp = tempfile::tempdir().context("a temporary folder")?;
    let source = match args.corpus.clone() {
        Some(path) => path,
        None => default_corpus_path()?,
    };
    let text = std::fs::read_to_string(&source).with_context(|| source.display().to_string())?;
    let documents: Vec<&str> = text.split("\n\n").collect();
    let take = args
        .documents
        .unwrap_or(documents.len())
        .min(documents.len());
    let corpus = tmp.path().join("corpus.txt");
    std::fs::write(&corpus, documents[..take].join("\n\n")).context("writing the corpus slice")?;

    let mut ember: Vec<Vec<Measured>> = vec![Vec::new(); args.jobs.len()];
    let mut reference = Vec::new();
    for round in 0..args.rounds {
        for (k, &jobs) in args.jobs.iter().enumerate() {
            ember[k].push(ember_run(&corpus, tmp.path(), &args, jobs)?);
        }
        reference.push(reference_run(&python, &corpus, tmp.path(), &args)?);
        eprintln!("bench data: round {} of {} done", round + 1, args.rounds);
    }
    let reference = median(reference);
    let rate = |m: &Measured| m.tokens as f64 / m.seconds;
    let mut markdown = format!(
        "Pre-training example creation, {take} documents of {}, S = {}, P = {}, dupe factor {}, \
         medians of {} rounds\n\n| implementation | threads | samples | tokens | seconds | tokens/s | peak MiB | tokens/s vs Python |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
        source.display(),
        args.seq_len,
        args.max_pred,
        args.dupe_factor,
        args.rounds
    );
    let mut rows = Vec::new();
    let mut line = |name: &str, threads: usize, m: &Measured| {
        markdown.push_str(&format!(
            "| {name} | {threads} | {} | {} | {:.2} | {:.0} | {:.0} | {:.2}× |\n",
            m.samples,
            m.tokens,
            m.seconds,
            rate(m),
            m.peak_mib,
            rate(m) / rate(&reference)
        ));
        rows.push(json!({
            "implementation": name, "threads": threads, "samples": m.samples, "tokens": m.tokens,
            "seconds": m.seconds, "tokens_per_s": rate(m), "peak_mib": m.peak_mib,
            "ratio": rate(m) / rate(&reference),
        }));
    };
    line(
        "create_pretraining_data.py algorithm (Python)",
        1,
        &reference,
    );
    for (k, &jobs) in args.jobs.iter().enumerate() {
        line("ember prepare-data", jobs, &median(ember[k].clone()));
    }
    println!("\n{markdown}");
    let base = crate::bench_reference::results_base(args.out.as_deref(), "data")?;
    std::fs::write(base.with_extension("md"), &markdown)?;
    std::fs::write(
        base.with_extension("json"),
        serde_json::to_string_pretty(
            &json!({"documents": take, "seq_len": args.seq_len, "rows": rows}),
        )?,
    )?;
    println!("ember: results in {}.{{md,json}}", base.display());
    Ok(())
}
