//! The GEMM library behind NdArray on the CPU, and its threads.
//!
//! With the `openblas` feature (on by default in `xtask` and the tests), Burn's NdArray backend
//! multiplies through the system OpenBLAS (Debian: `libopenblas-dev`, 0.3.21 on bookworm)
//! instead of the matrixmultiply crate: 1.4–1.5× the training step of BERT on 2 cores
//! (README, "CPU performance"). OpenBLAS runs each GEMM on its own thread pool, which is
//! right for one rank per machine and wrong for several ranks sharing the cores: 4 in-process
//! ranks on 2 cores trained at 1,552 tokens/s with 2 OpenBLAS threads per GEMM and 2,849 with 1
//! (matrixmultiply: 2,190). [`share_cores`] gives each local rank its share of the cores; a
//! user's `OPENBLAS_NUM_THREADS` is left as set.
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

/// Gives each of `local_ranks` ranks of this machine its share of the cores for its GEMMs:
/// `max(1, cores / local_ranks)` OpenBLAS threads, unless `OPENBLAS_NUM_THREADS` is set. Returns
/// the threads each GEMM now uses (`None` without the `openblas` feature: matrixmultiply runs
/// on rayon's pool, shared by the ranks).
pub fn share_cores(local_ranks: usize) -> Option<usize> {
    #[cfg(feature = "openblas")]
    {
        if std::env::var_os("OPENBLAS_NUM_THREADS").is_none() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let threads = (cores / local_ranks.max(1)).max(1);
            // SAFETY: plain C calls without pointers; OpenBLAS applies the count to later calls.
            unsafe { ffi::openblas_set_num_threads(threads as std::ffi::c_int) };
        }
        tracing::info!(gemm = %describe(), local_ranks, "CPU GEMM");
        // SAFETY: as above.
        Some(unsafe { ffi::openblas_get_num_threads() }.max(1) as usize)
    }
    #[cfg(not(feature = "openblas"))]
    {
        let _ = local_ranks;
        None
    }
}

/// The GEMM library, its kernels and threads, for the start-up log: e.g. `OpenBLAS 0.3.21
/// (SkylakeX kernels, 2 threads)` or `matrixmultiply (rayon threads)`.
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
        format!(
            "OpenBLAS {version} ({} kernels, {} threads)",
            text(unsafe { ffi::openblas_get_corename() }),
            unsafe { ffi::openblas_get_num_threads() }
        )
    }
    #[cfg(not(feature = "openblas"))]
    {
        "matrixmultiply (rayon threads)".to_string()
    }
}

#[cfg(all(test, feature = "openblas"))]
mod tests {
    /// The thread count is applied, and the description names OpenBLAS and that count.
    #[test]
    fn share_cores_sets_openblas_threads() {
        if std::env::var_os("OPENBLAS_NUM_THREADS").is_some() {
            return; // the user's setting wins, by design
        }
        assert_eq!(super::share_cores(usize::MAX), Some(1));
        assert!(
            super::describe().starts_with("OpenBLAS "),
            "{}",
            super::describe()
        );
        assert!(
            super::describe().ends_with(" 1 threads)"),
            "{}",
            super::describe()
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(super::share_cores(1), Some(cores));
    }
}
