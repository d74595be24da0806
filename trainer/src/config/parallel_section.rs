//! The `[parallel]` section: buckets, clipping, collectives and the ranks' checks.

use serde::{Deserialize, Serialize};

use crate::parallel::{AllreduceDtype, BucketStorage, ClipMode, TiedEmbedding};

/// Data-parallel settings (PyTorch DDP's `bucket_cap_mb`; MLPerf BERT's clipping modes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Gradient clipping with `optimizer.max_grad_norm`: `none`, `global` (the global norm
    /// after the allreduce), `local-global` (each rank's own global norm before it) or
    /// `bucket` (each bucket by its own norm before its allreduce, Samsung's MLPerf v1.1);
    /// [`ClipMode`] gives each formula. Default: global.
    #[arg(long)]
    pub clip: ClipMode,
    /// K of the `bucket` clip mode: each bucket is clipped to `max_grad_norm / √K`. Unset: the
    /// plan's actual bucket count. Samsung's MLPerf v1.1 code fixes K = 22 (its assumed
    /// bucket count; `run_pretraining.py`, `--local_gradient_clip`); pinning K keeps the
    /// optimisation when `bucket_cap_mb` changes the bucket count. Default: unset.
    #[arg(long)]
    pub bucket_clip_count: Option<usize>,
    /// Cap of every gradient bucket but the first, MiB of f32. Default: 25 (PyTorch DDP).
    #[arg(long)]
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket, MiB: small, so communication starts early. Default: 1.
    #[arg(long)]
    pub first_bucket_mb: f64,
    /// Micro-batches per optimizer step (gradient accumulation); only the last one
    /// communicates. Default: 1.
    #[arg(long)]
    pub grad_accum: usize,
    /// Seconds any collective may wait for the other ranks before the run stops with an
    /// error naming the missing rank. Default: 300.
    #[arg(long = "collective-timeout")]
    pub timeout_s: f64,
    /// Where gradient buckets live: `auto` (the device on CUDA and wgpu, the host on the
    /// CPU), `host` or `device` (Note [Bucket storage]). Default: auto.
    #[arg(long)]
    pub buckets: BucketStorage,
    /// How the tied word embedding's gradient is reduced: `auto` (split with more than one
    /// rank), `split` (the decoder's share with the heads' bucket, the batch's rows of the
    /// lookup's share after backward) or `whole` (after backward, as PyTorch DDP)
    /// (Note [Tied embedding split]). Default: auto.

    #[arg(long)]
    pub tied_embedding: TiedEmbedding,
    /// Every this many steps (and at the first), compare each gradient a hook handed to the
    /// reducer with the parameter's gradient when backward returned; a change stops the run
    /// with an error naming the parameter (Note [Re-checking late gradients]). Costs one
    /// pass over the hooked gradients and one small device read after the wait for the
    /// buckets (none in backward); 0 never checks. Default: 100.
    #[arg(long)]
    pub check_gradients_every: u64,
    /// The element type buckets travel in: `f32`, or `bf16` (half the bytes on the wire).
    /// Host buckets sum the bf16 values in f32 (a reduce-scatter and an allgather); device
    /// buckets go through NCCL's bf16 allreduce, which rounds at every hop of its ring, as
    /// PyTorch DDP's `bf16_compress_hook` (Note [bf16 device buckets] in `parallel/bf16.rs`,
    /// with the measured errors of both). Default: f32.
    #[arg(long)]
    pub allreduce_dtype: AllreduceDtype,
    /// Every this many steps, compare a digest of every parameter across the ranks (one
    /// read of the parameters to the host and a small allgather) and stop at the first
    /// tensor that differs (Note [Ranks stay one model] in `parallel/consistency.rs`); they
    /// are always compared at start. 0: only at start. Unset: before every checkpoint.
    /// Default: unset.
    #[arg(long)]
    pub check_every: Option<u64>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            clip: ClipMode::Global,
            bucket_clip_count: None,
            bucket_cap_mb: 25.0,
            first_bucket_mb: 1.0,
            grad_accum: 1,
            timeout_s: 300.0,
            buckets: BucketStorage::Auto,
            tied_embedding: TiedEmbedding::Auto,
            check_gradients_every: 100,
            allreduce_dtype: AllreduceDtype::F32,
            check_every: None,
        }
    }
}
