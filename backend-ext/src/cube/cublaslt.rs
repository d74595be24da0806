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
//! up after each wait: 16 windows per encoder layer for its 24 products (the dense layer's
//! `dx` and `dW`, and attention's `dV`/`dP` and `dQ`/`dK`, share one: [`matmuls`]), about 400
//! in a BERT-large step, which the GEMM and step benchmarks include in their times. A CubeCL
//! that exposes its streams (or takes an event to wait on) would let the product be enqueued
//! in order instead, with no wait at all. Without one, `model.cublaslt_sync = "device"` moves
//! the waits to the device: a one-unit CubeCL kernel signals the window through a flag that
//! ember's stream waits for (`cuStreamWaitValue32`) and then polls a second flag that ember's
//! stream writes after the products (`cuStreamWriteValue32`): no host wait, one more launch
//! per window (Note [Device-side GEMM windows] in `gemm_window.rs`; `cublaslt_window.rs`
//! keeps either order).
//!
//! The layout (which operand is which for a column-major library, transposes, leading
//! dimensions, batch strides) is `gemm_layout.rs`'s, tested on the host against a
//! column-major GEMM's definition. A layout it has no plan for (a strided slice, batch
//! dimensions that do not flatten) and a product cuBLASLt refuses run CubeCL's autotuned
//! matmul instead; the refusals are counted ([`refusals`]), the first is logged, and a refused
//! layout is not offered again. An error reported by either wait is a device fault, not a
//! refusal: it panics, as CubeCL does on one.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl_runtime::server::ComputeServer;
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::cublaslt_window::{self, Windows};
use crate::gemm_layout::{ColumnMajorGemm, column_major_gemm};

/// One GPU's cuBLASLt handle (with its workspace: 32 MiB on Hopper, cudarc's choice after
/// NVIDIA's advice) and the stream its products run on.
struct Handle {
    blas: CudaBlasLT,
    stream: Arc<CudaStream>,
    /// The device-side windows' flags (`model.cublaslt_sync = "device"`).
    windows: Windows,
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
    let handle = Arc::new(Mutex::new(Handle {
        blas,
        stream,
        windows: Windows::default(),
    }));
    map.insert(ordinal, handle.clone());
    Ok(handle)
}

/// A device pointer that CubeCL owns, as cudarc's operand traits take it: no event tracking
/// (the window of Note [cuBLASLt beside CubeCL], on the host or the device, orders the
/// accesses).
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

/// One product for [`matmuls`]: `a · b`, plus `bias` on every row.
pub(crate) type Operands<'t, R> = (
    &'t CubeTensor<R>,
    &'t CubeTensor<R>,
    Option<&'t CubeTensor<R>>,
);

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
    matmuls(&[(a, b, bias)]).pop().flatten()
}

/// Products that do not read each other's outputs, as [`matmul`] each, all in the same
/// window (the dense layer's `dx` and `dW`; attention's `dV` and `dP`, `dQ` and `dK`):
/// one window of Note [cuBLASLt beside CubeCL] instead of one per product. `None` where a
/// product has no plan or cuBLASLt refused it, for the caller's CubeCL matmul.
pub(crate) fn matmuls<R: CubeRuntime>(products: &[Operands<'_, R>]) -> Vec<Option<CubeTensor<R>>> {
    // Burn's CUDA backend, or ember's counting one around it (`CountingCuda`: what `train`
    // and the step benchmarks run): the same storage, so the same pointers.
    fn on<R: CubeRuntime, C: CudaLike>(
        products: &[Operands<'_, R>],
    ) -> Option<Vec<Option<CubeTensor<R>>>> {
        fn cast<R: CubeRuntime, C: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<C>> {
            (t as &dyn Any).downcast_ref()
        }
        let mut cast_products = Vec::with_capacity(products.len());
        for &(a, b, bias) in products {
            let bias = match bias {
                Some(bias) => Some(cast::<R, C>(bias)?),
                None => None,
            };
            cast_products.push((cast::<R, C>(a)?, cast::<R, C>(b)?, bias));
        }
        Some(
            cuda_matmuls(&cast_products)
                .into_iter()
                .map(|out| {
                    let out: Box<dyn Any> = Box::new(out?);
                    out.downcast::<CubeTensor<R>>().ok().map(|t| *t)
                })
                .collect(),
        )
    }
    on::<R, CudaRuntime>(products)
        .or_else(|| on::<R, crate::CountingRuntime<CudaRuntime>>(products))
        .unwrap_or_else(|| products.iter().map(|_| None).collect())
}

/// The storage of CubeCL's CUDA runtime: its resources are device pointers.
type CudaStorage = <<CudaRuntime as CubeRuntime>::CubeServer as ComputeServer>::Storage;

/// A runtime on CUDA's devices and storage: `CudaRuntime` and `CountingRuntime<CudaRuntime>`.
pub(super) trait CudaLike:
    CubeRuntime<CubeDevice = CudaDevice, CubeServer: ComputeServer<Storage = CudaStorage>>
{
}
impl<C> CudaLike for C where
    C: CubeRuntime<CubeDevice = CudaDevice, CubeServer: ComputeServer<Storage = CudaStorage>>
{
}

/// What a refused product is known by: its plan, dtype and whether it had a bias.
type RefusalKey = (ColumnMajorGemm, DType, bool);

/// The layouts cuBLASLt refused, so that they go to CubeCL's matmul at once instead of after
/// another host wait.
fn refused() -> &'static Mutex<HashSet<RefusalKey>> {
    static REFUSED: OnceLock<Mutex<HashSet<RefusalKey>>> = OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

/// A product with a plan, and its output's memory.
struct Planned<'t, C: CubeRuntime> {
    plan: ColumnMajorGemm,
    a: &'t CubeTensor<C>,
    b: &'t CubeTensor<C>,
    bias: Option<&'t CubeTensor<C>>,
    out: CubeTensor<C>,
    key: RefusalKey,
}

/// The plan of one product and its output, or `None` (no plan, a bias the epilogue cannot
/// take, a layout refused before).
fn plan<'t, C: CudaLike>(
    (a, b, bias): (
        &'t CubeTensor<C>,
        &'t CubeTensor<C>,
        Option<&'t CubeTensor<C>>,
    ),
) -> Option<Planned<'t, C>> {
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
    let key = (plan, a.dtype, bias.is_some());
    if refused()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&key)
    {
        return None;
    }
    let rank = a_shape.num_dims();
    let mut out_dims: Vec<usize> = (0..rank - 2).map(|d| a_shape[d].max(b_shape[d])).collect();
    out_dims.extend([a_shape[rank - 2], b_shape[rank - 1]]);
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::from(out_dims),
        a.dtype,
    );
    Some(Planned {
        plan,
        a,
        b,
        bias,
        out,
        key,
    })
}

fn cuda_matmuls<C: CudaLike>(products: &[Operands<'_, C>]) -> Vec<Option<CubeTensor<C>>> {
    let planned: Vec<Option<Planned<'_, C>>> = products.iter().map(|&p| plan(p)).collect();
    let Some(first) = planned.iter().flatten().next() else {
        return products.iter().map(|_| None).collect();
    };
    let ordinal = first.a.device.index;
    let results = run(ordinal, &planned);
    planned
        .into_iter()
        .zip(results)
        .map(|(planned, result)| {
            let planned = planned?;
            match result {
                Ok(()) => {
                    PRODUCTS.fetch_add(1, Ordering::Relaxed);
                    // In the counting runtime's launches, as the CubeCL GEMM it replaces would be.
                    super::counting::count_foreign_launch("cublasLtMatmul");
                    Some(planned.out)
                }
                Err(reason) => {
                    refused()
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(planned.key);
                    if REFUSALS.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!(
                            "cuBLASLt refused a {:?} product of [{:?}]·[{:?}] ({reason}): \
                             CubeCL's matmul runs it and the products of its layout, and the \
                             next refusals are only counted",
                            planned.a.dtype,
                            planned.a.shape(),
                            planned.b.shape()
                        );
                    }
                    None
                }
            }
        })
        .collect()
}

/// cudarc's `cublasLtMatmul` with elements `T`: `(handle, config, A', B', C', bias)`.
///
/// # Safety
/// As `Matmul::matmul`: the pointers are live device buffers of the extents `config` reads.
unsafe fn lt_matmul<T>(
    (blas, cfg, lhs, rhs, dst, bias): (
        &CudaBlasLT,
        MatmulConfig,
        &Borrowed<'_>,
        &Borrowed<'_>,
        &mut Borrowed<'_>,
        Option<&Borrowed<'_>>,
    ),
) -> Result<(), cudarc::cublaslt::result::CublasError>
where
    CudaBlasLT: Matmul<T>,
{
    // SAFETY: the caller's.
    unsafe { Matmul::<T>::matmul(blas, cfg, lhs, rhs, dst, bias, None) }
}

/// The planned products (`None`: skipped), in one window of Note [cuBLASLt beside CubeCL]
/// (two host waits, or Note [Device-side GEMM windows]: `cublaslt_window.rs`): `Ok` where the product was written into its output, else why cuBLASLt did
/// not (no handle: the library, the device; an unaligned pointer; no algorithm for the layout;
/// a refused launch), for the caller's CubeCL matmul.
///
/// # Panics
/// When a wait reports an error: a fault of an earlier kernel (CubeCL's stream) or of a
/// product (ember's), after which no result on this device can be trusted; when a device
/// window's wait expired (`cublaslt_window::end`).
fn run<C: CudaLike>(ordinal: usize, planned: &[Option<Planned<'_, C>>]) -> Vec<Result<(), String>> {
    let handle = match handle(ordinal) {
        Ok(handle) => handle,
        Err(e) => return planned.iter().map(|_| Err(e.clone())).collect(),
    };
    let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
    let Some(client) = planned.iter().flatten().next().map(|p| p.a.client.clone()) else {
        return Vec::new();
    };
    let resource = |t: &CubeTensor<C>| {
        client
            .get_resource(t.handle.clone())
            .map_err(|e| format!("CubeCL's buffer: {e:?}"))
    };
    // Each keeps its memory from being reused until the products are done.
    let mut held = Vec::new();
    let mut results: Vec<Result<[(CUdeviceptr, u64); 4], String>> = Vec::new();
    for p in planned {
        let Some(p) = p else {
            results.push(Err("no plan".into()));
            continue;
        };
        let pointers = (|| {
            let (ra, rb, rc) = (resource(p.a)?, resource(p.b)?, resource(&p.out)?);
            let rbias = p.bias.map(resource).transpose()?;
            // (CubeCL's resource type is private to cubecl-cuda: its fields are read in place.)
            let pointers = [
                (ra.resource().ptr, ra.resource().size),
                (rb.resource().ptr, rb.resource().size),
                (rc.resource().ptr, rc.resource().size),
                rbias
                    .as_ref()
                    .map_or((0, 0), |r| (r.resource().ptr, r.resource().size)),
            ];
            held.push((ra, rb, rc, rbias));
            // cuBLASLt picks its kernel assuming 256-byte aligned pointers (the default of
            // `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, which cudarc leaves). CubeCL's
            // buffers are 512-byte aligned; a view into one may not be.
            for (what, (ptr, _)) in ["left operand", "right operand", "output", "bias"]
                .into_iter()
                .zip(pointers)
            {
                if ptr % 256 != 0 {
                    return Err(format!("the {what} is not 256-byte aligned"));
                }
            }
            Ok(pointers)
        })();
        results.push(pointers);
    }
    if results.iter().all(Result::is_err) {
        return results.into_iter().map(|r| r.map(|_| ())).collect();
    }
    let device = planned
        .iter()
        .flatten()
        .next()
        .map(|p| p.a.device.clone())
        .expect("a window has a planned product");
    let handle = &mut *handle;
    let window = cublaslt_window::begin(&mut handle.windows, &client, &device, &handle.stream);
    let launched: Vec<Result<(), String>> = planned
        .iter()
        .zip(results)
        .map(|(p, pointers)| {
            // A product without a plan has no pointers: it stops here.
            let [pa, pb, pc, pbias] = pointers?;
            let p = p.as_ref().expect("a product with pointers has a plan");
            let element = p.a.dtype.size();
            let borrowed = |(ptr, bytes): (CUdeviceptr, u64)| Borrowed {
                ptr,
                len: bytes as usize / element,
                stream: &handle.stream,
            };
            // A' is the row-major right operand, B' the left (Note [Row-major GEMMs on a
            // column-major BLAS] in gemm_layout.rs).
            let (lhs, rhs, mut dst) = (borrowed(pb), borrowed(pa), borrowed(pc));
            let bias = p.bias.map(|_| borrowed(pbias));
            let cfg = config(&p.plan);
            // SAFETY: the pointers are CubeCL's live buffers (held in `held`; CubeCL's stream
            // runs nothing after the window's start until its end), written before the
            // window began (`cublaslt_window::begin`); the plan's extents stay within each tensor's
            // elements (gemm_layout.rs, tested against the column-major definition), and the
            // bias has C''s `m` elements (checked by `plan`).
            let operands = (&handle.blas, cfg, &lhs, &rhs, &mut dst, bias.as_ref());
            unsafe {
                match p.a.dtype {
                    DType::BF16 => lt_matmul::<burn::tensor::bf16>(operands),
                    DType::F16 => lt_matmul::<burn::tensor::f16>(operands),
                    _ => lt_matmul::<f32>(operands),
                }
            }
            .map_err(|e| format!("{e:?}"))
        })
        .collect();
    cublaslt_window::end::<C>(window, &handle.windows, &device, &handle.stream);
    drop(held);
    launched
}
