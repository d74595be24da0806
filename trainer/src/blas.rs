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
//! kernels in use so that the start-up log shows them; where they are below AVX2 on a CPU with
//! AVX2 or AVX-512, ember starts again with `OPENBLAS_CORETYPE=SkylakeX` (or `Haswell`)
//! ([`better_openblas_core`], [`restart_with_openblas_core`]).

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
        let corename = openblas_kernels().unwrap_or_else(|| "?".to_string());
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

/// The widest vector instructions a set of GEMM kernels uses, or a CPU offers; lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// SSE2–SSE4 (OpenBLAS's Prescott, Core2, Nehalem, … kernels).
    Sse,
    /// AVX (Sandybridge, Bulldozer, Piledriver, Steamroller).
    Avx,
    /// AVX2 with FMA (Haswell, Zen, Excavator).
    Avx2,
    /// AVX-512 F, CD, BW, DQ and VL (SkylakeX, Cooperlake, SapphireRapids).
    Avx512,
}

impl SimdLevel {
    /// The level of the OpenBLAS kernels named `corename` (what `openblas_get_corename`
    /// returns: the names of OpenBLAS's `driver/others/dynamic.c`, compared without case);
    /// `None` for a name not listed here (another architecture, or a core newer than this
    /// list).
    pub fn of_openblas_core(corename: &str) -> Option<SimdLevel> {
        Some(match corename.to_ascii_lowercase().as_str() {
            "skylakex" | "cooperlake" | "sapphirerapids" => SimdLevel::Avx512,
            "haswell" | "zen" | "excavator" => SimdLevel::Avx2,
            "sandybridge" | "bulldozer" | "piledriver" | "steamroller" => SimdLevel::Avx,
            "katmai" | "coppermine" | "northwood" | "prescott" | "banias" | "atom" | "core2"
            | "penryn" | "dunnington" | "nehalem" | "athlon" | "opteron" | "opteron(sse3)"
            | "barcelona" | "nano" | "bobcat" => SimdLevel::Sse,
            _ => return None,
        })
    }

    /// What this CPU offers, from its `cpuid` (what the OS enabled included); [`SimdLevel::Sse`]
    /// off x86-64.
    pub fn of_this_cpu() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f")
                && has!("avx512cd")
                && has!("avx512bw")
                && has!("avx512dq")
                && has!("avx512vl")
            {
                SimdLevel::Avx512
            } else if has!("avx2") && has!("fma") {
                SimdLevel::Avx2
            } else if has!("avx") {
                SimdLevel::Avx
            } else {
                SimdLevel::Sse
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Sse
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SimdLevel::Sse => "SSE",
            SimdLevel::Avx => "AVX",
            SimdLevel::Avx2 => "AVX2",
            SimdLevel::Avx512 => "AVX-512",
        })
    }
}

/// The `OPENBLAS_CORETYPE` that runs this CPU's GEMMs on its own vector units when OpenBLAS
/// chose kernels below AVX2 (`detected`) on a CPU with AVX2 or AVX-512 (`cpu`): `SkylakeX` or
/// `Haswell`; `None` otherwise (kernels of AVX2 and up are OpenBLAS's own choice, kept).
///
/// Why: OpenBLAS takes a CPU newer than its release for a generic x86-64 and falls back to its
/// SSE3 (Prescott) kernels. Debian bookworm's 0.3.21 does so on Sapphire Rapids Xeons: the
/// smoke recipe's 100 steps with 2 in-process ranks took 23 s there on Prescott's kernels, 15
/// on Haswell's and 12 on SkylakeX's (2 cores, docs/performance.md, "CPU performance").
pub fn better_openblas_core(detected: &str, cpu: SimdLevel) -> Option<&'static str> {
    let kernels = SimdLevel::of_openblas_core(detected)?;
    if kernels >= SimdLevel::Avx2 {
        return None;
    }
    match cpu {
        SimdLevel::Avx512 => Some("SkylakeX"),
        SimdLevel::Avx2 => Some("Haswell"),
        SimdLevel::Avx | SimdLevel::Sse => None,
    }
}

/// The kernels OpenBLAS chose in this process and the `OPENBLAS_CORETYPE` that would run
/// faster ones ([`better_openblas_core`]); `None` when `OPENBLAS_CORETYPE` is set (the user's
/// choice, `Prescott` included, is kept), when the choice is right, and without the
/// `openblas` feature.
pub fn openblas_core_to_force() -> Option<(String, &'static str)> {
    #[cfg(feature = "openblas")]
    {
        if std::env::var_os("OPENBLAS_CORETYPE").is_some() {
            return None;
        }
        let detected = openblas_kernels()?;
        better_openblas_core(&detected, SimdLevel::of_this_cpu()).map(|core| (detected, core))
    }
    #[cfg(not(feature = "openblas"))]
    None
}

/// The name of the kernels OpenBLAS runs in this process (`openblas_get_corename`:
/// `SkylakeX`, `Haswell`, `Prescott`, …); `None` without the `openblas` feature.
pub fn openblas_kernels() -> Option<String> {
    #[cfg(feature = "openblas")]
    {
        // SAFETY: OpenBLAS returns a pointer to a static NUL-terminated string.
        let name = unsafe { ffi::openblas_get_corename() };
        if name.is_null() {
            return None;
        }
        Some(
            unsafe { std::ffi::CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned(),
        )
    }
    #[cfg(not(feature = "openblas"))]
    None
}

/// Replaces this process by the same program with the same `args` (the first one `argv[0]`)
/// and `OPENBLAS_CORETYPE=core` added to its environment: OpenBLAS picks its kernels when it
/// is loaded, before any of ember's code runs, so the choice takes a new start. The process
/// keeps its id, standard streams and the rest of its environment.
///
/// # Errors
/// Only returns on failure: this binary could not be located or executed.
#[cfg(unix)]
pub fn restart_with_openblas_core(core: &str, args: Vec<std::ffi::OsString>) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return e,
    };
    let mut args = args.into_iter();
    let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
    std::process::Command::new(&exe)
        .arg0(arg0)
        .args(args)
        .env("OPENBLAS_CORETYPE", core)
        .exec()
}

#[cfg(all(test, feature = "openblas"))]
mod tests {
    use super::{GemmThreads, SimdLevel, better_openblas_core, describe, share_cores};

    /// Kernels below AVX2 on an AVX2 or AVX-512 CPU are replaced; the user's and OpenBLAS's
    /// own choice of AVX2 and up are kept, as are names not known here.
    #[test]
    fn openblas_fallback_kernels_are_replaced_by_this_cpus() {
        use SimdLevel::*;
        assert_eq!(better_openblas_core("Prescott", Avx512), Some("SkylakeX"));
        assert_eq!(better_openblas_core("prescott", Avx2), Some("Haswell"));
        assert_eq!(
            better_openblas_core("Sandybridge", Avx512),
            Some("SkylakeX")
        );
        assert_eq!(better_openblas_core("Opteron(SSE3)", Avx2), Some("Haswell"));
        for kept in [
            "Haswell",
            "Zen",
            "SkylakeX",
            "SapphireRapids",
            "NEOVERSEN1",
            "",
        ] {
            assert_eq!(better_openblas_core(kept, Avx512), None, "{kept}");
        }
        assert_eq!(better_openblas_core("Prescott", Avx), None);
        assert_eq!(better_openblas_core("Core2", Sse), None);
        assert!(Sse < Avx && Avx < Avx2 && Avx2 < Avx512);
    }

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
