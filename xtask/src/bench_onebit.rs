//! `cargo xtask bench onebit`: bytes sent and step time of AdamW against 1-bit Adam and of
//! LAMB against 1-bit LAMB, two in-process ranks through the whole trainer, over a modelled
//! network link.
//!
//! Each rank has one compute thread (`RAYON_NUM_THREADS=1`, `MATMUL_NUM_THREADS=1`). The
//! collectives run through the link model of `bench overlap` ([`Delayed`]: each collective
//! takes at least the α-β time of its algorithm, sleeping for the difference). By default the
//! bandwidth makes the exact optimizer's gradient allreduce of one step take 1.5× the step's
//! compute (measured first, without a link): communication is then 60% of a serial exact
//! step, the network-bound regime 1-bit Adam is for. Times are medians over the steps after
//! the freeze (the same steps for the exact optimizers), of rank 0's `step_s`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use burn::backend::{Autodiff, NdArray};
use clap::Args;
use ember_model::Preset;
use ember_trainer::config::OptimizerKind;
use ember_trainer::parallel::{Communicator, Delayed, InProcess, LinkModel};
use ember_trainer::{PreparedData, RunOptions, TrainConfig, prepare_data, train_rank};

type B = Autodiff<NdArray>;

/// Flags of `bench onebit`.
#[derive(Args, Debug)]
pub struct OnebitArgs {
    /// Model size
    #[arg(long, default_value = "tiny")]
    preset: Preset,
    /// Samples per rank
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Sequence length of the samples
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Warm-up steps (exact optimizer) before the timed steps
    #[arg(long, default_value_t = 2)]
    freeze_step: u64,
    /// Timed steps after the freeze
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Link bandwidth in GB/s [default: the exact step's allreduce takes 1.5× its compute]
    #[arg(long)]
    bandwidth_gbps: Option<f64>,
    /// Link latency in microseconds (α)
    #[arg(long, default_value_t = 10.0)]
    latency_us: f64,
}

/// Rank 0's step times and bytes of one two-rank run.
struct Run {
    step_s: Vec<f64>,
    comm_bytes: Vec<u64>,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn run_pair(
    config: &TrainConfig,
    data: &Arc<PreparedData>,
    link: Option<LinkModel>,
) -> Result<Run> {
    let comms = InProcess::group(2, Duration::from_secs(600));
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let data = data.clone();
                scope.spawn(move || {
                    let comm = match link {
                        Some(link) => Communicator::Host(Box::new(Delayed::new(comm, link))),
                        None => Communicator::Host(Box::new(comm)),
                    };
                    train_rank::<B>(
                        config,
                        &Default::default(),
                        RunOptions::default(),
                        comm,
                        Some(data),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut summaries = Vec::new();
    for result in results {
        summaries.push(result?);
    }
    let metrics = std::fs::read_to_string(config.train.out.join("metrics.jsonl"))
        .context("reading metrics.jsonl")?;
    let step_s = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "train")
        .filter_map(|v| v["step_s"].as_f64())
        .collect();
    Ok(Run {
        step_s,
        comm_bytes: summaries.swap_remove(0).comm_bytes,
    })
}

fn config(args: &OnebitArgs, out: &Path, optimizer: OptimizerKind) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.preset = args.preset;
    config.model.hidden_dropout_prob = Some(0.0);
    config.model.attention_probs_dropout_prob = Some(0.0);
    config.instances.max_seq_length = args.seq_len;
    config.instances.dupe_factor = 1;
    config.train.batch_size = args.batch_size;
    config.train.steps = args.freeze_step + args.steps;
    config.train.eval_every = Some(config.train.steps);
    config.train.eval_samples = 8;
    config.train.log_every = 1;
    config.train.out = out.join(format!("{optimizer:?}"));
    config.data.eval_documents = 20;
    config.optimizer.name = optimizer;
    if optimizer.is_onebit() {
        config.optimizer.onebit.freeze_step = Some(args.freeze_step);
    }
    config
}

pub fn run(args: OnebitArgs) -> Result<()> {
    // SAFETY: no other thread exists yet (the thread pools start lazily, at the first matmul
    // or parallel op), so nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("RAYON_NUM_THREADS", "1");
        std::env::set_var("MATMUL_NUM_THREADS", "1");
    }
    let dir = tempfile::tempdir()?;
    let data = Arc::new(prepare_data(&config(
        &args,
        dir.path(),
        OptimizerKind::AdamW,
    ))?);
    let timed = args.freeze_step as usize..;
    // The exact step's compute and bytes, without a link.
    let calibration = run_pair(
        &config(&args, dir.path(), OptimizerKind::AdamW),
        &data,
        None,
    )?;
    let compute_s = median(calibration.step_s[timed.clone()].to_vec());
    let exact_bytes = median(
        calibration.comm_bytes[timed.clone()]
            .iter()
            .map(|&b| b as f64)
            .collect(),
    );
    let link = LinkModel {
        latency_s: args.latency_us * 1e-6,
        bandwidth_bytes_per_s: args
            .bandwidth_gbps
            .map_or(exact_bytes / (1.5 * compute_s), |g| g * 1e9),
    };
    println!(
        "{} preset, 2 ranks × batch {} × {} tokens, 1 compute thread each; freeze after {} \
         steps, {} timed steps; exact step without a link {compute_s:.3} s, {:.2} MB sent per \
         rank; link model {:.3} GB/s, {} µs",
        args.preset,
        args.batch_size,
        args.seq_len,
        args.freeze_step,
        args.steps,
        exact_bytes / 1e6,
        link.bandwidth_bytes_per_s / 1e9,
        args.latency_us
    );
    println!();
    println!(
        "| optimizer | bytes sent per step per rank | step s (link) | bytes vs exact | step time vs exact |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (exact, onebit) in [
        (OptimizerKind::AdamW, OptimizerKind::OnebitAdam),
        (OptimizerKind::Lamb, OptimizerKind::OnebitLamb),
    ] {
        let mut reference = None;
        for optimizer in [exact, onebit] {
            let run = run_pair(&config(&args, dir.path(), optimizer), &data, Some(link))?;
            let bytes = median(
                run.comm_bytes[timed.clone()]
                    .iter()
                    .map(|&b| b as f64)
                    .collect(),
            );
            let step = median(run.step_s[timed.clone()].to_vec());
            let (b0, s0) = *reference.get_or_insert((bytes, step));
            println!(
                "| {} | {:.0} | {step:.3} | {:.4} ({:.1}× fewer) | {:.2} |",
                optimizer_name(optimizer),
                bytes,
                bytes / b0,
                b0 / bytes,
                step / s0
            );
        }
    }
    Ok(())
}

fn optimizer_name(kind: OptimizerKind) -> &'static str {
    match kind {
        OptimizerKind::AdamW => "adamw",
        OptimizerKind::Lamb => "lamb",
        OptimizerKind::OnebitAdam => "onebit-adam",
        OptimizerKind::OnebitLamb => "onebit-lamb",
    }
}
