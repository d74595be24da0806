//! Training batches from shards: a sampler's references ([`SampleRef`]) turned into padded
//! micro-batches. The samples come from a [`SampleSource`]: held in memory
//! ([`InMemorySamples`]), or read from the shards when they are needed ([`ShardReader`]:
//! each rank opens only the shards its references point into, a few at a time, so its memory
//! does not grow with the dataset). [`BatchPrefetcher`] reads and collates the next step's
//! batches in a background thread while the current step runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::batch::padded_length;
use crate::sampler::{Padding, RankSampler, SampleRef, SamplerConfig, SamplerState};
use crate::shard::OpenShard;
use crate::{DataError, HostBatch, ShardedDataset, TrainingInstance, collate_padded};

/// Cuts a local batch (given by its samples' real lengths) into `k` micro-batches as `padding`
/// says; returns, per micro-batch, the positions in the local batch and the padded length.
/// Micro-batches differ in size by at most one; `k` is capped at the batch size.
pub fn micro_batches(
    lengths: &[u16],
    k: usize,
    padding: Padding,
    max_seq_length: usize,
) -> Vec<(Vec<usize>, usize)> {
    let n = lengths.len();
    let k = k.clamp(1, n.max(1));
    let mut order: Vec<usize> = (0..n).collect();
    if padding == Padding::Grouped {
        order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    }
    (0..k)
        .map(|j| {
            let part: Vec<usize> = order[j * n / k..(j + 1) * n / k].to_vec();
            let longest = part.iter().map(|&i| lengths[i] as usize).max().unwrap_or(0);
            let padded = match padding {
                Padding::Max => max_seq_length,
                Padding::Dynamic | Padding::Grouped => padded_length(longest, max_seq_length),
            };
            (part, padded)
        })
        .collect()
}

/// Where the samples behind references come from.
pub trait SampleSource: Send {
    /// The samples of `refs`, in their order.
    ///
    /// # Errors
    /// A shard's [`DataError`] (naming the file and sample) when a sample cannot be read.
    fn fetch(&mut self, refs: &[SampleRef]) -> Result<Vec<TrainingInstance>, DataError>;
}

/// Every sample in memory, `[bin][index]` (as [`ShardedDataset::load`] returns them).
pub struct InMemorySamples(pub Vec<Arc<[TrainingInstance]>>);

impl SampleSource for InMemorySamples {
    fn fetch(&mut self, refs: &[SampleRef]) -> Result<Vec<TrainingInstance>, DataError> {
        refs.iter()
            .map(|r| {
                self.0
                    .get(r.bin as usize)
                    .and_then(|bin| bin.get(r.index as usize))
                    .cloned()
                    .ok_or_else(|| DataError::InvalidSetting {
                        field: "sample reference",
                        reason: format!("bin {} index {} is not in the dataset", r.bin, r.index),
                    })
            })
            .collect()
    }
}

/// Reads samples from the shards of a [`ShardedDataset`] by reference, keeping at most
/// `max_open` shards open (least recently used closed first). References into one shard are
/// read together, consecutive rows in one read per field; every sample is validated as
/// [`crate::shard::read_shard`] validates it.
///
/// Cost: one HDF5 read per field per run of consecutive rows. On gzip-compressed shards each
/// read decompresses the chunk (up to 1024 samples) that holds it: uncompressed shards (as
/// MLPerf's `hdf5_4320_shards_uncompressed`) are the ones to stream from.
pub struct ShardReader {
    /// `[bin][shard]`.
    shards: Vec<Vec<PathBuf>>,
    /// `[bin][shard]`: the bin index of each shard's first sample, and the bin's total last.
    starts: Vec<Vec<usize>>,
    vocab_size: usize,
    /// Open shards, most recently used last.
    open: Vec<((usize, usize), OpenShard)>,
    max_open: usize,
    /// Samples read so far.
    pub samples_read: u64,
}

impl ShardReader {
    /// A reader of `dataset`'s shards (opened lazily); ids are checked against `vocab_size`.
    pub fn new(dataset: &ShardedDataset, vocab_size: usize, max_open: usize) -> Self {
        let starts = dataset
            .shard_sizes
            .iter()
            .map(|sizes| {
                let mut starts = Vec::with_capacity(sizes.len() + 1);
                let mut total = 0;
                for &n in sizes {
                    starts.push(total);
                    total += n;
                }
                starts.push(total);
                starts
            })
            .collect();
        Self {
            shards: dataset.shards.clone(),
            starts,
            vocab_size,
            open: Vec::new(),
            max_open: max_open.max(1),
            samples_read: 0,
        }
    }

    /// `(bin, shard, row)` of a reference.
    fn locate(&self, r: SampleRef) -> Result<(usize, usize, usize), DataError> {
        let (bin, index) = (r.bin as usize, r.index as usize);
        let starts = self
            .starts
            .get(bin)
            .filter(|s| index < *s.last().unwrap_or(&0))
            .ok_or_else(|| DataError::InvalidSetting {
                field: "sample reference",
                reason: format!("bin {bin} index {index} is not in the dataset"),
            })?;
        let shard = starts.partition_point(|&s| s <= index) - 1;
        Ok((bin, shard, index - starts[shard]))
    }

    /// The open shard `(bin, j)`, opening it (and closing the least recently used) if needed.
    fn shard(&mut self, key: (usize, usize)) -> Result<&OpenShard, DataError> {
        match self.open.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let entry = self.open.remove(i);
                self.open.push(entry);
            }
            None => {
                let shard = OpenShard::open(&self.shards[key.0][key.1])?;
                if self.open.len() >= self.max_open {
                    self.open.remove(0);
                }
                self.open.push((key, shard));
            }
        }
        Ok(&self.open.last().expect("pushed above").1)
    }
}

impl ShardReader {
    /// `refs` grouped into runs of consecutive rows of one shard, each read at once:
    /// `((bin, shard), rows, [(row, position in refs)])`.
    fn runs(&self, refs: &[SampleRef]) -> Result<Vec<ShardRun>, DataError> {
        let mut order = refs
            .iter()
            .enumerate()
            .map(|(k, &r)| self.locate(r).map(|(b, j, row)| ((b, j), row, k)))
            .collect::<Result<Vec<_>, _>>()?;
        order.sort_unstable();
        let mut runs: Vec<ShardRun> = Vec::new();
        for (key, row, k) in order {
            match runs.last_mut() {
                Some((last_key, rows, members)) if *last_key == key && row <= rows.end => {
                    rows.end = row + 1;
                    members.push((row, k));
                }
                _ => runs.push((key, row..row + 1, vec![(row, k)])),
            }
        }
        Ok(runs)
    }

    /// The real lengths of `refs`, in order, reading only their `input_mask` rows (what a
    /// rank sends with its draw in the presort exchange).
    ///
    /// # Errors
    /// A shard's [`DataError`] naming the file and sample.
    pub fn lengths(&mut self, refs: &[SampleRef]) -> Result<Vec<u16>, DataError> {
        let mut out = vec![0u16; refs.len()];
        for (key, rows, members) in self.runs(refs)? {
            let lengths = self.shard(key)?.lengths(rows.clone())?;
            for (row, k) in members {
                out[k] = lengths[row - rows.start];
            }
        }
        Ok(out)
    }
}

/// A run of consecutive rows of one shard: `((bin, shard), rows, [(row, position)])`.
type ShardRun = ((usize, usize), std::ops::Range<usize>, Vec<(usize, usize)>);

impl SampleSource for ShardReader {
    fn fetch(&mut self, refs: &[SampleRef]) -> Result<Vec<TrainingInstance>, DataError> {
        let mut out: Vec<Option<TrainingInstance>> = vec![None; refs.len()];
        for (key, rows, members) in self.runs(refs)? {
            let vocab_size = self.vocab_size;
            let samples = self.shard(key)?.read(vocab_size, rows.clone())?;
            self.samples_read += samples.len() as u64;
            for (row, k) in members {
                out[k] = Some(samples[row - rows.start].clone());
            }
        }
        Ok(out
            .into_iter()
            .map(|s| s.expect("every reference read"))
            .collect())
    }
}

/// Turns a step's references into its micro-batches: fetch, cut by [`micro_batches`], collate.
pub struct BatchMaker {
    source: Box<dyn SampleSource>,
    padding: Padding,
    micro_batches: usize,
    max_seq_length: usize,
}

impl BatchMaker {
    /// Micro-batches of `micro_batches` parts padded as `padding` says.
    ///
    /// # Errors
    /// [`DataError::InvalidSetting`] if `micro_batches` is 0.
    pub fn new(
        source: Box<dyn SampleSource>,
        padding: Padding,
        micro_batches: usize,
        max_seq_length: usize,
    ) -> Result<Self, DataError> {
        if micro_batches == 0 {
            return Err(DataError::InvalidSetting {
                field: "grad_accum",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Self {
            source,
            padding,
            micro_batches,
            max_seq_length,
        })
    }

    /// The micro-batches of the local batch `refs`.
    ///
    /// # Errors
    /// As [`SampleSource::fetch`]; [`DataError::InvalidSetting`] for a sample longer than the
    /// model's sequence length.
    pub fn make(&mut self, refs: &[SampleRef]) -> Result<Vec<HostBatch>, DataError> {
        let picked = self.source.fetch(refs)?;
        if let Some(long) = picked.iter().find(|i| i.len() > self.max_seq_length) {
            return Err(DataError::InvalidSetting {
                field: "max_seq_length",
                reason: format!(
                    "a sample has {} tokens, more than the model's {}",
                    long.len(),
                    self.max_seq_length
                ),
            });
        }
        let lengths: Vec<u16> = picked.iter().map(|i| i.len() as u16).collect();
        Ok(micro_batches(
            &lengths,
            self.micro_batches,
            self.padding,
            self.max_seq_length,
        )
        .into_iter()
        .map(|(part, padded)| {
            let part: Vec<&TrainingInstance> = part.iter().map(|&i| &picked[i]).collect();
            collate_padded(&part, padded)
        })
        .collect())
    }
}

/// Training batches from shards, synchronously: each step, the rank's sampler draws a local
/// batch of `micro_batches × batch_size` references, which [`BatchMaker`] turns into padded
/// micro-batches (the trainer accumulates gradients over them).
pub struct ShardLoader {
    sampler: RankSampler,
    maker: BatchMaker,
}

impl ShardLoader {
    /// The loader of `rank` of `world_size` over `dataset`, its samples from `source`.
    /// `config.local_batch` is the whole local batch of a step.
    ///
    /// # Errors
    /// Those of [`RankSampler::new`] and [`BatchMaker::new`]; [`DataError::InvalidSetting`] if
    /// a sample is longer than `max_seq_length`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dataset: &ShardedDataset,
        source: Box<dyn SampleSource>,
        config: &SamplerConfig,
        padding: Padding,
        micro_batches: usize,
        max_seq_length: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, DataError> {
        let maker = BatchMaker::new(source, padding, micro_batches, max_seq_length)?;
        // Every sample's length when they were read ([`ShardedDataset::open`]), else what the
        // bins (or, for a plain folder, the shards' width S) allow: a dataset made for longer
        // sequences is refused before training, not at the first long sample.
        let longest = dataset.lengths.iter().flatten().copied().max();
        let what = match longest {
            Some(n) => (n as usize, "a sample has"),
            None => (
                dataset.bins.iter().map(|b| b.hi).max().unwrap_or(0),
                "the shards hold samples of up to",
            ),
        };
        if what.0 > max_seq_length {
            return Err(DataError::InvalidSetting {
                field: "max_seq_length",
                reason: format!(
                    "{}: {} {} tokens, more than the model's {max_seq_length}",
                    dataset.root.display(),
                    what.1,
                    what.0
                ),
            });
        }
        let sampler = RankSampler::new(
            config,
            &dataset.shard_sizes,
            dataset.lengths.clone(),
            rank,
            world_size,
        )?;
        Ok(Self { sampler, maker })
    }

    /// The next step's micro-batches.
    ///
    /// # Errors
    /// As [`BatchMaker::make`].
    ///
    /// # Panics
    /// As [`RankSampler::next_batch`]: an exchanging presort loader of a group larger than one
    /// rank needs [`ShardLoader::draw_own`] and [`ShardLoader::batches_from`].
    pub fn next_step(&mut self) -> Result<Vec<HostBatch>, DataError> {
        let refs = self.sampler.next_batch();
        self.maker.make(&refs)
    }

    /// Whether the batches need the presort exchange.
    pub fn exchanges(&self) -> bool {
        self.sampler.exchanges()
    }

    /// Exchange mode: this rank's own draw of the next step, to allgather.
    pub fn draw_own(&mut self) -> Vec<SampleRef> {
        self.sampler.draw_own()
    }

    /// Exchange mode: the step's micro-batches from every rank's draw, in rank order.
    ///
    /// # Errors
    /// As [`BatchMaker::make`].
    pub fn batches_from(&mut self, draws: &[Vec<SampleRef>]) -> Result<Vec<HostBatch>, DataError> {
        let refs = self.sampler.deal_from(draws);
        self.maker.make(&refs)
    }

    /// The sampler (its quota, epoch and state).
    pub fn sampler(&self) -> &RankSampler {
        &self.sampler
    }

    /// The sampler, to draw with.
    pub fn sampler_mut(&mut self) -> &mut RankSampler {
        &mut self.sampler
    }

    /// Continues from a saved sampler state.
    ///
    /// # Errors
    /// As [`RankSampler::restore`].
    pub fn restore(&mut self, state: &SamplerState) -> Result<(), DataError> {
        self.sampler.restore(state)
    }

    /// The sampler, and the maker that a [`BatchPrefetcher`] runs.
    pub fn into_parts(self) -> (RankSampler, BatchMaker) {
        (self.sampler, self.maker)
    }
}

/// Reads and collates batches in a background thread (`ember-data`), up to `depth` local
/// batches ahead: [`BatchPrefetcher::submit`] a step's references, and
/// [`BatchPrefetcher::receive`] its micro-batches in submission order, with the time the
/// caller waited for them.
pub struct BatchPrefetcher {
    requests: Option<SyncSender<Vec<SampleRef>>>,
    /// Set when the prefetcher is dropped: the thread stops before its next batch.
    stop: Arc<AtomicBool>,
    results: Receiver<Result<Vec<HostBatch>, DataError>>,
    in_flight: usize,
    thread: Option<JoinHandle<()>>,
}

impl BatchPrefetcher {
    /// Starts the reader thread.
    ///
    /// # Errors
    /// [`DataError::Io`] if the thread cannot be started.
    pub fn spawn(mut maker: BatchMaker, depth: usize) -> Result<Self, DataError> {
        let (requests, inbox) = sync_channel::<Vec<SampleRef>>(depth.max(1));
        let (outbox, results) = sync_channel(depth.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ember-data".into())
            .spawn(move || {
                for refs in inbox {
                    if stopped.load(Ordering::Relaxed) || outbox.send(maker.make(&refs)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|error| DataError::Io {
                path: PathBuf::from("<ember-data thread>"),
                error,
            })?;
        Ok(Self {
            requests: Some(requests),
            stop,
            results,
            in_flight: 0,
            thread: Some(thread),
        })
    }

    /// Local batches submitted and not yet received.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Queues a local batch to read (blocks only when `depth` are already queued).
    pub fn submit(&mut self, refs: Vec<SampleRef>) {
        if let Some(requests) = &self.requests
            && requests.send(refs).is_ok()
        {
            self.in_flight += 1;
        }
    }

    /// The oldest submitted local batch's micro-batches, and how long this call waited.
    ///
    /// # Errors
    /// The reader's [`DataError`] (a shard that cannot be read); [`DataError::InvalidSetting`]
    /// when nothing was submitted or the reader thread is gone.
    pub fn receive(&mut self) -> Result<(Vec<HostBatch>, Duration), DataError> {
        let gone = || DataError::InvalidSetting {
            field: "data",
            reason: "the shard reader thread stopped".into(),
        };
        if self.in_flight == 0 {
            return Err(gone());
        }
        let started = Instant::now();
        let result = self.results.recv().map_err(|_| gone())?;
        self.in_flight -= 1;
        Ok((result?, started.elapsed()))
    }
}

impl Drop for BatchPrefetcher {
    fn drop(&mut self) {
        // The flag stops the thread before its next batch, closing the request channel ends
        // its loop; drain so that it is not blocked on a full result channel.
        self.stop.store(true, Ordering::Relaxed);
        self.requests = None;
        while self.results.try_recv().is_ok() {}
        if let Some(thread) = self.thread.take() {
            while !thread.is_finished() {
                if self
                    .results
                    .recv_timeout(Duration::from_millis(10))
                    .is_err()
                    && thread.is_finished()
                {
                    break;
                }
            }
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_pad_each_part_to_its_longest() {
        let lengths = [20u16, 100, 35, 90];
        let grouped = micro_batches(&lengths, 2, Padding::Grouped, 128);
        assert_eq!(grouped, vec![(vec![1, 3], 104), (vec![2, 0], 40)]);
        let dynamic = micro_batches(&lengths, 2, Padding::Dynamic, 128);
        assert_eq!(dynamic, vec![(vec![0, 1], 104), (vec![2, 3], 96)]);
        let max = micro_batches(&lengths, 1, Padding::Max, 128);
        assert_eq!(max, vec![(vec![0, 1, 2, 3], 128)]);
        assert_eq!(micro_batches(&lengths, 9, Padding::Grouped, 128).len(), 4);
    }
}
