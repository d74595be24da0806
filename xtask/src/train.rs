//! `cargo xtask train`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use burn::backend::{Autodiff, NdArray};
use clap::Args;
use ember_trainer::config::SettingFlags;
use ember_trainer::parallel::LaunchEnv;
use ember_trainer::{RunOptions, TrainConfig};

/// Flags of `train`: how to run, then every setting of the configuration (`SettingFlags`),
/// each overriding the config file's value.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// TOML training config: a file, or a shipped one by name (tiny-cpu,
    /// mlperf-bert-large-adam, mlperf-bert-large-lamb; compiled into the binary)
    /// [default: tiny-cpu]
    #[arg(long)]
    config: Option<PathBuf>,
    /// Data-parallel ranks as threads of this process (in-process collectives). Under
    /// mpirun, srun or torchrun the ranks come from the launcher instead
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    nproc: usize,
    /// Where to train: cpu (Burn's NdArray), cuda (NVIDIA GPU `LOCAL_RANK`, needs the `cuda`
    /// feature; several GPUs: one process each, under torchrun, srun or mpirun) or wgpu (any
    /// Vulkan/Metal/DX12 GPU, or Mesa's lavapipe on the CPU; needs the `wgpu` feature; one
    /// process, --nproc ranks sharing the adapter)
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    device: String,
    /// Do not draw the progress bar
    #[arg(long)]
    no_progress: bool,
    /// Every setting of the configuration, grouped by section.
    #[command(flatten)]
    settings: SettingFlags,
}

impl TrainArgs {
    /// The config file with the flags applied.
    fn resolve(&self) -> Result<TrainConfig> {
        let mut config = crate::shipped::load_config(self.config.as_deref())?;
        let origin = self.config.clone().unwrap_or_else(|| "tiny-cpu".into());
        self.settings.apply(&mut config, &origin)?;
        Ok(config)
    }
}

pub fn run(args: TrainArgs) -> Result<()> {
    let config = args.resolve()?;
    config
        .model
        .gemm
        .for_device(&args.device)
        .map_err(anyhow::Error::msg)
        .context("model.gemm")?;
    let device = Default::default();
    // SIGTERM/SIGINT: finish the step, write a checkpoint, exit 0 (a second one ends at once).
    ember_trainer::checkpoint::signals::install().context("installing the signal handlers")?;
    let options = RunOptions {
        progress: !args.no_progress,
        stop_on_signal: true,
        on_eval: Some(crate::curves::on_eval),
        ..RunOptions::default()
    };
    let launch = LaunchEnv::from_env(None)?;
    if let Some(note) = &launch.note {
        tracing::warn!("{note}");
    }
    let summary = if args.device == "cuda" {
        train_cuda(&config, options, &launch, args.nproc)?
    } else if args.device == "wgpu" {
        train_wgpu(&config, options, &launch, args.nproc)?
    } else if launch.world_size > 1 {
        if args.nproc > 1 {
            bail!(
                "--nproc {} asks for in-process ranks, but this process is already rank {} of {} \
                 from the {}",
                args.nproc,
                launch.rank,
                launch.world_size,
                launch.source
            );
        }
        crate::launch::train_launched(&config, &device, options, &launch)
            .context("training failed")?
    } else if args.nproc > 1 {
        ember_trainer::train_in_process::<Autodiff<NdArray>>(&config, args.nproc, &device, options)
            .context("training failed")?
    } else {
        ember_trainer::train::<Autodiff<NdArray>>(&config, &device, options)
            .context("training failed")?
    };
    if !summary.is_main_rank {
        return Ok(());
    }
    if let Some(signal) = &summary.stopped_by {
        println!(
            "ember: stopped by {signal} after step {}; checkpoint {}; continue with --resume {}",
            summary.steps,
            summary.last_checkpoint.display(),
            config.train.out.display()
        );
        return Ok(());
    }
    println!(
        "ember: {} steps of {} samples on {} rank(s) in {:.0} s ({:.0} tokens/s); held-out masked-LM accuracy {:.4} \
         (unigram baseline {:.4}, always {:?}), next-sentence accuracy {:.4}; loss {:.3} -> {:.3}; \
         model {}, full-state checkpoint {}",
        summary.steps,
        summary.global_batch_size,
        summary.world_size,
        summary.train_seconds,
        summary.tokens_per_second,
        summary.eval.mlm_accuracy,
        summary.unigram_baseline,
        summary.unigram_token,
        summary.eval.nsp_accuracy,
        summary.losses.first().copied().unwrap_or(f64::NAN),
        summary.losses.last().copied().unwrap_or(f64::NAN),
        summary.checkpoint.display(),
        summary.last_checkpoint.display(),
    );
    println!(
        "ember: data wait {:.1} s ({:.1}% of training); peak memory {}{}",
        summary.data_wait_s,
        100.0 * summary.data_wait_s / summary.train_seconds.max(1e-9),
        summary
            .peak_rss_bytes
            .map_or("unknown".to_string(), |b| format!(
                "{:.0} MiB",
                b as f64 / 1048576.0
            )),
        summary
            .target_reached_at_samples
            .map_or(String::new(), |n| format!(
                "; target reached at {n} training samples"
            )),
    );
    if summary.precision.is_half() || summary.loss_scale.is_some() {
        println!(
            "ember: computed in {}{}",
            summary.precision,
            summary.loss_scale.map_or(String::new(), |scale| format!(
                "; loss scale {scale} at the end, {} step(s) skipped for an overflow",
                summary.skipped_steps
            ))
        );
    }
    if summary.corpus_lines_skipped > 0 {
        println!(
            "ember: skipped {} corpus line(s) that were not UTF-8 (see the warnings; --strict \
             stops at the first)",
            summary.corpus_lines_skipped
        );
    }
    Ok(())
}

/// Training on NVIDIA GPUs: one process per GPU.
#[cfg(feature = "cuda")]
fn train_cuda(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
    nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    if nproc > 1 {
        bail!(
            "--nproc runs ranks as threads; on NVIDIA GPUs start one process per GPU (torchrun \
             --nproc-per-node N, srun, or mpirun)"
        );
    }
    if launch.world_size > 1 {
        return crate::launch::train_launched_cuda(config, options, launch)
            .context("training failed");
    }
    let device = burn::backend::cuda::CudaDevice::new(crate::cuda::start(launch, false)?);
    let options = RunOptions {
        host_sync_counter: Some(host_syncs),
        launch_counter: Some(launches),
        ..options
    };
    ember_trainer::train::<Autodiff<ember_backend_ext::CountingCuda>>(config, &device, options)
        .context("training failed")
}

/// Training on one wgpu adapter (the default one: a GPU, else Mesa's lavapipe).
#[cfg(feature = "wgpu")]
fn train_wgpu(
    config: &TrainConfig,
    options: RunOptions,
    launch: &LaunchEnv,
    nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    if launch.world_size > 1 {
        bail!("--device wgpu trains in one process on one adapter (--nproc ranks as threads)");
    }
    // Burn's wgpu backend with its host synchronisations counted (reported in the metrics).
    type Wgpu = ember_backend_ext::CountingWgpu;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let options = RunOptions {
        host_sync_counter: Some(host_syncs),
        launch_counter: Some(launches),
        ..options
    };
    if nproc > 1 {
        ember_trainer::train_in_process::<Autodiff<Wgpu>>(config, nproc, &device, options)
            .context("training failed")
    } else {
        ember_trainer::train::<Autodiff<Wgpu>>(config, &device, options).context("training failed")
    }
}

#[cfg(not(feature = "wgpu"))]
fn train_wgpu(
    _config: &TrainConfig,
    _options: RunOptions,
    _launch: &LaunchEnv,
    _nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    bail!(
        "--device wgpu needs a build with the `wgpu` feature: cargo run --release -p xtask --features wgpu -- train --device wgpu"
    )
}

#[cfg(not(feature = "cuda"))]
fn train_cuda(
    _config: &TrainConfig,
    _options: RunOptions,
    _launch: &LaunchEnv,
    _nproc: usize,
) -> Result<ember_trainer::TrainSummary> {
    bail!(
        "--device cuda needs a build with the `cuda` feature: cargo run --release -p xtask --features cuda -- train --device cuda"
    )
}

/// The calling thread's host synchronisations (GPU backends run on `CountingRuntime`, so that
/// the metrics report them per step: `host_syncs_backward`, `host_syncs_step`).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn host_syncs() -> u64 {
    ember_backend_ext::HostSyncs::now().total()
}

/// The kernels the calling thread launched (`kernel_launches_step` in the metrics).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
fn launches() -> u64 {
    ember_backend_ext::HostSyncs::now().launches
}
