//! Collectives over NCCL (through cudarc, loaded at run time), one process per GPU. Behind the
//! `cuda` cargo feature; compiles without a GPU or CUDA toolkit.
//!
//! Buffers are host memory (the [`Collective`] contract): each operation copies to the GPU,
//! runs the NCCL collective on the rank's stream and copies back. Waits are bounded: the
//! stream is polled through an event until the timeout, after which the error names the
//! operation and the communicator is aborted (`ncclCommAbort`, on drop).
//!
//! The unique id that joins the ranks is made by rank 0 ([`new_unique_id`]) and handed to the
//! others by any bootstrap collective: [`Nccl::bootstrap`] uses an existing one, such as MPI.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use super::collective::{Collective, CommError, ReduceOp};

fn nccl_error(e: impl std::fmt::Debug) -> CommError {
    CommError::Backend {
        backend: "nccl",
        message: format!("{e:?}"),
    }
}

/// A fresh NCCL unique id (call on rank 0 only), as its 128 bytes.
///
/// # Errors
/// [`CommError::Backend`] if the NCCL library cannot be loaded.
pub fn new_unique_id() -> Result<Vec<u8>, CommError> {
    let id = Id::new().map_err(nccl_error)?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// One rank's NCCL communicator on GPU `local_rank`.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
    timeout: Duration,
    seq: u64,
}

// SAFETY: a `Comm` is an NCCL communicator handle plus its stream; NCCL allows a communicator
// to be used from any thread as long as calls are not concurrent. An `Nccl` is moved to the
// communication thread and used only there.
unsafe impl Send for Nccl {}

impl Nccl {
    /// Joins the NCCL group described by `id` (from [`new_unique_id`] on rank 0) as `rank`
    /// of `world_size`, on GPU `local_rank`.
    ///
    /// # Errors
    /// [`CommError::Backend`]: no such GPU, NCCL not loadable, or the group failed to form.
    pub fn new(
        local_rank: usize,
        rank: usize,
        world_size: usize,
        id: &[u8],
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let internal: [std::ffi::c_char; 128] = id
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| nccl_error(format!("a unique id has 128 bytes, got {}", id.len())))?;
        let context = CudaContext::new(local_rank).map_err(nccl_error)?;
        let stream = context.default_stream();
        let comm = Comm::from_rank(stream.clone(), rank, world_size, Id::uninit(internal))
            .map_err(nccl_error)?;
        Ok(Self {
            comm,
            stream,
            timeout,
            seq: 0,
        })
    }

    /// Forms the NCCL group through `bootstrap` (MPI, say): rank 0 makes the unique id and
    /// every rank receives it by an allgather.
    ///
    /// # Errors
    /// As [`Nccl::new`], or the bootstrap collective's error.
    pub fn bootstrap(
        bootstrap: &mut dyn Collective,
        local_rank: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let mine = if bootstrap.rank() == 0 {
            new_unique_id()?
        } else {
            Vec::new()
        };
        let all = bootstrap.allgather(&mine)?;
        Self::new(
            local_rank,
            bootstrap.rank(),
            bootstrap.world_size(),
            &all[0],
            timeout,
        )
    }

    /// Waits for the work queued on the stream, up to the timeout.
    fn wait(&self, op: &'static str, seq: u64) -> Result<(), CommError> {
        let event = self.stream.record_event(None).map_err(nccl_error)?;
        let deadline = Instant::now() + self.timeout;
        while !event.is_complete() {
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    rank: self.comm.rank(),
                    op,
                    seq,
                    timeout: self.timeout,
                    missing: Vec::new(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let seq = self.next_seq();
        let send = self.stream.clone_htod(data).map_err(nccl_error)?;
        let mut recv = self
            .stream
            .alloc_zeros::<f32>(data.len())
            .map_err(nccl_error)?;
        let op = match op {
            ReduceOp::Sum => NcclOp::Sum,
            ReduceOp::Average => NcclOp::Avg,
        };
        self.comm
            .all_reduce(&send, &mut recv, &op)
            .map_err(nccl_error)?;
        self.wait("allreduce", seq)?;
        self.stream.memcpy_dtoh(&recv, data).map_err(nccl_error)
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        let seq = self.next_seq();
        let mut buffer = self.stream.clone_htod(data).map_err(nccl_error)?;
        self.comm
            .broadcast_in_place(&mut buffer, root as i32)
            .map_err(nccl_error)?;
        self.wait("broadcast", seq)?;
        self.stream.memcpy_dtoh(&buffer, data).map_err(nccl_error)
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let seq = self.next_seq();
        let n = self.world_size();
        // Lengths first (NCCL's allgather needs equal counts), then the padded bytes.
        let mut lengths = vec![0f32; n];
        lengths[self.rank()] = data.len() as f32;
        self.allreduce(&mut lengths, ReduceOp::Sum)?;
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let width = lengths.iter().copied().max().unwrap_or(0).max(1);
        let mut padded = data.to_vec();
        padded.resize(width, 0);
        let send = self.stream.clone_htod(&padded).map_err(nccl_error)?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(width * n)
            .map_err(nccl_error)?;
        self.comm.all_gather(&send, &mut recv).map_err(nccl_error)?;
        self.wait("allgather", seq)?;
        let mut all = vec![0u8; width * n];
        self.stream
            .memcpy_dtoh(&recv, &mut all)
            .map_err(nccl_error)?;
        Ok(all
            .chunks(width)
            .zip(&lengths)
            .map(|(chunk, &len)| chunk[..len].to_vec())
            .collect())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut token = [0f32];
        self.allreduce(&mut token, ReduceOp::Sum)
    }
}
