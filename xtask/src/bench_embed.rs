//! `cargo xtask bench embed`: sentences per second of ember's [`Embedder`] against
//! sentence-transformers on the same machine, the same model folder and the same sentences, in
//! the same run (`bench/reference/embed.py`), with the vectors of both compared.
//!
//! The models are random BERTs of all-MiniLM-L6-v2's shape (6 layers, H 384, 12 heads, FFN
//! 1536) and BERT-base's, written as a sentence-transformers folder (mean pooling, Normalize,
//! 256 tokens, bert-base-uncased's vocabulary), or a folder given with `--model`. The sentences
//! are the embedded corpus's first ones (Wikipedia, one sentence per line). Batch 32 measures
//! throughput over `--sentences` sentences; batch 1 is latency, each sentence alone, over a
//! quarter of them. Both sides get `--threads` threads (ember: rayon's pool and OpenBLAS;
//! PyTorch: `torch.set_num_threads`), one warm-up round, then `--rounds` timed rounds; the
//! medians are compared.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use ember_backend_ext::FusedOps;
use ember_model::{BertConfig, Embedder, Preset};
use serde_json::{Value, json};

use crate::bench_reference::{reference_python, results_base};

/// Flags of `bench embed`.
#[derive(Args, Debug)]
pub struct EmbedBenchArgs {
    /// Model shapes: minilm (all-MiniLM-L6-v2's: 6 layers, H 384) and base (BERT-base),
    /// random weights
    #[arg(long, value_delimiter = ',', default_value = "minilm,base")]
    shapes: Vec<String>,
    /// A sentence-transformers (or BERT) folder to time instead of the random shapes
    #[arg(long)]
    model: Option<PathBuf>,
    /// Batch sizes; 1 is each sentence alone (latency)
    #[arg(long, value_delimiter = ',', default_value = "32,1")]
    batch_size: Vec<usize>,
    /// Sentences per round at batch sizes above 1 (a quarter of them at batch 1)
    #[arg(long, default_value_t = 256)]
    sentences: usize,
    /// Timed rounds per configuration and side, after one warm-up
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Threads of each side [default: 2, the CPU comparison's setting]
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The other side: pytorch (sentence-transformers) or none
    #[arg(long, default_value = "pytorch")]
    reference: String,
    /// The reference's Python, with torch and sentence-transformers [default:
    /// ~/.cache/ember/reference-venv/bin/python]
    #[arg(long)]
    python: Option<PathBuf>,
    /// Where to run both: cpu or cuda (the `cuda` feature)
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Results folder [default: bench/results]
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One measured configuration.
struct Row {
    model: String,
    batch_size: usize,
    sentences: usize,
    ember_s: f64,
    reference_s: Option<f64>,
    max_diff: Option<f64>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A random BERT of `shape`, written as a sentence-transformers folder in `dir`.
fn write_model(shape: &str, dir: &Path) -> Result<PathBuf> {
    use burn::backend::NdArray;
    let mut config = BertConfig::preset(Preset::Base);
    match shape {
        "minilm" => {
            config.num_hidden_layers = 6;
            config.hidden_size = 384;
            config.num_attention_heads = 12;
            config.intermediate_size = 1536;
        }
        "base" => {}
        other => bail!("unknown shape {other:?} (expected minilm or base)"),
    }
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    let folder = dir.join(shape);
    std::fs::create_dir_all(folder.join("1_Pooling"))?;
    let model = config.init_for_pretraining::<NdArray>(&Default::default());
    model.save_hf_safetensors(&folder.join("model.safetensors"))?;
    std::fs::write(folder.join("config.json"), config.to_hf_json())?;
    std::fs::write(folder.join("vocab.txt"), ember_data::embedded::VOCAB_TXT)?;
    let modules = json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]);
    std::fs::write(folder.join("modules.json"), modules.to_string())?;
    std::fs::write(
        folder.join("1_Pooling/config.json"),
        json!({"word_embedding_dimension": config.hidden_size, "pooling_mode_mean_tokens": true})
            .to_string(),
    )?;
    std::fs::write(
        folder.join("sentence_bert_config.json"),
        json!({"max_seq_length": 256, "do_lower_case": false}).to_string(),
    )?;
    Ok(folder)
}

/// A `.npy` file of f32 (numpy's format 1.0/2.0, little-endian, C order), as written by
/// `bench/reference/embed.py`.
fn read_npy(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| path.display().to_string())?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        bail!("{}: not a .npy file", path.display());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
    };
    let header = String::from_utf8_lossy(&bytes[start..start + header_len]);
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        bail!(
            "{}: expected little-endian f32 in C order: {header}",
            path.display()
        );
    }
    Ok(bytes[start + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

pub fn run(args: EmbedBenchArgs) -> Result<()> {
    if args.rounds == 0 || args.threads == 0 || args.batch_size.contains(&0) {
        bail!("--rounds, --threads and every --batch-size must be at least 1");
    }
    // SAFETY: before any thread of this process reads them (rayon's pool and OpenBLAS start
    // at their first use, later).
    unsafe {
        std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string());
        std::env::set_var("OPENBLAS_NUM_THREADS", "1");
    }
    ember_trainer::blas::share_cores(1, ember_trainer::blas::GemmThreads::Rayon);
    let python = match args.reference.as_str() {
        "pytorch" => Some(reference_python(args.python.as_deref())?),
        "none" => None,
        other => bail!("--reference {other}: expected pytorch or none"),
    };
    match args.device.as_str() {
        "cuda" => run_cuda(&args, python.as_deref()),
        _ => bench::<burn::backend::NdArray>(&args, python.as_deref(), &Default::default()),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &EmbedBenchArgs, python: Option<&Path>) -> Result<()> {
    let gpu = crate::cuda::start(&ember_trainer::parallel::LaunchEnv::single(), false)?;
    bench::<burn::backend::Cuda>(args, python, &burn::backend::cuda::CudaDevice::new(gpu))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &EmbedBenchArgs, _: Option<&Path>) -> Result<()> {
    bail!("--device cuda needs a build with the `cuda` feature")
}

fn bench<B: FusedOps>(
    args: &EmbedBenchArgs,
    python: Option<&Path>,
    device: &B::Device,
) -> Result<()> {
    let tmp = tempfile::tempdir().context("a temporary folder")?;
    let models: Vec<(String, PathBuf)> = match &args.model {
        Some(folder) => vec![(folder.display().to_string(), folder.clone())],
        None => args
            .shapes
            .iter()
            .map(|shape| Ok((shape.clone(), write_model(shape, tmp.path())?)))
            .collect::<Result<_>>()?,
    };
    let all: Vec<&str> = ember_data::embedded::corpus_text()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(args.sentences.max(4))
        .collect();
    let script = python
        .map(|_| crate::shipped::write_script("embed.py", tmp.path()))
        .transpose()?;
    let mut rows = Vec::new();
    for (name, folder) in &models {
        for &batch_size in &args.batch_size {
            let count = if batch_size == 1 {
                all.len().div_ceil(4)
            } else {
                all.len()
            };
            let sentences = &all[..count];
            let file = tmp.path().join(format!("sentences-{count}.txt"));
            std::fs::write(&file, sentences.join("\n"))?;
            let embedder =
                Embedder::<B>::from_pretrained(folder, device)?.with_batch_size(batch_size);
            let mut ember = None;
            let mut seconds = Vec::new();
            for round in 0..=args.rounds {
                let started = Instant::now();
                let out = embedder.encode(sentences)?;
                let values = out
                    .into_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .expect("f32");
                if round > 0 {
                    seconds.push(started.elapsed().as_secs_f64());
                }
                ember = Some(values);
            }
            let (mut reference_s, mut max_diff) = (None, None);
            if let (Some(python), Some(script)) = (python, &script) {
                let npy = tmp.path().join("reference.npy");
                let output = Command::new(python)
                    .arg(script)
                    .args(["--model", &folder.display().to_string()])
                    .args(["--sentences", &file.display().to_string()])
                    .args(["--batch-size", &batch_size.to_string()])
                    .args(["--rounds", &args.rounds.to_string()])
                    .args(["--threads", &args.threads.to_string()])
                    .args(["--device", &args.device])
                    .args(["--out", &npy.display().to_string()])
                    .output()
                    .with_context(|| format!("running {}", python.display()))?;
                if !output.status.success() {
                    bail!(
                        "the sentence-transformers side failed:\n{}",
                        String::from_utf8_lossy(&output.stderr)
                    );
                }
                let stdout = String::from_utf8_lossy(&output.stdout);
                let line = stdout.lines().last().unwrap_or_default();
                let parsed: Value = serde_json::from_str(line)
                    .with_context(|| format!("the reference's output: {line}"))?;
                let times: Vec<f64> = parsed["seconds"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_f64).collect())
                    .unwrap_or_default();
                if times.is_empty() {
                    bail!("the reference printed no timings: {line}");
                }
                reference_s = Some(median(times));
                let theirs = read_npy(&npy)?;
                let ours = ember.as_ref().expect("at least one round");
                max_diff = Some(
                    ours.iter()
                        .zip(&theirs)
                        .map(|(a, b)| f64::from((a - b).abs()))
                        .fold(0.0, f64::max),
                );
            }
            let row = Row {
                model: name.clone(),
                batch_size,
                sentences: count,
                ember_s: median(seconds),
                reference_s,
                max_diff,
            };
            eprintln!(
                "{} batch {}: ember {:.1} sentences/s{}",
                row.model,
                row.batch_size,
                row.sentences as f64 / row.ember_s,
                row.reference_s.map_or(String::new(), |r| format!(
                    ", sentence-transformers {:.1} ({:.2}×)",
                    row.sentences as f64 / r,
                    r / row.ember_s
                ))
            );
            rows.push(row);
        }
    }
    report(args, &rows)
}

fn report(args: &EmbedBenchArgs, rows: &[Row]) -> Result<()> {
    let mut markdown = format!(
        "Sentence embeddings on {} with {} thread(s): ember against sentence-transformers, the \
         same folder and sentences; medians of {} rounds.\n\n| model | batch | sentences | \
         ember sentences/s | sentence-transformers sentences/s | ember / s-t | largest \
         difference |\n|---|---:|---:|---:|---:|---:|---:|\n",
        args.device, args.threads, args.rounds
    );
    for row in rows {
        let rate = |s: f64| row.sentences as f64 / s;
        markdown.push_str(&format!(
            "| {} | {} | {} | {:.1} | {} | {} | {} |\n",
            row.model,
            row.batch_size,
            row.sentences,
            rate(row.ember_s),
            row.reference_s
                .map_or("–".into(), |r| format!("{:.1}", rate(r))),
            row.reference_s
                .map_or("–".into(), |r| format!("**{:.2}×**", r / row.ember_s)),
            row.max_diff.map_or("–".into(), |d| format!("{d:.1e}")),
        ));
    }
    print!("{markdown}");
    let base = results_base(args.out.as_deref(), "embed")?;
    std::fs::write(base.with_extension("md"), &markdown)?;
    let json_rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "model": r.model, "batch_size": r.batch_size, "sentences": r.sentences,
                "ember_s": r.ember_s, "reference_s": r.reference_s, "max_diff": r.max_diff,
            })
        })
        .collect();
    std::fs::write(
        base.with_extension("json"),
        serde_json::to_string_pretty(
            &json!({"device": args.device, "threads": args.threads, "rows": json_rows}),
        )?,
    )?;
    eprintln!("results: {}.md, .json", base.display());
    Ok(())
}
