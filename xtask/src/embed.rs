//! `embed --model DIR --input texts.txt --out embeddings.jsonl`: one embedding per input line
//! ([`ember_model::Embedder`]: the folder's sentence-transformers pipeline), written as one JSON
//! array per line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ember_backend_ext::FusedOps;
use ember_model::{Embedder, Pooling};

/// Flags of `embed`.
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// Model folder: a sentence-transformers folder (modules.json, 1_Pooling, ..., as
    /// all-MiniLM-L6-v2), or a BERT folder (config.json, model.safetensors, tokenizer.json or
    /// vocab.txt: mean pooling)
    #[arg(long)]
    model: PathBuf,
    /// Text file, one text per line
    #[arg(long)]
    input: PathBuf,
    /// Output: one JSON array of floats per input line
    #[arg(long)]
    out: PathBuf,
    /// Pool with this mode instead of the folder's: mean, cls, max, mean_sqrt_len_tokens,
    /// weightedmean or lasttoken
    #[arg(long)]
    pooling: Option<Pooling>,
    /// L2-normalise each embedding (the folder's Normalize module, or none, otherwise)
    #[arg(long, overrides_with = "no_normalize")]
    normalize: bool,
    /// Leave out the folder's Normalize module
    #[arg(long, overrides_with = "normalize")]
    no_normalize: bool,
    /// Tokens per text at most, [CLS] and [SEP] included [default: the folder's
    /// max_seq_length]
    #[arg(long)]
    max_seq_length: Option<usize>,
    /// Texts per forward pass
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Where to compute: cpu, cuda (the `cuda` feature) or wgpu (the `wgpu` feature)
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    device: String,
}

pub fn run(args: EmbedArgs) -> Result<()> {
    match args.device.as_str() {
        "cuda" => run_cuda(&args),
        "wgpu" => run_wgpu(&args),
        _ => embed::<burn::backend::NdArray>(&args, &Default::default()),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &EmbedArgs) -> Result<()> {
    let gpu = crate::cuda::start(&ember_trainer::parallel::LaunchEnv::single(), false)?;
    embed::<burn::backend::Cuda>(args, &burn::backend::cuda::CudaDevice::new(gpu))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &EmbedArgs) -> Result<()> {
    anyhow::bail!(
        "--device cuda needs a build with the `cuda` feature (cargo install ... --features cuda)"
    )
}

#[cfg(feature = "wgpu")]
fn run_wgpu(args: &EmbedArgs) -> Result<()> {
    embed::<burn::backend::Wgpu>(args, &burn::backend::wgpu::WgpuDevice::DefaultDevice)
}

#[cfg(not(feature = "wgpu"))]
fn run_wgpu(_: &EmbedArgs) -> Result<()> {
    anyhow::bail!(
        "--device wgpu needs a build with the `wgpu` feature (cargo install ... --features wgpu)"
    )
}

fn embed<B: FusedOps>(args: &EmbedArgs, device: &B::Device) -> Result<()> {
    let mut embedder =
        Embedder::<B>::from_pretrained(&args.model, device)?.with_batch_size(args.batch_size);
    if let Some(pooling) = args.pooling {
        embedder = embedder.with_pooling(pooling);
    }
    if args.normalize || args.no_normalize {
        embedder = embedder.with_normalize(args.normalize);
    }
    if let Some(tokens) = args.max_seq_length {
        embedder = embedder.with_max_seq_length(tokens);
    }
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
