//! Shared helpers of the workspace tests: fixture paths and golden-file reading.

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};

/// `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A tensor of a golden file, converted to f64, with its shape.
#[derive(Debug, Clone)]
pub struct Golden {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
}

impl Golden {
    /// The values as i64 (for integer inputs).
    pub fn ints(&self) -> Vec<i64> {
        self.values.iter().map(|&v| v as i64).collect()
    }
}

/// Reads every tensor of a safetensors file written by a fixture script (f32 or i64).
pub fn read_goldens(path: &std::path::Path) -> std::collections::HashMap<String, Golden> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = SafeTensors::deserialize(&bytes).expect("a safetensors golden file");
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect(),
                Dtype::I64 => data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            (
                name,
                Golden {
                    shape: view.shape().to_vec(),
                    values,
                },
            )
        })
        .collect()
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Largest absolute value of a slice.
pub fn max_abs(a: &[f64]) -> f64 {
    a.iter().map(|x| x.abs()).fold(0.0, f64::max)
}

/// Every tensor of a safetensors file as f64 values, by name.
pub fn read_safetensors(path: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f64>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.names()
        .into_iter()
        .map(|name| {
            let values = file
                .tensor(name)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
                .collect();
            (name.to_string(), values)
        })
        .collect()
}

/// Asserts that two checkpoints hold the same tensors, each within `tol · max(1, max|a|)`
/// (weights are O(0.02..1), so this is an absolute bound for most). Returns the largest
/// difference seen.
pub fn assert_same_weights(a: &std::path::Path, b: &std::path::Path, tol: f64) -> f64 {
    let (x, y) = (read_safetensors(a), read_safetensors(b));
    assert_eq!(
        x.keys().collect::<Vec<_>>(),
        y.keys().collect::<Vec<_>>(),
        "the same tensors"
    );
    let mut worst = 0f64;
    let mut failures = Vec::new();
    for (name, values) in &x {
        let diff = max_abs_diff(values, &y[name]);
        let bound = tol * max_abs(values).max(1.0);
        if diff > bound {
            failures.push(format!("{name}: differ by {diff:e} (bound {bound:e})"));
        }
        worst = worst.max(diff);
    }
    failures.sort();
    assert!(
        failures.is_empty(),
        "{} and {} differ in {} of {} tensors:\n{}",
        a.display(),
        b.display(),
        failures.len(),
        x.len(),
        failures.join("\n")
    );
    worst
}

/// The training configuration of the data-parallel tests: the tiny model without dropout, 3
/// steps of sequences of at most 64 tokens, every step logged, output in `out`.
/// `max_predictions_per_seq = 1` gives every sample exactly one masked token, so each rank's
/// mean loss weighs its samples as the whole batch's mean does: the per-rank means then average
/// to the global mean exactly, and N ranks can equal one rank with the whole batch.
pub fn data_parallel_config(out: &std::path::Path) -> ember_trainer::TrainConfig {
    let mut config = ember_trainer::TrainConfig::default();
    config.model.hidden_dropout_prob = Some(0.0);
    config.model.attention_probs_dropout_prob = Some(0.0);
    config.instances.max_seq_length = 64;
    config.instances.max_predictions_per_seq = 1;
    config.instances.dupe_factor = 1;
    config.train.steps = 3;
    config.train.eval_every = Some(3);
    config.train.eval_samples = 16;
    config.train.log_every = 1;
    config.train.out = out.to_path_buf();
    config
}

/// [`data_parallel_config`] with what an equivalence test must keep on when the runs it
/// compares need not be exact splits of one batch: the presets' dropout (0.1) and up to 8
/// masked positions per sample.
pub fn dropout_and_masks_config(out: &std::path::Path) -> ember_trainer::TrainConfig {
    let mut config = data_parallel_config(out);
    config.model.hidden_dropout_prob = Some(0.1);
    config.model.attention_probs_dropout_prob = Some(0.1);
    config.instances.max_predictions_per_seq = 8;
    config
}

/// Starts the test binary again with `OPENBLAS_CORETYPE` set when OpenBLAS chose kernels
/// below this CPU's vector units (`ember_trainer::blas::better_openblas_core`; ember's own
/// binary does the same in `cli_main`). Called before `main` by
/// [`openblas_kernels_of_this_cpu!`], with the C runtime's `argc` and `argv`.
///
/// # Safety
/// `argv` holds `argc` valid NUL-terminated strings (glibc's arguments to `.init_array`
/// functions).
#[doc(hidden)]
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub unsafe fn restart_with_this_cpus_openblas_kernels(
    argc: std::ffi::c_int,
    argv: *const *const std::ffi::c_char,
) {
    use std::os::unix::ffi::OsStringExt;
    let Some((_, core)) = ember_trainer::blas::openblas_core_to_force() else {
        return;
    };
    if argv.is_null() {
        return;
    }
    let args = (0..argc.max(0) as usize)
        .map(|i| {
            // SAFETY: the caller's contract.
            let arg = unsafe { std::ffi::CStr::from_ptr(*argv.add(i)) };
            std::ffi::OsString::from_vec(arg.to_bytes().to_vec())
        })
        .collect();
    // Returns only when the restart failed: the tests then run on OpenBLAS's own choice.
    let error = ember_trainer::blas::restart_with_openblas_core(core, args);
    eprintln!("could not start again with OPENBLAS_CORETYPE={core}: {error}");
}

/// Declares, in a test binary, a constructor that runs before the test harness's `main`: it
/// starts the binary again with this CPU's OpenBLAS kernels where OpenBLAS chose slower ones
/// ([`restart_with_this_cpus_openblas_kernels`]). OpenBLAS picks its kernels when it is
/// loaded, before any test runs, so nothing later can change them; a harness-run test binary
/// has no `main` of its own, hence the constructor (glibc passes `argc`, `argv` and `envp` to
/// `.init_array` functions). The CPU tests took half the time on a Sapphire Rapids Xeon, where
/// Debian's OpenBLAS 0.3.21 runs its SSE3 kernels (docs/testing.md).
#[macro_export]
macro_rules! openblas_kernels_of_this_cpu {
    () => {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        #[used]
        #[unsafe(link_section = ".init_array")]
        static OPENBLAS_KERNELS_OF_THIS_CPU: unsafe extern "C" fn(
            std::ffi::c_int,
            *const *const std::ffi::c_char,
            *const *const std::ffi::c_char,
        ) = {
            unsafe extern "C" fn restart(
                argc: std::ffi::c_int,
                argv: *const *const std::ffi::c_char,
                _envp: *const *const std::ffi::c_char,
            ) {
                // SAFETY: glibc calls `.init_array` functions with the program's arguments.
                unsafe { $crate::restart_with_this_cpus_openblas_kernels(argc, argv) }
            }
            restart
        };
    };
}

/// mimalloc, for [`ember_binarys_allocator!`].
#[doc(hidden)]
pub use mimalloc;

/// Keeps the memory mimalloc frees in the process (its `purge_delay` option at −1), unless
/// `MIMALLOC_PURGE_DELAY` says otherwise: what `ember`'s binary does at start-up
/// (`keep_freed_memory` in xtask/src/lib.rs). Called before `main` by
/// [`ember_binarys_allocator!`].
#[doc(hidden)]
pub fn keep_memory_that_mimalloc_frees() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain C call without pointers.
        unsafe { mimalloc_api::mi_option_set(mimalloc_api::PURGE_DELAY, -1) };
    }
}

/// The parts of mimalloc's C API (mimalloc.h) the test binaries use; the library is linked
/// through the `mimalloc` crate.
mod mimalloc_api {
    use std::ffi::{c_int, c_long, c_void};

    /// `mi_option_purge_delay`.
    pub const PURGE_DELAY: c_int = 15;

    unsafe extern "C" {
        pub fn mi_option_set(option: c_int, value: c_long);
        pub fn mi_option_get(option: c_int) -> c_long;
        pub fn mi_is_in_heap_region(p: *const c_void) -> bool;
    }
}

/// Asserts that this process allocates with mimalloc and keeps the memory it frees, as
/// [`ember_binarys_allocator!`] arranges (unless `MIMALLOC_PURGE_DELAY` asks otherwise).
pub fn assert_ember_binarys_allocator() {
    let probe = Box::new([0u64; 64]);
    // SAFETY: plain C calls; the pointer is only compared with mimalloc's regions.
    let (ours, purge_delay) = unsafe {
        (
            mimalloc_api::mi_is_in_heap_region(probe.as_ptr().cast()),
            mimalloc_api::mi_option_get(mimalloc_api::PURGE_DELAY),
        )
    };
    assert!(ours, "a Box was not allocated by mimalloc");
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        assert_eq!(
            purge_delay, -1,
            "mimalloc returns freed memory after {purge_delay} ms"
        );
    }
}

/// Declares, in a test binary, the allocator of `ember`'s binary (xtask/src/lib.rs): mimalloc,
/// keeping freed pages ([`keep_memory_that_mimalloc_frees`], from a constructor that runs
/// before the harness). With the system allocator a training step's large buffers (a tiny
/// BERT's 17.6 MB of parameters, gradients and 1-bit momenta, copied several times a step) are
/// fresh pages every step, each page faulted and zeroed by the kernel: the tests would time a
/// slower trainer than the one users run (docs/testing.md).
#[macro_export]
macro_rules! ember_binarys_allocator {
    () => {
        #[global_allocator]
        static EMBER_BINARYS_ALLOCATOR: $crate::mimalloc::MiMalloc = $crate::mimalloc::MiMalloc;

        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        #[used]
        #[unsafe(link_section = ".init_array")]
        static KEEP_MEMORY_THAT_MIMALLOC_FREES: extern "C" fn() = {
            extern "C" fn keep() {
                $crate::keep_memory_that_mimalloc_frees()
            }
            keep
        };
    };
}

/// Asserts that this process runs OpenBLAS's kernels for this CPU (AVX2 and up where the CPU
/// has them), as [`openblas_kernels_of_this_cpu!`] arranges; nothing to check when
/// `OPENBLAS_CORETYPE` asks for slower kernels (the user's choice) or without OpenBLAS.
pub fn assert_this_cpus_openblas_kernels() {
    use ember_trainer::blas::SimdLevel;
    let Some(name) = ember_trainer::blas::openblas_kernels() else {
        return; // matrixmultiply: no OpenBLAS kernels to choose
    };
    if let Ok(user) = std::env::var("OPENBLAS_CORETYPE") {
        if SimdLevel::of_openblas_core(&user).is_none_or(|level| level < SimdLevel::Avx2) {
            return;
        }
    }
    let cpu = SimdLevel::of_this_cpu();
    if let Some(level) = SimdLevel::of_openblas_core(&name) {
        assert!(
            level >= cpu.min(SimdLevel::Avx2),
            "OpenBLAS's {name} kernels ({level}) on a CPU with {cpu}"
        );
    }
}
