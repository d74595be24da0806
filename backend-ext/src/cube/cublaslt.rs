//! NVIDIA's cuBLASLt as ember's GEMM on CUDA (`model.gemm = "cublaslt"`, Note [GPU GEMMs] in
//! `gemm.rs`): the dense layers' products and attention's batched products, through cudarc's
//! `cublaslt` module (`cublasLtMatmul` with the algorithm its heuristic ranks first; f32
//! operands as TF32, `CUBLAS_COMPUTE_32F_FAST_TF32`, as cubek's tensor-core kernels read them;
//! bf16 and f16 multiplied exactly and accumulated in f32, `CUBLAS_COMPUTE_32F`).
//!
//! Note [cuBLASLt beside CubeCL]: CubeCL 0.10 gives each thread a CUDA stream of its own,
//! created non-blocking (no implicit ordering with any other stream), and exposes neither the
//! stream nor a way to enqueue foreign work on it: `ComputeClient` hands out device pointers
//! (`get_resource`) and host-side waits (`sync`). A cuBLASLt product therefore runs on a
//! stream of ember's own (one per GPU, in the primary context CubeCL also uses, so the
//! pointers are valid there) between two host waits: CubeCL's stream first (the operands are
//! written and the output's memory is allocated; CubeCL's pool allocates stream-ordered), then
//! ember's (the product is written before CubeCL's next kernel can read it, or its pool hand
//! the operands' memory to another tensor). The cost is the GPU idling while the host catches
//! up after each wait: about 600 products in a BERT-large step, which the GEMM and step
//! benchmarks include in their times. A CubeCL that exposes its streams (or takes an event to
//! wait on) would let the product be enqueued in order instead, with no wait at all. Without
//! one, the waits could move to the device: a one-thread CubeCL kernel writing a flag that
//! ember's stream waits for (`cuStreamWaitValue32`), and after the product a CubeCL kernel
//! spinning until ember's stream writes another (`cuStreamWriteValue32`): no host wait, two
//! more launches per GEMM, and a spinning kernel to prove on a GPU first.
//!
//! The layout (which operand is which for a column-major library, transposes, leading
//! dimensions, batch strides) is `gemm_layout.rs`'s, tested on the host against a
//! column-major GEMM's definition. A layout it has no plan for (a strided slice, batch
//! dimensions that do not flatten) and a product cuBLASLt refuses run CubeCL's autotuned
//! matmul instead; the refusals are counted ([`refusals`]) and the first is logged.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::gemm_layout::{ColumnMajorGemm, column_major_gemm};

/// One GPU's cuBLASLt handle (with its workspace: 32 MiB on Hopper, cudarc's choice after
/// NVIDIA's advice) and the stream its products run on.
struct Handle {
    blas: CudaBlasLT,
    stream: Arc<CudaStream>,
}

/// The handles, by CUDA ordinal: created at a GPU's first product, kept for the process. A
/// product holds its GPU's lock from its first wait to its last.
fn handles() -> &'static Mutex<HashMap<usize, Arc<Mutex<Handle>>>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<Mutex<Handle>>>>> = OnceLock::new();
    HANDLES.get_or_init(Default::default)
}

/// Products cuBLASLt refused (then run by CubeCL's matmul), since the process started.
static REFUSALS: AtomicUsize = AtomicUsize::new(0);
/// Products cuBLASLt computed, since the process started.
static PRODUCTS: AtomicUsize = AtomicUsize::new(0);

/// How many products cuBLASLt computed in this process (each batched product counts once).
pub fn products() -> usize {
    PRODUCTS.load(Ordering::Relaxed)
}

/// How many products `model.gemm = "cublaslt"` handed to CubeCL's matmul because cuBLASLt
/// refused them (no algorithm for the layout, an error); layouts without a plan
/// (`gemm_layout.rs`) are not counted.
pub fn refusals() -> usize {
    REFUSALS.load(Ordering::Relaxed)
}

/// Whether cuBLASLt's library opens in this process (cudarc's names: `libcublasLt.so`,
/// `.so.12`, ...; xtask's CUDA start links `libcublasLt.so.13` and pip's under those names).
///
/// # Errors
/// The library not found, with the names tried.
pub fn check_library() -> Result<(), String> {
    // SAFETY: opens the library by name (its constructors run, as they would at first use).
    if unsafe { cudarc::cublaslt::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(format!(
            "model.gemm = \"cublaslt\": NVIDIA's cuBLASLt did not open (tried {}; pip's \
             `nvidia-cublas` wheel or the CUDA toolkit ships it; `ember gpu-libs` shows where \
             ember looked)",
            cudarc::get_lib_name_candidates("cublasLt").join(", ")
        ))
    }
}

fn handle(ordinal: usize) -> Result<Arc<Mutex<Handle>>, String> {
    let mut map = handles().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(handle) = map.get(&ordinal) {
        return Ok(handle.clone());
    }
    check_library()?;
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| format!("a stream on CUDA device {ordinal}: {e:?}"))?;
    let blas = CudaBlasLT::new(stream.clone())
        .map_err(|e| format!("a cuBLASLt handle on CUDA device {ordinal}: {e:?}"))?;
    let handle = Arc::new(Mutex::new(Handle { blas, stream }));
    map.insert(ordinal, handle.clone());
    Ok(handle)
}

/// A device pointer that CubeCL owns, as cudarc's operand traits take it: no event tracking
/// (the host waits of Note [cuBLASLt beside CubeCL] order the accesses).
struct Borrowed<'s> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'s Arc<CudaStream>,
}

impl<T> DeviceSlice<T> for Borrowed<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Borrowed<'_> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Borrowed<'_> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// cudarc's configuration for a plan (`C'` written, not accumulated: β = 0).
fn config(plan: &ColumnMajorGemm) -> MatmulConfig {
    let batched = plan.batch > 1;
    let batch = |stride: usize| batched.then_some(stride as i64);
    MatmulConfig {
        transa: plan.transa,
        transb: plan.transb,
        transc: false,
        m: plan.m as u64,
        n: plan.n as u64,
        k: plan.k as u64,
        alpha: 1.0,
        lda: plan.lda as i64,
        ldb: plan.ldb as i64,
        beta: 0.0,
        ldc: plan.ldc as i64,
        stride_a: batch(plan.stride_a),
        stride_b: batch(plan.stride_b),
        stride_c: batch(plan.stride_c),
        stride_bias: None,
        batch_size: batched.then_some(plan.batch as i32),
    }
}

/// `a · b` (Burn's `float_matmul` semantics: batched over the leading dimensions, broadcast
/// where one side has 1), plus `bias` `[n]` on every row (cuBLASLt's `CUBLASLT_EPILOGUE_BIAS`:
/// one kernel where the add would be another; a product without batch only), through cuBLASLt
/// when `R` is CUDA, the tensors are f32, bf16 or f16 of one dtype, and their layout has a
/// plan; `None` otherwise, for the caller's CubeCL matmul (and bias add).
pub(crate) fn matmul<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    fn cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<CudaRuntime>> {
        (t as &dyn Any).downcast_ref()
    }
    let bias = match bias {
        Some(bias) => Some(cuda(bias)?),
        None => None,
    };
    let out = cuda_matmul(cuda(a)?, cuda(b)?, bias)?;
    let out: Box<dyn Any> = Box::new(out);
    Some(*out.downcast::<CubeTensor<R>>().ok()?)
}

fn cuda_matmul(
    a: &CubeTensor<CudaRuntime>,
    b: &CubeTensor<CudaRuntime>,
    bias: Option<&CubeTensor<CudaRuntime>>,
) -> Option<CubeTensor<CudaRuntime>> {
    if a.dtype != b.dtype || !matches!(a.dtype, DType::F32 | DType::BF16 | DType::F16) {
        return None;
    }
    let (a_shape, b_shape) = (a.shape(), b.shape());
    let plan = column_major_gemm(
        a_shape.as_slice(),
        a.meta.strides(),
        b_shape.as_slice(),
        b.meta.strides(),
    )?;
    // The epilogue adds a contiguous vector over C'`s rows (the row-major output's columns),
    // the same vector for every product.
    if let Some(bias) = bias
        && (bias.dtype != a.dtype
            || bias.shape().as_slice() != [plan.m]
            || bias.meta.strides()[0] != 1
            || plan.batch != 1)
    {
        return None;
    }
    let rank = a_shape.num_dims();
    let mut out_dims: Vec<usize> = (0..rank - 2).map(|d| a_shape[d].max(b_shape[d])).collect();
    out_dims.extend([a_shape[rank - 2], b_shape[rank - 1]]);
    let ordinal = (&a.device as &dyn Any).downcast_ref::<CudaDevice>()?.index;
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::from(out_dims),
        a.dtype,
    );
    match run(ordinal, &plan, [a, b, &out], bias) {
        Ok(()) => {
            PRODUCTS.fetch_add(1, Ordering::Relaxed);
            Some(out)
        }
        Err(reason) => {
            if REFUSALS.fetch_add(1, Ordering::Relaxed) == 0 {
                tracing::warn!(
                    "cuBLASLt refused a {:?} product of [{a_shape:?}]·[{b_shape:?}] ({reason}): \
                     CubeCL's matmul runs it, and the next refusals are only counted",
                    a.dtype
                );
            }
            None
        }
    }
}

/// The product `a · b (+ bias)` into `out`, between the two host waits of Note [cuBLASLt
/// beside CubeCL].
fn run(
    ordinal: usize,
    plan: &ColumnMajorGemm,
    [a, b, out]: [&CubeTensor<CudaRuntime>; 3],
    bias: Option<&CubeTensor<CudaRuntime>>,
) -> Result<(), String> {
    let handle = handle(ordinal)?;
    let handle = handle.lock().unwrap_or_else(|e| e.into_inner());
    let client = &a.client;
    let resource = |t: &CubeTensor<CudaRuntime>| {
        client
            .get_resource(t.handle.clone())
            .map_err(|e| format!("CubeCL's buffer: {e:?}"))
    };
    // Each keeps its memory from being reused until the product is done.
    let (ra, rb, rc) = (resource(a)?, resource(b)?, resource(out)?);
    let rbias = bias.map(resource).transpose()?;
    // (CubeCL's resource type is private to cubecl-cuda: its fields are read in place.)
    let (pa, pb, pc) = (
        (ra.resource().ptr, ra.resource().size),
        (rb.resource().ptr, rb.resource().size),
        (rc.resource().ptr, rc.resource().size),
    );
    let pbias = rbias
        .as_ref()
        .map(|r| (r.resource().ptr, r.resource().size));
    // cuBLASLt picks its kernel assuming 256-byte aligned pointers (the default of
    // `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, which cudarc leaves). CubeCL's buffers are
    // 512-byte aligned; a view into one may not be.
    for (what, ptr) in [
        ("left operand", Some(pa.0)),
        ("right operand", Some(pb.0)),
        ("output", Some(pc.0)),
        ("bias", pbias.map(|p| p.0)),
    ] {
        if ptr.is_some_and(|ptr| ptr % 256 != 0) {
            return Err(format!("the {what} is not 256-byte aligned"));
        }
    }
    cubecl::future::block_on(client.sync()).map_err(|e| format!("CubeCL's stream: {e:?}"))?;
    let element = a.dtype.size();
    let borrowed = |(ptr, bytes): (CUdeviceptr, u64)| Borrowed {
        ptr,
        len: bytes as usize / element,
        stream: &handle.stream,
    };
    // A' is the row-major right operand, B' the left (Note [Row-major GEMMs on a column-major
    // BLAS] in gemm_layout.rs).
    let (lhs, rhs, mut dst) = (borrowed(pb), borrowed(pa), borrowed(pc));
    let bias = pbias.map(borrowed);
    let cfg = config(plan);
    // SAFETY: the pointers are CubeCL's live buffers (held by `ra`, `rb`, `rc`, `rbias`),
    // written before CubeCL's stream was waited for; the plan's extents stay within each
    // tensor's elements (gemm_layout.rs, tested against the column-major definition), and the
    // bias has C''s `m` elements (checked by the caller).
    let launched = unsafe {
        match a.dtype {
            DType::BF16 => Matmul::<burn::tensor::bf16>::matmul(
                &handle.blas,
                cfg,
                &lhs,
                &rhs,
                &mut dst,
                bias.as_ref(),
                None,
            ),
            DType::F16 => Matmul::<burn::tensor::f16>::matmul(
                &handle.blas,
                cfg,
                &lhs,
                &rhs,
                &mut dst,
                bias.as_ref(),
                None,
            ),
            _ => {
                Matmul::<f32>::matmul(&handle.blas, cfg, &lhs, &rhs, &mut dst, bias.as_ref(), None)
            }
        }
    };
    let waited = handle.stream.synchronize();
    launched.map_err(|e| format!("{e:?}"))?;
    waited.map_err(|e| format!("waiting for cuBLASLt's stream: {e:?}"))
}
