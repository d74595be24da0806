//! The window kernel of `model.cublaslt_sync = "device"` (Note [Device-side GEMM windows] in
//! `backend-ext/src/cube/gemm_window.rs`): it signals its window, returns once the window is
//! released (cyclically: a later release, across the wrap of the numbers, releases it too),
//! and gives up after its polls with the window recorded as expired. CubeCL's stream waits for
//! it: the flags read after it show its writes.

use ember_backend_ext::gemm_window::{CubeRuntime, WindowFlags};

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
        flags.signal_and_wait(window, polls);
        assert_eq!(
            flags.values(),
            after,
            "window {window} from flags {before:?} with {polls} polls"
        );
    }
    // Two windows back to back on one buffer: the second starts after the first returned.
    let flags = WindowFlags::<R>::new(device, [0, 1, 0]);
    flags.signal_and_wait(1, 1_000);
    flags.signal_and_wait(2, 50);
    assert_eq!(flags.values(), [2, 1, 2]);
}
