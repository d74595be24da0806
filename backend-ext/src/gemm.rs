//! The `model.gemm` setting: which of CubeCL's matmuls runs the GEMMs of the dense layers and
//! the attention products on the GPU backends, and the precision those GEMMs give f32.
//!
//! Note [GPU GEMMs]: Burn 0.21's CUDA and wgpu backends multiply with cubek's matmul. Built
//! without Burn's `autotune` feature (as ember was until the GPU-speed issue), every product
//! runs one kernel family, `SimpleCyclicCmma` with its default tile sizes (cubek-matmul 0.2,
//! `Strategy::Auto`): on an H200 a BERT-large step reached ~23 TFLOP/s, bf16 no faster than
//! f32 (../docs/gpu.md). With `autotune` (backend-ext's feature of that name, on with `cuda`)
//! cubek times its candidates for each new shape on the device (the TMA, specialized and
//! double-buffered tensor-core kernels, the unit and GEMV kernels; Burn's `matmul_autotune`)
//! and keeps the fastest, recorded in CubeCL's autotune cache (`ember_trainer::kernel_cache`
//! puts it on disk), so only a process's first run of a shape pays for the search.
//!
//! Both stay selectable ([`Gemm`]), so a GPU run can measure one against the other
//! (`cargo xtask bench gemm`), and so does NVIDIA's cuBLASLt on CUDA ([`Gemm::Cublaslt`]:
//! what PyTorch's `torch.matmul` and `nn.Linear` call; `cube/cublaslt.rs`). CubeCL 0.10 runs
//! each thread's kernels on a CUDA stream it does not expose, so a cuBLASLt product waits on
//! the host for CubeCL's stream before it starts and for its own stream after it ends (Note
//! [cuBLASLt beside CubeCL] in `cube/cublaslt.rs`): two host synchronisations per GEMM (or
//! per pair of independent GEMMs), about 400 windows in a BERT-large step, which `bench gemm`
//! and `bench train-step` count in their times; or, with [`CublasltSync::Device`], flags in
//! GPU memory that keep the same order without a host wait (Note [Device-side GEMM windows]
//! in `cube/gemm_window.rs`).
//!
//! Precision: cubek's tensor-core kernels read f32 operands as TF32 (10 mantissa bits, unit
//! roundoff 2⁻¹¹; `adjust_dtypes` in cubek-matmul's blueprint.rs) wherever the device has
//! TF32, as PyTorch does with `torch.backends.cuda.matmul.allow_tf32 = True` (PyTorch's
//! default is exact f32 GEMMs). bf16 and f16 operands are multiplied exactly and accumulated
//! in f32 on every path. [`crate::FusedOps::f32_gemm_precision`] says which a device gives.

use std::sync::atomic::{AtomicU8, Ordering};

/// Which matmul runs the GEMMs on the GPU backends (`model.gemm`): one of CubeCL's, or
/// NVIDIA's cuBLASLt on CUDA. NdArray ignores it (its GEMMs are BLAS's or matrixmultiply's,
/// `linear.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Gemm {
    /// [`Gemm::Autotune`] where this build has it ([`AUTOTUNE_BUILT`]), else [`Gemm::Cmma`].
    #[default]
    Auto,
    /// cubek's autotuner picks the fastest of its kernels for each shape on the device
    /// (Burn's `MatmulStrategy::Autotune`); the choice is cached on disk.
    Autotune,
    /// One tensor-core kernel family for every shape (cubek's `SimpleCyclicCmma`, or its unit
    /// kernel where the device has no tensor cores): Burn's matmul built without autotune.
    Cmma,
    /// NVIDIA's cuBLASLt (`cublasLtMatmul`, its own heuristic's algorithm; f32 as TF32,
    /// bf16 and f16 accumulated in f32), on `--device cuda` only; a product whose layout it
    /// cannot take (a strided slice; `gemm_layout.rs`) runs CubeCL's autotuned matmul.
    Cublaslt,
}

/// Whether this build has cubek's autotuned matmul (backend-ext's `autotune` feature).
pub const AUTOTUNE_BUILT: bool = cfg!(feature = "autotune");

/// Whether this build can call cuBLASLt (backend-ext's `cuda` feature).
pub const CUBLASLT_BUILT: bool = cfg!(feature = "cuda");

/// The process's choice, as [`Gemm`]'s discriminant (0: Auto).
static CHOICE: AtomicU8 = AtomicU8::new(0);

impl Gemm {
    /// What runs under this choice in this build: [`Gemm::Autotune`], [`Gemm::Cmma`] or
    /// [`Gemm::Cublaslt`].
    ///
    /// # Errors
    /// `Gemm::Autotune` or `Gemm::Cublaslt` in a build without it, naming the cargo feature.
    pub fn resolve(self) -> Result<Gemm, String> {
        match self {
            Gemm::Auto if AUTOTUNE_BUILT => Ok(Gemm::Autotune),
            Gemm::Auto => Ok(Gemm::Cmma),
            Gemm::Autotune if !AUTOTUNE_BUILT => Err(
                "model.gemm = \"autotune\" needs a build with CubeCL's autotuned matmul (cargo \
                 feature `ember-backend-ext/autotune`, on with `cuda`); this one has only \
                 \"cmma\""
                    .into(),
            ),
            Gemm::Cublaslt if !CUBLASLT_BUILT => Err(
                "model.gemm = \"cublaslt\" needs a CUDA build (cargo feature `cuda`); this one \
                 runs CubeCL's matmuls only"
                    .into(),
            ),
            other => Ok(other),
        }
    }

    /// This choice on a device kind (`cuda`, `wgpu`, `cpu`, as xtask's `--device` names them).
    ///
    /// # Errors
    /// [`Gemm::resolve`]'s, and `cublaslt` off CUDA (cuBLASLt is NVIDIA's library).
    pub fn for_device(self, device: &str) -> Result<Gemm, String> {
        if self == Gemm::Cublaslt && device != "cuda" {
            return Err(format!(
                "model.gemm = \"cublaslt\" runs on --device cuda only (NVIDIA's library), not \
                 on {device}"
            ));
        }
        self.resolve()
    }

    /// The setting's name.
    pub fn name(self) -> &'static str {
        match self {
            Gemm::Auto => "auto",
            Gemm::Autotune => "autotune",
            Gemm::Cmma => "cmma",
            Gemm::Cublaslt => "cublaslt",
        }
    }
}

impl std::str::FromStr for Gemm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Gemm::Auto),
            "autotune" => Ok(Gemm::Autotune),
            "cmma" => Ok(Gemm::Cmma),
            "cublaslt" => Ok(Gemm::Cublaslt),
            other => Err(format!(
                "unknown gemm `{other}` (expected auto, autotune, cmma or cublaslt)"
            )),
        }
    }
}

/// Sets the GEMM the GPU backends use from now on, process-wide (as [`crate::set_gemm_parts`]
/// is for NdArray's). A GEMM already enqueued keeps its kernel.
///
/// # Errors
/// [`Gemm::resolve`]'s: `autotune` or `cublaslt` in a build without it; `cublaslt` where
/// NVIDIA's library does not open (the choice is then unchanged).
pub fn set_gpu_gemm(gemm: Gemm) -> Result<(), String> {
    let resolved = gemm.resolve()?;
    #[cfg(feature = "cuda")]
    if resolved == Gemm::Cublaslt {
        crate::cublaslt::check_library()?;
    }
    CHOICE.store(resolved as u8, Ordering::Relaxed);
    Ok(())
}

/// The GEMM the GPU backends use: [`Gemm::Autotune`], [`Gemm::Cmma`] or [`Gemm::Cublaslt`]
/// ([`set_gpu_gemm`]; by default [`Gemm::Auto`] resolved).
pub fn gpu_gemm() -> Gemm {
    match CHOICE.load(Ordering::Relaxed) {
        1 => Gemm::Autotune,
        2 => Gemm::Cmma,
        3 => Gemm::Cublaslt,
        _ => Gemm::Auto
            .resolve()
            .expect("`auto` resolves in every build"),
    }
}

/// How a cuBLASLt product is ordered with CubeCL's kernels (`model.cublaslt_sync`; Note
/// [cuBLASLt beside CubeCL] in `cube/cublaslt.rs`). Only [`Gemm::Cublaslt`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CublasltSync {
    /// Two host waits per window of products: CubeCL's stream before it, cuBLASLt's after it
    /// (the GPU idles while the host catches up after each).
    #[default]
    Host,
    /// Flags in GPU memory, no host wait: a one-unit CubeCL kernel writes the window's number
    /// and holds CubeCL's stream until cuBLASLt's stream, which waited for that number
    /// (`cuStreamWaitValue32`), writes it back after the products (`cuStreamWriteValue32`):
    /// one more kernel launch per window (Note [Device-side GEMM windows] in
    /// `cube/gemm_window.rs`). Falls back to `host` where the device refuses stream memory
    /// operations.
    Device,
}

/// The process's [`CublasltSync`] (0: host, 1: device).
static SYNC: AtomicU8 = AtomicU8::new(0);

impl CublasltSync {
    /// The setting's name.
    pub fn name(self) -> &'static str {
        match self {
            CublasltSync::Host => "host",
            CublasltSync::Device => "device",
        }
    }
}

impl std::str::FromStr for CublasltSync {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host" => Ok(CublasltSync::Host),
            "device" => Ok(CublasltSync::Device),
            other => Err(format!(
                "unknown cublaslt_sync `{other}` (expected host or device)"
            )),
        }
    }
}

/// Sets how cuBLASLt's products are ordered with CubeCL's kernels from now on, process-wide
/// (as [`set_gpu_gemm`]). A window already enqueued keeps its order.
pub fn set_cublaslt_sync(sync: CublasltSync) {
    SYNC.store(sync as u8, Ordering::Relaxed);
}

/// How cuBLASLt's products are ordered ([`set_cublaslt_sync`]; by default
/// [`CublasltSync::Host`]).
pub fn cublaslt_sync() -> CublasltSync {
    match SYNC.load(Ordering::Relaxed) {
        1 => CublasltSync::Device,
        _ => CublasltSync::Host,
    }
}

/// The precision a backend's GEMMs give f32 operands ([`crate::FusedOps::f32_gemm_precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPrecision {
    /// Exact f32 products (24-bit significands), accumulated in f32.
    F32,
    /// Operands rounded to TF32 (11-bit significands) on the tensor cores, accumulated in
    /// f32: NVIDIA's TF32 since Ampere (Note [GPU GEMMs]).
    Tf32,
}

impl GemmPrecision {
    /// The unit roundoff of the operands' rounding: 2⁻²⁴ for f32, 2⁻¹¹ for TF32 (round to
    /// nearest, 10 stored mantissa bits).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            GemmPrecision::F32 => f64::powi(2.0, -24),
            GemmPrecision::Tf32 => f64::powi(2.0, -11),
        }
    }

    /// `f32` or `tf32`.
    pub fn name(self) -> &'static str {
        match self {
            GemmPrecision::F32 => "f32",
            GemmPrecision::Tf32 => "tf32",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_resolves_to_what_the_build_has_and_names_parse() {
        let expected = if AUTOTUNE_BUILT {
            Gemm::Autotune
        } else {
            Gemm::Cmma
        };
        assert_eq!(Gemm::Auto.resolve(), Ok(expected));
        assert_eq!(Gemm::Cmma.resolve(), Ok(Gemm::Cmma));
        assert_eq!(Gemm::Autotune.resolve().is_ok(), AUTOTUNE_BUILT);
        assert_eq!(Gemm::Cublaslt.resolve().is_ok(), CUBLASLT_BUILT);
        for g in [Gemm::Auto, Gemm::Autotune, Gemm::Cmma, Gemm::Cublaslt] {
            assert_eq!(g.name().parse::<Gemm>(), Ok(g));
        }
        let err = "cublas".parse::<Gemm>().unwrap_err();
        assert!(
            err.contains("`cublas`") && err.contains("cublaslt"),
            "{err}"
        );
    }

    #[test]
    fn cublaslt_is_refused_off_cuda_with_the_device_named() {
        assert_eq!(Gemm::Cmma.for_device("wgpu"), Ok(Gemm::Cmma));
        let err = Gemm::Cublaslt.for_device("wgpu").unwrap_err();
        assert!(err.contains("cublaslt") && err.contains("wgpu"), "{err}");
        assert_eq!(Gemm::Cublaslt.for_device("cuda").is_ok(), CUBLASLT_BUILT);
        // The CHOICE discriminants round-trip through gpu_gemm.
        assert_eq!(Gemm::Cublaslt as u8, 3);
    }

    #[test]
    fn cublaslt_sync_names_parse_and_the_setting_round_trips() {
        for sync in [CublasltSync::Host, CublasltSync::Device] {
            assert_eq!(sync.name().parse::<CublasltSync>(), Ok(sync));
        }
        let err = "devices".parse::<CublasltSync>().unwrap_err();
        assert!(
            err.contains("`devices`") && err.contains("host or device"),
            "{err}"
        );
        assert_eq!(cublaslt_sync(), CublasltSync::Host);
        set_cublaslt_sync(CublasltSync::Device);
        assert_eq!(cublaslt_sync(), CublasltSync::Device);
        set_cublaslt_sync(CublasltSync::Host);
        assert_eq!(cublaslt_sync(), CublasltSync::Host);
    }

    #[test]
    fn unit_roundoffs_are_the_formats() {
        assert_eq!(
            GemmPrecision::F32.unit_roundoff(),
            f64::from(f32::EPSILON) / 2.0
        );
        assert_eq!(GemmPrecision::Tf32.unit_roundoff(), 1.0 / 2048.0);
    }
}
