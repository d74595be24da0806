//! Finding the GPU libraries that cudarc opens at run time, by the names machines ship.
//!
//! Note [CUDA library names]: cudarc 0.19 (built for CUDA 12) opens NCCL as `libnccl.so`,
//! `libnccl.so.12`, ..., `libnccl.so.1` and NVRTC as `libnvrtc.so`, `libnvrtc.so.12`, ...
//! (`cudarc::get_lib_name_candidates`), one `dlopen` each, with no way to hand it a path. But
//! NCCL's soname is `libnccl.so.2` (the only name pip's `nvidia-nccl-cu12/13` and Debian's
//! `libnccl2` ship) and CUDA 13 ships `libnvrtc.so.13` (and `libcublasLt.so.13`, which
//! `model.gemm = "cublaslt"` opens): on the lent H200 neither loaded. So before CUDA is used,
//! each library is looked for in this order: the override variable (`EMBER_NCCL_LIBRARY`,
//! `EMBER_NVRTC_LIBRARY`, `EMBER_CUBLASLT_LIBRARY`: a file); cudarc's own names through the
//! system's search (`LD_LIBRARY_PATH`, `ld.so.cache`); the names the library ships under
//! (`libnccl.so.2`; `libnvrtc.so.13`, `.12`; `libcublasLt.so.13`, `.12`) through the same search; then those names in the
//! folders such libraries live in (beside the binary, the active Python environment's
//! `site-packages/nvidia/*/lib`, `$CUDA_HOME`, `/usr/local/cuda`). A library found only under
//! another name is given cudarc's first name by a symbolic link in a folder of ember's cache,
//! and the process starts itself again (`exec`, same process id, same arguments) with that
//! folder and the library's own folder first on `LD_LIBRARY_PATH`: the loader reads
//! `LD_LIBRARY_PATH` once, at process start. A library found nowhere is a one-line error that
//! lists every name and folder tried.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

/// One library cudarc opens.
#[derive(Debug, Clone)]
pub struct Library {
    /// What it is, for messages ("NCCL").
    pub what: &'static str,
    /// The names cudarc tries, in its order.
    pub cudarc_names: Vec<String>,
    /// The names the library ships under, newest first.
    pub shipped_names: &'static [&'static str],
    /// The variable that names the file directly.
    pub override_var: Option<&'static str>,
    /// Sub-folders of `site-packages/nvidia/` whose `lib/` may hold it (pip's wheels).
    pub pip_packages: &'static [&'static str],
    /// Needed only by a setting (`model.gemm`), which checks for it itself: not finding it is
    /// no error at start.
    pub optional: bool,
}

impl Library {
    /// NCCL (`nvidia-nccl-cu12/13`; Debian's `libnccl2`).
    pub fn nccl(cudarc_names: Vec<String>) -> Self {
        Self {
            what: "NCCL",
            cudarc_names,
            shipped_names: &["libnccl.so.2"],
            override_var: Some("EMBER_NCCL_LIBRARY"),
            pip_packages: &["nccl"],
            optional: false,
        }
    }

    /// NVRTC, which CubeCL compiles its kernels with (`nvidia-cuda-nvrtc`, the CUDA toolkit),
    /// no newer than the driver's CUDA major version `driver_major` (a driver refuses the code
    /// of a newer NVRTC; unknown: any).
    pub fn nvrtc(cudarc_names: Vec<String>, driver_major: Option<u32>) -> Self {
        let cuda_13 = driver_major.is_none_or(|major| major >= 13);
        Self {
            what: "NVRTC",
            cudarc_names,
            shipped_names: if cuda_13 {
                &["libnvrtc.so.13", "libnvrtc.so.12"]
            } else {
                &["libnvrtc.so.12"]
            },
            override_var: Some("EMBER_NVRTC_LIBRARY"),
            pip_packages: if cuda_13 {
                &["cu13", "cuda_nvrtc", "cu12"]
            } else {
                &["cuda_nvrtc", "cu12"]
            },
            optional: false,
        }
    }

    /// NVIDIA's cuBLASLt, for `model.gemm = "cublaslt"` (pip's `nvidia-cublas` for CUDA 13,
    /// `nvidia-cublas-cu12`; the CUDA toolkit), no newer than the driver's CUDA major version
    /// `driver_major` (unknown: any). Optional: other GEMMs do not need it.
    pub fn cublaslt(cudarc_names: Vec<String>, driver_major: Option<u32>) -> Self {
        let cuda_13 = driver_major.is_none_or(|major| major >= 13);
        Self {
            what: "cuBLASLt",
            cudarc_names,
            shipped_names: if cuda_13 {
                &["libcublasLt.so.13", "libcublasLt.so.12"]
            } else {
                &["libcublasLt.so.12"]
            },
            override_var: Some("EMBER_CUBLASLT_LIBRARY"),
            pip_packages: if cuda_13 {
                &["cu13", "cublas", "cu12"]
            } else {
                &["cublas", "cu12"]
            },
            optional: true,
        }
    }

    /// The NVIDIA driver's `libcuda` (installed with the driver, never by pip).
    pub fn driver(cudarc_names: Vec<String>) -> Self {
        Self {
            what: "the NVIDIA driver (libcuda)",
            cudarc_names,
            shipped_names: &["libcuda.so.1"],
            override_var: None,
            pip_packages: &[],
            optional: false,
        }
    }
}

/// Where a library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Located {
    /// Under a name cudarc tries: nothing to do.
    Loadable,
    /// Only at this file, under a name cudarc does not try: it needs a link.
    At(PathBuf),
}

/// `dlopen` flags (glibc's `dlfcn.h`).
const RTLD_LAZY: c_int = 1;
/// `dlinfo` request for the library's `struct link_map`.
const RTLD_DI_LINKMAP: c_int = 2;

unsafe extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlclose(handle: *mut c_void) -> c_int;
    fn dlinfo(handle: *mut c_void, request: c_int, info: *mut c_void) -> c_int;
}

/// The first two fields of glibc's `struct link_map` (the rest is not read).
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
}

/// Whether `name` opens through the system's search (a bare name) or as a file (a path), and
/// the file it opened.
fn opens(name: &str) -> Option<PathBuf> {
    let c_name = CString::new(name).ok()?;
    // SAFETY: a NUL-terminated name; the handle is closed before returning. A library's
    // constructors run, as they would when cudarc opens it.
    unsafe {
        let handle = dlopen(c_name.as_ptr(), RTLD_LAZY);
        if handle.is_null() {
            return None;
        }
        let mut map: *const LinkMap = std::ptr::null();
        let path = if dlinfo(handle, RTLD_DI_LINKMAP, (&raw mut map).cast()) == 0
            && !map.is_null()
            && !(*map).l_name.is_null()
        {
            let path = CStr::from_ptr((*map).l_name).to_string_lossy().into_owned();
            (!path.is_empty()).then(|| PathBuf::from(path))
        } else {
            None
        };
        dlclose(handle);
        Some(path.unwrap_or_else(|| PathBuf::from(name)))
    }
}

/// The folders searched after the system's own search: beside the binary (`exe_dir`, its
/// `lib/` and `../lib/`), the `site-packages/nvidia/<package>/lib` of the Python environments
/// in use (`VIRTUAL_ENV`, `CONDA_PREFIX`, and each environment whose `bin/` is on `PATH`:
/// where pip's PyTorch put its NCCL and NVRTC), `$CONDA_PREFIX/lib`, `$CUDA_HOME`/`$CUDA_PATH`'s
/// `lib64` and `lib`, and `/usr/local/cuda/lib64`.
pub fn search_folders(
    library: &Library,
    var: &dyn Fn(&str) -> Option<String>,
    exe_dir: Option<&Path>,
) -> Vec<PathBuf> {
    let mut folders = Vec::new();
    if let Some(dir) = exe_dir {
        folders.extend([dir.to_path_buf(), dir.join("lib"), dir.join("../lib")]);
    }
    let mut environments: Vec<(PathBuf, bool)> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|env| var(env).map(|prefix| (PathBuf::from(prefix), *env == "CONDA_PREFIX")))
        .collect();
    for dir in std::env::split_paths(&var("PATH").unwrap_or_default()) {
        if dir.file_name().is_some_and(|n| n == "bin")
            && let Some(prefix) = dir.parent()
            && !environments.iter().any(|(p, _)| p == prefix)
        {
            environments.push((prefix.to_path_buf(), false));
        }
    }
    for (prefix, conda) in environments {
        let lib = prefix.join("lib");
        // site-packages of every Python version of the environment.
        let mut pythons: Vec<PathBuf> = std::fs::read_dir(&lib)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
            })
            .collect();
        pythons.sort();
        // Only the Python installations that hold pip's NVIDIA packages (below): every `bin/`
        // on PATH is a prefix, and most have none.
        // (Debian's and Ubuntu's system Pythons install into dist-packages.)
        for python in pythons {
            for packages in ["site-packages/nvidia", "dist-packages/nvidia"] {
                if !python.join(packages).is_dir() {
                    continue;
                }
                for package in library.pip_packages {
                    folders.push(python.join(packages).join(package).join("lib"));
                }
            }
        }
        if conda {
            folders.push(lib);
        }
    }
    for env in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = var(env) {
            folders.extend([Path::new(&root).join("lib64"), Path::new(&root).join("lib")]);
        }
    }
    folders.push(PathBuf::from("/usr/local/cuda/lib64"));
    folders.dedup();
    folders
}

/// Finds `library` (Note [CUDA library names]), the process environment read through `var`.
///
/// # Errors
/// One line naming the library, every name and folder tried, and the override variable; or
/// the override variable and its value when that file does not open.
pub fn locate(
    library: &Library,
    var: &dyn Fn(&str) -> Option<String>,
    exe_dir: Option<&Path>,
) -> Result<Located, String> {
    // The file cudarc would open now, if any.
    let cudarc_opens = library
        .cudarc_names
        .iter()
        .find_map(|n| opens(n))
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p));
    if let Some(name) = library.override_var
        && let Some(path) = var(name).filter(|p| !p.is_empty())
    {
        let file = PathBuf::from(&path);
        return match opens(file.to_str().unwrap_or_default()) {
            Some(_) if file.is_file() => {
                let file = std::fs::canonicalize(&file).unwrap_or(file);
                // Already what cudarc opens (after the links were made): nothing to do.
                if cudarc_opens.as_ref() == Some(&file) {
                    Ok(Located::Loadable)
                } else {
                    Ok(Located::At(file))
                }
            }
            _ => Err(format!(
                "{name}={path:?}: no {} library there that opens (a file such as {})",
                library.what,
                library.shipped_names.join(" or ")
            )),
        };
    }
    if cudarc_opens.is_some() {
        return Ok(Located::Loadable);
    }
    for name in library.shipped_names {
        if let Some(path) = opens(name).filter(|p| p.is_absolute()) {
            return Ok(Located::At(path));
        }
    }
    let folders = search_folders(library, var, exe_dir);
    for folder in &folders {
        for name in library.shipped_names {
            let file = folder.join(name);
            if file.is_file() && opens(file.to_str().unwrap_or_default()).is_some() {
                return Ok(Located::At(std::fs::canonicalize(&file).unwrap_or(file)));
            }
        }
    }
    let mut names: Vec<&str> = Vec::new();
    for name in library
        .cudarc_names
        .iter()
        .map(String::as_str)
        .chain(library.shipped_names.iter().copied())
    {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let folders: Vec<String> = folders.iter().map(|f| f.display().to_string()).collect();
    let hint = match library.override_var {
        Some(name) => format!("; set {name} to the library file"),
        None => String::new(),
    };
    Err(format!(
        "{} not found: tried {} through LD_LIBRARY_PATH ({}) and the system's library cache, \
         then {} in {}{hint}",
        library.what,
        names.join(", "),
        var("LD_LIBRARY_PATH").unwrap_or_default(),
        library.shipped_names.join(", "),
        folders.join(", ")
    ))
}

/// A folder of `cache` holding a symbolic link `name → target` for each pair, made once per
/// set of links (its name is a hash of them) through a temporary folder and a rename.
///
/// # Errors
/// The I/O error, naming the folder.
pub fn link_folder(links: &[(String, PathBuf)], cache: &Path) -> Result<PathBuf, String> {
    let key: String = links
        .iter()
        .map(|(name, target)| format!("{name}={}\n", target.display()))
        .collect();
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let parent = cache.join("cuda-links");
    let folder = parent.join(format!("{hash:016x}"));
    if folder.is_dir() {
        return Ok(folder);
    }
    let error = |e: std::io::Error| format!("{}: {e}", parent.display());
    std::fs::create_dir_all(&parent).map_err(error)?;
    let temp = tempfile::Builder::new()
        .prefix(".links")
        .tempdir_in(&parent)
        .map_err(error)?;
    for (name, target) in links {
        std::os::unix::fs::symlink(target, temp.path().join(name)).map_err(error)?;
    }
    match std::fs::rename(temp.path(), &folder) {
        Ok(()) => {
            // Renamed away: nothing left for the guard to remove.
            let _ = temp.keep();
            Ok(folder)
        }
        // Another process made the same folder first.
        Err(_) if folder.is_dir() => Ok(folder),
        Err(e) => Err(error(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library every glibc system has, standing in for a GPU library: libz, shipped as
    /// `libz.so.1`, which a cudarc-like search for `libz_cudarc.so` misses.
    fn zlib() -> Library {
        Library {
            what: "zlib",
            cudarc_names: vec!["libz_cudarc.so".into(), "libz_cudarc.so.12".into()],
            shipped_names: &["libz.so.1"],
            override_var: Some("EMBER_TEST_ZLIB"),
            pip_packages: &["zlib"],
            optional: false,
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn a_library_under_its_shipped_name_is_found_by_path() {
        let Ok(Located::At(path)) = locate(&zlib(), &no_env, None) else {
            panic!("libz.so.1 is on every glibc system");
        };
        assert!(path.is_absolute() && path.is_file(), "{}", path.display());
        // Under a name the search tries first, nothing needs doing.
        let mut direct = zlib();
        direct.cudarc_names.push("libz.so.1".into());
        assert_eq!(locate(&direct, &no_env, None), Ok(Located::Loadable));
    }

    #[test]
    fn folders_beside_the_binary_and_in_python_environments_are_searched() {
        let Ok(Located::At(real)) = locate(&zlib(), &no_env, None) else {
            panic!("libz.so.1 is on every glibc system");
        };
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv");
        let lib = venv.join("lib/python3.12/site-packages/nvidia/zlib/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::copy(&real, lib.join("libz_pip.so.7")).unwrap();
        let mut pip = zlib();
        pip.shipped_names = &["libz_pip.so.7"];
        let found = Ok(Located::At(
            std::fs::canonicalize(lib.join("libz_pip.so.7")).unwrap(),
        ));
        let env = |name: &str| (name == "VIRTUAL_ENV").then(|| venv.display().to_string());
        assert_eq!(locate(&pip, &env, None), found);
        // An environment whose bin/ is on PATH (activated, or put there by hand).
        let path = |name: &str| {
            (name == "PATH").then(|| format!("/usr/bin:{}", venv.join("bin").display()))
        };
        assert_eq!(locate(&pip, &path, None), found);
        let beside = dir.path().join("bin");
        std::fs::create_dir_all(beside.join("lib")).unwrap();
        std::fs::copy(&real, beside.join("lib/libz_pip.so.7")).unwrap();
        assert_eq!(
            locate(&pip, &no_env, Some(&beside)),
            Ok(Located::At(
                std::fs::canonicalize(beside.join("lib/libz_pip.so.7")).unwrap()
            ))
        );
        // The override names the file; a file that does not open is an error naming it.
        let by_var = |name: &str| {
            (name == "EMBER_TEST_ZLIB")
                .then(|| beside.join("lib/libz_pip.so.7").display().to_string())
        };
        assert!(matches!(locate(&pip, &by_var, None), Ok(Located::At(_))));
        let bad = |name: &str| (name == "EMBER_TEST_ZLIB").then(|| "/no/such/libz.so".to_string());
        let e = locate(&pip, &bad, None).unwrap_err();
        assert!(
            e.contains("EMBER_TEST_ZLIB") && e.contains("/no/such/libz.so"),
            "{e}"
        );
    }

    #[test]
    fn cublaslt_is_looked_for_in_pips_wheels_no_newer_than_the_driver() {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv");
        std::fs::create_dir_all(venv.join("lib/python3.12/site-packages/nvidia")).unwrap();
        let env = |name: &str| (name == "VIRTUAL_ENV").then(|| venv.display().to_string());
        let nvidia = venv.join("lib/python3.12/site-packages/nvidia");
        let cuda_13 = Library::cublaslt(vec!["libcublasLt.so".into()], Some(13));
        assert!(cuda_13.optional);
        assert_eq!(
            cuda_13.shipped_names,
            &["libcublasLt.so.13", "libcublasLt.so.12"]
        );
        let folders = search_folders(&cuda_13, &env, None);
        // CUDA 13's `nvidia-cublas` installs into nvidia/cu13/lib, CUDA 12's into cublas/lib.
        for package in ["cu13", "cublas"] {
            assert!(
                folders.contains(&nvidia.join(package).join("lib")),
                "{package}: {folders:?}"
            );
        }
        let cuda_12 = Library::cublaslt(vec!["libcublasLt.so".into()], Some(12));
        assert_eq!(cuda_12.shipped_names, &["libcublasLt.so.12"]);
        assert!(!search_folders(&cuda_12, &env, None).contains(&nvidia.join("cu13/lib")));
        let e = locate(&cuda_12, &no_env, None).unwrap_err();
        assert!(
            e.contains("cuBLASLt") && e.contains("EMBER_CUBLASLT_LIBRARY"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_library_lists_every_name_and_folder_tried() {
        let mut missing = zlib();
        missing.shipped_names = &["libnothing_here.so.2"];
        let env = |name: &str| (name == "CUDA_HOME").then(|| "/opt/cuda-x".to_string());
        let e = locate(&missing, &env, Some(Path::new("/opt/ember/bin"))).unwrap_err();
        for part in [
            "zlib not found",
            "libz_cudarc.so, libz_cudarc.so.12, libnothing_here.so.2",
            "/opt/ember/bin/lib",
            "/opt/cuda-x/lib64",
            "/usr/local/cuda/lib64",
            "set EMBER_TEST_ZLIB",
        ] {
            assert!(e.contains(part), "{part:?} in {e}");
        }
        assert!(!e.contains('\n'));
    }

    #[test]
    fn link_folders_are_made_once_and_open_under_the_new_name() {
        let Ok(Located::At(real)) = locate(&zlib(), &no_env, None) else {
            panic!("libz.so.1 is on every glibc system");
        };
        let cache = tempfile::tempdir().unwrap();
        let links = vec![("libz_cudarc.so".to_string(), real.clone())];
        let folder = link_folder(&links, cache.path()).unwrap();
        let link = folder.join("libz_cudarc.so");
        assert_eq!(std::fs::read_link(&link).unwrap(), real);
        assert!(opens(link.to_str().unwrap()).is_some());
        assert_eq!(link_folder(&links, cache.path()).unwrap(), folder);
        assert_eq!(
            std::fs::read_dir(cache.path().join("cuda-links"))
                .unwrap()
                .count(),
            1
        );
    }
}
