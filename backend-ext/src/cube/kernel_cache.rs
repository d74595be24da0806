//! Where CubeCL keeps its compiled kernels and its autotune results between processes.
//!
//! CubeCL 0.10 reads its configuration once per process (`CubeClRuntimeConfig::get`): from a
//! `cubecl.toml` (or the `[cubecl]` section of a `burn.toml`) in the working folder or above,
//! else its defaults, in which kernels are compiled again by every process (no compilation
//! cache) and autotune results go to the `target/` folder of the Cargo project around the
//! working folder (or `~/.cache/cubecl` outside one). On the H200 a BERT-large process spent
//! ~30 s compiling 163 kernels and autotuning before its first step, every time
//! (docs/gpu.md). [`set_kernel_cache`] gives both caches one stated folder before the first
//! device is opened, one folder per build of ember in it (Note [Kernel cache per build]):
//! PTX (CUDA) and SPIR-V (Vulkan) under `<dir>/build-<fingerprint>/<runtime>/`, autotune
//! results under `<dir>/build-<fingerprint>/autotune/`, each file written under CubeCL's file
//! lock, so the ranks of a node may share the folder.
//!
//! Note [Kernel cache per build]: CubeCL finds a compiled kernel in its cache by a hash of the
//! kernel's type name, cube size and launch settings (`KernelId::stable_hash`), not of its
//! code: a binary whose kernels changed, run with the folder an older binary filled, would
//! load the older binary's PTX and never compile its own. So [`set_kernel_cache`] gives each
//! build a folder of its own, `<dir>/build-<fingerprint>` ([`build_fingerprint`]: the running
//! executable's path, size and modification time; the path tells apart builds that
//! reproducible-build tools stamp with one fixed time, as Nix's store paths). Every process
//! of one binary (the ranks of a node, a second run) shares it; a rebuilt or copied binary
//! compiles afresh once. Where the executable cannot be read, nothing compiled is cached
//! (autotune results still are, in `build-unknown`). The folders of old builds can be
//! deleted. PTX is also compiled for the GPU at hand: machines
//! with different GPUs should not share one folder (a node-local `EMBER_KERNEL_CACHE`).

use std::path::{Path, PathBuf};

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};

/// The environment variable that names the kernel cache folder (default:
/// `<ember's cache folder>/kernels`).
pub const KERNEL_CACHE_VAR: &str = "EMBER_KERNEL_CACHE";

/// What [`set_kernel_cache`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// CubeCL keeps compiled kernels and autotune results in this folder.
    Folder(PathBuf),
    /// A CubeCL configuration file was found (its path): CubeCL follows it, caches included.
    ConfigFile(PathBuf),
    /// CubeCL's configuration was already in use in this process (read or set earlier, e.g.
    /// by a device opened before): unchanged.
    AlreadyInUse,
}

impl std::fmt::Display for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelCache::Folder(dir) => write!(f, "{}", dir.display()),
            KernelCache::ConfigFile(file) => write!(f, "as {} says", file.display()),
            KernelCache::AlreadyInUse => f.write_str("as CubeCL was configured before"),
        }
    }
}

/// Makes CubeCL cache compiled kernels and autotune results in `dir` (in the running build's
/// folder there: Note [Kernel cache per build]) for the rest of the process, unless a CubeCL configuration file applies (searched from the working folder up,
/// as CubeCL does) or CubeCL's configuration is already in use. CubeCL's environment
/// variables (`CUBECL_DEBUG_LOG`, `CUBECL_DEBUG_OPTION`, `CUBECL_AUTOTUNE_LEVEL`) still apply.
/// Call it before the first tensor is made on a CubeCL device. Nothing is written until
/// CubeCL compiles or autotunes; CubeCL creates the folder then.
pub fn set_kernel_cache(dir: &Path) -> KernelCache {
    if let Some(file) = std::env::current_dir()
        .ok()
        .and_then(|cwd| config_file_from(&cwd))
    {
        return KernelCache::ConfigFile(file);
    }
    let mut slot = CubeClRuntimeConfig::storage().lock();
    if slot.is_some() {
        return KernelCache::AlreadyInUse;
    }
    // Note [Kernel cache per build].
    let fingerprint = build_fingerprint();
    let dir = dir.join(format!(
        "build-{}",
        fingerprint.as_deref().unwrap_or("unknown")
    ));
    let mut config = with_cache(CubeClRuntimeConfig::default().override_from_env(), &dir);
    if fingerprint.is_none() {
        config.compilation.cache = None;
    }
    *slot = Some(std::sync::Arc::new(config));
    KernelCache::Folder(dir)
}

/// The running executable's fingerprint (Note [Kernel cache per build]): 16 hex digits of a
/// hash of its path, size and modification time; `None` where the executable cannot be read.
/// Linux's `/proc/self/exe` first: it still reads a binary replaced on disk since it started,
/// whose `current_exe` path ends in " (deleted)".
pub fn build_fingerprint() -> Option<String> {
    let proc_exe = Path::new("/proc/self/exe");
    let path = std::fs::canonicalize(proc_exe)
        .or_else(|_| std::env::current_exe())
        .ok()?;
    std::fs::metadata(proc_exe)
        .or_else(|_| std::fs::metadata(&path))
        .ok()
        .and_then(|meta| fingerprint_from(&path, &meta))
}

/// [`build_fingerprint`] of the file at `path`; `None` where its metadata cannot be read.
#[cfg(test)]
fn fingerprint_of(path: &Path) -> Option<String> {
    fingerprint_from(path, &std::fs::metadata(path).ok()?)
}

/// The fingerprint of the executable at `path` whose metadata is `meta`.
fn fingerprint_from(path: &Path, meta: &std::fs::Metadata) -> Option<String> {
    use std::hash::{Hash, Hasher};
    let modified = meta
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?;
    // SipHash with fixed keys: the same value in every process.
    let mut hasher = std::hash::DefaultHasher::new();
    (
        path,
        meta.len(),
        modified.as_secs(),
        modified.subsec_nanos(),
    )
        .hash(&mut hasher);
    Some(format!("{:016x}", hasher.finish()))
}

/// `config` with both caches in `dir`.
fn with_cache(mut config: CubeClRuntimeConfig, dir: &Path) -> CubeClRuntimeConfig {
    config.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
    config.autotune.cache = CacheConfig::File(dir.to_path_buf());
    config
}

/// The CubeCL configuration file CubeCL would read, searching `start` and its parents:
/// `cubecl.toml` or `CubeCL.toml`, or a `burn.toml` / `Burn.toml` with a `[cubecl]` section.
fn config_file_from(start: &Path) -> Option<PathBuf> {
    start.ancestors().find_map(|dir| {
        let whole = CubeClRuntimeConfig::file_names()
            .iter()
            .map(|name| dir.join(name))
            .find(|path| path.is_file());
        whole.or_else(|| {
            CubeClRuntimeConfig::section_file_names()
                .iter()
                .map(|(name, section)| (dir.join(name), format!("[{section}")))
                .find(|(path, header)| {
                    std::fs::read_to_string(path).is_ok_and(|text| {
                        text.lines()
                            .any(|line| line.trim_start().starts_with(header.as_str()))
                    })
                })
                .map(|(path, _)| path)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_caches_go_to_the_folder() {
        let config = with_cache(CubeClRuntimeConfig::default(), Path::new("/k"));
        assert!(
            matches!(&config.compilation.cache, Some(CacheConfig::File(p)) if p == Path::new("/k"))
        );
        assert!(matches!(&config.autotune.cache, CacheConfig::File(p) if p == Path::new("/k")));
        assert_eq!(config.autotune.cache.root(), PathBuf::from("/k"));
    }

    /// Note [Kernel cache per build]: a file's fingerprint is stable while it is unchanged, and
    /// changes when it is rewritten (a rebuild) or its size changes.
    /// Sets the modification time of the file at `path` to `time`.
    fn stamp(path: &Path, time: std::time::SystemTime) {
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(time).unwrap();
    }

    #[test]
    fn a_rebuilt_binary_gets_another_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("ember");
        std::fs::write(&exe, b"kernels v1").unwrap();
        let first = fingerprint_of(&exe).unwrap();
        assert_eq!(first.len(), 16);
        assert_eq!(
            fingerprint_of(&exe).unwrap(),
            first,
            "stable while unchanged"
        );
        // The same size, a later modification time.
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::write(&exe, b"kernels v2").unwrap();
        stamp(&exe, later);
        let rebuilt = fingerprint_of(&exe).unwrap();
        assert_ne!(rebuilt, first, "a rewritten binary");
        std::fs::write(&exe, b"kernels v2 and more").unwrap();
        stamp(&exe, later);
        assert_ne!(fingerprint_of(&exe).unwrap(), rebuilt, "another size");
        assert_eq!(fingerprint_of(&dir.path().join("absent")), None);
        // The same bytes and time at another path (a reproducible build's fixed time).
        let other = dir.path().join("ember-other");
        std::fs::copy(&exe, &other).unwrap();
        stamp(&other, later);
        assert_ne!(fingerprint_of(&other), fingerprint_of(&exe), "another path");
        assert_eq!(
            build_fingerprint().map(|f| f.len()),
            Some(16),
            "this test binary's"
        );
        assert_eq!(
            build_fingerprint(),
            build_fingerprint(),
            "stable in a process"
        );
    }

    #[test]
    fn a_cubecl_file_above_the_working_folder_is_found() {
        let root = tempfile::tempdir().unwrap();
        let inner = root.path().join("a/b");
        std::fs::create_dir_all(&inner).unwrap();
        assert_eq!(config_file_from(&inner), None);
        // A burn.toml without a [cubecl] section is not CubeCL's configuration.
        std::fs::write(root.path().join("a/burn.toml"), "[other]\nx = 1\n").unwrap();
        assert_eq!(config_file_from(&inner), None);
        std::fs::write(
            root.path().join("a/burn.toml"),
            "[cubecl.autotune]\nlevel = \"full\"\n",
        )
        .unwrap();
        assert_eq!(
            config_file_from(&inner),
            Some(root.path().join("a/burn.toml"))
        );
        std::fs::write(inner.join("cubecl.toml"), "").unwrap();
        assert_eq!(config_file_from(&inner), Some(inner.join("cubecl.toml")));
    }
}
