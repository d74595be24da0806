//! `convert --from PATH --to DIR`: a BERT checkpoint (Hugging Face safetensors, PyTorch
//! `pytorch_model.bin`, or an ember run or checkpoint folder) into a folder that transformers
//! opens: `config.json` and `model.safetensors` under Hugging Face's names, as the class the
//! source holds (`BertForPreTraining`, or `BertModel` for an encoder without the pre-training
//! heads, such as all-MiniLM-L6-v2), or as `BertForPreTraining` with the missing heads
//! initialised fresh (`--init-missing`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::backend::NdArray;
use clap::{Args, ValueEnum};
use ember_model::{BertConfig, BertForPreTraining, WeightsFile};

/// The transformers class the converted folder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Architecture {
    /// What the source holds: `BertForPreTraining` when it has the pre-training heads,
    /// `BertModel` when it has the encoder alone.
    Auto,
    /// `BertForPreTraining`: refused when the source lacks a parameter, unless
    /// `--init-missing`.
    #[value(name = "bert-for-pretraining")]
    BertForPreTraining,
    /// `BertModel`: the encoder (embeddings, layers, pooler); the source's heads are left out.
    BertModel,
}

/// Flags of `convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// A Hugging Face folder or weights file (.safetensors, pytorch_model.bin), or an ember run
    /// or checkpoint folder
    #[arg(long)]
    from: PathBuf,
    /// Output folder (created)
    #[arg(long)]
    to: PathBuf,
    /// The model's config.json [default: the one beside the weights]
    #[arg(long)]
    config: Option<PathBuf>,
    /// The class the converted folder holds
    #[arg(long, value_enum, default_value = "auto")]
    architecture: Architecture,
    /// Write BertForPreTraining with the parameters the source lacks (the heads of an
    /// encoder-only source) initialised as BERT initialises them (listed)
    #[arg(long)]
    init_missing: bool,
}

/// Whether a Hugging Face key belongs to the pre-training heads.
fn is_head(key: &str) -> bool {
    key.starts_with("cls.")
}

pub fn run(args: ConvertArgs) -> Result<()> {
    let file = WeightsFile::find(&args.from)?;
    let config_path = match &args.config {
        Some(path) => path.clone(),
        None => {
            let beside = file.path().with_file_name("config.json");
            if !beside.is_file() {
                bail!(
                    "no config.json beside {}: pass the model's config with --config",
                    file.path().display()
                );
            }
            beside
        }
    };
    if args.init_missing && args.architecture == Architecture::BertModel {
        bail!(
            "--init-missing writes BertForPreTraining; it has no effect with --architecture bert-model"
        );
    }
    let config = BertConfig::load_json(&config_path)?;
    let device = Default::default();
    let model: BertForPreTraining<NdArray> = config.init_for_pretraining(&device);
    let (model, report) = model.load_pretrained(&file)?;
    let missing = &report.initialised;
    let encoder_missing: Vec<&String> = missing.iter().filter(|k| !is_head(k)).collect();
    let write_encoder = match args.architecture {
        Architecture::BertModel => true,
        Architecture::BertForPreTraining => false,
        Architecture::Auto => {
            !args.init_missing && !missing.is_empty() && encoder_missing.is_empty()
        }
    };
    let lacking = if write_encoder {
        encoder_missing
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
    } else if args.init_missing {
        Vec::new()
    } else {
        missing.iter().map(String::as_str).collect()
    };
    if !lacking.is_empty() {
        bail!(
            "{}: lacks {} parameter(s) of {}, which the converted folder would hold as random \
             values: {}{}",
            file.path().display(),
            lacking.len(),
            if write_encoder {
                "BertModel"
            } else {
                "BertForPreTraining"
            },
            lacking.join(", "),
            if write_encoder {
                ""
            } else {
                " (--init-missing initialises them and says so)"
            }
        );
    }
    std::fs::create_dir_all(&args.to).with_context(|| args.to.display().to_string())?;
    let weights = args.to.join("model.safetensors");
    let architecture = if write_encoder {
        model.bert.save_hf_safetensors(&weights)?;
        "BertModel"
    } else {
        model.save_hf_safetensors(&weights)?;
        "BertForPreTraining"
    };
    write_config(
        &args.to.join("config.json"),
        &config.to_hf_json_as(architecture),
    )?;
    println!(
        "ember: converted {} ({} parameters) to {} as {architecture} (config.json, \
         model.safetensors){}",
        file.path().display(),
        report.loaded.len(),
        args.to.display(),
        if !write_encoder && !missing.is_empty() {
            format!(
                "; initialised fresh, as BERT initialises them: {}",
                missing.join(", ")
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// `config.json` through a temporary name and a rename.
fn write_config(path: &Path, json: &str) -> Result<()> {
    let tmp = ember_model::checkpoint::temp_path(path);
    std::fs::write(&tmp, json)
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| path.display().to_string())
}
