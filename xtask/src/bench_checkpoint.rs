//! `bench checkpoint`: how long the large files of a full-state checkpoint (weights and
//! optimizer state, with their SHA-256s) take to write and to load for a preset, against the
//! same number of bytes written (with fsync) and read as one plain file in the same run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use clap::Args;
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_trainer::checkpoint::{
    FileDigest, read_optimizer_state, write_file, write_optimizer_state,
};
use ember_trainer::config::OptimizerConfig;
use ember_trainer::grads::named_params;
use ember_trainer::optim::{OptimizerState, ParamMoments, PreTrainingOptimizer};

type B = Autodiff<NdArray>;

/// Flags of `bench checkpoint`.
#[derive(Args, Debug)]
pub struct CheckpointArgs {
    /// Model sizes
    #[arg(long, value_delimiter = ',', default_value = "base,large")]
    presets: Vec<Preset>,
    /// Folder to write in (a checkpoint's file system is what is measured)
    #[arg(long, default_value = "runs/bench-checkpoint")]
    dir: PathBuf,
}

/// Every parameter's value as both moments (step 1): a state of the real size and shapes.
fn full_state(model: &BertForPreTraining<B>) -> OptimizerState {
    struct Values(Vec<burn::tensor::TensorData>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.val().into_data());
        }
    }
    let mut values = Values(Vec::new());
    model.visit(&mut values);
    named_params::<B, _>(model)
        .into_iter()
        .zip(values.0)
        .map(|((path, _), data)| {
            (
                path,
                ParamMoments {
                    moment_1: data.clone(),
                    moment_2: data,
                    time: 1,
                },
            )
        })
        .collect()
}

fn seconds<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let started = Instant::now();
    let value = f()?;
    Ok((value, started.elapsed().as_secs_f64()))
}

pub fn run(args: CheckpointArgs) -> Result<()> {
    std::fs::create_dir_all(&args.dir).with_context(|| args.dir.display().to_string())?;
    let device = Default::default();
    println!(
        "| preset | parameters | files MiB | write s (weights + optimizer + SHA-256) | plain write s | ratio | load s (SHA-256 + weights + optimizer) | plain read s | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut parts = Vec::new();
    for preset in &args.presets {
        let mut config = BertConfig::preset(*preset);
        config.vocab_size = 30522;
        let model: BertForPreTraining<B> = config.init_for_pretraining(&device);
        let state = full_state(&model);
        let mut optimizer = PreTrainingOptimizer::new(&OptimizerConfig::default(), &model, false);
        optimizer
            .load_state(&model, state)
            .map_err(anyhow::Error::msg)?;
        let weights = args.dir.join("model.safetensors");
        let moments = args.dir.join("optimizer.safetensors");

        // Write: what `Trainer::save_checkpoint` does with the two large files.
        let ((), weights_s) = seconds(|| Ok(model.valid().save_hf_safetensors(&weights)?))?;
        let ((), moments_s) =
            seconds(|| Ok(write_optimizer_state(&moments, &optimizer.state(&model))?))?;
        let ((), digest_s) = seconds(|| {
            FileDigest::of_file(&weights)?;
            FileDigest::of_file(&moments)?;
            Ok(())
        })?;
        let write_s = weights_s + moments_s + digest_s;
        let bytes = std::fs::metadata(&weights)?.len() + std::fs::metadata(&moments)?.len();

        // Load: what `Trainer::resume` does with them (the digests again, then both files).
        let fresh: BertForPreTraining<B> = config.init_for_pretraining(&device);
        let mut fresh_optimizer =
            PreTrainingOptimizer::new(&OptimizerConfig::default(), &fresh, false);
        let (fresh, load_weights_s) = seconds(|| Ok(fresh.load_hf_safetensors(&weights)?))?;
        let ((), load_moments_s) = seconds(|| {
            fresh_optimizer
                .load_state(&fresh, read_optimizer_state(&moments)?)
                .map_err(anyhow::Error::msg)
        })?;
        let load_s = digest_s + load_weights_s + load_moments_s;

        // The reference: the same bytes as one plain file, written with fsync and read back.
        let plain = args.dir.join("plain.bin");
        let buffer = vec![7u8; bytes as usize];
        let ((), plain_write_s) = seconds(|| Ok(write_file(&plain, &buffer)?))?;
        drop(buffer);
        let (_, plain_read_s) = seconds(|| Ok(std::fs::read(&plain)?))?;
        for file in [&weights, &moments, &plain] {
            let _ = std::fs::remove_file(file);
        }
        println!(
            "| {} | {:.0}M | {:.0} | {write_s:.2} ({weights_s:.2} + {moments_s:.2} + {digest_s:.2}) | {plain_write_s:.2} | {:.2} | {load_s:.2} ({digest_s:.2} + {load_weights_s:.2} + {load_moments_s:.2}) | {plain_read_s:.2} | {:.2} |",
            preset.name(),
            model.num_params() as f64 / 1e6,
            bytes as f64 / (1 << 20) as f64,
            write_s / plain_write_s,
            load_s / plain_read_s,
        );
        parts.push(preset.name());
    }
    println!(
        "\n({} run; the files were read back from the page cache, as a resume on the same node would)",
        parts.join(", ")
    );
    Ok(())
}
