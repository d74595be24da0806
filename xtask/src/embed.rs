//! `embed --model DIR --input texts.txt --out embeddings.jsonl`: one embedding per input line
//! ([`ember_model::Embedder`]), written as one JSON array per line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::backend::NdArray;
use clap::Args;
use ember_model::{Embedder, Pooling};

/// Flags of `embed`.
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// Model folder: config.json, model.safetensors, tokenizer.json or vocab.txt (for instance
    /// all-MiniLM-L6-v2)
    #[arg(long)]
    model: PathBuf,
    /// Text file, one text per line
    #[arg(long)]
    input: PathBuf,
    /// Output: one JSON array of floats per input line
    #[arg(long)]
    out: PathBuf,
    /// mean (over real tokens) or cls
    #[arg(long, default_value = "mean")]
    pooling: Pooling,
    /// L2-normalise each embedding
    #[arg(long)]
    normalize: bool,
    /// Texts per forward pass
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn run(args: EmbedArgs) -> Result<()> {
    let device = Default::default();
    let embedder = Embedder::<NdArray>::from_pretrained(&args.model, &device)?
        .with_pooling(args.pooling)
        .with_normalize(args.normalize)
        .with_batch_size(args.batch_size);
    let text = std::fs::read_to_string(&args.input)
        .with_context(|| format!("{}: cannot read the texts", args.input.display()))?;
    let lines: Vec<&str> = text.lines().collect();
    let embeddings = embedder.encode(&lines)?;
    let dim = embedder.dim();
    let values = embeddings
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("f32 after convert");
    let tmp = ember_model::checkpoint::temp_path(&args.out);
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| args.out.display().to_string())?,
    );
    for row in values.chunks(dim) {
        writeln!(file, "{}", serde_json::to_string(row)?)?;
    }
    file.flush()?;
    drop(file);
    std::fs::rename(&tmp, &args.out).with_context(|| args.out.display().to_string())?;
    println!(
        "ember: {} embeddings of {dim} dimensions written to {}",
        lines.len(),
        args.out.display()
    );
    Ok(())
}
