//! Starting CUDA in this process, before anything else touches it: the GPU libraries found by
//! the names machines ship (Note [CUDA library names] in `trainer/src/cuda/libs.rs`), this
//! process started again when one had to be linked under cudarc's name, and the rank's GPU
//! chosen among those it sees and named in the log. `ember gpu-libs` shows the same survey.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use ember_trainer::cuda::device::{cudarc_names, driver_cuda_major, select_gpu};
use ember_trainer::cuda::libs::{Library, Located, link_folder, locate};
use ember_trainer::parallel::LaunchEnv;

/// Set in the environment of the process started again: the folder of links it was given.
const LINKED_VAR: &str = "EMBER_CUDA_LINKS";

/// Makes sure the driver, NVRTC and (`nccl`) NCCL open, and cuBLASLt where it is found (only
/// `model.gemm = "cublaslt"` needs it, and checks for it then), then picks the GPU of `launch`'s
/// local rank and logs it; returns its CUDA ordinal. Call before CUDA, MPI or the rendezvous
/// start: it may start this process again (same id, same arguments).
///
/// # Errors
/// One line: a library not found (every name and folder tried), no driver or GPU, a local
/// rank past the visible GPUs.
pub fn start(launch: &LaunchEnv, nccl: bool) -> Result<usize> {
    ensure_libraries(nccl)?;
    let gpu = select_gpu(launch.local_rank, launch.local_world_size).map_err(|e| anyhow!(e))?;
    tracing::info!(
        "rank {} of {} (local rank {}): {gpu}",
        launch.rank,
        launch.world_size,
        launch.local_rank
    );
    Ok(gpu.index)
}

/// The GPU of a single process without NCCL (local rank 0 of 1), after [`start`]: what the
/// benchmarks run on.
///
/// # Errors
/// As [`start`].
pub fn single_device() -> Result<burn::backend::cuda::CudaDevice> {
    Ok(burn::backend::cuda::CudaDevice::new(start(
        &LaunchEnv::single(),
        false,
    )?))
}

/// Each library CUDA runs need (NCCL with `nccl`), and where it was found.
fn survey(nccl: bool) -> Result<Vec<(Library, Result<Located, String>)>> {
    let var = |name: &str| std::env::var(name).ok();
    let exe = std::env::current_exe().context("locating this binary")?;
    let driver = Library::driver(cudarc_names("cuda"));
    let found_driver = locate(&driver, &var, exe.parent());
    // NVRTC no newer than the driver (the driver opens by cudarc's own names, or not at all).
    let driver_major = found_driver
        .as_ref()
        .is_ok_and(|l| *l == Located::Loadable)
        .then(driver_cuda_major)
        .flatten();
    let mut libraries = vec![
        Library::nvrtc(cudarc_names("nvrtc"), driver_major),
        Library::cublaslt(cudarc_names("cublasLt"), driver_major),
    ];
    if nccl {
        libraries.push(Library::nccl(cudarc_names("nccl")));
    }
    let mut found = vec![(driver, found_driver)];
    found.extend(libraries.into_iter().map(|library| {
        let located = locate(&library, &var, exe.parent());
        (library, located)
    }));
    Ok(found)
}

/// The links the found libraries need (cudarc's first name → the file).
fn links(found: &[(Library, Result<Located, String>)]) -> Vec<(String, PathBuf)> {
    found
        .iter()
        .filter_map(|(library, located)| match located {
            Ok(Located::At(path)) => Some((library.cudarc_names[0].clone(), path.clone())),
            _ => None,
        })
        .collect()
}

/// A folder of links for `links`, and `LD_LIBRARY_PATH` with it first, then what was there,
/// then each library's own folder (NVRTC opens its builtins by name from there), so that the
/// process's other libraries resolve as they did.
fn library_path(links: &[(String, PathBuf)]) -> Result<(PathBuf, OsString)> {
    let folder = link_folder(links, &ember_data::embedded::cache_dir()).map_err(|e| {
        anyhow!("linking the GPU libraries under cudarc's names: {e} (set EMBER_CACHE_DIR)")
    })?;
    let mut path = vec![folder.clone()];
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.extend(std::env::split_paths(&old));
    }
    path.extend(
        links
            .iter()
            .filter_map(|(_, t)| t.parent().map(Path::to_path_buf)),
    );
    let joined = std::env::join_paths(path).context("LD_LIBRARY_PATH")?;
    Ok((folder, joined))
}

/// Finds each library; links the ones found under other names and starts this process again.
fn ensure_libraries(nccl: bool) -> Result<()> {
    let found = survey(nccl)?;
    let mut missing = Vec::new();
    for (library, located) in &found {
        match located {
            Ok(Located::Loadable) => {}
            Ok(Located::At(path)) => tracing::info!(
                "{}: {} (cudarc opens it as {})",
                library.what,
                path.display(),
                library.cudarc_names[0]
            ),
            // Without a driver nothing else matters.
            Err(e) if library.override_var.is_none() => bail!("no GPU here: {e}"),
            // `model.gemm = "cublaslt"` says so itself when it needs the library.
            Err(e) if library.optional => tracing::debug!("{e}"),
            Err(e) => missing.push(e.clone()),
        }
    }
    if !missing.is_empty() {
        bail!("{}", missing.join("; "));
    }
    let links = links(&found);
    if links.is_empty() {
        return Ok(());
    }
    if let Some(folder) = std::env::var_os(LINKED_VAR) {
        bail!(
            "{} still do not open through the links in {} (LD_LIBRARY_PATH={})",
            links
                .iter()
                .map(|(name, _)| name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            Path::new(&folder).display(),
            std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
        );
    }
    let (folder, joined) = library_path(&links)?;
    tracing::info!(
        "starting again with {} first on LD_LIBRARY_PATH",
        folder.display()
    );
    let exe = std::env::current_exe().context("locating this binary")?;
    let mut args = std::env::args_os();
    let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
    let error = std::process::Command::new(&exe)
        .arg0(arg0)
        .args(args)
        .env("LD_LIBRARY_PATH", joined)
        .env(LINKED_VAR, &folder)
        .exec();
    Err(anyhow!("starting {} again: {error}", exe.display()))
}

/// Flags of `gpu-libs`.
#[derive(Args, Debug)]
pub struct GpuLibsArgs {
    /// Print only the LD_LIBRARY_PATH under which the libraries open by cudarc's names, for
    /// other programs built on cudarc (the CUDA kernel tests)
    #[arg(long)]
    ld_library_path: bool,
}

/// `ember gpu-libs`: where the driver, NVRTC, cuBLASLt and NCCL were found, and the GPUs this process
/// sees.
pub fn gpu_libs(args: GpuLibsArgs) -> Result<()> {
    let found = survey(true)?;
    let links = links(&found);
    if args.ld_library_path {
        let path = if links.is_empty() {
            std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default()
        } else {
            library_path(&links)?.1
        };
        println!("{}", path.to_string_lossy());
        return Ok(());
    }
    for (library, located) in &found {
        match located {
            Ok(Located::Loadable) => println!("{}: opens by cudarc's own names", library.what),
            Ok(Located::At(path)) => println!(
                "{}: {} (linked as {} when a run starts)",
                library.what,
                path.display(),
                library.cudarc_names[0]
            ),
            Err(e) => println!("{e}"),
        }
    }
    if found.first().is_some_and(|(_, located)| located.is_ok()) {
        match select_gpu(0, None) {
            Ok(first) => {
                for index in 0..first.visible {
                    match select_gpu(index, None) {
                        Ok(gpu) => println!("{gpu}"),
                        Err(e) => println!("GPU {index}: {e}"),
                    }
                }
            }
            Err(e) => println!("{e}"),
        }
    }
    Ok(())
}
