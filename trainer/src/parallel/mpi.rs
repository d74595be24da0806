//! Collectives over MPI (rsmpi, OpenMPI from Debian), for multi-process and multi-node CPU
//! runs launched by `mpirun` or `srun`. Behind the `mpi` cargo feature.
//!
//! MPI has no timeouts of its own: every collective (allreduce, broadcast, allgather, barrier)
//! runs as a non-blocking collective polled until the deadline. A rank that passes the deadline prints which operation stalled
//! and calls `MPI_Abort`, which ends every rank of the job (MPI cannot cancel a collective
//! in flight). A rank that dies is reported by `mpirun` itself, which then stops the others.

use std::io::Write;
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use super::collective::{Collective, CommError, ReduceOp, alltoall_block};

/// The MPI world communicator. Owns the MPI environment: dropping it finalises MPI.
pub struct Mpi {
    world: SimpleCommunicator,
    // Dropped after `world` (field order): MPI_Finalize last.
    _universe: Universe,
    timeout: Duration,
    seq: u64,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED (checked in `init`), which allows any
// thread to call MPI as long as calls never overlap. An `Mpi` is used by one thread at a time:
// it is created on the main thread and then moved to the communication thread, which alone
// uses it until it drops it.
unsafe impl Send for Mpi {}

impl Mpi {
    /// Initialises MPI (`MPI_Init_thread`, serialized) and takes its world communicator.
    ///
    /// # Errors
    /// [`CommError::Backend`] when MPI is already initialised or lacks serialized threading.
    pub fn init(timeout: Duration) -> Result<Self, CommError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| CommError::Backend {
                backend: "mpi",
                message: "MPI was already initialised in this process".into(),
            })?;
        if threading < Threading::Serialized {
            return Err(CommError::Backend {
                backend: "mpi",
                message: format!(
                    "the MPI library offers only {threading:?} threading; serialized is needed"
                ),
            });
        }
        Ok(Self {
            world: universe.world(),
            _universe: universe,
            timeout,
            seq: 0,
        })
    }

    /// Polls a non-blocking collective until it completes or the timeout passes; on timeout,
    /// aborts the job (see the module docs).
    fn wait(&self, op: &'static str, seq: u64, mut test: impl FnMut() -> bool) {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(10);
        while !test() {
            if Instant::now() >= deadline {
                // One write of the whole line: `eprintln!` writes its pieces separately, and
                // mpirun's own abort notice can land between them.
                let line = format!(
                    "error: {op} #{seq} on MPI rank {} timed out after {:.1} s: another rank stalled or died; aborting the job\n",
                    self.world.rank(),
                    self.timeout.as_secs_f64()
                );
                let mut stderr = std::io::stderr().lock();
                let _ = stderr.write_all(line.as_bytes());
                let _ = stderr.flush();
                drop(stderr);
                self.world.abort(1);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    fn name(&self) -> &'static str {
        "mpi"
    }

    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let seq = self.seq;
        self.seq += 1;
        let send = data.to_vec();
        mpi::request::scope(|scope| {
            let mut request = Some(self.world.immediate_all_reduce_into(
                scope,
                &send[..],
                &mut *data,
                SystemOperation::sum(),
            ));
            self.wait("allreduce", seq, || match request.take().unwrap().test() {
                Ok(_) => true,
                Err(pending) => {
                    request = Some(pending);
                    false
                }
            });
        });
        if op == ReduceOp::Average {
            let n = self.world.size() as f32;
            data.iter_mut().for_each(|x| *x /= n);
        }
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        let seq = self.seq;
        self.seq += 1;
        let root = self.world.process_at_rank(root as i32);
        mpi::request::scope(|scope| {
            let mut request = Some(root.immediate_broadcast_into(scope, &mut *data));
            self.wait("broadcast", seq, || match request.take().unwrap().test() {
                Ok(_) => true,
                Err(pending) => {
                    request = Some(pending);
                    false
                }
            });
        });
        Ok(())
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        // Non-blocking, lengths first, each polled until the deadline: presort gathers every
        // step, and a stalled rank must end the job, not hang it.
        let seq = self.seq;
        self.seq += 1;
        let n = self.world.size() as usize;
        let mut counts = vec![0i32; n];
        let len = data.len() as i32;
        mpi::request::scope(|scope| {
            let mut request = Some(self.world.immediate_all_gather_into(
                scope,
                &len,
                &mut counts[..],
            ));
            self.wait("allgather (lengths)", seq, || poll(&mut request));
        });
        let displs: Vec<i32> = counts
            .iter()
            .scan(0, |offset, &c| {
                let d = *offset;
                *offset += c;
                Some(d)
            })
            .collect();
        let mut buffer = vec![0u8; counts.iter().sum::<i32>() as usize];
        {
            let mut partition = PartitionMut::new(&mut buffer[..], &counts[..], &displs[..]);
            mpi::request::scope(|scope| {
                let mut request = Some(self.world.immediate_all_gather_varcount_into(
                    scope,
                    data,
                    &mut partition,
                ));
                self.wait("allgather", seq, || poll(&mut request));
            });
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| buffer[d as usize..(d + c) as usize].to_vec())
            .collect())
    }

    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        let seq = self.seq;
        self.seq += 1;
        let n = self.world.size() as usize;
        alltoall_block(seq, send, n)?;
        // MPI_Alltoall needs equal sizes on every rank: a rank whose buffer differs would
        // corrupt the exchange, so the lengths are compared first (as allgather's are sent).
        let mut lengths = vec![0u64; n];
        let len = send.len() as u64;
        mpi::request::scope(|scope| {
            let mut request = Some(self.world.immediate_all_gather_into(
                scope,
                &len,
                &mut lengths[..],
            ));
            self.wait("alltoall (lengths)", seq, || poll(&mut request));
        });
        if let Some(rank) = lengths.iter().position(|&l| l != len) {
            return Err(CommError::Mismatch {
                seq,
                detail: format!(
                    "alltoall of {} bytes on rank {rank} but {len} on rank {}",
                    lengths[rank],
                    self.world.rank()
                ),
            });
        }
        let mut received = vec![0u8; send.len()];
        mpi::request::scope(|scope| {
            let mut request = Some(self.world.immediate_all_to_all_into(
                scope,
                send,
                &mut received[..],
            ));
            self.wait("alltoall", seq, || poll(&mut request));
        });
        Ok(received)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let seq = self.seq;
        self.seq += 1;
        let mut request = Some(self.world.immediate_barrier());
        self.wait("barrier", seq, || poll(&mut request));
        Ok(())
    }
}

/// Tests a pending request once: true (and the request consumed) when it completed.
fn poll<'a, R: ?Sized, S: mpi::request::Scope<'a>>(
    request: &mut Option<mpi::request::Request<'a, R, S>>,
) -> bool {
    match request.take().expect("polled after completion").test() {
        Ok(_) => true,
        Err(pending) => {
            *request = Some(pending);
            false
        }
    }
}
