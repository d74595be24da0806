//! The window kernel of `model.cublaslt_sync = "device"` (Note [Device-side GEMM windows] in
//! `backend-ext/src/cube/gemm_window.rs`): it signals its window, returns once the window is
//! released (cyclically: a later release, across the wrap of the numbers, releases it too),
//! and gives up after its polls with the window recorded as expired. CubeCL's stream waits for
//! it: the flags read after it show its writes. `R` is a counting runtime: enqueuing a window
//! is one launch that has reached the server when `signal_and_wait` returns, with no flush of
//! CubeCL's queue (on CUDA a flush waits for the device to reach the previous one) and no
//! host wait.

use ember_backend_ext::HostSyncs;
use ember_backend_ext::gemm_window::{CubeRuntime, WindowFlags};

/// Enqueues window `window` on `flags` and checks what it cost the host.
fn signal_and_wait<R: CubeRuntime>(flags: &WindowFlags<R>, window: u32, polls: u32) {
    let before = HostSyncs::now();
    flags.signal_and_wait(window, polls);
    let cost = HostSyncs::now().since(before);
    assert_eq!(
        (cost.launches, cost.flushes, cost.total()),
        (1, 0, 0),
        "window {window}: (launches taken by the server, flushes, host waits) of enqueuing it"
    );
}

pub(super) fn check_window_kernel<R: CubeRuntime>(device: &R::Device) {
    // (flags before, window, polls, flags after)
    let cases: [([u32; 3], u32, u32, [u32; 3]); 5] = [
        ([0, 7, 0], 7, 1_000, [7, 7, 0]),
        ([3, 9, 0], 8, 1_000, [8, 9, 0]),
        // Across the wrap: window u32::MAX − 1 is released by 2.
        ([0, 2, 0], u32::MAX - 1, 1_000, [u32::MAX - 1, 2, 0]),
        // Never released: the wait expires and says which window.
        ([0, 4, 0], 5, 100, [5, 4, 5]),
        // Window 1 after u32::MAX (the host skips 0, the "none" of `expired`): not released.
        ([0, u32::MAX, 0], 1, 100, [1, u32::MAX, 1]),
    ];
    for (before, window, polls, after) in cases {
        let flags = WindowFlags::<R>::new(device, before);
        signal_and_wait(&flags, window, polls);
        assert_eq!(
            flags.values(),
            after,
            "window {window} from flags {before:?} with {polls} polls"
        );
    }
    // Two windows back to back on one buffer: the second starts after the first returned.
    let flags = WindowFlags::<R>::new(device, [0, 1, 0]);
    signal_and_wait(&flags, 1, 1_000);
    signal_and_wait(&flags, 2, 50);
    assert_eq!(flags.values(), [2, 1, 2]);
}
