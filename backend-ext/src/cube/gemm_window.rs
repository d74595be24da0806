//! The CubeCL side of a device-side GEMM window (`model.cublaslt_sync = "device"`): a flags
//! buffer in GPU memory and the one-unit kernel that signals a window and holds CubeCL's stream
//! until the window is released.
//!
//! Note [Device-side GEMM windows]: CubeCL 0.10 runs a thread's kernels on a CUDA stream it does
//! not expose (Note [cuBLASLt beside CubeCL] in `cublaslt.rs`), so cuBLASLt's products run on a
//! stream of ember's own, and the two must be ordered: the products after the kernels that wrote
//! their operands, CubeCL's next kernels after the products. With host waits each window costs
//! two synchronisations and leaves the GPU idle while the host catches up. Here the order is
//! kept on the device, with three `u32` flags (`[signal, release, expired]`):
//!
//! 1. CubeCL's stream runs [`signal_and_wait_kernel`] with the window's number `n`: it writes
//!    `signal = n` (after every earlier kernel of the stream, which wrote the operands), then
//!    polls `release` until it reaches `n`. CubeCL's queue is pushed to CUDA after the launch
//!    by a blocking call to its runner thread that does not wait for the device
//!    ([`WindowFlags::signal_and_wait`]): CubeCL hands launches to CUDA in batches, and the
//!    kernel must reach CUDA before anything waits for its signal;
//! 2. cuBLASLt's stream waits for `signal ≥ n` (`cuStreamWaitValue32`, `GEQ`), runs the
//!    window's products, then writes `release = n` (`cuStreamWriteValue32`, whose default
//!    flags put a memory barrier before the write);
//! 3. the kernel returns, and CubeCL's next kernels read the products.
//!
//! The host enqueues all of it and waits for nothing. The cost is one launch of a one-unit
//! kernel per window, which occupies one unit of one SM while the products run. This is the
//! pattern of NCCL's proxy flags and of NVSHMEM's `signal_wait_until`: a kernel spinning on a
//! flag in GPU memory written by another stream. Window numbers grow by one per window and
//! wrap (skipping 0, the "none" of `expired`); both sides compare cyclically, as `cuStreamWaitValue32`'s `GEQ` does (`(int32)(flag −
//! n) ≥ 0`), so a release of window `n` also releases every earlier one. The kernel gives up
//! after `max_polls` polls and writes `expired = n`, so a stream that never releases (a fault on
//! cuBLASLt's side) stops the wait instead of hanging the process; the host reads `expired`
//! at the first windows and then now and then ([`WindowFlags::values`]) and treats a non-zero
//! value as a device fault. Where the order cannot hold, device windows are refused
//! ([`device_windows_refused`]: one hardware queue, blocking launches).
//!
//! The operands' memory goes back to CubeCL at the window's end without a wait. That is safe
//! because CubeCL 0.10 keeps a memory pool per stream and ember's operands come from the
//! calling thread's stream, whose next kernels wait behind the window kernel; an operand
//! allocated on another thread's stream would need host waits.
//!
//! The kernel is plain CubeCL (atomics on `u32`), so the kernel tests run it on lavapipe too,
//! with the release written beforehand or never (`max_polls` then ends it). The CUDA stream
//! operations are in `cublaslt_window.rs`.

pub use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Index of the flag CubeCL's kernel writes when a window's operands are ready.
pub const SIGNAL: usize = 0;
/// Index of the flag cuBLASLt's stream writes when a window's products are done.
pub const RELEASE: usize = 1;
/// Index of the flag the kernel writes when it stopped waiting for a release.
pub const EXPIRED: usize = 2;

/// `signal = window`, then polls until `release` has reached `window` (cyclically, as
/// `cuStreamWaitValue32`'s `GEQ`), or writes `expired = window` after `max_polls` polls. Launch
/// with one cube of one unit (Note [Device-side GEMM windows]).
#[cube(launch)]
pub fn signal_and_wait_kernel(flags: &mut Array<Atomic<u32>>, window: u32, max_polls: u32) {
    if UNIT_POS == 0 {
        flags[SIGNAL].store(window);
        let mut polls = 0u32;
        let mut waiting = true;
        while waiting {
            let released = flags[RELEASE].load();
            // (int32)(released − window) ≥ 0, in unsigned arithmetic (wrapping).
            if released - window < 2147483648u32 {
                waiting = false;
            } else {
                polls += 1;
                if polls >= max_polls {
                    flags[EXPIRED].store(window);
                    waiting = false;
                }
            }
        }
    }
}

/// Whether `released` has reached `window` in the cyclic order of the window numbers (the
/// kernel's and `cuStreamWaitValue32`'s `GEQ` test, on the host).
pub fn released(released: u32, window: u32) -> bool {
    released.wrapping_sub(window) < 1 << 31
}

/// The three flags of Note [Device-side GEMM windows] in a device's memory, on one runtime's
/// client.
pub struct WindowFlags<R: CubeRuntime> {
    client: ComputeClient<R>,
    handle: Handle,
}

impl<R: CubeRuntime> WindowFlags<R> {
    /// The flags on `device`, set to `[signal, release, expired]` (a new window sequence starts
    /// from zeros). The upload is enqueued on this thread's CubeCL stream.
    pub fn new(device: &R::Device, values: [u32; 3]) -> Self {
        let client = R::client(device);
        let handle = client.create_from_slice(u32::as_bytes(&values));
        Self { client, handle }
    }

    /// Enqueues [`signal_and_wait_kernel`] for `window` on this thread's CubeCL stream and
    /// pushes CubeCL's queue to CUDA (a blocking call, not `flush`), so that the kernel has
    /// reached the device's stream when this returns: the kernels enqueued after it start once the window is released (or the wait
    /// expired).
    ///
    /// CubeCL hands its launches to a runner thread in batches (32 tasks, or a blocking call):
    /// without a blocking call here the kernel could reach CUDA after the stream operations
    /// that wait for its signal, and a host wait on that stream would never return.
    ///
    /// The blocking call is `memory_usage`, not `flush`: any blocking call makes the runner
    /// take the queued tasks first, in order (each launch task calls `cuLaunchKernel`), but
    /// CubeCL's CUDA `flush` also waits on the host for the event it recorded at the previous
    /// flush (its drop queue frees memory behind that fence: `cubecl-runtime`'s
    /// `PendingDropQueue::flush`, a `cuEventSynchronize`). Here that event would follow the
    /// previous window's kernel, so each window would wait for the previous window's products
    /// and the host could never run more than one window ahead. `memory_usage` reads the pool's
    /// counters and waits for nothing on the device (the counting runtime's `flushes` stay 0:
    /// the kernel tests check it on lavapipe and CUDA). CubeCL still flushes its drop queue by
    /// itself after a launch once 64 buffers or 64 MiB wait to be freed (`cubecl-cuda`'s
    /// `Command::kernel`), a wait for the previous such flush that is its policy, not a
    /// window's, and that the counting runtime does not see.
    pub fn signal_and_wait(&self, window: u32, max_polls: u32) {
        // SAFETY: the buffer holds the three `u32` flags the kernel indexes.
        let flags = unsafe { ArrayArg::from_raw_parts(self.handle.clone(), 3) };
        signal_and_wait_kernel::launch::<R>(
            &self.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            flags,
            window,
            max_polls,
        );
        // A blocking call to the runner (the queued launches reach CUDA), not a device wait.
        if let Err(e) = self.client.memory_usage() {
            panic!("CubeCL's queue did not reach CUDA after a GEMM window's kernel: {e:?}");
        }
    }

    /// `[signal, release, expired]`, read after the kernels enqueued before (a host wait).
    pub fn values(&self) -> [u32; 3] {
        let bytes = self.client.read_one_unchecked(self.handle.clone());
        let values = u32::from_bytes(&bytes);
        [values[SIGNAL], values[RELEASE], values[EXPIRED]]
    }

    /// The buffer's handle (for its device address) and the client it lives on.
    pub fn handle(&self) -> (&ComputeClient<R>, &Handle) {
        (&self.client, &self.handle)
    }
}

/// Polls before the window kernel stops waiting, by default: 2²⁸, minutes on a GPU (a poll is
/// an atomic round trip to L2), where a window's products take milliseconds.
pub const DEFAULT_MAX_POLLS: u32 = 1 << 28;

/// The environment variable that sets the window kernel's polls ([`max_polls`]): a smaller
/// budget makes a window whose release never comes show within seconds (the GPU check's
/// smoke runs), at the risk of expiring a window whose host was merely slow to enqueue it.
pub const MAX_POLLS_VAR: &str = "EMBER_GEMM_WINDOW_MAX_POLLS";

/// The window kernel's polls for [`MAX_POLLS_VAR`]'s `value`: [`DEFAULT_MAX_POLLS`] when
/// unset.
///
/// # Errors
/// A value that is not a whole number from 1 to 2³² − 1, with the variable's name.
pub fn max_polls(value: Option<&str>) -> Result<u32, String> {
    let Some(value) = value else {
        return Ok(DEFAULT_MAX_POLLS);
    };
    match value.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "{MAX_POLLS_VAR}={value:?}: expected the window kernel's polls, a whole number from 1 \
             to {}",
            u32::MAX
        )),
    }
}

/// Why device windows cannot be used, if they cannot, from `CUDA_DEVICE_MAX_CONNECTIONS`
/// and `CUDA_LAUNCH_BLOCKING`:
/// - with one connection (Megatron-LM's setting, which NVIDIA's containers often carry) every
///   stream's work goes through one hardware queue in submission order, so a product enqueued
///   on ember's stream after the window kernel that waits for it on CubeCL's would wait
///   behind it until the wait expires;
/// - with launches made blocking (`CUDA_LAUNCH_BLOCKING=1`, as debugging and
///   compute-sanitizer run them) the window kernel's launch returns only when the kernel has
///   ended, which it does only after the products that the same host thread has yet to
///   enqueue: every window would wait until it expires. The CUDA driver API's stream memory
///   operations warn that their ordering is invisible to CUDA and may deadlock where misused.
///
/// (Note [Device-side GEMM windows].)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn device_windows_refused(
    max_connections: Option<String>,
    launch_blocking: Option<String>,
) -> Option<String> {
    if max_connections.is_some_and(|v| v.trim() == "1") {
        return Some(
            "CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware queue, where a \
             window kernel would wait for products queued behind it"
                .to_string(),
        );
    }
    launch_blocking.is_some_and(|v| v.trim() == "1").then(|| {
        "CUDA_LAUNCH_BLOCKING=1 returns from a window kernel's launch only when it has \
             ended, which it does only once the products enqueued after it have run"
            .to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::{DEFAULT_MAX_POLLS, MAX_POLLS_VAR, device_windows_refused, max_polls, released};

    #[test]
    fn window_numbers_compare_cyclically_as_cu_stream_wait_value_geq() {
        assert!(released(5, 5));
        assert!(released(6, 5));
        assert!(!released(4, 5));
        assert!(!released(0, 1), "a fresh buffer holds no window");
        // Across the wrap: window 0 follows u32::MAX.
        assert!(released(0, u32::MAX));
        assert!(released(3, u32::MAX - 2));
        assert!(!released(u32::MAX, 0));
        // Half the cycle apart is the boundary of int32's sign.
        assert!(released((1 << 31) - 1, 0));
        assert!(!released(1 << 31, 0));
    }

    #[test]
    fn one_connection_or_blocking_launches_refuse_device_windows() {
        let refused = |connections: Option<&str>, blocking: Option<&str>| {
            device_windows_refused(connections.map(String::from), blocking.map(String::from))
        };
        assert!(
            refused(Some("1"), None)
                .unwrap()
                .contains("CUDA_DEVICE_MAX_CONNECTIONS")
        );
        assert!(refused(Some(" 1\n"), None).is_some());
        assert_eq!(refused(Some("8"), None), None);
        assert_eq!(refused(Some("32"), None), None);
        assert_eq!(refused(None, None), None);
        assert!(
            refused(None, Some("1"))
                .unwrap()
                .contains("CUDA_LAUNCH_BLOCKING")
        );
        assert!(refused(Some("8"), Some("1")).is_some());
        assert_eq!(refused(None, Some("0")), None);
    }

    #[test]
    fn the_window_kernels_polls_come_from_the_environment_or_the_default() {
        assert_eq!(max_polls(None), Ok(DEFAULT_MAX_POLLS));
        assert_eq!(max_polls(Some("16777216")), Ok(1 << 24));
        assert_eq!(max_polls(Some(" 1000\n")), Ok(1000));
        for bad in ["0", "-5", "1e6", "", "4294967296"] {
            let e = max_polls(Some(bad)).unwrap_err();
            assert!(
                e.starts_with(MAX_POLLS_VAR) && e.contains("whole number"),
                "{bad}: {e}"
            );
        }
    }
}
