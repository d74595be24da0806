//! In-memory instance loader: a fresh seeded permutation every epoch, fixed-size batches, the
//! incomplete tail of an epoch dropped (as `drop_last=True`), so every step has the same global
//! batch size.
//!
//! With several data-parallel ranks, every rank draws the same permutation (same seed) and
//! takes its own slice of each global batch: rank r gets samples `r·B .. (r+1)·B` of the
//! `world_size·B` drawn for the step (as PyTorch's `DistributedSampler`, which deals a shared
//! permutation out to ranks). The ranks' batches are disjoint and together are exactly the
//! batch one rank would draw with `world_size·B`.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use std::sync::Arc;

use crate::{DataError, HostBatch, TrainingInstance, collate};

/// Yields shuffled batches of a set of instances, deterministically for a seed.
#[derive(Debug)]
pub struct InstanceLoader {
    instances: Arc<[TrainingInstance]>,
    /// Per-rank batch size.
    batch_size: usize,
    rank: usize,
    world_size: usize,
    max_seq_length: usize,
    seed: u64,
    /// Epochs completed so far; the permutation of epoch e is drawn from seed + e.
    epoch: u64,
    /// Next index into `order`.
    position: usize,
    order: Vec<usize>,
}

impl InstanceLoader {
    /// A loader over `instances` with batches of `batch_size` (one rank).
    ///
    /// # Errors
    /// [`DataError::BatchLargerThanData`] (naming `what`) if there are fewer instances than one
    /// batch; [`DataError::InvalidSetting`] if `batch_size` is 0.
    pub fn new(
        instances: impl Into<Arc<[TrainingInstance]>>,
        batch_size: usize,
        max_seq_length: usize,
        seed: u64,
        what: &str,
    ) -> Result<Self, DataError> {
        Self::for_rank(instances, batch_size, max_seq_length, seed, what, 0, 1)
    }

    /// The loader of data-parallel rank `rank` of `world_size`: batches of `batch_size` per
    /// rank, disjoint from the other ranks' (see the module docs).
    ///
    /// # Errors
    /// As [`InstanceLoader::new`], with the global batch `world_size · batch_size`;
    /// [`DataError::InvalidSetting`] if `rank >= world_size`.
    pub fn for_rank(
        instances: impl Into<Arc<[TrainingInstance]>>,
        batch_size: usize,
        max_seq_length: usize,
        seed: u64,
        what: &str,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, DataError> {
        let instances = instances.into();
        if rank >= world_size {
            return Err(DataError::InvalidSetting {
                field: "rank",
                reason: format!("rank {rank} is not below the world size {world_size}"),
            });
        }
        if batch_size == 0 {
            return Err(DataError::InvalidSetting {
                field: "batch_size",
                reason: "must be at least 1".into(),
            });
        }
        if instances.len() < batch_size * world_size {
            return Err(DataError::BatchLargerThanData {
                what: what.to_string(),
                batch_size: batch_size * world_size,
                available: instances.len(),
            });
        }
        let mut loader = Self {
            order: (0..instances.len()).collect(),
            instances,
            batch_size,
            rank,
            world_size,
            max_seq_length,
            seed,
            epoch: 0,
            position: 0,
        };
        loader.shuffle();
        Ok(loader)
    }

    fn shuffle(&mut self) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_add(self.epoch));
        self.order = (0..self.instances.len()).collect();
        self.order.shuffle(&mut rng);
    }

    /// This rank's next batch; starts a new epoch (a new permutation) when fewer than a
    /// global batch (`world_size · batch_size`) of instances are left.
    pub fn next_batch(&mut self) -> HostBatch {
        let global = self.batch_size * self.world_size;
        if self.position + global > self.instances.len() {
            self.epoch += 1;
            self.position = 0;
            self.shuffle();
        }
        let start = self.position + self.rank * self.batch_size;
        let picked: Vec<&TrainingInstance> = self.order[start..start + self.batch_size]
            .iter()
            .map(|&i| &self.instances[i])
            .collect();
        self.position += global;
        collate(&picked, self.max_seq_length)
    }

    /// Every instance once, in order, in batches of `batch_size` (the last one may be smaller):
    /// for evaluation.
    pub fn sequential_batches(&self) -> impl Iterator<Item = HostBatch> + '_ {
        self.instances.chunks(self.batch_size).map(|chunk| {
            let refs: Vec<&TrainingInstance> = chunk.iter().collect();
            collate(&refs, self.max_seq_length)
        })
    }

    /// Number of instances.
    pub fn len(&self) -> usize {
        self.instances.len()
    }

    /// Whether there are no instances (never true: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.instances.is_empty()
    }

    /// Epochs completed so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The instances, in creation order.
    pub fn instances(&self) -> &[TrainingInstance] {
        &self.instances
    }

    /// Where the loader stands, `(epoch, position)`: the permutation (seeded by `seed + epoch`)
    /// and the index in it of the next global batch. Saved with a checkpoint.
    pub fn position(&self) -> (u64, usize) {
        (self.epoch, self.position)
    }

    /// Continues from a saved [`InstanceLoader::position`] of a loader built with the same
    /// instances, batch size, seed and world size: the next batches are those the saved loader
    /// would have given.
    ///
    /// # Errors
    /// [`DataError::InvalidSetting`] if `position` lies beyond the instances.
    pub fn restore(&mut self, epoch: u64, position: usize) -> Result<(), DataError> {
        if position > self.instances.len() {
            return Err(DataError::InvalidSetting {
                field: "position",
                reason: format!(
                    "saved position {position} is beyond the {} instances",
                    self.instances.len()
                ),
            });
        }
        self.epoch = epoch;
        self.position = position;
        self.shuffle();
        Ok(())
    }
}
