//! Collective communication behind two traits; the in-process implementation (one thread per
//! rank) that tests and single-machine runs use is in `in_process.rs`.
//!
//! [`Collective`] works on host memory: every implementation has it (in-process, MPI, NCCL
//! staging through its device), and the trainer uses it for what is small or lives on the host
//! anyway (configurations, sample references, losses and evaluation counts, start-up
//! parameters). [`DeviceCollective`] allreduces a gradient bucket where it lives, on the
//! device of the rank's backend: NCCL in place on the GPU buffer, the in-process hub by Burn
//! ops on the shared device. See Note [Bucket storage] in `buckets.rs`.
//!
//! Every collective takes part in a numbered sequence: the n-th call on every rank is the same
//! operation, as in MPI and NCCL. Ranks that disagree (one calls `allreduce` where another
//! calls `broadcast`, or buffer sizes differ) get an error, not a hang; a rank that never
//! arrives makes the others fail after the timeout with an error naming it.

use std::time::Duration;

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// How an allreduce combines the ranks' buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over ranks.
    Sum,
    /// Element-wise sum divided by `world_size` (what data-parallel gradients need).
    Average,
}

/// A failed collective. Each variant names the rank at fault where it is known.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// A rank dropped its communicator (it returned an error, panicked or was killed) before
    /// contributing to an operation the others wait on.
    #[error("rank {rank} left the job before {op} #{seq} (it failed or was killed)")]
    RankGone {
        /// The rank that left.
        rank: usize,
        /// The operation the others were waiting in.
        op: &'static str,
        /// Sequence number of the operation.
        seq: u64,
    },
    /// The operation did not complete within the timeout.
    #[error(
        "{op} #{seq} on rank {rank} timed out after {:.1} s waiting for rank(s) {missing:?}",
        timeout.as_secs_f64()
    )]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// Sequence number of the operation.
        seq: u64,
        /// The timeout in force.
        timeout: Duration,
        /// Ranks that had not arrived (empty when unknown, as with MPI).
        missing: Vec<usize>,
    },
    /// Ranks called different operations, or the same one with different sizes.
    #[error("collective #{seq} mismatch: {detail}")]
    Mismatch {
        /// Sequence number of the operation.
        seq: u64,
        /// What differed, naming the ranks.
        detail: String,
    },
    /// An error reported by the communication library (MPI, NCCL).
    #[error("{backend}: {message}")]
    Backend {
        /// `mpi`, `nccl`, or `device` (the device that wrote a bucket).
        backend: &'static str,
        /// The library's message.
        message: String,
    },
}

/// The collectives data-parallel training needs, on host memory. Each call blocks until the
/// operation has completed on this rank; implementations bound the wait by a timeout.
///
/// The in-process and MPI implementations work on the buffers directly, NCCL stages them
/// through device memory.
pub trait Collective: Send {
    /// This process's (or thread's) rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// Number of ranks in the job.
    fn world_size(&self) -> usize;
    /// Short name for logs: `in-process`, `mpi`, `nccl`, `single`.
    fn name(&self) -> &'static str;
    /// Reduces `data` over all ranks in place; every rank ends with the result.
    ///
    /// # Errors
    /// [`CommError`]: a rank left, the timeout passed, or the sizes differ.
    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError>;
    /// Copies `root`'s `data` into every rank's `data` (all ranks pass the same length).
    ///
    /// # Errors
    /// As [`Collective::allreduce`].
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError>;
    /// Every rank's `data`, indexed by rank (lengths may differ).
    ///
    /// # Errors
    /// As [`Collective::allreduce`].
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError>;
    /// All-to-all of equal blocks (MPI's `MPI_Alltoall`, PyTorch's `all_to_all_single`):
    /// `send` holds `world_size` blocks of `send.len() / world_size` bytes, block j for rank
    /// j; the result holds one block from each rank, in rank order. 1-bit Adam's compressed
    /// allreduce sends each rank its chunk of the signs this way (`crate::onebit`).
    ///
    /// # Errors
    /// As [`Collective::allreduce`]; [`CommError::Mismatch`] when `send.len()` is not a
    /// multiple of `world_size` or differs between ranks (where the implementation can tell).
    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError>;
    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// As [`Collective::allreduce`].
    fn barrier(&mut self) -> Result<(), CommError>;
}

/// Collectives on device memory: a gradient bucket reduced on the device it was computed on,
/// without a copy to the host. Implemented by NCCL (CUDA backends), the in-process hub (any
/// backend: ranks that share a device, or NdArray, whose device is the host) and the one-rank
/// job. Calls run on the rank's communication thread, in the same sequence as the host
/// collectives of [`Collective`].
pub trait DeviceCollective<B: Backend>: Collective {
    /// Reduces the flat bucket `bucket` (`[n]`, on this rank's device) over all ranks and
    /// returns the result, on the same device, in a buffer no other rank holds (the rank may
    /// write it in place). NCCL reduces in place (the returned tensor shares the bucket's
    /// buffer); the in-process hub returns a new tensor to each rank.
    ///
    /// # Errors
    /// As [`Collective::allreduce`].
    fn allreduce_device(
        &mut self,
        bucket: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError>;
}

/// The one-rank job: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "single"
    }
    fn allreduce(&mut self, _data: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, _data: &mut [f32], _root: usize) -> Result<(), CommError> {
        Ok(())
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        Ok(vec![data.to_vec()])
    }
    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        Ok(send.to_vec())
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}

impl<B: Backend> DeviceCollective<B> for SingleRank {
    fn allreduce_device(
        &mut self,
        bucket: Tensor<B, 1>,
        _op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        Ok(bucket)
    }
}

/// `send.len() / world_size`, the block an all-to-all sends each rank.
///
/// # Errors
/// [`CommError::Mismatch`] when `send.len()` is not a multiple of `world_size`.
pub fn alltoall_block(seq: u64, send: &[u8], world_size: usize) -> Result<usize, CommError> {
    if !send.len().is_multiple_of(world_size) {
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "alltoall of {} bytes over {world_size} ranks: not a multiple of the world size",
                send.len()
            ),
        });
    }
    Ok(send.len() / world_size)
}
