//! A network link modelled on top of any collective, for benchmarks on one machine: each
//! operation takes at least the time the α-β model of a ring predicts (Hockney 1994; Patarasuk
//! & Yuan 2009), sleeping for the difference.

use std::time::{Duration, Instant};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use super::collective::{Collective, CommError, DeviceCollective, ReduceOp};

/// A network link's cost model (Hockney's α-β model): a message of n bytes takes
/// `latency + n / bandwidth`. Ring algorithms (Patarasuk & Yuan 2009) move
/// `2(W−1)/W · bytes` per rank for an allreduce, in `2(W−1)` latency-bound steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// α, seconds per message.
    pub latency_s: f64,
    /// β⁻¹, bytes per second.
    pub bandwidth_bytes_per_s: f64,
}

impl LinkModel {
    /// Seconds a ring allreduce of `bytes` takes over `world_size` ranks.
    pub fn allreduce_seconds(&self, bytes: usize, world_size: usize) -> f64 {
        if world_size < 2 {
            return 0.0;
        }
        let w = world_size as f64;
        2.0 * (w - 1.0) * self.latency_s
            + 2.0 * (w - 1.0) / w * bytes as f64 / self.bandwidth_bytes_per_s
    }

    /// Seconds an all-to-all takes whose send buffer holds `bytes` (W blocks): each rank
    /// sends W−1 blocks, one message each (the pairwise exchange of Thakur et al. 2005).
    pub fn alltoall_seconds(&self, bytes: usize, world_size: usize) -> f64 {
        if world_size < 2 {
            return 0.0;
        }
        let w = world_size as f64;
        (w - 1.0) * self.latency_s + (w - 1.0) / w * bytes as f64 / self.bandwidth_bytes_per_s
    }

    /// Seconds a ring allgather takes whose result holds `bytes` in all (W−1 latency-bound
    /// steps, each rank receiving the (W−1)/W of the result it lacks).
    pub fn allgather_seconds(&self, bytes: usize, world_size: usize) -> f64 {
        if world_size < 2 {
            return 0.0;
        }
        let w = world_size as f64;
        (w - 1.0) * self.latency_s + (w - 1.0) / w * bytes as f64 / self.bandwidth_bytes_per_s
    }

    /// Seconds a broadcast of `bytes` takes (pipelined: one latency per hop, one full copy).
    pub fn broadcast_seconds(&self, bytes: usize, world_size: usize) -> f64 {
        if world_size < 2 {
            return 0.0;
        }
        (world_size as f64 - 1.0) * self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
    }
}

/// Wraps a [`Collective`] so that each operation takes at least the time `link` predicts,
/// sleeping (not spinning) for the difference: a shared-memory group then behaves like ranks
/// joined by that network, without using CPU for the modelled transfer.
pub struct Delayed<C: Collective> {
    inner: C,
    link: LinkModel,
}

impl<C: Collective> Delayed<C> {
    /// `inner` delayed by `link`.
    pub fn new(inner: C, link: LinkModel) -> Self {
        Self { inner, link }
    }

    fn pad(started: Instant, seconds: f64) {
        let target = Duration::from_secs_f64(seconds);
        if let Some(rest) = target.checked_sub(started.elapsed()) {
            std::thread::sleep(rest);
        }
    }
}

impl<C: Collective> Collective for Delayed<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let started = Instant::now();
        self.inner.allreduce(data, op)?;
        Self::pad(
            started,
            self.link
                .allreduce_seconds(data.len() * 4, self.world_size()),
        );
        Ok(())
    }
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        let started = Instant::now();
        self.inner.broadcast(data, root)?;
        Self::pad(
            started,
            self.link
                .broadcast_seconds(data.len() * 4, self.world_size()),
        );
        Ok(())
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let started = Instant::now();
        let all = self.inner.allgather(data)?;
        let total: usize = all.iter().map(Vec::len).sum();
        Self::pad(
            started,
            self.link.allgather_seconds(total, self.world_size()),
        );
        Ok(all)
    }
    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        let started = Instant::now();
        let received = self.inner.alltoall(send)?;
        Self::pad(
            started,
            self.link.alltoall_seconds(send.len(), self.world_size()),
        );
        Ok(received)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        let started = Instant::now();
        self.inner.barrier()?;
        Self::pad(started, self.link.allreduce_seconds(0, self.world_size()));
        Ok(())
    }
}

impl<B: Backend, C: DeviceCollective<B>> DeviceCollective<B> for Delayed<C> {
    fn allreduce_device(
        &mut self,
        bucket: Tensor<B, 1>,
        op: ReduceOp,
    ) -> Result<Tensor<B, 1>, CommError> {
        let started = Instant::now();
        let bytes = bucket.dims()[0] * 4;
        let out = self.inner.allreduce_device(bucket, op)?;
        Self::pad(
            started,
            self.link.allreduce_seconds(bytes, self.world_size()),
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::InProcess;

    #[test]
    fn link_model_costs_follow_the_ring_formula() {
        let link = LinkModel {
            latency_s: 1e-5,
            bandwidth_bytes_per_s: 1e9,
        };
        // 2(W−1)α + 2(W−1)/W · n/β with W = 4, n = 1e8: 6e-5 + 1.5 · 0.1.
        let t = link.allreduce_seconds(100_000_000, 4);
        assert!((t - (6e-5 + 0.15)).abs() < 1e-12, "{t}");
        assert_eq!(link.allreduce_seconds(1_000, 1), 0.0);
        let mut delayed: Vec<_> = InProcess::group(1, Duration::from_secs(1))
            .into_iter()
            .map(|c| {
                Delayed::new(
                    c,
                    LinkModel {
                        latency_s: 5.0,
                        bandwidth_bytes_per_s: 1e9,
                    },
                )
            })
            .collect();
        // One rank: the model says free, so no delay (a delay would be 5 s at least; the
        // bound leaves a loaded machine's scheduling room).
        let started = Instant::now();
        delayed[0].allreduce(&mut [1.0], ReduceOp::Sum).unwrap();
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
