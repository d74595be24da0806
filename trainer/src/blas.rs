//! The GEMM library behind NdArray on the CPU, and its threads.
//!
//! With the `openblas` feature (on by default in `xtask` and the tests), Burn's NdArray backend
//! multiplies through the system OpenBLAS (Debian: `libopenblas-dev`, 0.3.21 on bookworm)
//! instead of the matrixmultiply crate: 1.4–1.5× the training step of BERT on 2 cores
//! (docs/performance.md, "CPU performance"). Each rank's GEMMs get its share of the cores ([`share_cores`]):
//! 4 in-process ranks on 2 cores trained at 1,552 tokens/s with 2 OpenBLAS threads per GEMM and
//! 2,849 with 1 (matrixmultiply: 2,190). Whose threads run them is [`GemmThreads`]: by default
//! rayon's, the pool that runs the fused ops, each GEMM split into parts that are single-threaded
//! OpenBLAS calls (`ember_backend_ext::set_gemm_parts`); OpenBLAS's own pool spins on the cores
//! for ~0.1 s after each GEMM, which on 2 cores took turns with rayon's threads all step long
//! (docs/performance.md, "CPU performance").
//!
//! OpenBLAS picks its kernels from the CPU it detects at start-up; some builds misdetect newer
//! x86 CPUs and fall back to SSE3 kernels at a quarter of the speed. [`describe`] names the
//! kernels in use so that the start-up log shows them; `OPENBLAS_CORETYPE=SkylakeX` (or
//! `Haswell` on AVX2-only CPUs) forces the right ones.

#[cfg(feature = "openblas")]
mod ffi {
    use std::ffi::{c_char, c_int};

    // OpenBLAS's own C API (cblas.h), in the library burn-ndarray links for its GEMM.
    unsafe extern "C" {
        pub fn openblas_set_num_threads(num_threads: c_int);
        pub fn openblas_get_num_threads() -> c_int;
        pub fn openblas_get_corename() -> *const c_char;
        pub fn openblas_get_config() -> *const c_char;
    }
}

/// Which threads run NdArray's dense-layer GEMMs on the CPU (`model.gemm_threads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmThreads {
    /// Rayon's pool, which also runs the fused ops: each GEMM split into one part per core of
    /// this rank (`ember_backend_ext::set_gemm_parts`), each part one single-threaded OpenBLAS
    /// call; one pool, as PyTorch's intra-op pool runs MKL and its own ops. The default.
    #[default]
    Rayon,
    /// OpenBLAS's own threads: one call per GEMM, `cores / local ranks` threads (or
    /// `OPENBLAS_NUM_THREADS`), which spin on their core for ~0.1 s after each GEMM (ember
    /// before this setting existed).
    Blas,
}

impl std::str::FromStr for GemmThreads {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "rayon" => Ok(GemmThreads::Rayon),
            "blas" => Ok(GemmThreads::Blas),
            other => Err(format!(
                "unknown gemm_threads `{other}` (expected rayon or blas)"
            )),
        }
    }
}

impl std::fmt::Display for GemmThreads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GemmThreads::Rayon => "rayon",
            GemmThreads::Blas => "blas",
        })
    }
}

/// Gives each of `local_ranks` ranks of this machine its share of the cores for its GEMMs, as
/// `gemm_threads` says:
/// - [`GemmThreads::Rayon`]: OpenBLAS at one thread per call, each GEMM split into
///   `max(1, rayon threads / local_ranks)` parts on rayon's pool (`RAYON_NUM_THREADS` sets its
///   size; `OPENBLAS_NUM_THREADS` is not read);
/// - [`GemmThreads::Blas`]: `max(1, cores / local_ranks)` OpenBLAS threads, or
///   `OPENBLAS_NUM_THREADS` when it is set, and GEMMs not split.
///
/// Returns the OpenBLAS threads of each call (`None` without the `openblas` feature:
/// matrixmultiply runs its own threads, and GEMMs are not split either way).
pub fn share_cores(local_ranks: usize, gemm_threads: GemmThreads) -> Option<usize> {
    let threads = set_gemm_threads(local_ranks, gemm_threads);
    tracing::info!(gemm = %describe(), local_ranks, "CPU GEMM");
    threads
}

/// [`share_cores`] without its log line (`bench train-step` switches between the settings).
pub fn set_gemm_threads(local_ranks: usize, gemm_threads: GemmThreads) -> Option<usize> {
    #[cfg(feature = "openblas")]
    {
        let local_ranks = local_ranks.max(1);
        let (blas_threads, parts) = match gemm_threads {
            GemmThreads::Rayon => (1, (rayon::current_num_threads() / local_ranks).max(1)),
            GemmThreads::Blas => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let user = std::env::var("OPENBLAS_NUM_THREADS")
                    .ok()
                    .and_then(|n| n.trim().parse::<usize>().ok());
                (user.unwrap_or(cores / local_ranks).max(1), 1)
            }
        };
        // SAFETY: plain C calls without pointers; OpenBLAS applies the count to later calls.
        unsafe { ffi::openblas_set_num_threads(blas_threads as std::ffi::c_int) };
        ember_backend_ext::set_gemm_parts(parts);
        // SAFETY: as above.
        Some(unsafe { ffi::openblas_get_num_threads() }.max(1) as usize)
    }
    #[cfg(not(feature = "openblas"))]
    {
        let _ = (local_ranks, gemm_threads);
        ember_backend_ext::set_gemm_parts(1);
        None
    }
}

/// The GEMM library, its kernels and threads, for the start-up log: e.g. `OpenBLAS 0.3.21
/// (Zen kernels, 1 thread per call, 2 parts on rayon's threads)`, `OpenBLAS 0.3.21 (SkylakeX
/// kernels, 2 threads)` or `matrixmultiply (its own threads)`.
pub fn describe() -> String {
    #[cfg(feature = "openblas")]
    {
        // SAFETY: OpenBLAS returns pointers to static NUL-terminated strings.
        let text = |p: *const std::ffi::c_char| {
            if p.is_null() {
                "?".to_string()
            } else {
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        };
        let config = text(unsafe { ffi::openblas_get_config() });
        let version = config.split_whitespace().nth(1).unwrap_or("?").to_string();
        let corename = text(unsafe { ffi::openblas_get_corename() });
        let threads = unsafe { ffi::openblas_get_num_threads() };
        match ember_backend_ext::gemm_parts() {
            1 => format!("OpenBLAS {version} ({corename} kernels, {threads} threads)"),
            parts => format!(
                "OpenBLAS {version} ({corename} kernels, {threads} thread per call, {parts} parts on rayon's threads)"
            ),
        }
    }
    #[cfg(not(feature = "openblas"))]
    {
        "matrixmultiply (its own threads)".to_string()
    }
}

#[cfg(all(test, feature = "openblas"))]
mod tests {
    use super::{GemmThreads, describe, share_cores};

    /// Blas: the thread count is applied and GEMMs are not split. Rayon: OpenBLAS at one thread
    /// per call and one part per rayon thread of each rank. The description names both.
    #[test]
    fn share_cores_sets_openblas_threads_and_gemm_parts() {
        let rayon_threads = rayon::current_num_threads();
        assert_eq!(share_cores(1, GemmThreads::Rayon), Some(1));
        assert_eq!(ember_backend_ext::gemm_parts(), rayon_threads);
        if rayon_threads > 1 {
            assert!(
                describe().ends_with(&format!(
                    "1 thread per call, {rayon_threads} parts on rayon's threads)"
                )),
                "{}",
                describe()
            );
        }
        assert_eq!(share_cores(usize::MAX, GemmThreads::Rayon), Some(1));
        assert_eq!(ember_backend_ext::gemm_parts(), 1);

        if std::env::var_os("OPENBLAS_NUM_THREADS").is_some() {
            return; // the user's setting wins in blas mode, by design
        }
        assert_eq!(share_cores(usize::MAX, GemmThreads::Blas), Some(1));
        assert_eq!(ember_backend_ext::gemm_parts(), 1);
        assert!(describe().starts_with("OpenBLAS "), "{}", describe());
        assert!(describe().ends_with(" 1 threads)"), "{}", describe());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(share_cores(1, GemmThreads::Blas), Some(cores));
        assert_eq!(ember_backend_ext::gemm_parts(), 1);
    }

    #[test]
    fn gemm_threads_parse_and_print() {
        for threads in [GemmThreads::Rayon, GemmThreads::Blas] {
            assert_eq!(threads.to_string().parse::<GemmThreads>(), Ok(threads));
        }
        let error = "openblas".parse::<GemmThreads>().unwrap_err();
        assert!(
            error.contains("`openblas`") && error.contains("rayon or blas"),
            "{error}"
        );
    }
}
