//! NVIDIA's cuBLASLt as ember's GEMM on CUDA (`model.gemm = "cublaslt"`, Note [GPU GEMMs] in
//! `gemm.rs`): the dense layers' products (the bias in the forward product's epilogue, the
//! bias gradient in the weight gradient's) and attention's batched products, through
//! `cublasLtMatmul` with the algorithm its heuristic ranks first (`cublaslt_call.rs`: f32
//! operands as TF32, `CUBLAS_COMPUTE_32F_FAST_TF32`, as cubek's tensor-core kernels read them;
//! bf16 and f16 multiplied exactly and accumulated in f32, `CUBLAS_COMPUTE_32F`; descriptors
//! kept per kind of product, Note [cuBLASLt descriptors kept]).
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
//! kind (a layout, dtypes and epilogue) is not offered again; a weight gradient whose
//! bias-gradient epilogue was refused is offered without it. An error reported by either wait is a device fault, not a
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
use cudarc::driver::{CudaContext, CudaStream};

use super::cublaslt_call::{Epilogue, Kind, Lt, Pointers};
use super::cublaslt_window::{self, Windows};
use crate::gemm_layout::column_major_gemm;

/// One GPU's cuBLASLt handle (with its workspace and prepared kinds of product:
/// `cublaslt_call.rs`) and the stream its products run on.
struct Handle {
    lt: Lt,
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

/// Products whose bias gradient cuBLASLt's epilogue computed, since the process started.
static BIAS_GRADIENTS: AtomicUsize = AtomicUsize::new(0);

/// How many products cuBLASLt computed in this process (each batched product counts once).
pub fn products() -> usize {
    PRODUCTS.load(Ordering::Relaxed)
}

/// How many of [`products`] also computed a dense layer's bias gradient in their epilogue
/// (`CUBLASLT_EPILOGUE_BGRADA`, the weight gradient's product), instead of a reduction of
/// its own.
pub fn bias_gradients() -> usize {
    BIAS_GRADIENTS.load(Ordering::Relaxed)
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
    let lt = Lt::new(&stream).map_err(|e| format!("cuBLASLt on CUDA device {ordinal}: {e}"))?;
    let handle = Arc::new(Mutex::new(Handle {
        lt,
        stream,
        windows: Windows::default(),
    }));
    map.insert(ordinal, handle.clone());
    Ok(handle)
}

/// What a product of [`matmuls`] does besides `a · b` (cuBLASLt's epilogues: Note [cuBLASLt
/// descriptors kept] in `cublaslt_call.rs`).
pub(crate) enum With<'t, R: CubeRuntime> {
    /// The product alone.
    Nothing,
    /// `bias` `[n]` added to every row (`CUBLASLT_EPILOGUE_BIAS`; a product without batch).
    Bias(&'t CubeTensor<R>),
    /// Also `Σ_rows b` `[n]`, in the product's output dtype (`CUBLASLT_EPILOGUE_BGRADA`: with `a = xᵀ` and
    /// `b` the output's gradient, the dense layer's bias gradient beside `dW`; a product
    /// without batch).
    BiasGradient,
}

// (By hand: a derive would ask `R: Copy`.)
impl<R: CubeRuntime> Clone for With<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: CubeRuntime> Copy for With<'_, R> {}

/// One product for [`matmuls`]: `a · b`, what else it does, and the dtype to write it in (the
/// operands', or f32 beside half operands: Note [cuBLASLt's f32 output] in `cublaslt_call.rs`).
pub(crate) type Operands<'t, R> = (&'t CubeTensor<R>, &'t CubeTensor<R>, With<'t, R>, DType);

/// A product computed by cuBLASLt: `a · b` (with the bias, where asked), and `Σ_rows b` where
/// [`With::BiasGradient`] asked for it.
pub(crate) struct Product<R: CubeRuntime> {
    pub out: CubeTensor<R>,
    pub bias_gradient: Option<CubeTensor<R>>,
}

/// `a · b` (Burn's `float_matmul` semantics: batched over the leading dimensions, broadcast
/// where one side has 1), plus `bias` `[n]` on every row (cuBLASLt's `CUBLASLT_EPILOGUE_BIAS`:
/// one kernel where the add would be another; a product without batch only), through cuBLASLt
/// when `R` is CUDA, the tensors are f32, bf16 or f16 of one dtype, and their layout has a
/// plan; written in the operands' dtype; `None` otherwise, for the caller's CubeCL matmul (and bias add).
pub(crate) fn matmul<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    let with = bias.map_or(With::Nothing, With::Bias);
    matmuls(&[(a, b, with, a.dtype)])
        .pop()
        .flatten()
        .map(|p| p.out)
}

/// Products that do not read each other's outputs, as [`matmul`] each (with their
/// [`With`]), all in the same window (the dense layer's `dx` and `dW` with `db`; attention's
/// `dV` and `dP`, `dQ` and `dK`): one window of Note [cuBLASLt beside CubeCL] instead of one per
/// product. `None` where a product has no plan or cuBLASLt refused it, for the caller's CubeCL
/// matmul (and its own bias add or bias gradient).
pub(crate) fn matmuls<R: CubeRuntime>(products: &[Operands<'_, R>]) -> Vec<Option<Product<R>>> {
    // Burn's CUDA backend, or ember's counting one around it (`CountingCuda`: what `train`
    // and the step benchmarks run): the same storage, so the same pointers.
    fn on<R: CubeRuntime, C: CudaLike>(
        products: &[Operands<'_, R>],
    ) -> Option<Vec<Option<Product<R>>>> {
        fn cast<R: CubeRuntime, C: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<C>> {
            (t as &dyn Any).downcast_ref()
        }
        fn back<C: CubeRuntime, R: CubeRuntime>(t: CubeTensor<C>) -> Option<CubeTensor<R>> {
            let t: Box<dyn Any> = Box::new(t);
            t.downcast::<CubeTensor<R>>().ok().map(|t| *t)
        }
        let mut cast_products = Vec::with_capacity(products.len());
        for &(a, b, with, output) in products {
            let with = match with {
                With::Nothing => With::Nothing,
                With::Bias(bias) => With::Bias(cast::<R, C>(bias)?),
                With::BiasGradient => With::BiasGradient,
            };
            cast_products.push((cast::<R, C>(a)?, cast::<R, C>(b)?, with, output));
        }
        Some(
            cuda_matmuls(&cast_products)
                .into_iter()
                .map(|product| {
                    let product = product?;
                    Some(Product {
                        out: back(product.out)?,
                        bias_gradient: match product.bias_gradient {
                            Some(db) => Some(back(db)?),
                            None => None,
                        },
                    })
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

/// The kinds of product (plan, dtypes, epilogue) cuBLASLt refused, so that they go to CubeCL's
/// matmul at once instead of after another host wait.
fn refused() -> &'static Mutex<HashSet<Kind>> {
    static REFUSED: OnceLock<Mutex<HashSet<Kind>>> = OnceLock::new();
    REFUSED.get_or_init(Default::default)
}

/// A product with a plan, and its outputs' memory.
struct Planned<'t, C: CubeRuntime> {
    a: &'t CubeTensor<C>,
    b: &'t CubeTensor<C>,
    bias: Option<&'t CubeTensor<C>>,
    out: CubeTensor<C>,
    /// `[n]`, for [`With::BiasGradient`].
    bias_gradient: Option<CubeTensor<C>>,
    kind: Kind,
}

/// The plan of one product and its outputs, or `None` (no plan, dtypes cuBLASLt is not
/// offered, a bias or bias gradient the epilogue cannot take, a kind refused before).
fn plan<'t, C: CudaLike>((a, b, with, output): Operands<'t, C>) -> Option<Planned<'t, C>> {
    if a.dtype != b.dtype || super::cublaslt_call::types(a.dtype, output).is_none() {
        return None;
    }
    let (a_shape, b_shape) = (a.shape(), b.shape());
    let plan = column_major_gemm(
        a_shape.as_slice(),
        a.meta.strides(),
        b_shape.as_slice(),
        b.meta.strides(),
    )?;
    // The epilogues' vectors run over C''s rows (the row-major output's columns), one vector
    // for one product (no batch).
    let (bias, mut epilogue) = match with {
        With::Nothing => (None, Epilogue::None),
        With::Bias(bias) => (Some(bias), Epilogue::Bias),
        With::BiasGradient => (None, Epilogue::BiasGradient),
    };
    // The bias gradient needs one product with more than one row to sum (cuBLASLt before 12.3.4
    // has no BGRADA at k = 1, nvmath-python's `BgradHandler`) and `A'` read as stored (BGRADA
    // sums `op(A')` over `k` for a non-transposed `A'` only: nvmath-python's cuBLASMp tests;
    // the dense layer's `dW` plan reads `g` as stored, `gemm_layout.rs`): otherwise the
    // product runs without it and the caller's reduction computes it, with no refusal spent.
    if epilogue == Epilogue::BiasGradient && (plan.batch != 1 || plan.k == 1 || plan.transa) {
        epilogue = Epilogue::None;
    }
    if epilogue == Epilogue::Bias && plan.batch != 1 {
        return None;
    }
    // The bias has the output's type (cuBLASLt's default `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE`).
    if let Some(bias) = bias
        && (bias.dtype != output
            || bias.shape().as_slice() != [plan.m]
            || bias.meta.strides()[0] != 1)
    {
        return None;
    }
    // A view starting off cuBLASLt's 256-byte alignment (`run` checks the pointers themselves;
    // CubeCL's buffers start on 512 bytes) goes to CubeCL's matmul without outputs allocated
    // for nothing.
    if [Some(a), Some(b), bias]
        .into_iter()
        .flatten()
        .any(|t| !t.handle.offset_start.unwrap_or(0).is_multiple_of(256))
    {
        return None;
    }
    let refused = refused().lock().unwrap_or_else(|e| e.into_inner());
    // A weight gradient whose bias-gradient epilogue was refused is still a product cuBLASLt
    // may take: without the epilogue (the caller's reduction computes the bias gradient).
    let kind_with = |epilogue| Kind {
        plan,
        operands: a.dtype,
        output,
        epilogue,
    };
    if epilogue == Epilogue::BiasGradient && refused.contains(&kind_with(epilogue)) {
        epilogue = Epilogue::None;
    }
    let kind = kind_with(epilogue);
    if refused.contains(&kind) {
        return None;
    }
    drop(refused);
    let rank = a_shape.num_dims();
    let mut out_dims: Vec<usize> = (0..rank - 2).map(|d| a_shape[d].max(b_shape[d])).collect();
    out_dims.extend([a_shape[rank - 2], b_shape[rank - 1]]);
    let empty = |dims: Vec<usize>| {
        empty_device_contiguous_dtype(
            a.client.clone(),
            a.device.clone(),
            Shape::from(dims),
            output,
        )
    };
    let out = empty(out_dims);
    let bias_gradient = (epilogue == Epilogue::BiasGradient).then(|| empty(vec![plan.m]));
    Some(Planned {
        a,
        b,
        bias,
        out,
        bias_gradient,
        kind,
    })
}

fn cuda_matmuls<C: CudaLike>(products: &[Operands<'_, C>]) -> Vec<Option<Product<C>>> {
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
                    if planned.bias_gradient.is_some() {
                        BIAS_GRADIENTS.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Product {
                        out: planned.out,
                        bias_gradient: planned.bias_gradient,
                    })
                }
                Err(Refusal::Operands(reason)) => {
                    // This product's pointers, not its kind: the next product of the kind
                    // tries cuBLASLt again.
                    if REFUSALS.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!(
                            "cuBLASLt did not take a product of {:?} [{:?}]·[{:?}] ({reason}): \
                             CubeCL's matmul runs it, and the next refusals are only counted",
                            planned.a.dtype,
                            planned.a.shape(),
                            planned.b.shape(),
                        );
                    }
                    None
                }
                Err(Refusal::Kind(reason)) => {
                    refused()
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(planned.kind);
                    if REFUSALS.fetch_add(1, Ordering::Relaxed) == 0 {
                        tracing::warn!(
                            "cuBLASLt refused a product of {:?} [{:?}]·[{:?}] written in {:?} \
                             with epilogue {:?} ({reason}): CubeCL's matmul runs it and the \
                             products of its kind, and the next refusals are only counted",
                            planned.a.dtype,
                            planned.a.shape(),
                            planned.b.shape(),
                            planned.kind.output,
                            planned.kind.epilogue
                        );
                    }
                    None
                }
            }
        })
        .collect()
}

/// Why cuBLASLt did not compute a product.
enum Refusal {
    /// Of the product's kind (no handle: the library, the device; no algorithm for the
    /// layout; a refused launch): the kind's later products go to CubeCL directly.
    Kind(String),
    /// Of this product's operands (a pointer off cuBLASLt's alignment: a view into a buffer;
    /// CubeCL could not give a buffer): the kind's next product tries cuBLASLt again.
    Operands(String),
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
fn run<C: CudaLike>(
    ordinal: usize,
    planned: &[Option<Planned<'_, C>>],
) -> Vec<Result<(), Refusal>> {
    let handle = match handle(ordinal) {
        Ok(handle) => handle,
        Err(e) => {
            return planned
                .iter()
                .map(|_| Err(Refusal::Kind(e.clone())))
                .collect();
        }
    };
    let mut handle = handle.lock().unwrap_or_else(|e| e.into_inner());
    // cuBLASLt launches in the calling thread's current CUDA context. CubeCL makes its
    // context current on its own runner thread only, cudarc on the thread that made the
    // handle; without this, another thread's first product runs in the CUDA runtime's
    // default (device 0's primary context), which on any other device fails, or binds a
    // context on device 0 that the rank never meant to use.
    if let Err(e) = handle.stream.context().bind_to_thread() {
        let reason = format!("CUDA device {ordinal}'s context on this thread: {e:?}");
        return planned
            .iter()
            .map(|_| Err(Refusal::Kind(reason.clone())))
            .collect();
    }
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
    let mut results: Vec<Result<Pointers, Refusal>> = Vec::new();
    for p in planned {
        let Some(p) = p else {
            results.push(Err(Refusal::Kind("no plan".into())));
            continue;
        };
        let pointers = (|| {
            let (ra, rb, rc) = (resource(p.a)?, resource(p.b)?, resource(&p.out)?);
            let rvector = p
                .bias
                .or(p.bias_gradient.as_ref())
                .map(resource)
                .transpose()?;
            // (CubeCL's resource type is private to cubecl-cuda: its fields are read in place.)
            // A' is the row-major right operand, B' the left (Note [Row-major GEMMs on a
            // column-major BLAS] in gemm_layout.rs).
            let pointers = Pointers {
                a: rb.resource().ptr,
                b: ra.resource().ptr,
                c: rc.resource().ptr,
                vector: rvector.as_ref().map_or(0, |r| r.resource().ptr),
            };
            held.push((ra, rb, rc, rvector));
            // cuBLASLt picks its kernel assuming 256-byte aligned pointers (the default of
            // `CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`, left unset). CubeCL's buffers are
            // 512-byte aligned; a view into one may not be.
            for (what, ptr) in [
                ("left operand", pointers.b),
                ("right operand", pointers.a),
                ("output", pointers.c),
                ("bias or bias gradient", pointers.vector),
            ] {
                if ptr % 256 != 0 {
                    return Err(format!("the {what} is not 256-byte aligned"));
                }
            }
            Ok(pointers)
        })();
        results.push(pointers.map_err(Refusal::Operands));
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
    // A window with a kind's first product waits on the host: cuBLASLt loads that kind's kernels
    // at their first launch (CUDA's lazy loading), which may wait for the device, where a
    // device window's kernel would be spinning until the products it waits for are done
    // (CUDA's Lazy Loading notes: a kernel waiting on another that is still to be loaded can
    // deadlock). Each kind keeps its algorithm, so its later launches load nothing.
    let first_of_a_kind = planned
        .iter()
        .flatten()
        .any(|p| !handle.lt.is_prepared(&p.kind));
    let window = cublaslt_window::begin(
        &mut handle.windows,
        &client,
        &device,
        &handle.stream,
        first_of_a_kind,
    );
    let launched: Vec<Result<(), Refusal>> = planned
        .iter()
        .zip(results)
        .map(|(p, pointers)| {
            // A product without a plan has no pointers: it stops here.
            let pointers = pointers?;
            let p = p.as_ref().expect("a product with pointers has a plan");
            // SAFETY: the pointers are CubeCL's live buffers (held in `held`; CubeCL's stream
            // runs nothing after the window's start until its end), written before the window
            // began (`cublaslt_window::begin`); the plan's layouts stay within each tensor's
            // elements (gemm_layout.rs, tested against the column-major definition), and the
            // bias and bias gradient have C''s `m` elements (`plan`).
            unsafe { handle.lt.matmul(&p.kind, &pointers, &handle.stream) }.map_err(Refusal::Kind)
        })
        .collect();
    cublaslt_window::end::<C>(window, &handle.windows, &device, &handle.stream);
    drop(held);
    launched
}
