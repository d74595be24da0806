//! Starting on an NVIDIA GPU: the libraries cudarc opens, found by the names machines ship
//! ([`libs`], compiled everywhere), and the GPU a rank takes, named in the log ([`device`],
//! with the `cuda` feature).

#[cfg(feature = "cuda")]
pub mod device;
pub mod libs;
