//! Collectives over NCCL (through cudarc, loaded at run time), one process per GPU. Behind the
//! `cuda` cargo feature; compiles without a GPU or CUDA toolkit.
//!
//! Gradient buckets are reduced in place on the GPU ([`DeviceCollective`] for Burn's CUDA
//! backends): NCCL runs on the bucket's device pointer, on a stream of its own, so that the
//! compute stream goes on with the backward of the lower layers. The host collectives
//! ([`Collective`]: configurations, sample references, losses, evaluation counts) copy their
//! few bytes to the GPU and back. Waits are bounded: the NCCL stream is polled through an event
//! until the timeout, after which the error names the operation and the communicator is aborted
//! (`ncclCommAbort`, on drop).
//!
//! Note [NCCL ordering]: NCCL must not read a bucket before the kernels that wrote it (the
//! concatenation, the additions of later micro-batches and clipping on the compute stream)
//! have run. CubeCL 0.10 gives each thread a stream of its own and does not expose the CUDA
//! streams. Before this call the communication thread has waited on the host for the kernels
//! that wrote the bucket, through a marker the compute thread allocated after the bucket's
//! last write (Note [A bucket's writes, awaited] in ember-backend-ext's `bucket_ops.rs`:
//! CubeCL's own alignment of streams misses writes in place). Here the communication thread asks CubeCL for
//! the bucket's device pointer (a command on its own stream, which also orders it after a
//! bf16 bucket's cast made on that stream), waits for its own CubeCL stream
//! (`ComputeClient::sync`), and then enqueues NCCL on its NCCL stream. Only the communication thread waits; the
//! compute thread never does, and keeps enqueueing backward. The cost against a GPU-side
//! `cudaStreamWaitEvent` is the host's reaction time to the event, microseconds per bucket.
//! The compute stream reads the reduced bucket only after the step's wait
//! ([`super::Reducer::finalize_backward`]) has seen NCCL finish.
//!
//! The unique id that joins the ranks is made by rank 0 ([`new_unique_id`]) and handed to the
//! others by MPI ([`Nccl::bootstrap`]) or over TCP ([`super::rendezvous`]). Joining
//! (`ncclCommInitRank`) blocks until every rank has joined; it runs on a thread of its own and
//! is given up after the collective timeout, naming the operation.
//!
//! Note [A timed-out collective]: when a wait on NCCL's stream runs out of time, NCCL's
//! kernel may still be reading and writing the bucket. Returning the bucket's memory to
//! CubeCL's pool would let the next tensors of this process take memory that NCCL writes
//! later. So a timed-out bucket is never released (its handle is leaked, the process is
//! about to stop with the error anyway) and the communicator refuses every later operation;
//! it is aborted when dropped (`ncclCommAbort`).

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::client::ComputeClient;
use cubecl::server::Handle;
use cudarc::driver::{CudaContext, CudaStream, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};

use super::collective::{Collective, CommError, DeviceCollective, ReduceOp, alltoall_block};

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

/// CubeCL runtimes whose buffers are CUDA device memory: `CudaRuntime`, and it wrapped in
/// the host-synchronisation counter of `ember-backend-ext`.
pub trait CudaMemory: CubeRuntime {
    /// The device pointer of `handle`'s memory (its first byte), with what keeps the memory
    /// alive while the pointer is used. Asked from the calling thread's stream, which CubeCL
    /// aligns with the stream that wrote the memory (Note [NCCL ordering]).
    ///
    /// # Errors
    /// CubeCL's error, as [`CommError::Backend`].
    fn device_ptr(
        client: &ComputeClient<Self>,
        handle: Handle,
    ) -> Result<(u64, Box<dyn Any + Send>), CommError>;
}

/// The same body for each runtime: `GpuResource`, cubecl-cuda's resource type, has public
/// fields but no public path, so only code that names the runtime sees it.
macro_rules! cuda_memory {
    ($runtime:ty) => {
        impl CudaMemory for $runtime {
            fn device_ptr(
                client: &ComputeClient<Self>,
                handle: Handle,
            ) -> Result<(u64, Box<dyn Any + Send>), CommError> {
                let resource = client.get_resource(handle).map_err(nccl_error)?;
                Ok((resource.resource().ptr, Box::new(resource)))
            }
        }
    };
}

cuda_memory!(cubecl::cuda::CudaRuntime);
cuda_memory!(ember_backend_ext::CountingRuntime<cubecl::cuda::CudaRuntime>);

/// `len` f32 of device memory at `ptr`, which CubeCL owns: what NCCL reduces in place.
struct BucketMemory<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    element: std::marker::PhantomData<T>,
}

impl<T> DeviceSlice<T> for BucketMemory<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtrMut<T> for BucketMemory<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        // The ordering is the caller's (Note [NCCL ordering]): nothing to record.
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// One rank's NCCL communicator on GPU `local_rank`.
pub struct Nccl {
    comm: Comm,
    /// NCCL's own stream (not CubeCL's, not the legacy default stream).
    stream: Arc<CudaStream>,
    timeout: Duration,
    seq: u64,
    /// The operation that timed out, after which nothing else may run (Note [A timed-out
    /// collective]).
    broken: Option<String>,
}

/// A communicator handed from the joining thread (NCCL allows a communicator to move between
/// threads; see `unsafe impl Send for Nccl`).
struct Joined(Comm);
// SAFETY: as for `Nccl`: the handle is used by one thread at a time.
unsafe impl Send for Joined {}

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
        // The device's primary context, which CubeCL's CUDA runtime uses too.
        let context = CudaContext::new(local_rank).map_err(nccl_error)?;
        let stream = context.new_stream().map_err(nccl_error)?;
        // ncclCommInitRank waits for every rank: on a thread of its own, given up after the
        // timeout (the thread stays blocked; the process stops with the error).
        let (sender, receiver) = std::sync::mpsc::channel();
        let join_stream = stream.clone();
        std::thread::Builder::new()
            .name("nccl-join".into())
            .spawn(move || {
                let joined = join_stream
                    .context()
                    .bind_to_thread()
                    .map_err(nccl_error)
                    .and_then(|()| {
                        Comm::from_rank(join_stream, rank, world_size, Id::uninit(internal))
                            .map_err(nccl_error)
                    });
                let _ = sender.send(joined.map(Joined));
            })
            .map_err(|e| nccl_error(format!("starting the joining thread: {e}")))?;
        let comm = match receiver.recv_timeout(timeout) {
            Ok(joined) => joined?.0,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(nccl_error(
                    "the joining thread ended without a communicator",
                ));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                return Err(CommError::Timeout {
                    rank,
                    op: "joining the NCCL communicator (ncclCommInitRank)",
                    seq: 0,
                    timeout,
                    missing: Vec::new(),
                });
            }
        };
        Ok(Self {
            comm,
            stream,
            timeout,
            seq: 0,
            broken: None,
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

    /// Waits for the work queued on NCCL's stream, up to the timeout.
    fn wait(&self, op: &'static str, seq: u64) -> Result<(), CommError> {
        let event = self.stream.record_event(None).map_err(nccl_error)?;
        let deadline = Instant::now() + self.timeout;
        while !event.try_is_complete().map_err(nccl_error)? {
            if Instant::now() >= deadline {
                return Err(CommError::Timeout {
                    rank: self.comm.rank(),
                    op,
                    seq,
                    timeout: self.timeout,
                    missing: Vec::new(),
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        Ok(())
    }

    /// The next operation's sequence number; an error once an operation has timed out (Note
    /// [A timed-out collective]).
    fn next_seq(&mut self) -> Result<u64, CommError> {
        if let Some(op) = &self.broken {
            return Err(nccl_error(format!(
                "the communicator is unusable after {op} timed out"
            )));
        }
        self.seq += 1;
        Ok(self.seq - 1)
    }

    /// [`Nccl::wait`], marking the communicator unusable when it times out.
    fn wait_or_break(&mut self, op: &'static str, seq: u64) -> Result<(), CommError> {
        let waited = self.wait(op, seq);
        if waited.is_err() {
            self.broken = Some(format!("{op} #{seq}"));
        }
        waited
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Average => NcclOp::Avg,
    }
}

impl<R, F, I, BT> DeviceCollective<CubeBackend<R, F, I, BT>> for Nccl
where
    R: CudaMemory,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn allreduce_device(
        &mut self,
        bucket: Tensor<CubeBackend<R, F, I, BT>, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<CubeBackend<R, F, I, BT>, 1>, CommError> {
        let seq = self.next_seq()?;
        let mut tensor: CubeTensor<R> = bucket.into_primitive().tensor();
        if !matches!(tensor.dtype, DType::F32 | DType::BF16) {
            return Err(nccl_error(format!(
                "device allreduce of {:?} buckets is not supported (f32 or bf16)",
                tensor.dtype
            )));
        }
        // NCCL writes in place: into memory no other tensor shares.
        if !(tensor.handle.can_mut() && tensor.is_contiguous()) {
            let copy = Tensor::<CubeBackend<R, F, I, BT>, 1>::from_primitive(
                TensorPrimitive::Float(tensor),
            )
            .mul_scalar(1.0);
            tensor = copy.into_primitive().tensor();
        }
        let len = tensor.shape().num_elements();
        self.stream.context().bind_to_thread().map_err(nccl_error)?;
        // Note [NCCL ordering]: an aligned command for the pointer, then wait for the producers.
        let (ptr, keep_alive) = R::device_ptr(&tensor.client, tensor.handle.clone())?;
        cubecl::future::block_on(tensor.client.sync()).map_err(nccl_error)?;
        // bf16 buckets (`parallel.allreduce_dtype`): NCCL's ncclBfloat16, summed in bf16 at
        // each hop of its ring.
        if tensor.dtype == DType::BF16 {
            self.all_reduce_in_place::<burn::tensor::bf16>(ptr, len, op)?;
        } else {
            self.all_reduce_in_place::<f32>(ptr, len, op)?;
        }
        if let Err(e) = self.wait_or_break("allreduce", seq) {
            // Note [A timed-out collective]: NCCL may still write this memory.
            std::mem::forget(keep_alive);
            std::mem::forget(tensor);
            return Err(e);
        }
        drop(keep_alive);
        Ok(Tensor::from_primitive(TensorPrimitive::Float(tensor)))
    }
}

impl Nccl {
    /// NCCL's in-place allreduce of `len` elements of `T` at device address `ptr`, on NCCL's
    /// stream (the caller orders it after the buffer's producers: Note [NCCL ordering]).
    fn all_reduce_in_place<T: cudarc::nccl::NcclType>(
        &self,
        ptr: u64,
        len: usize,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let mut memory = BucketMemory::<T> {
            ptr,
            len,
            stream: self.stream.clone(),
            element: std::marker::PhantomData,
        };
        self.comm
            .all_reduce_in_place(&mut memory, &nccl_op(op))
            .map_err(nccl_error)?;
        Ok(())
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
        let seq = self.next_seq()?;
        let send = self.stream.clone_htod(data).map_err(nccl_error)?;
        let mut recv = self
            .stream
            .alloc_zeros::<f32>(data.len())
            .map_err(nccl_error)?;
        self.comm
            .all_reduce(&send, &mut recv, &nccl_op(op))
            .map_err(nccl_error)?;
        self.wait_or_break("allreduce", seq)?;
        self.stream.memcpy_dtoh(&recv, data).map_err(nccl_error)
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        let seq = self.next_seq()?;
        let mut buffer = self.stream.clone_htod(data).map_err(nccl_error)?;
        self.comm
            .broadcast_in_place(&mut buffer, root as i32)
            .map_err(nccl_error)?;
        self.wait_or_break("broadcast", seq)?;
        self.stream.memcpy_dtoh(&buffer, data).map_err(nccl_error)
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let seq = self.next_seq()?;
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
        self.wait_or_break("allgather", seq)?;
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

    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        let seq = self.next_seq()?;
        let n = self.world_size();
        let block = alltoall_block(seq, send, n)?;
        let rank = self.rank();
        let mut received = vec![0u8; send.len()];
        // This rank's own block stays on the host; the others go as one NCCL group of
        // send/recv pairs (NCCL's all-to-all recipe), staged through device memory.
        received[rank * block..(rank + 1) * block]
            .copy_from_slice(&send[rank * block..(rank + 1) * block]);
        if n > 1 && block > 0 {
            let device_send = self.stream.clone_htod(send).map_err(nccl_error)?;
            let mut device_recv = (0..n)
                .map(|_| self.stream.alloc_zeros::<u8>(block))
                .collect::<Result<Vec<_>, _>>()
                .map_err(nccl_error)?;
            {
                let sends: Vec<_> = (0..n)
                    .map(|peer| device_send.slice(peer * block..(peer + 1) * block))
                    .collect();
                let recvs: Vec<_> = device_recv.iter_mut().map(|r| r.slice_mut(..)).collect();
                let mut group = self.comm.group();
                for (peer, (s, r)) in sends.into_iter().zip(recvs).enumerate() {
                    if peer == rank {
                        continue;
                    }
                    group.send(s, peer as i32).map_err(nccl_error)?;
                    group.recv(r, peer as i32).map_err(nccl_error)?;
                }
            }
            self.wait_or_break("alltoall", seq)?;
            for (peer, buffer) in device_recv.iter().enumerate() {
                if peer != rank {
                    self.stream
                        .memcpy_dtoh(buffer, &mut received[peer * block..(peer + 1) * block])
                        .map_err(nccl_error)?;
                }
            }
        }
        Ok(received)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut token = [0f32];
        self.allreduce(&mut token, ReduceOp::Sum)
    }
}
