//! `cargo xtask <command>` (also built as the `ember` binary, for `mpirun`): ember's command
//! line.
//!
//! - `train`: pre-trains BERT from a TOML config (default `configs/tiny-cpu.toml`) with flag
//!   overrides, on the CPU (Burn's NdArray backend); `--nproc N` trains with N in-process
//!   data-parallel ranks; under `mpirun` each process is one rank (`mpi` feature).
//! - `launch`: runs `mpirun -np N` on this binary; `comm-check` times the collectives of such
//!   a job and shows its collective timeout.
//! - `prepare-data`: text → MLPerf HDF5 shards; `stratify`: shards → length bins;
//!   `balance-report`: padding efficiency and rank imbalance of each sampler.
//! - `bench overlap`: how much of the gradient allreduce the bucketed hooks hide; `bench
//!   kernels`: the fused ops against their reference; `bench step`: a training step's time and
//!   host synchronisations, device against host buckets; `bench train-step`: the training
//!   step against PyTorch's in the same run.

mod bench;
mod bench_checkpoint;
mod bench_data;
mod bench_embed;
mod bench_gemm;
mod bench_gemm_bias;
#[doc(hidden)]
pub use bench_data::number_after;
mod bench_kernels;
#[doc(hidden)]
pub use bench_kernels::{Row as KernelRow, slower_fused};
mod bench_kernels_attention;
mod bench_kernels_loss;
mod bench_largest_batch;
#[doc(hidden)]
pub use bench_largest_batch::{
    MAX_BATCH, Search, out_of_memory, run_with_timeout, search as largest_batch_search,
};
mod bench_onebit;
mod bench_reference;
pub use bench_reference::{HostInputs as BenchInputs, Lengths as BenchLengths};
mod bench_step;
mod bench_summary;
mod bench_train_step;
mod bench_train_step_ember;
mod bench_train_step_report;
mod comm_check;
mod convert;
#[cfg(feature = "cuda")]
mod cuda;
mod curves;
mod data;
mod embed;
mod launch;
mod plot;
pub mod shipped;
mod train;

/// mimalloc instead of glibc's malloc: the MLM logits and their gradients are ~80 MB buffers,
/// which glibc serves with a fresh mmap each time (page faults and zeroing on every op);
/// mimalloc reuses them. Measured: a tiny-BERT batch-32 step takes 2.0 s instead of 2.6 s on
/// 2 cores.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "ember: BERT pre-training in Rust on Burn",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Pre-train BERT and write metrics and a Hugging Face checkpoint.
    Train(train::TrainArgs),
    /// Run this binary under `mpirun -np N` (needs the `mpi` feature):
    /// `launch --nproc 4 -- train --steps 100`.
    Launch(launch::LaunchArgs),
    /// Time the collectives among launched ranks (MPI), or hold one rank back to see the
    /// collective timeout end the job: `launch --nproc 2 -- comm-check`.
    CommCheck(comm_check::CommCheckArgs),
    /// Text corpus → MLPerf HDF5 shards (create_pretraining_data per part, in parallel).
    PrepareData(data::PrepareArgs),
    /// Reshard by real length into one folder per length bin.
    Stratify(data::StratifyArgs),
    /// Padding efficiency, rank imbalance and step time of each sampler, simulated on shards;
    /// writes balance.md and balance.png.
    BalanceReport(data::BalanceArgs),
    /// A BERT checkpoint (Hugging Face safetensors, pytorch_model.bin, ember run or
    /// checkpoint) into a folder transformers opens: config.json + model.safetensors.
    Convert(convert::ConvertArgs),
    /// Sentence embeddings of a sentence-transformers or BERT model folder (its pooling,
    /// Dense and Normalize modules), one JSON array per input line.
    Embed(embed::EmbedArgs),
    /// Benchmarks, each against a reference measured in the same run (PyTorch, the unfused
    /// path, the serial path).
    Bench(bench::BenchArgs),
    /// Where the GPU libraries are found (the NVIDIA driver, NVRTC, NCCL; under cudarc's names
    /// or linked to them) and which GPUs this process sees
    #[cfg(feature = "cuda")]
    GpuLibs(cuda::GpuLibsArgs),
}

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in mimalloc.h).
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

unsafe extern "C" {
    /// mimalloc's option setter (the allocator above is linked statically).
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// Keeps freed memory in the process: mimalloc by default returns freed pages to the OS after
/// 10 ms, and a training step that allocates the same activation buffers again then pays a
/// page fault and the kernel's zeroing per page (17% of BERT-base's CPU step in perf, the
/// `clear_page_erms` of docs/performance.md's profile); never purging made the step 1.3× faster. Peak
/// memory is unchanged, the resident set stays at it. `MIMALLOC_PURGE_DELAY` still wins.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain C call without pointers, before the work starts.
        unsafe { mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// The error of parsing `args` (the arguments after the program's name) as this binary's
/// command line, `None` where they parse: how CI checks the commands of
/// `scripts/gpu-check.sh`, which only a GPU machine runs (`xtask/tests/gpu_check.rs`).
#[doc(hidden)]
pub fn parse_error(args: &[String]) -> Option<String> {
    let argv = std::iter::once("xtask".to_string()).chain(args.iter().cloned());
    Cli::try_parse_from(argv).err().map(|e| e.to_string())
}

/// Parses the command line and runs the command; what both binaries' `main` calls.
pub fn cli_main() -> ExitCode {
    keep_freed_memory();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // OpenBLAS chose its kernels when this binary was loaded: where it took this CPU for an
    // older one, start again with the right ones (ember_trainer::blas::better_openblas_core).
    #[cfg(unix)]
    if let Some((detected, core)) = ember_trainer::blas::openblas_core_to_force() {
        tracing::info!(
            "OpenBLAS chose its {detected} kernels on a CPU with {}: starting again with \
             OPENBLAS_CORETYPE={core} (set OPENBLAS_CORETYPE to keep another choice)",
            ember_trainer::blas::SimdLevel::of_this_cpu()
        );
        let error =
            ember_trainer::blas::restart_with_openblas_core(core, std::env::args_os().collect());
        tracing::warn!(
            "starting again with OPENBLAS_CORETYPE={core}: {error}; the GEMMs run on {detected} kernels"
        );
    }
    // The same command line under both names: help and usage say `ember` when the installed
    // binary runs, `cargo xtask` in a checkout.
    let invoked_as_ember = std::env::args_os()
        .next()
        .and_then(|arg0| {
            std::path::Path::new(&arg0)
                .file_stem()
                .map(|s| s == "ember")
        })
        .unwrap_or(false);
    let mut command = Cli::command();
    if invoked_as_ember {
        command = command.name("ember").bin_name("ember");
    }
    let cli = match Cli::from_arg_matches(&command.get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    #[cfg(any(feature = "cuda", feature = "wgpu"))]
    {
        // Before any device is opened (Note [GPU GEMMs]: autotune results and compiled
        // kernels are kept from one process to the next).
        let cache = ember_backend_ext::set_kernel_cache(&kernel_cache_dir());
        tracing::debug!(%cache, "CubeCL's kernel and autotune cache");
    }
    let result: Result<()> = match cli.command {
        Command::Train(args) => train::run(args),
        Command::Launch(args) => launch::run(args),
        Command::CommCheck(args) => comm_check::run(args),
        Command::PrepareData(args) => data::prepare(args),
        Command::Stratify(args) => data::stratify_command(args),
        Command::BalanceReport(args) => data::balance(args),
        Command::Convert(args) => convert::run(args),
        Command::Embed(args) => embed::run(args),
        Command::Bench(args) => bench::run(args),
        #[cfg(feature = "cuda")]
        Command::GpuLibs(args) => cuda::gpu_libs(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // `{:#}` prints the whole chain of causes on one line, without a backtrace: the
            // errors name the file or setting at fault, which is what a user needs.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The folder in which CubeCL keeps compiled kernels and autotune results, in a folder per
/// build of ember (`ember_backend_ext::set_kernel_cache`, Note [Kernel cache per build]):
/// `$EMBER_KERNEL_CACHE`, else `kernels/` in ember's cache folder (`$EMBER_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/ember`, else `~/.cache/ember`).
pub fn kernel_cache_dir() -> std::path::PathBuf {
    kernel_cache_dir_from(
        std::env::var_os("EMBER_KERNEL_CACHE"),
        ember_data::embedded::cache_dir(),
    )
}

fn kernel_cache_dir_from(
    var: Option<std::ffi::OsString>,
    cache_dir: std::path::PathBuf,
) -> std::path::PathBuf {
    match var {
        Some(dir) if !dir.is_empty() => dir.into(),
        _ => cache_dir.join("kernels"),
    }
}
