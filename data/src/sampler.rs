//! Samplers for data-parallel training on sharded data, and how a local batch is cut into
//! padded micro-batches.
//!
//! Every sampler is deterministic for (seed, epoch, rank, world_size) and works on sample
//! *references* (bin, index) and lengths only, so the same code drives training and the
//! load-balance simulation of `balance-report`.
//!
//! - **Rank subsets** ([`rank_subset`]): within each bin, with at least as many shards as
//!   ranks, rank r takes whole shards r, r+W, r+2W, … (it need read no other); otherwise
//!   sample i goes to rank i mod W. Subsets are disjoint and cover the bin.
//! - **random**: the rank's subset, one permutation per epoch, B samples per step (the
//!   incomplete tail of an epoch is dropped).
//! - **stratified**: a fixed quota per length bin in every local batch (given, or proportional
//!   to the bins' sizes by largest remainder), each bin its own permutation per epoch, so every
//!   rank sees the same length mix.
//! - **presort** (local presorting): within a group of G consecutive ranks, the group's G×B
//!   samples (each member's stratified draw, or random draw on unstratified data) are sorted by
//!   length descending (ties: rank, then draw order) and dealt in snake order: row r of G
//!   samples goes to ranks 0..G left to right when r is even, right to left when odd. The
//!   group's draws either come from an exchange (each rank draws its own, an allgather carries
//!   them: [`SamplerConfig::exchange`], what training does) or each rank simulates its whole
//!   group from the shared seed (what the load-balance simulation does); both give the same
//!   batches.
//!
//! Padding ([`Padding`]): to the maximum sequence length, dynamic (to the longest sample of the
//! batch rounded up to a multiple of 8), or length-grouped micro-batches: the local batch sorted
//! by length and cut into k micro-batches, each padded to its own longest sample.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use crate::DataError;

/// Which sampler draws the local batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplerKind {
    /// Uniform from the rank's subset.
    Random,
    /// A fixed quota per length bin.
    Stratified,
    /// Group presort with snake dealing (see the module docs).
    Presort,
}

impl std::str::FromStr for SamplerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "random" => Ok(Self::Random),
            "stratified" => Ok(Self::Stratified),
            "presort" => Ok(Self::Presort),
            other => Err(format!(
                "unknown sampler `{other}` (expected random, stratified or presort)"
            )),
        }
    }
}

impl std::fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Random => "random",
            Self::Stratified => "stratified",
            Self::Presort => "presort",
        })
    }
}

/// How a local batch is padded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Padding {
    /// Every sample padded to the maximum sequence length.
    Max,
    /// Each micro-batch padded to its longest sample, rounded up to a multiple of 8.
    Dynamic,
    /// Sorted by length before being cut into micro-batches, each padded dynamically.
    Grouped,
}

impl std::str::FromStr for Padding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "max" => Ok(Self::Max),
            "dynamic" => Ok(Self::Dynamic),
            "grouped" => Ok(Self::Grouped),
            other => Err(format!(
                "unknown padding `{other}` (expected max, dynamic or grouped)"
            )),
        }
    }
}

/// A sample of a binned dataset: its bin and its index inside the bin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SampleRef {
    /// The bin.
    pub bin: u32,
    /// The index within the bin.
    pub index: u32,
}

/// The sample indices of a bin that rank `rank` of `world_size` owns: whole shards
/// `rank, rank + W, …` when the bin has at least W shards, else every W-th sample from `rank`.
/// `shard_sizes` are the bin's shards' sample counts, in order.
pub fn rank_subset(shard_sizes: &[usize], rank: usize, world_size: usize) -> Vec<u32> {
    let total: usize = shard_sizes.iter().sum();
    if shard_sizes.len() >= world_size {
        let mut start = 0;
        let mut subset = Vec::new();
        for (j, &n) in shard_sizes.iter().enumerate() {
            if j % world_size == rank {
                subset.extend((start..start + n).map(|i| i as u32));
            }
            start += n;
        }
        subset
    } else {
        (rank..total)
            .step_by(world_size)
            .map(|i| i as u32)
            .collect()
    }
}

/// Splits `total` into `bin_sizes`-proportional integer quotas summing to `total` (largest
/// remainder; ties to the lower bin). Empty bins get 0.
pub fn proportional_quota(bin_sizes: &[usize], total: usize) -> Vec<usize> {
    let sum: usize = bin_sizes.iter().sum();
    if sum == 0 {
        return vec![0; bin_sizes.len()];
    }
    // Integer arithmetic: floors n·total / sum, remainders n·total mod sum.
    let mut quota: Vec<usize> = bin_sizes.iter().map(|&n| n * total / sum).collect();
    let remainder = |b: usize| bin_sizes[b] * total % sum;
    let mut order: Vec<usize> = (0..bin_sizes.len()).filter(|&b| bin_sizes[b] > 0).collect();
    order.sort_by(|&a, &b| remainder(b).cmp(&remainder(a)).then(a.cmp(&b)));
    let missing = total - quota.iter().sum::<usize>();
    for &b in order.iter().cycle().take(missing) {
        quota[b] += 1;
    }
    quota
}

/// Settings of a sampler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// The sampler.
    pub kind: SamplerKind,
    /// B, the samples per rank per step (the local batch).
    pub local_batch: usize,
    /// G, the ranks of a presort group (consecutive ranks; the last group may be smaller).
    pub presort_group: usize,
    /// Samples per bin in each local batch (stratified and presort on binned data); `None`:
    /// proportional to the bins' sizes.
    pub bin_quota: Option<Vec<usize>>,
    /// Seed shared by all ranks.
    pub seed: u64,
    /// Presort only. `true`: each rank draws only its own batch ([`RankSampler::draw_own`]),
    /// the draws are exchanged through a collective (an allgather), and
    /// [`RankSampler::deal_from`] deals the group's; `false`: each rank simulates its whole
    /// group's draws. Both give every rank the same batch.
    #[serde(default)]
    pub exchange: bool,
}

/// Where one stream of samples stands: the epoch (permutations drawn so far, minus one) and
/// the next position in the current permutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StreamState {
    /// Completed epochs of this stream.
    pub epoch: u64,
    /// Next position in the epoch's permutation.
    pub position: usize,
}

/// A sampler's resumable state: for each rank it simulates (itself, or its presort group),
/// the state of each of its streams. Save it with a checkpoint; [`RankSampler::restore`]
/// continues where it stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// `[member][stream]`.
    pub streams: Vec<Vec<StreamState>>,
    /// Steps drawn so far.
    pub steps: u64,
}

/// A permuted stream of sample references, reshuffled each epoch.
#[derive(Debug, Clone)]
struct Stream {
    items: Vec<SampleRef>,
    order: Vec<u32>,
    key: u64,
    state: StreamState,
}

/// SplitMix64: a seed for (seed, rank, stream, epoch) with no correlation between neighbours.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Stream {
    fn new(items: Vec<SampleRef>, key: u64) -> Self {
        let mut stream = Self {
            order: Vec::new(),
            items,
            key,
            state: StreamState::default(),
        };
        stream.shuffle();
        stream
    }

    fn shuffle(&mut self) {
        let mut rng = StdRng::seed_from_u64(mix(self.key ^ mix(self.state.epoch)));
        self.order = (0..self.items.len() as u32).collect();
        self.order.shuffle(&mut rng);
    }

    fn restore(&mut self, state: StreamState) {
        self.state = state;
        self.shuffle();
    }

    /// The next `n` samples; a new epoch first when fewer than `n` are left.
    fn take(&mut self, n: usize, out: &mut Vec<SampleRef>) {
        if n == 0 {
            return;
        }
        if self.state.position + n > self.items.len() {
            self.state.epoch += 1;
            self.state.position = 0;
            self.shuffle();
        }
        let range = self.state.position..self.state.position + n;
        out.extend(self.order[range].iter().map(|&i| self.items[i as usize]));
        self.state.position += n;
    }
}

/// One rank's draws of the base sampler (random or stratified).
#[derive(Debug, Clone)]
struct BaseSampler {
    streams: Vec<Stream>,
    /// Samples per stream per step.
    quota: Vec<usize>,
}

impl BaseSampler {
    fn draw(&mut self) -> Vec<SampleRef> {
        let mut out = Vec::new();
        for (stream, &q) in self.streams.iter_mut().zip(&self.quota) {
            stream.take(q, &mut out);
        }
        out
    }
}

/// Draws the local batches of one rank (see the module docs).
#[derive(Debug, Clone)]
pub struct RankSampler {
    config: SamplerConfig,
    rank: usize,
    /// The ranks simulated: this rank, or its presort group in rank order.
    members: Vec<BaseSampler>,
    /// This rank's position among `members`.
    me: usize,
    /// The presort group: its first rank and its size (this rank alone without presort).
    group: (usize, usize),
    steps: u64,
    /// `lengths[bin][index]`: real length of each sample.
    lengths: std::sync::Arc<Vec<Vec<u16>>>,
}

impl RankSampler {
    /// The sampler of `rank` of `world_size`. `shard_sizes[bin]` are the sample counts of each
    /// bin's shards, `lengths[bin][index]` the samples' real lengths (shared by all ranks).
    ///
    /// # Errors
    /// [`DataError::InvalidSetting`] naming the setting: `rank >= world_size`, `local_batch` 0,
    /// `presort_group` 0, a `bin_quota` of the wrong number of bins, not summing to B or asking
    /// from an empty bin, or a rank whose subset of a bin is smaller than its quota.
    pub fn new(
        config: &SamplerConfig,
        shard_sizes: &[Vec<usize>],
        lengths: std::sync::Arc<Vec<Vec<u16>>>,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, DataError> {
        let invalid =
            |field: &'static str, reason: String| DataError::InvalidSetting { field, reason };
        if rank >= world_size {
            return Err(invalid(
                "rank",
                format!("{rank} is not below the world size {world_size}"),
            ));
        }
        let b = config.local_batch;
        if b == 0 {
            return Err(invalid("batch_size", "must be at least 1".into()));
        }
        if config.presort_group == 0 {
            return Err(invalid("presort_group", "must be at least 1".into()));
        }
        let bin_sizes: Vec<usize> = shard_sizes.iter().map(|s| s.iter().sum()).collect();
        let binned =
            config.kind != SamplerKind::Random && bin_sizes.iter().filter(|&&n| n > 0).count() > 1;
        let quota = if binned {
            match &config.bin_quota {
                Some(q) => {
                    if q.len() != bin_sizes.len() {
                        return Err(invalid(
                            "bin_quota",
                            format!("{} quotas for {} length bins", q.len(), bin_sizes.len()),
                        ));
                    }
                    if q.iter().sum::<usize>() != b {
                        return Err(invalid(
                            "bin_quota",
                            format!(
                                "{q:?} sums to {}, not the local batch {b}",
                                q.iter().sum::<usize>()
                            ),
                        ));
                    }
                    if let Some(bin) = (0..q.len()).find(|&i| q[i] > 0 && bin_sizes[i] == 0) {
                        return Err(invalid(
                            "bin_quota",
                            format!("bin {bin} is empty but has quota {}", q[bin]),
                        ));
                    }
                    q.clone()
                }
                None => proportional_quota(&bin_sizes, b),
            }
        } else {
            vec![b]
        };
        let (first, count) = if config.kind == SamplerKind::Presort {
            let g = config.presort_group;
            let first = rank / g * g;
            (first, g.min(world_size - first))
        } else {
            (rank, 1)
        };
        let simulated = if config.exchange {
            rank..rank + 1
        } else {
            first..first + count
        };
        let members = simulated
            .map(|r| {
                let streams: Vec<Stream> = if binned {
                    shard_sizes
                        .iter()
                        .enumerate()
                        .map(|(bin, sizes)| {
                            let items = rank_subset(sizes, r, world_size)
                                .into_iter()
                                .map(|index| SampleRef { bin: bin as u32, index })
                                .collect();
                            Stream::new(items, mix(config.seed ^ mix(((r as u64) << 32) | bin as u64)))
                        })
                        .collect()
                } else {
                    let items = shard_sizes
                        .iter()
                        .enumerate()
                        .flat_map(|(bin, sizes)| {
                            rank_subset(sizes, r, world_size)
                                .into_iter()
                                .map(move |index| SampleRef { bin: bin as u32, index })
                        })
                        .collect();
                    vec![Stream::new(items, mix(config.seed ^ mix((r as u64) << 32 | 0xFFFF_FFFF)))]
                };
                for (stream, &q) in streams.iter().zip(&quota) {
                    if stream.items.len() < q {
                        return Err(invalid(
                            "batch_size",
                            format!(
                                "rank {r} of {world_size} holds {} samples of a stream that must give {q} per step; use a smaller batch or world size, or more data",
                                stream.items.len()
                            ),
                        ));
                    }
                }
                Ok(BaseSampler { streams, quota: quota.clone() })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            config: config.clone(),
            rank,
            members,
            me: if config.exchange { 0 } else { rank - first },
            group: (first, count),
            steps: 0,
            lengths,
        })
    }

    /// The samples per bin of each local batch (one entry when the sampler does not bin).
    pub fn quota(&self) -> &[usize] {
        &self.members[0].quota
    }

    /// This rank's next local batch of B sample references.
    ///
    /// # Panics
    /// In exchange mode with a group of more than one rank: use [`RankSampler::draw_own`],
    /// an allgather, and [`RankSampler::deal_from`].
    pub fn next_batch(&mut self) -> Vec<SampleRef> {
        if self.config.exchange && self.config.kind == SamplerKind::Presort {
            assert_eq!(
                self.group.1, 1,
                "an exchanging presort sampler needs its group's draws"
            );
            let own = self.draw_own();
            return self.deal_from(&[own]);
        }
        let me = self.me;
        self.next_group_batches().swap_remove(me)
    }

    /// Exchange mode: this rank's own draw for the next step (before presorting), to be sent
    /// to the other ranks.
    pub fn draw_own(&mut self) -> Vec<SampleRef> {
        self.steps += 1;
        self.members[self.me].draw()
    }

    /// Exchange mode: this rank's batch, given every rank's [`RankSampler::draw_own`] of the
    /// step in rank order (the world's, as an allgather returns them, or just the group's).
    pub fn deal_from(&self, draws: &[Vec<SampleRef>]) -> Vec<SampleRef> {
        let (first, count) = self.group;
        let group = if draws.len() == count {
            draws
        } else {
            &draws[first..first + count]
        };
        let lengths = &self.lengths;
        deal_snake(group, |s: &SampleRef| {
            lengths[s.bin as usize][s.index as usize]
        })
        .swap_remove(self.rank - first)
    }

    /// Exchange mode: this rank's batch from every rank's draw with the drawn samples' real
    /// lengths (as [`encode_draw`] carries them), so that no rank needs the lengths of samples
    /// it does not own. Deals as [`RankSampler::deal_from`].
    pub fn deal_with_lengths(&self, draws: &[Vec<(SampleRef, u16)>]) -> Vec<SampleRef> {
        let (first, count) = self.group;
        let group = if draws.len() == count {
            draws
        } else {
            &draws[first..first + count]
        };
        deal_snake(group, |s: &(SampleRef, u16)| s.1)
            .swap_remove(self.rank - first)
            .into_iter()
            .map(|(r, _)| r)
            .collect()
    }

    /// Whether this sampler's batches need the exchange (presort in exchange mode).
    pub fn exchanges(&self) -> bool {
        self.config.exchange && self.config.kind == SamplerKind::Presort
    }

    /// The next local batches of every rank this sampler simulates: its presort group, in rank
    /// order (presort), or this rank alone. A simulation of all ranks needs one sampler per
    /// group.
    pub fn next_group_batches(&mut self) -> Vec<Vec<SampleRef>> {
        self.steps += 1;
        let draws: Vec<Vec<SampleRef>> = self.members.iter_mut().map(BaseSampler::draw).collect();
        if self.config.kind != SamplerKind::Presort {
            return draws;
        }
        let lengths = &self.lengths;
        deal_snake(&draws, |s: &SampleRef| {
            lengths[s.bin as usize][s.index as usize]
        })
    }

    /// The state to save with a checkpoint.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            streams: self
                .members
                .iter()
                .map(|m| m.streams.iter().map(|s| s.state).collect())
                .collect(),
            steps: self.steps,
        }
    }

    /// Continues from a saved `state` (of a sampler built with the same settings).
    ///
    /// # Errors
    /// [`DataError::InvalidSetting`] if the state has another shape (other sampler or group).
    pub fn restore(&mut self, state: &SamplerState) -> Result<(), DataError> {
        let shape_ok = state.streams.len() == self.members.len()
            && state
                .streams
                .iter()
                .zip(&self.members)
                .all(|(s, m)| s.len() == m.streams.len());
        if !shape_ok {
            return Err(DataError::InvalidSetting {
                field: "sampler_state",
                reason: format!(
                    "the saved state is for another sampler layout (rank {}, {} members)",
                    self.rank,
                    state.streams.len()
                ),
            });
        }
        for (member, saved) in self.members.iter_mut().zip(&state.streams) {
            for (stream, &s) in member.streams.iter_mut().zip(saved) {
                stream.restore(s);
            }
        }
        self.steps = state.steps;
        Ok(())
    }

    /// Epochs completed by this rank's first stream.
    pub fn epoch(&self) -> u64 {
        self.members[self.me].streams[0].state.epoch
    }
}

/// Local presorting of one group: `draws[m]` is member m's local batch. The G×B samples are
/// sorted by length descending (ties by member, then draw position) and dealt in snake order;
/// returns each member's new local batch (B samples, in row order, so longest first).
///
/// Members must draw equally many samples.
pub fn deal_snake<T: Copy>(draws: &[Vec<T>], len: impl Fn(&T) -> u16) -> Vec<Vec<T>> {
    let g = draws.len();
    let mut all: Vec<(u16, usize, usize, T)> = draws
        .iter()
        .enumerate()
        .flat_map(|(m, d)| d.iter().enumerate().map(move |(i, s)| (0, m, i, *s)))
        .collect();
    for entry in &mut all {
        entry.0 = len(&entry.3);
    }
    all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut out: Vec<Vec<T>> = vec![Vec::with_capacity(all.len() / g.max(1)); g];
    for (row, chunk) in all.chunks(g).enumerate() {
        for (col, entry) in chunk.iter().enumerate() {
            let member = if row % 2 == 0 { col } else { g - 1 - col };
            out[member].push(entry.3);
        }
    }
    out
}

/// Sample references as bytes for a collective: (bin, index) as little-endian u32 pairs.
pub fn encode_refs(refs: &[SampleRef]) -> Vec<u8> {
    refs.iter()
        .flat_map(|r| r.bin.to_le_bytes().into_iter().chain(r.index.to_le_bytes()))
        .collect()
}

/// A draw as bytes for the presort exchange: per sample its reference and real length, 10
/// bytes (little-endian `bin u32, index u32, length u16`).
pub fn encode_draw(draw: &[(SampleRef, u16)]) -> Vec<u8> {
    draw.iter()
        .flat_map(|(r, len)| {
            r.bin
                .to_le_bytes()
                .into_iter()
                .chain(r.index.to_le_bytes())
                .chain(len.to_le_bytes())
        })
        .collect()
}

/// The inverse of [`encode_draw`].
///
/// # Errors
/// [`DataError::InvalidSetting`] if the length is not a multiple of 10 (a corrupt exchange).
pub fn decode_draw(bytes: &[u8]) -> Result<Vec<(SampleRef, u16)>, DataError> {
    if bytes.len() % 10 != 0 {
        return Err(DataError::InvalidSetting {
            field: "presort exchange",
            reason: format!(
                "{} bytes is not a list of (bin, index, length)",
                bytes.len()
            ),
        });
    }
    Ok(bytes
        .chunks_exact(10)
        .map(|c| {
            let reference = SampleRef {
                bin: u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                index: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            };
            (reference, u16::from_le_bytes([c[8], c[9]]))
        })
        .collect())
}

/// The inverse of [`encode_refs`].
///
/// # Errors
/// [`DataError::InvalidSetting`] if the length is not a multiple of 8 (a corrupt exchange).
pub fn decode_refs(bytes: &[u8]) -> Result<Vec<SampleRef>, DataError> {
    if bytes.len() % 8 != 0 {
        return Err(DataError::InvalidSetting {
            field: "presort exchange",
            reason: format!("{} bytes is not a list of (bin, index) pairs", bytes.len()),
        });
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| SampleRef {
            bin: u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            index: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect())
}

#[cfg(test)]
mod tests;
