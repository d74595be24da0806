//! The in-process collectives: ranks are threads of one process that meet in shared memory
//! (tests, single-machine runs, and the benchmarks' modelled links).

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::collective::{Collective, CommError, DeviceCollective, ReduceOp, alltoall_block};

enum Payload {
    F32(Vec<f32>),
    Bytes(Vec<u8>),
    Gathered(Vec<Vec<u8>>),
    /// A device tensor (`Tensor<B, 1>` of the ranks' backend), type-erased so that one hub
    /// serves host and device collectives in one numbered sequence.
    Device(Box<dyn Any + Send + Sync>),
    /// One device tensor per rank, each taken once by its rank (a device allreduce's result:
    /// Note [CubeCL streams and in-place writes]).
    DeviceEach(Vec<Mutex<Option<Box<dyn Any + Send>>>>),
}

struct Slot {
    op: &'static str,
    inputs: Vec<Option<Payload>>,
    output: Option<Arc<Payload>>,
    readers_left: usize,
}

struct HubState {
    slots: HashMap<u64, Slot>,
    gone: Vec<bool>,
}

struct Hub {
    world_size: usize,
    state: Mutex<HubState>,
    arrived: Condvar,
}

/// One rank of an in-process group: ranks are threads of one process that meet in shared
/// memory. Sums run in rank order, so results are identical on every rank and every run.
///
/// Dropping a communicator (its thread returned or panicked) tells the others that the rank
/// has left: their pending and later collectives fail with [`CommError::RankGone`].
pub struct InProcess {
    hub: Arc<Hub>,
    rank: usize,
    seq: u64,
    timeout: Duration,
}

impl InProcess {
    /// Communicators for ranks `0..world_size`, to be moved one into each rank's thread.
    /// `timeout` bounds every wait.
    pub fn group(world_size: usize, timeout: Duration) -> Vec<InProcess> {
        assert!(world_size > 0, "a group has at least one rank");
        let hub = Arc::new(Hub {
            world_size,
            state: Mutex::new(HubState {
                slots: HashMap::new(),
                gone: vec![false; world_size],
            }),
            arrived: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| InProcess {
                hub: hub.clone(),
                rank,
                seq: 0,
                timeout,
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A rank that panicked while holding the lock leaves consistent data (each update is
        // a single insert or take), so the poison flag carries no information here.
        self.hub.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Deposits this rank's `input` for the next operation; the last rank to arrive runs
    /// `combine` over all inputs (in rank order); everyone gets the shared output.
    fn exchange(
        &mut self,
        op: &'static str,
        input: Payload,
        combine: impl FnOnce(u64, Vec<Payload>) -> Result<Payload, CommError>,
    ) -> Result<Arc<Payload>, CommError> {
        let seq = self.seq;
        self.seq += 1;
        let world_size = self.hub.world_size;
        let deadline = Instant::now() + self.timeout;
        let mut state = self.lock();
        let slot = state.slots.entry(seq).or_insert_with(|| Slot {
            op,
            inputs: (0..world_size).map(|_| None).collect(),
            output: None,
            readers_left: world_size,
        });
        if slot.op != op {
            let first = slot
                .inputs
                .iter()
                .position(Option::is_some)
                .unwrap_or_default();
            return Err(CommError::Mismatch {
                seq,
                detail: format!(
                    "rank {} called {op} where rank {first} called {}",
                    self.rank, slot.op
                ),
            });
        }
        slot.inputs[self.rank] = Some(input);
        if slot.inputs.iter().all(Option::is_some) {
            let inputs = slot.inputs.iter_mut().map(|i| i.take().unwrap()).collect();
            let output = combine(seq, inputs);
            // On a mismatch every rank gets the same error: store it as a poisoned slot.
            match output {
                Ok(output) => slot.output = Some(Arc::new(output)),
                Err(error) => {
                    state.slots.remove(&seq);
                    self.hub.arrived.notify_all();
                    return Err(error);
                }
            }
            self.hub.arrived.notify_all();
        }
        loop {
            let Some(slot) = state.slots.get_mut(&seq) else {
                // Removed by the combining rank after a mismatch.
                return Err(CommError::Mismatch {
                    seq,
                    detail: format!("{op}: another rank's buffer disagreed (see rank 0's error)"),
                });
            };
            if let Some(output) = slot.output.clone() {
                slot.readers_left -= 1;
                if slot.readers_left == 0 {
                    state.slots.remove(&seq);
                }
                return Ok(output);
            }
            let missing: Vec<usize> = (0..world_size)
                .filter(|&r| slot.inputs[r].is_none())
                .collect();
            if let Some(&rank) = missing.iter().find(|&&r| state.gone[r]) {
                return Err(CommError::RankGone { rank, op, seq });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    op,
                    seq,
                    timeout: self.timeout,
                    missing,
                });
            }
            state = self
                .hub
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let mut state = self.lock();
        state.gone[self.rank] = true;
        drop(state);
        self.hub.arrived.notify_all();
    }
}

fn same_lengths(seq: u64, op: &str, lengths: impl Iterator<Item = usize>) -> Result<(), CommError> {
    let lengths: Vec<usize> = lengths.collect();
    match lengths.iter().position(|&n| n != lengths[0]) {
        None => Ok(()),
        Some(rank) => Err(CommError::Mismatch {
            seq,
            detail: format!(
                "{op} of {} values on rank {rank} but {} on rank 0",
                lengths[rank], lengths[0]
            ),
        }),
    }
}

/// The ranks' f32 buffers of an allreduce or broadcast, checked to have equal lengths.
fn f32_buffers(seq: u64, op: &str, inputs: Vec<Payload>) -> Result<Vec<Vec<f32>>, CommError> {
    let buffers: Vec<Vec<f32>> = inputs
        .into_iter()
        .map(|p| match p {
            Payload::F32(v) => v,
            _ => unreachable!("{op} slots hold f32 buffers"),
        })
        .collect();
    same_lengths(seq, op, buffers.iter().map(Vec::len))?;
    Ok(buffers)
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.hub.world_size
    }

    fn name(&self) -> &'static str {
        "in-process"
    }

    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let world_size = self.hub.world_size as f32;
        let output = self.exchange("allreduce", Payload::F32(data.to_vec()), |seq, inputs| {
            let buffers = f32_buffers(seq, "allreduce", inputs)?;
            let mut sum = buffers[0].clone();
            for buffer in &buffers[1..] {
                sum.iter_mut().zip(buffer).for_each(|(s, x)| *s += x);
            }
            if op == ReduceOp::Average {
                sum.iter_mut().for_each(|s| *s /= world_size);
            }
            Ok(Payload::F32(sum))
        })?;
        let Payload::F32(result) = &*output else {
            unreachable!("allreduce produces f32")
        };
        data.copy_from_slice(result);
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        let output = self.exchange("broadcast", Payload::F32(data.to_vec()), |seq, inputs| {
            let buffers = f32_buffers(seq, "broadcast", inputs)?;
            Ok(Payload::F32(buffers.into_iter().nth(root).unwrap()))
        })?;
        let Payload::F32(result) = &*output else {
            unreachable!("broadcast produces f32")
        };
        data.copy_from_slice(result);
        Ok(())
    }

    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let output = self.exchange("allgather", Payload::Bytes(data.to_vec()), |_, inputs| {
            Ok(Payload::Gathered(
                inputs
                    .into_iter()
                    .map(|p| match p {
                        Payload::Bytes(v) => v,
                        _ => unreachable!("allgather slots hold bytes"),
                    })
                    .collect(),
            ))
        })?;
        let Payload::Gathered(all) = &*output else {
            unreachable!("allgather produces bytes")
        };
        Ok(all.clone())
    }

    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        let block = alltoall_block(self.seq, send, self.hub.world_size)?;
        let output = self.exchange("alltoall", Payload::Bytes(send.to_vec()), |seq, inputs| {
            let inputs: Vec<Vec<u8>> = inputs
                .into_iter()
                .map(|p| match p {
                    Payload::Bytes(v) => v,
                    _ => unreachable!("alltoall slots hold bytes"),
                })
                .collect();
            same_lengths(seq, "alltoall", inputs.iter().map(Vec::len))?;
            Ok(Payload::Gathered(inputs))
        })?;
        let Payload::Gathered(all) = &*output else {
            unreachable!("alltoall gathers bytes")
        };
        let mine = self.rank * block..(self.rank + 1) * block;
        Ok(all.iter().flat_map(|b| &b[mine.clone()]).copied().collect())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.exchange("barrier", Payload::Bytes(Vec::new()), |_, _| {
            Ok(Payload::Bytes(Vec::new()))
        })
        .map(|_| ())
    }
}

impl<B: Backend> DeviceCollective<B> for InProcess {
    /// Sums the ranks' tensors with Burn ops on the device, in rank order (identical results on
    /// every rank and run), on the communication thread of the last rank to arrive. Each rank
    /// gets a buffer of its own (Note [CubeCL streams and in-place writes]).
    fn allreduce_device(
        &mut self,
        bucket: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let world_size = self.hub.world_size;
        let input = Payload::Device(Box::new(bucket));
        let output = self.exchange("device allreduce", input, |seq, inputs| {
            let tensors: Vec<Tensor<B, 1>> = inputs
                .into_iter()
                .map(|p| match p {
                    Payload::Device(t) => *t
                        .downcast::<Tensor<B, 1>>()
                        .expect("the ranks of a group share one backend"),
                    _ => unreachable!("checked by the operation's name"),
                })
                .collect();
            same_lengths(seq, "device allreduce", tensors.iter().map(|t| t.dims()[0]))?;
            // Note [CubeCL streams and in-place writes]: CubeCL 0.10 orders work across
            // threads' streams by the stream a buffer was *allocated* on: a reader on another
            // stream first submits the owner stream's queued work. A kernel that writes into a
            // buffer in place from a third stream escapes that: readers do not wait for it,
            // and it does not wait for their queued reads. So a buffer that crosses threads is
            // never written in place, and no two ranks share one:
            // - `tensors` keeps every input alive, so the first sum (or a single rank's
            //   division) gets a buffer of this thread's stream, which the later ops write into;
            // - each rank gets its own copy of the result, made here. A shared result is not
            //   safe: once one rank has dropped its handle with a read of it still queued on
            //   its stream, Burn lets the other rank write it in place (the handle looks
            //   unique), and the queued read sees that write (CI saw it: a rank's `+ 1` on the
            //   result reached the other rank). NCCL gives each rank its own buffer likewise.
            // The same holds for frees: see the wait below.
            let mut sum = tensors[0].clone();
            for t in &tensors[1..] {
                sum = sum + t.clone();
            }
            let finish = |sum: Tensor<B, 1>| match op {
                ReduceOp::Average => sum.div_scalar(world_size as f32),
                // `× 1` copies exactly (it keeps −0.0, which `+ 0` would not).
                ReduceOp::Sum => sum.mul_scalar(1.0),
            };
            let mut results: Vec<Tensor<B, 1>> =
                (1..world_size).map(|_| finish(sum.clone())).collect();
            // The last rank takes the sum's own buffer (one copy fewer); with one rank and a
            // `Sum`, that is its input, as the one-rank job returns.
            results.push(match op {
                ReduceOp::Sum if world_size > 1 => sum,
                ReduceOp::Sum => tensors[0].clone(),
                ReduceOp::Average => sum.div_scalar(world_size as f32),
            });
            // Dropping the inputs here hands their memory back to the ranks' streams, whose
            // next kernels may reuse it at once; this thread's reads of it must reach the
            // device first. Waiting here blocks only the communication thread.
            let _ = B::sync(&results[0].device());
            drop(tensors);
            Ok(Payload::DeviceEach(
                results
                    .into_iter()
                    .map(|t| Mutex::new(Some(Box::new(t) as Box<dyn Any + Send>)))
                    .collect(),
            ))
        })?;
        let Payload::DeviceEach(results) = &*output else {
            unreachable!("a device allreduce produces a tensor per rank")
        };
        let mine = results[self.rank]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("each rank takes its result once");
        Ok(*mine
            .downcast::<Tensor<B, 1>>()
            .expect("the ranks of a group share one backend"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Runs `body` on every rank of an in-process group of `world_size` threads.
    pub(crate) fn run_group<T: Send + 'static>(
        world_size: usize,
        timeout: Duration,
        body: impl Fn(InProcess) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = Arc::new(body);
        let handles: Vec<_> = InProcess::group(world_size, timeout)
            .into_iter()
            .map(|comm| {
                let body = body.clone();
                std::thread::spawn(move || body(comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn allreduce_broadcast_allgather_give_every_rank_the_result() {
        let results = run_group(3, Duration::from_secs(10), |mut comm| {
            let r = comm.rank() as f32;
            let mut sum = vec![r, 10.0 * r];
            comm.allreduce(&mut sum, ReduceOp::Sum).unwrap();
            let mut mean = vec![r + 1.0];
            comm.allreduce(&mut mean, ReduceOp::Average).unwrap();
            let mut root = vec![r; 2];
            comm.broadcast(&mut root, 2).unwrap();
            let gathered = comm.allgather(&[comm.rank() as u8; 2]).unwrap();
            // Block j of rank r is [10r + j, 10r + j]: rank j receives [10i + j] from each i.
            let send: Vec<u8> = (0..3u8)
                .flat_map(|j| [10 * comm.rank() as u8 + j; 2])
                .collect();
            let exchanged = comm.alltoall(&send).unwrap();
            let expected: Vec<u8> = (0..3u8)
                .flat_map(|i| [10 * i + comm.rank() as u8; 2])
                .collect();
            assert_eq!(exchanged, expected, "rank {}", comm.rank());
            comm.barrier().unwrap();
            (sum, mean, root, gathered)
        });
        for (sum, mean, root, gathered) in results {
            assert_eq!(sum, vec![3.0, 30.0]);
            assert_eq!(mean, vec![2.0]);
            assert_eq!(root, vec![2.0, 2.0]);
            assert_eq!(gathered, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        }
    }

    #[test]
    fn different_sizes_or_operations_are_errors_not_hangs() {
        let results = run_group(2, Duration::from_secs(10), |mut comm| {
            let mut data = vec![0.0; 1 + comm.rank()];
            let allreduce = comm
                .allreduce(&mut data, ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            let alltoall = comm
                .alltoall(&vec![0; 2 * (1 + comm.rank())])
                .unwrap_err()
                .to_string();
            let not_divisible = comm.alltoall(&[0; 3]).unwrap_err().to_string();
            [allreduce, alltoall, not_divisible]
        });
        for messages in results {
            for message in messages {
                assert!(message.contains("mismatch"), "{message}");
            }
        }
        let results = run_group(2, Duration::from_secs(10), |mut comm| {
            if comm.rank() == 0 {
                comm.barrier().unwrap_err().to_string()
            } else {
                comm.allgather(&[1]).unwrap_err().to_string()
            }
        });
        assert!(results.iter().any(|m| m.contains("called")), "{results:?}");
    }

    #[test]
    fn a_rank_that_leaves_or_stalls_is_named() {
        // Rank 1 returns without joining the allreduce: rank 0 learns at once, not at timeout.
        let started = Instant::now();
        let results = run_group(2, Duration::from_secs(30), |mut comm| {
            if comm.rank() == 1 {
                return String::new();
            }
            let mut data = vec![1.0];
            comm.allreduce(&mut data, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        assert!(results[0].contains("rank 1 left"), "{}", results[0]);
        assert!(started.elapsed() < Duration::from_secs(10));

        // Rank 1 stalls (alive, never calls): rank 0 times out naming it.
        let results = run_group(2, Duration::from_millis(300), |mut comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_secs(2));
                return String::new();
            }
            let mut data = vec![1.0];
            comm.allreduce(&mut data, ReduceOp::Sum)
                .unwrap_err()
                .to_string()
        });
        assert!(
            results[0].contains("timed out") && results[0].contains("[1]"),
            "{}",
            results[0]
        );
    }
}
