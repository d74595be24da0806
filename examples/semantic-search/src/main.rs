//! Semantic search over the embedded Wikipedia corpus, an app that uses ember as a library:
//! `ember_model::Embedder` embeds every sentence once into an index (a safetensors file of
//! the vectors beside the sentences), and queries are answered with the most similar
//! sentences (`ember_model::semantic_search`, cosine).
//!
//! ```sh
//! cargo run --release -p ember-semantic-search -- index --model all-MiniLM-L6-v2 --out wiki-index
//! cargo run --release -p ember-semantic-search -- query --index wiki-index "Who painted the Mona Lisa?"
//! ```

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::backend::NdArray;
use burn::tensor::{Tensor, TensorData};
use clap::{Parser, Subcommand};
use ember_model::{Embedder, semantic_search};
use safetensors::tensor::{Dtype, TensorView};

type B = NdArray;

#[derive(Parser)]
#[command(
    name = "ember-semantic-search",
    about = "Semantic search with ember's sentence embeddings"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Embed every sentence of the corpus and save the index
    Index {
        /// A sentence-transformers folder (all-MiniLM-L6-v2) or BERT folder
        #[arg(long)]
        model: PathBuf,
        /// The index folder to write (embeddings.safetensors, sentences.txt, index.json)
        #[arg(long)]
        out: PathBuf,
        /// One sentence per line [default: the embedded Wikipedia corpus]
        #[arg(long)]
        corpus: Option<PathBuf>,
        /// Index at most this many sentences (the corpus has 36k)
        #[arg(long)]
        limit: Option<usize>,
    },
    /// The sentences most similar to a query
    Query {
        /// An index written by `index`
        #[arg(long)]
        index: PathBuf,
        /// How many sentences to print
        #[arg(short, long, default_value_t = 5)]
        k: usize,
        /// The query
        text: String,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Index {
            model,
            out,
            corpus,
            limit,
        } => index(&model, &out, corpus.as_deref(), limit),
        Command::Query { index, k, text } => query(&index, k, &text),
    }
}

/// The corpus's sentences: non-empty lines.
fn sentences(corpus: Option<&Path>, limit: Option<usize>) -> Result<Vec<String>> {
    let text = match corpus {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the corpus", path.display()))?,
        None => ember_data::embedded::corpus_text().to_string(),
    };
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(limit.unwrap_or(usize::MAX))
        .map(str::to_string)
        .collect())
}

fn index(model: &Path, out: &Path, corpus: Option<&Path>, limit: Option<usize>) -> Result<()> {
    let device = Default::default();
    let embedder = Embedder::<B>::from_pretrained(model, &device)?;
    let sentences = sentences(corpus, limit)?;
    if sentences.is_empty() {
        bail!("the corpus has no sentences");
    }
    let texts: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let embeddings = embedder.encode(&texts)?;
    let [n, dim] = embeddings.dims();
    let values = embeddings
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32");
    // Written under temporary names, then renamed: a failed run leaves no half index.
    let tmp = out.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| tmp.display().to_string())?;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![n, dim], &bytes)?;
    safetensors::serialize_to_file(
        [("embeddings", view)],
        None,
        &tmp.join("embeddings.safetensors"),
    )?;
    std::fs::write(tmp.join("sentences.txt"), sentences.join("\n") + "\n")?;
    let model = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
    let meta = serde_json::json!({"model": model, "sentences": n, "dim": dim});
    std::fs::write(tmp.join("index.json"), meta.to_string())?;
    if out.exists() {
        std::fs::remove_dir_all(out).with_context(|| out.display().to_string())?;
    }
    std::fs::rename(&tmp, out).with_context(|| out.display().to_string())?;
    println!(
        "indexed {n} sentences ({dim} dimensions) in {:.1} s into {}",
        started.elapsed().as_secs_f64(),
        out.display()
    );
    Ok(())
}

fn query(index: &Path, k: usize, text: &str) -> Result<()> {
    let meta_path = index.join("index.json");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&meta_path).with_context(|| {
            format!("{}: not an index (run `index` first)", meta_path.display())
        })?)
        .with_context(|| meta_path.display().to_string())?;
    let model = meta["model"]
        .as_str()
        .with_context(|| format!("{}: no model", meta_path.display()))?;
    let sentences: Vec<String> = std::fs::read_to_string(index.join("sentences.txt"))?
        .lines()
        .map(str::to_string)
        .collect();
    let file = index.join("embeddings.safetensors");
    let bytes = std::fs::read(&file).with_context(|| file.display().to_string())?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: not a safetensors file", file.display()))?;
    let view = tensors
        .tensor("embeddings")
        .with_context(|| format!("{}: no embeddings", file.display()))?;
    let shape: [usize; 2] = view
        .shape()
        .try_into()
        .with_context(|| format!("{}: embeddings are not a matrix", file.display()))?;
    if shape[0] != sentences.len() {
        bail!(
            "{}: {} vectors for {} sentences",
            index.display(),
            shape[0],
            sentences.len()
        );
    }
    let values: Vec<f32> = view
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let device = Default::default();
    let corpus = Tensor::<B, 2>::from_data(TensorData::new(values, shape), &device);
    let embedder = Embedder::<B>::from_pretrained(Path::new(model), &device)?;
    let hits = semantic_search(embedder.encode(&[text])?, corpus, k);
    for hit in &hits[0] {
        println!("{:.4}  {}", hit.score, sentences[hit.corpus_id]);
    }
    Ok(())
}
