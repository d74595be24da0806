//! The workspace's integration tests, as one test binary: each binary links (and, at opt-level
//! 3, monomorphises) Burn, the model and the trainer again, about 1.5 minutes of a 2-core build
//! apiece. The data-parallel tests (`data_parallel/`) were a second binary, for NdArray's
//! process-wide random generator; each test now draws its weights under the trainer's
//! initialisation lock, and nextest runs every test in a process of its own. The fused
//! kernels' own tests (`kernels/`) are here too, on this binary's wgpu backend type.

// OpenBLAS's kernels for this CPU (a restart before the harness starts where it chose slower).
ember_tests::openblas_kernels_of_this_cpu!();
// The allocator of `ember`'s binary: mimalloc, keeping freed pages.
ember_tests::ember_binarys_allocator!();

mod data_parallel;
mod device_reducer;
mod docs;
mod embed;
mod eval_shards;
mod fused_training;
mod hf_parity;
mod kernels;
mod mixed_precision;
mod model;
mod pretrained;
mod reference_ops;
mod shard_training;
mod train;
mod unpad;
mod vocab_padding;

/// The wgpu backend of these tests (Mesa's lavapipe in CI): CubeCL's wgpu runtime wrapped in
/// ember's host-synchronisation counter, which changes nothing else (one backend type for all
/// wgpu tests, so that the binary monomorphises Burn's CubeCL ops once).
pub type Wgpu = ember_backend_ext::CountingWgpu;
