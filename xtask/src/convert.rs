//! `convert --from PATH --to DIR`: a BERT checkpoint (Hugging Face safetensors, PyTorch
//! `pytorch_model.bin`, or an ember run or checkpoint folder) into a folder that
//! `transformers.BertForPreTraining.from_pretrained(DIR)` opens: `config.json` and
//! `model.safetensors` under Hugging Face's names.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::backend::NdArray;
use clap::Args;
use ember_model::{BertConfig, BertForPreTraining, WeightsFile};

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
}

pub fn run(args: ConvertArgs) -> Result<()> {
    let file = WeightsFile::find(&args.from)?;
    let config_path = match args.config {
        Some(path) => path,
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
    let config = BertConfig::load_json(&config_path)?;
    let device = Default::default();
    let model: BertForPreTraining<NdArray> = config.init_for_pretraining(&device);
    let (model, report) = model.load_pretrained(&file)?;
    if !report.initialised.is_empty() {
        bail!(
            "{}: lacks {} parameter(s) of BertForPreTraining, which the converted folder would hold as random values: {}",
            file.path().display(),
            report.initialised.len(),
            report.initialised.join(", ")
        );
    }
    std::fs::create_dir_all(&args.to).with_context(|| args.to.display().to_string())?;
    model.save_hf_safetensors(&args.to.join("model.safetensors"))?;
    let config_out = args.to.join("config.json");
    let tmp = ember_model::checkpoint::temp_path(&config_out);
    std::fs::write(&tmp, config.to_hf_json())
        .and_then(|()| std::fs::rename(&tmp, &config_out))
        .with_context(|| config_out.display().to_string())?;
    println!(
        "ember: converted {} ({} parameters) to {} (config.json, model.safetensors)",
        file.path().display(),
        report.loaded.len(),
        args.to.display()
    );
    Ok(())
}
