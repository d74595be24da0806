//! How a window of cuBLASLt products is ordered with CubeCL's kernels (`model.cublaslt_sync`):
//! two host waits (Note [cuBLASLt beside CubeCL] in `cublaslt.rs`) or flags in GPU memory
//! (Note [Device-side GEMM windows] in `gemm_window.rs`; the stream operations are here).

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::collections::hash_map::Entry;

use burn_cubecl::CubeRuntime;
use cubecl::cuda::CudaDevice;
use cudarc::driver::CudaStream;
use cudarc::driver::sys::{
    self, CUdeviceptr, CUstreamWaitValue_flags_enum, CUstreamWriteValue_flags_enum,
};

use super::cublaslt::CudaLike;
use super::gemm_window::{
    DEFAULT_MAX_POLLS, EXPIRED, MAX_POLLS_VAR, RELEASE, SIGNAL, WindowFlags,
    device_windows_refused, max_polls,
};
use crate::{CublasltSync, cublaslt_sync};

/// Windows between two reads of the `expired` flag (a host wait each: about every third
/// BERT-large step, at 16 windows per encoder layer).
const CHECK_EVERY: u32 = 1024;
/// The first windows of a sequence read the `expired` flag too: a device where the order
/// fails shows at the first window, after one window's polls, instead of a thousand windows
/// (each expired, its products read before they were written) later.
const CHECK_FIRST: u32 = 4;

/// Why the environment rules device windows out, if it does ([`device_windows_refused`]),
/// read once: not at every window of a step's hundreds.
fn refused_by_environment() -> Option<&'static String> {
    static REFUSED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    REFUSED
        .get_or_init(|| {
            device_windows_refused(
                std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok(),
                std::env::var("CUDA_LAUNCH_BLOCKING").ok(),
            )
        })
        .as_ref()
}

/// The window kernel's polls: [`MAX_POLLS_VAR`] or the default, read once. A value that is
/// not a number of polls gets a warning naming the variable, and the default.
fn polls() -> u32 {
    static POLLS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *POLLS.get_or_init(
        || match max_polls(std::env::var(MAX_POLLS_VAR).ok().as_deref()) {
            Ok(polls) => polls,
            Err(e) => {
                tracing::warn!("{e}; the GEMM windows poll {DEFAULT_MAX_POLLS} times");
                DEFAULT_MAX_POLLS
            }
        },
    )
}

/// One device's window sequence on one runtime's client (`CudaRuntime`, or the counting
/// runtime around it, whose clients are distinct).
struct DeviceWindows<C: CubeRuntime> {
    flags: WindowFlags<C>,
    /// The device addresses of the `signal` and `release` flags.
    signal: CUdeviceptr,
    release: CUdeviceptr,
    /// The last window's number (0: none yet; the flags start at 0).
    last: u32,
}

/// The device-side state of a GPU's cuBLASLt handle: its window sequences by runtime, or why
/// the device refused stream memory operations (then every window waits on the host).
#[derive(Default)]
pub(super) struct Windows {
    by_runtime: HashMap<TypeId, Box<dyn Any + Send>>,
    refused: Option<String>,
}

/// A window begun by [`begin`], to be ended by [`end`] once its products are enqueued.
pub(super) enum Window {
    /// CubeCL's stream was waited for; ember's is waited for at the end.
    Host,
    /// CubeCL's stream waits on the device for the release of window `number`.
    Device { number: u32, release: CUdeviceptr },
}

/// Orders cuBLASLt's `stream` after the kernels enqueued on `client`'s CubeCL stream so far,
/// as [`cublaslt_sync`] says: a host wait, or Note [Device-side GEMM windows]'s signal (the
/// first device window on a runtime sets up its flags and checks that the device takes stream
/// memory operations; a device that does not gets host waits, with a warning). `host` asks
/// for host waits whatever the setting (a window that launches a cuBLASLt kernel for the first
/// time: `cublaslt.rs`).
///
/// # Panics
/// When CubeCL's stream reports an error (a fault of an earlier kernel).
pub(super) fn begin<C: CudaLike>(
    windows: &mut Windows,
    client: &cubecl::prelude::ComputeClient<C>,
    device: &CudaDevice,
    stream: &CudaStream,
    host: bool,
) -> Window {
    if cublaslt_sync() == CublasltSync::Device
        && windows.refused.is_none()
        && let Some(reason) = refused_by_environment()
    {
        refuse(windows, reason.clone());
    }
    if cublaslt_sync() == CublasltSync::Device && windows.refused.is_none() && !host {
        // The stream memory operations take the thread's current context (CubeCL makes it
        // current on its runner thread only).
        if let Err(e) = stream.context().bind_to_thread() {
            panic!("CUDA device {}: ember's context: {e:?}", device.index);
        }
        match device_windows::<C>(windows, client, device, stream) {
            Ok(w) => {
                // 0 is the `expired` flag's "none".
                let number = w.last.wrapping_add(1).max(1);
                w.last = number;
                w.flags.signal_and_wait(number, polls());
                // SAFETY: `signal` is the flags buffer's first word, kept alive by `w.flags`.
                let waited = unsafe {
                    sys::cuStreamWaitValue32_v2(
                        stream.cu_stream(),
                        w.signal,
                        number,
                        CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                }
                .result();
                match waited {
                    Ok(()) => {
                        return Window::Device {
                            number,
                            release: w.release,
                        };
                    }
                    Err(e) => {
                        // The kernel is on CubeCL's stream: release it from the host once the
                        // earlier windows' products are done (a release of `number` releases
                        // every earlier window too), then wait as usual.
                        wait_for_products(stream, device);
                        release_from_host(w.release, number, device, stream);
                        refuse(windows, format!("cuStreamWaitValue32: {e:?}"));
                    }
                }
            }
            Err(reason) => refuse(windows, reason),
        }
    }
    if let Err(e) = cubecl::future::block_on(client.sync()) {
        panic!(
            "CUDA device {}: CubeCL's stream failed before a cuBLASLt product: {e:?}",
            device.index
        );
    }
    Window::Host
}

/// Orders CubeCL's next kernels after the products enqueued on `stream` since [`begin`]: a
/// host wait for `stream`, or the release of the device window. The first [`CHECK_FIRST`]
/// device windows and every [`CHECK_EVERY`]th read the flags (a host wait) to find a window
/// whose wait expired.
///
/// # Panics
/// When `stream` reports an error (a product failed on the device), or a window's wait
/// expired (cuBLASLt's stream did not release it within the kernel's polls).
pub(super) fn end<C: CudaLike>(
    window: Window,
    windows: &Windows,
    device: &CudaDevice,
    stream: &CudaStream,
) {
    let ordinal = device.index;
    let Window::Device { number, release } = window else {
        wait_for_products(stream, device);
        return;
    };
    if let Err(e) = stream.context().bind_to_thread() {
        panic!("CUDA device {ordinal}: ember's context: {e:?}");
    }
    // SAFETY: `release` is the flags buffer's second word, kept alive by `windows`.
    let written = unsafe {
        sys::cuStreamWriteValue32_v2(
            stream.cu_stream(),
            release,
            number,
            CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    }
    .result();
    if let Err(e) = written {
        // The products are enqueued: wait for them here, then release CubeCL's stream.
        tracing::warn!(
            "cuStreamWriteValue32 on CUDA device {ordinal}: {e:?}; released by the host"
        );
        wait_for_products(stream, device);
        release_from_host(release, number, device, stream);
    }
    if (number <= CHECK_FIRST || number % CHECK_EVERY == 0)
        && let Some(w) = windows
            .by_runtime
            .get(&TypeId::of::<C>())
            .and_then(|w| w.downcast_ref::<DeviceWindows<C>>())
    {
        let values = w.flags.values();
        if values[EXPIRED] != 0 {
            panic!(
                "CUDA device {ordinal}: cuBLASLt's stream did not release GEMM window {} within \
                 {} polls (flags {values:?}): its products may not have run",
                values[EXPIRED],
                polls(),
            );
        }
    }
}

/// The window sequence of runtime `C` on this device, set up at its first window: the flags
/// (zeros, uploaded before ember's stream touches them), their addresses, and one write and
/// wait on ember's stream to check that the device takes stream memory operations.
fn device_windows<'w, C: CudaLike>(
    windows: &'w mut Windows,
    client: &cubecl::prelude::ComputeClient<C>,
    device: &CudaDevice,
    stream: &CudaStream,
) -> Result<&'w mut DeviceWindows<C>, String> {
    let entry = match windows.by_runtime.entry(TypeId::of::<C>()) {
        Entry::Occupied(entry) => entry.into_mut(),
        Entry::Vacant(entry) => {
            let flags = WindowFlags::<C>::new(device, [0; 3]);
            cubecl::future::block_on(client.sync())
                .map_err(|e| format!("the flags' upload: {e:?}"))?;
            let (flags_client, flags_handle) = flags.handle();
            let base = flags_client
                .get_resource(flags_handle.clone())
                .map_err(|e| format!("the flags' buffer: {e:?}"))?
                .resource()
                .ptr;
            let word = |i: usize| base + (i * std::mem::size_of::<u32>()) as CUdeviceptr;
            let (signal, release) = (word(SIGNAL), word(RELEASE));
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| format!("{e:?}"))?;
            // SAFETY: `release` is a live word of the flags buffer, 0 since the upload.
            let probe = unsafe {
                sys::cuStreamWriteValue32_v2(
                    stream.cu_stream(),
                    release,
                    0,
                    CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                )
                .result()
                .map_err(|e| format!("cuStreamWriteValue32: {e:?}"))
                .and_then(|()| {
                    sys::cuStreamWaitValue32_v2(
                        stream.cu_stream(),
                        release,
                        0,
                        CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                    .result()
                    .map_err(|e| format!("cuStreamWaitValue32: {e:?}"))
                })
            }
            .and_then(|()| {
                stream.synchronize().map_err(|e| {
                    format!("ember's stream after the stream memory operations: {e:?}")
                })
            });
            if let Err(reason) = probe {
                // An operation may still be queued on ember's stream against the buffer: keep
                // the buffer (12 bytes) rather than hand it back to CubeCL's pool.
                std::mem::forget(flags);
                return Err(reason);
            }
            let w = DeviceWindows {
                flags,
                signal,
                release,
                last: 0,
            };
            entry.insert(Box::new(w))
        }
    };
    entry
        .downcast_mut::<DeviceWindows<C>>()
        .ok_or_else(|| "the window sequence of another runtime".to_string())
}

/// Writes `release = number` from the host (a memset on the legacy stream, which waits for
/// neither CubeCL's nor ember's non-blocking stream; the kernel polling the flag sees it), for
/// a window whose stream operation failed. The caller has waited for ember's stream, so no
/// earlier window is released before its products are done.
///
/// # Panics
/// When the memset fails: the kernel would then poll until it expires.
fn release_from_host(release: CUdeviceptr, number: u32, device: &CudaDevice, stream: &CudaStream) {
    // The memset takes the thread's current context: the primary one, which CubeCL uses too.
    let bound = stream.context().bind_to_thread();
    // SAFETY: `release` is a live word of the flags buffer.
    let set = bound.and_then(|()| unsafe { sys::cuMemsetD32_v2(release, number, 1) }.result());
    if let Err(e) = set {
        panic!(
            "CUDA device {}: releasing a GEMM window from the host failed: {e:?}",
            device.index
        );
    }
}

/// Waits on the host for the products enqueued on ember's `stream`.
///
/// # Panics
/// When the stream reports an error: a product failed on the device.
fn wait_for_products(stream: &CudaStream, device: &CudaDevice) {
    if let Err(e) = stream.synchronize() {
        panic!(
            "CUDA device {}: a cuBLASLt product failed on the device: {e:?}",
            device.index
        );
    }
}

/// Records why device windows are not used on this device (host waits from now on).
fn refuse(windows: &mut Windows, reason: String) {
    tracing::warn!(
        "model.cublaslt_sync = \"device\": {reason}; cuBLASLt's products wait on the host \
         instead"
    );
    windows.refused = Some(reason);
}
