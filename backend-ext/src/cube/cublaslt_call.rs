//! One GPU's cuBLASLt handle and its products, on cuBLASLt's own API (cudarc's `result` layer):
//! the epilogues ember uses, and the descriptors and algorithm of each kind of product made
//! once.
//!
//! Note [cuBLASLt descriptors kept]: cudarc's `Matmul::matmul` creates three matrix layouts, an
//! operation descriptor and a preference, asks the heuristic for an algorithm and destroys them
//! all again at every product: about fifteen calls into the library, for each of the ~600
//! products of a BERT-large step, while the GPU waits for the host (Note [cuBLASLt beside
//! CubeCL] in `cublaslt.rs`). None of them depends on the operands' addresses (the layouts
//! hold shapes, the descriptor types, transposes and the epilogue; the algorithm is chosen for
//! the preference's default 256-byte alignment, which `cublaslt.rs` checks of every pointer),
//! so here they are made at the first product of a kind (its plan, dtypes and epilogue) and
//! kept with the handle. A product then costs one `cublasLtMatmul` call, and one attribute
//! write for the bias or bias-gradient pointer. (cuBLASLt keeps its own cache of heuristic
//! answers, `CUBLASLT_HEURISTICS_CACHE_CAPACITY`; the descriptors' calls are what this saves.)
//! A kind whose descriptors or algorithm cuBLASLt refuses is not kept: `cublaslt.rs` records
//! the refusal, runs that product on CubeCL, and does not offer the kind again (a weight
//! gradient whose bias-gradient epilogue was refused is offered without it). At most
//! [`MAX_KINDS`] kinds are kept (embedding many shapes makes a kind per shape): past that the
//! cache starts again.
//!
//! The epilogues (cuBLAS's documentation of `cublasLtEpilogue_t`; the operands are the
//! column-major ones of Note [Row-major GEMMs on a column-major BLAS] in `gemm_layout.rs`):
//! - [`Epilogue::Bias`] (`CUBLASLT_EPILOGUE_BIAS`): a vector of `C'`'s `m` rows added to every
//!   column: the dense layer's bias on every row of its output;
//! - [`Epilogue::BiasGradient`] (`CUBLASLT_EPILOGUE_BGRADA`): `op(A')` summed over the GEMM's
//!   `k` dimension into a vector of `C'`'s `m` rows, written beside the product. For the dense
//!   layer's weight gradient `dW = xᵀ·g`, `A'` is the output's gradient `g` and `k` its rows, so
//!   the vector is the bias gradient `Σ_rows g`: apex's `fused_dense` (`gemm_bgradb_lt`, its
//!   operands the other way round, hence BGRADB there) and Transformer Engine compute the
//!   weight and bias gradients in one GEMM the same way. Its dtype is the output's (cuBLASLt's
//!   default, `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` unset). cuBLASLt does not document the
//!   sum's accumulation; the CUDA test bounds it as the products are bounded.
//!
//! Note [cuBLASLt's f32 output]: a product of bf16 (f16) operands may be written in f32, from
//! its f32 accumulator (`C'`'s layout in `CUDA_R_32F`, `CUBLAS_COMPUTE_32F`; cuBLASLt's table
//! of supported types lists it beside the half output; Megatron-LM's `wgrad_gemm_accum_fp32`
//! and Transformer Engine's weight gradients with `fuse_wgrad_accumulation` write f32 from
//! half operands the same way). The dense layer's weight gradient under autocast takes it
//! (Note [Weight gradients in f32] in `linear.rs`): `dW` reaches the f32 masters without a
//! half rounding and a cast launch, as CubeCL's GEMM writes it. The bias gradient of
//! `CUBLASLT_EPILOGUE_BGRADA` has the output's type (cuBLAS's documentation of
//! `CUBLASLT_MATMUL_DESC_BIAS_POINTER`: "the same type as the output elements"), so it is f32
//! too. A kind cuBLASLt refuses goes to CubeCL as any refused kind.
//!
//! bf16 and f16 products written in their own type add a split-K algorithm's partial products
//! in f32
//! (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` = `CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE`;
//! algorithms without split-K pass any mask): the partial sums PyTorch keeps unrounded in its
//! cuBLAS GEMMs when `torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction` is
//! `False` (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`; its cuBLASLt paths set no
//! mask). A deliberate difference from PyTorch's default (`True`, partial products rounded
//! to bf16 in place or in the workspace): ember's other GEMM paths (cubek's kernels)
//! accumulate the whole sum in f32, and its tests bound every path's products alike. The
//! heuristic may then have fewer split-K algorithms to choose from; `bench gemm` sets
//! cuBLASLt beside `torch.matmul` with PyTorch's default. A product written in f32 (Note
//! [cuBLASLt's f32 output]) keeps every scheme: its partial sums are f32 in place, in the
//! output's type or in the compute type alike.

use std::collections::HashMap;
use std::sync::Arc;

use burn::tensor::DType;
use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::gemm_layout::{ColumnMajorGemm, MatrixLayout, ProductCompute, product_compute};

/// What a product does besides `C' = op(A')·op(B')` (Note [cuBLASLt descriptors kept]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Epilogue {
    /// Nothing (`CUBLASLT_EPILOGUE_DEFAULT`).
    None,
    /// Adds a vector of `m` elements to each column of `C'` (`CUBLASLT_EPILOGUE_BIAS`).
    Bias,
    /// Writes `op(A')` summed over `k`, `m` elements (`CUBLASLT_EPILOGUE_BGRADA`).
    BiasGradient,
}

impl Epilogue {
    fn value(self) -> sys::cublasLtEpilogue_t {
        match self {
            Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::BiasGradient => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BGRADA,
        }
    }
}

/// A kind of product: what its descriptors and algorithm depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Kind {
    pub plan: ColumnMajorGemm,
    /// `A'` and `B'`'s dtype.
    pub operands: DType,
    /// `C'`'s dtype (and the epilogue's vector's): the operands', or f32 beside half operands
    /// ([`types`], Note [cuBLASLt's f32 output]).
    pub output: DType,
    pub epilogue: Epilogue,
}

/// Kinds kept per handle before the cache starts again (Note [cuBLASLt descriptors kept]): a
/// BERT step has a few dozen.
const MAX_KINDS: usize = 4096;

/// The device addresses of one product: `A'`, `B'`, `C'` and the epilogue's vector (0 without).
pub(super) struct Pointers {
    pub a: CUdeviceptr,
    pub b: CUdeviceptr,
    pub c: CUdeviceptr,
    pub vector: CUdeviceptr,
}

/// cuBLASLt's element types (operands, output) and compute type for a product of `operands`
/// written in `output`, as [`product_compute`] allows: f32 as TF32
/// (`CUBLAS_COMPUTE_32F_FAST_TF32`), bf16 and f16 exact with f32 accumulation
/// (`CUBLAS_COMPUTE_32F`), written in their own dtype or in f32 (Note [cuBLASLt's f32
/// output]); the scale type (α, β) is f32 for all. `None` for any other pair.
pub(super) fn types(
    operands: DType,
    output: DType,
) -> Option<(
    sys::cudaDataType,
    sys::cudaDataType,
    sys::cublasComputeType_t,
)> {
    use sys::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
    let element = |dtype| match dtype {
        DType::F32 => Some(CUDA_R_32F),
        DType::BF16 => Some(CUDA_R_16BF),
        DType::F16 => Some(CUDA_R_16F),
        _ => None,
    };
    let compute = match product_compute(operands, output)? {
        ProductCompute::Tf32 => CUBLAS_COMPUTE_32F_FAST_TF32,
        ProductCompute::F32 => CUBLAS_COMPUTE_32F,
    };
    Some((element(operands)?, element(output)?, compute))
}

/// A matrix layout descriptor, destroyed with it.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(element: sys::cudaDataType, layout: &MatrixLayout) -> Result<Self, CublasError> {
        let handle = result::create_matrix_layout(
            element,
            layout.rows as u64,
            layout.cols as u64,
            layout.ld as i64,
        )?;
        let made = Layout(handle);
        if let Some((count, stride)) = layout.batch {
            let (count, stride) = (count as i32, stride as i64);
            use sys::cublasLtMatrixLayoutAttribute_t as A;
            // SAFETY: each value is the attribute's documented type (int32, int64).
            unsafe {
                made.set(A::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
                made.set(A::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride)?;
            }
        }
        Ok(made)
    }
}

impl Layout {
    /// Sets one attribute to `value`.
    ///
    /// # Safety
    /// `T` is the attribute's documented type.
    unsafe fn set<T>(
        &self,
        attribute: sys::cublasLtMatrixLayoutAttribute_t,
        value: &T,
    ) -> Result<(), CublasError> {
        // SAFETY: a live layout; the value's type is the caller's promise.
        unsafe {
            result::set_matrix_layout_attribute(
                self.0,
                attribute,
                (value as *const T).cast(),
                size_of::<T>(),
            )
        }
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once. An error here (a library
        // torn down at exit) leaks the descriptor, nothing more.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// An operation descriptor, destroyed with it.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    /// Sets one attribute to `value`.
    ///
    /// # Safety
    /// `T` is the attribute's documented type.
    unsafe fn set<T>(
        &self,
        attribute: sys::cublasLtMatmulDescAttributes_t,
        value: &T,
    ) -> Result<(), CublasError> {
        // SAFETY: a live descriptor; the value's type is the caller's promise.
        unsafe {
            result::set_matmul_desc_attribute(
                self.0,
                attribute,
                (value as *const T).cast(),
                size_of::<T>(),
            )
        }
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A preference descriptor, destroyed with it.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    /// Sets one attribute to `value`.
    ///
    /// # Safety
    /// `T` is the attribute's documented type.
    unsafe fn set<T>(
        &self,
        attribute: sys::cublasLtMatmulPreferenceAttributes_t,
        value: &T,
    ) -> Result<(), CublasError> {
        // SAFETY: a live preference; the value's type is the caller's promise.
        unsafe {
            result::set_matmul_pref_attribute(
                self.0,
                attribute,
                (value as *const T).cast(),
                size_of::<T>(),
            )
        }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// The descriptors and algorithm of one kind of product.
struct Prepared {
    desc: Desc,
    /// `A'`, `B'`, `C'` (also `D`: the product is written in place of `C`, β = 0).
    layouts: [Layout; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// One GPU's cuBLASLt handle, its workspace and the kinds of product prepared so far.
pub(super) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// Kept for its memory; `workspace_ptr` is its address.
    _workspace: CudaSlice<u8>,
    workspace_ptr: CUdeviceptr,
    workspace_size: usize,
    prepared: HashMap<Kind, Prepared>,
}

// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time; `Lt` is only
// reached through its GPU's mutex (`cublaslt.rs`), as cudarc's `CudaBlasLT` is `Send`.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.prepared.clear();
        // SAFETY: created by `create_handle`, destroyed once, after its descriptors.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

impl Lt {
    /// A handle with a workspace on `stream`'s device: 32 MiB from Hopper on, else 4 MiB
    /// (NVIDIA's advice, as cudarc's `Workspace`).
    ///
    /// # Errors
    /// The library's or the driver's error, as text.
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        let major = stream
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| format!("the device's compute capability: {e:?}"))?;
        let workspace_size = if major >= 9 { 32 << 20 } else { 4 << 20 };
        // SAFETY: only cuBLASLt writes the workspace, and only on `stream`.
        let workspace = unsafe { stream.alloc::<u8>(workspace_size) }
            .map_err(|e| format!("cuBLASLt's workspace of {workspace_size} bytes: {e:?}"))?;
        let workspace_ptr = workspace.device_ptr(stream).0;
        let handle = result::create_handle().map_err(|e| format!("a cuBLASLt handle: {e:?}"))?;
        Ok(Lt {
            handle,
            _workspace: workspace,
            workspace_ptr,
            workspace_size,
            prepared: HashMap::new(),
        })
    }

    /// The descriptors and the heuristic's first algorithm for `kind`, the epilogue's vector
    /// set to `vector` (the heuristic sees a product as it will run).
    fn prepare(&self, kind: &Kind, vector: CUdeviceptr) -> Result<Prepared, String> {
        let Kind {
            plan,
            operands,
            output,
            epilogue,
        } = kind;
        let (element, out_element, compute) = types(*operands, *output).ok_or_else(|| {
            format!("no cuBLASLt types for {operands:?} operands and a {output:?} output")
        })?;
        let fail = |what: &'static str| move |e: CublasError| format!("{what}: {e:?}");
        let [la, lb, lc] = plan.layouts();
        let layouts = [
            Layout::new(element, &la).map_err(fail("A's layout"))?,
            Layout::new(element, &lb).map_err(fail("B's layout"))?,
            Layout::new(out_element, &lc).map_err(fail("C's layout"))?,
        ];
        let desc = Desc(
            result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
                .map_err(fail("the operation descriptor"))?,
        );
        let (transa, transb) = (i32::from(plan.transa), i32::from(plan.transb));
        let epilogue_value = epilogue.value();
        use sys::cublasLtMatmulDescAttributes_t as A;
        // SAFETY: cublasOperation_t is an i32 (0: N, 1: T), the epilogue a
        // cublasLtEpilogue_t, the vector's pointer a device address.
        unsafe {
            desc.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &transa)
                .map_err(fail("transa"))?;
            desc.set(A::CUBLASLT_MATMUL_DESC_TRANSB, &transb)
                .map_err(fail("transb"))?;
            desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue_value)
                .map_err(fail("the epilogue"))?;
            if *epilogue != Epilogue::None {
                desc.set(A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &vector)
                    .map_err(fail("the epilogue's vector"))?;
            }
        }
        let pref = Pref(result::create_matmul_pref().map_err(fail("the preference"))?);
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: the workspace size is a size_t.
        unsafe {
            pref.set(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &self.workspace_size,
            )
        }
        .map_err(fail("the workspace preference"))?;
        // A half output only: an f32 output's partial sums are f32 under every scheme.
        if matches!(output, DType::BF16 | DType::F16) {
            let mask =
                sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            // SAFETY: the mask is a uint32_t.
            unsafe { pref.set(P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask) }
                .map_err(fail("the reduction scheme preference"))?;
        }
        // SAFETY: live descriptors of this handle; C and D share a layout.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle,
                desc.0,
                layouts[0].0,
                layouts[1].0,
                layouts[2].0,
                layouts[2].0,
                pref.0,
            )
        }
        .map_err(fail("no algorithm for the layout"))?;
        Ok(Prepared {
            desc,
            layouts,
            algo: heuristic.algo,
        })
    }

    /// Whether `kind`'s descriptors are made (its kernels launched before, unless its first
    /// launch failed).
    pub(super) fn is_prepared(&self, kind: &Kind) -> bool {
        self.prepared.contains_key(kind)
    }

    /// `C' = op(A')·op(B')` (β = 0) with `kind`'s epilogue, enqueued on `stream`; the kind's
    /// descriptors are made at its first product and kept (Note [cuBLASLt descriptors kept]).
    ///
    /// # Errors
    /// Why cuBLASLt did not enqueue it (a refused layout or epilogue, no algorithm, a failed
    /// launch), as text; a refused kind is not kept.
    ///
    /// # Safety
    /// The pointers are live device buffers of `stream`'s context holding the extents the
    /// plan's layouts read (and `m` elements of the vector where the epilogue has one), not
    /// written by other work until the product is done.
    pub(super) unsafe fn matmul(
        &mut self,
        kind: &Kind,
        pointers: &Pointers,
        stream: &CudaStream,
    ) -> Result<(), String> {
        if !self.prepared.contains_key(kind) {
            let prepared = self.prepare(kind, pointers.vector)?;
            if self.prepared.len() >= MAX_KINDS {
                self.prepared.clear();
            }
            self.prepared.insert(*kind, prepared);
        }
        let prepared = &self.prepared[kind];
        if kind.epilogue != Epilogue::None {
            // SAFETY: the attribute is a device address.
            unsafe {
                prepared.desc.set(
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &pointers.vector,
                )
            }
            .map_err(|e| format!("the epilogue's vector: {e:?}"))?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptors are this handle's and live; the pointers are the caller's
        // promise; α and β are f32, the scale type.
        unsafe {
            result::matmul(
                self.handle,
                prepared.desc.0,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                pointers.a as *const _,
                prepared.layouts[0].0,
                pointers.b as *const _,
                prepared.layouts[1].0,
                pointers.c as *const _,
                prepared.layouts[2].0,
                pointers.c as *mut _,
                prepared.layouts[2].0,
                &prepared.algo,
                self.workspace_ptr as *mut _,
                self.workspace_size,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| format!("cublasLtMatmul: {e:?}"))
    }
}
