//! A run's data: the corpus read into training and held-out instances (or the training shards,
//! streamed), the evaluation set (the held-out documents, or `data.eval_shards`), and each
//! rank's share of it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::backend::Backend;
use ember_data::{
    BatchPrefetcher, HostBatch, InstanceLoader, RankSampler, SampleRef, SamplerConfig,
    SamplerState, ShardLoader, ShardReader, ShardedDataset, TrainingInstance, WordPieceTokenizer,
    create_training_instances, decode_draw, encode_draw, read_corpus, read_eval_set,
    split_held_out, tokenize_documents,
};
use tracing::info;

use crate::checkpoint::DataPosition;
use crate::eval::unigram_baseline;
use crate::parallel::{CommThread, check_agreement};
use crate::{TrainConfig, TrainError};

/// Shards a [`ShardReader`] keeps open at once.
const MAX_OPEN_SHARDS: usize = 8;
/// Training samples read for the unigram baseline when training on shards.
const BASELINE_SAMPLES: usize = 2048;

/// Training and held-out instances of a configuration, with the tokenizer that made them.
pub struct PreparedData {
    pub tokenizer: WordPieceTokenizer,
    /// Shared, so that in-process ranks read one copy. Empty when training on shards.
    pub train: Arc<[TrainingInstance]>,
    /// The evaluation set: the first `train.eval_samples` of `data.eval_shards`, or instances
    /// of the corpus's held-out documents.
    pub eval: Arc<[TrainingInstance]>,
    /// The training shards (`data.shards`): their files and sample counts (each rank reads
    /// the lengths and samples it draws when it draws them).
    pub shards: Option<ShardedDataset>,
    /// Corpus lines skipped because they were not UTF-8 (`data.strict` unset).
    pub skipped_lines: usize,
}

/// Reads the vocabulary and corpus of `config`, holds out the last `eval_documents`
/// documents, and creates the training instances (`dupe_factor` passes) and the evaluation
/// instances (one pass, another seed). With `data.shards`, only the shards' metadata is read;
/// with `data.eval_shards`, the evaluation set is read from there. The corpus is read only
/// when something needs it.
///
/// # Errors
/// [`TrainError::Data`] naming the file: missing or empty corpus, bad vocabulary, too few
/// documents, missing or bad shards, an eval set that is empty, of another sequence length or
/// of another vocabulary.
pub fn prepare_data(config: &TrainConfig) -> Result<PreparedData, TrainError> {
    let tokenizer = WordPieceTokenizer::from_vocab_file(&config.vocab_path()?)?;
    let seq_len = config.instances.max_seq_length;
    let shards = match &config.data.shards {
        Some(path) => {
            let dataset = ShardedDataset::scan(path, config.data.skip_bad_shards)?;
            for skipped in &dataset.skipped {
                tracing::warn!("skipped a bad shard: {skipped}");
            }
            Some(dataset)
        }
        None => None,
    };
    let eval_from_shards = match &config.data.eval_shards {
        Some(path) => {
            let eval = read_eval_set(
                path,
                tokenizer.vocab_size(),
                seq_len,
                config.train.eval_samples,
            )?;
            if eval.is_empty() {
                return Err(TrainError::Data(ember_data::DataError::EmptyShard {
                    path: path.clone(),
                }));
            }
            if eval.len() < config.train.eval_samples {
                tracing::warn!(
                    "{}: {} samples, fewer than train.eval_samples {}: evaluating all of them",
                    path.display(),
                    eval.len(),
                    config.train.eval_samples
                );
            }
            Some(eval)
        }
        None => None,
    };
    if shards.is_some() && eval_from_shards.is_some() {
        return Ok(PreparedData {
            tokenizer,
            train: Vec::new().into(),
            eval: eval_from_shards.unwrap_or_default().into(),
            shards,
            skipped_lines: 0,
        });
    }
    let corpus_path = config.corpus_path()?;
    // Held out before tokenising, by raw document count, as `prepare-data` holds them out of
    // its shards.
    let corpus = read_corpus(&corpus_path, config.data.strict)?;
    let skipped_lines = corpus.skipped_lines;
    let (train_docs, eval_docs) =
        split_held_out(corpus.documents, config.data.eval_documents, &corpus_path)?;
    let special = tokenizer.special();
    let train = if shards.is_some() {
        Vec::new()
    } else {
        create_training_instances(
            &tokenize_documents(&tokenizer, &train_docs)?,
            &config.instances,
            special,
            tokenizer.vocab_size(),
        )?
    };
    let eval = match eval_from_shards {
        Some(eval) => eval,
        None => {
            let eval_config = ember_data::PretrainingConfig {
                dupe_factor: 1,
                seed: config.instances.seed.wrapping_add(1),
                ..config.instances.clone()
            };
            let eval_docs = tokenize_documents(&tokenizer, &eval_docs)?;
            create_training_instances(&eval_docs, &eval_config, special, tokenizer.vocab_size())?
        }
    };
    Ok(PreparedData {
        tokenizer,
        train: train.into(),
        eval: eval.into(),
        shards,
        skipped_lines,
    })
}

/// A rank's stream of shard batches: its sampler draws (with the presort exchange when it
/// needs one) `data.prefetch` steps ahead of the step that trains on them, and the background
/// reader reads and collates them ([`BatchPrefetcher`]).
pub(crate) struct ShardStream {
    sampler: RankSampler,
    /// Reads the lengths of this rank's own draws, for the presort exchange.
    lengths: ShardReader,
    prefetcher: BatchPrefetcher,
    depth: usize,
    /// The sampler's state after each draw still in flight, oldest first.
    pending: VecDeque<SamplerState>,
    /// The sampler's state after the draw of the last batch handed out: what a checkpoint
    /// saves, so that a resumed run draws the next one.
    consumed: SamplerState,
}

impl ShardStream {
    /// The references of the next step: the rank's own draw, or with presort its share of the
    /// group's draws: each rank reads the lengths of its own draw (`input_mask` rows only) and
    /// sends them with the references (10 bytes a sample, through an allgather), so that no
    /// rank needs the lengths, or the samples, of data it does not own.
    fn draw<B: Backend>(&mut self, comm: &CommThread<B>) -> Result<Vec<SampleRef>, TrainError> {
        if !self.sampler.exchanges() {
            return Ok(self.sampler.next_batch());
        }
        let own = self.sampler.draw_own();
        let lengths = self.lengths.lengths(&own)?;
        let own = encode_draw(&own.into_iter().zip(lengths).collect::<Vec<_>>());
        let world = if comm.world_size() == 1 {
            vec![own]
        } else {
            comm.call(move |c| c.allgather(&own))?
        };
        let draws = world
            .iter()
            .map(|bytes| decode_draw(bytes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(self.sampler.deal_with_lengths(&draws))
    }
}

/// Where a rank's training batches come from.
pub(crate) enum TrainBatches {
    /// Instances made from the corpus: a shared permutation dealt out to ranks.
    Instances(InstanceLoader),
    /// Shards, streamed through a sampler.
    Shards(Box<ShardStream>),
}

impl TrainBatches {
    /// The `k` micro-batches of the next step, and the seconds the step waited for them
    /// (all of this call: drawing, the presort exchange, and the reader's batches when they
    /// are not ready).
    pub(crate) fn next_step<B: Backend>(
        &mut self,
        k: usize,
        comm: &CommThread<B>,
    ) -> Result<(Vec<HostBatch>, f64), TrainError> {
        match self {
            Self::Instances(loader) => {
                let started = Instant::now();
                let batches = (0..k).map(|_| loader.next_batch()).collect();
                Ok((batches, started.elapsed().as_secs_f64()))
            }
            Self::Shards(stream) => {
                let started = Instant::now();
                while stream.prefetcher.in_flight() < stream.depth {
                    let refs = stream.draw(comm)?;
                    stream.pending.push_back(stream.sampler.state());
                    stream.prefetcher.submit(refs);
                }
                let (batches, _) = stream.prefetcher.receive()?;
                if let Some(state) = stream.pending.pop_front() {
                    stream.consumed = state;
                }
                Ok((batches, started.elapsed().as_secs_f64()))
            }
        }
    }

    /// Where this rank's data stands, for a checkpoint.
    pub(crate) fn position(&self) -> DataPosition {
        match self {
            Self::Instances(loader) => {
                let (epoch, position) = loader.position();
                DataPosition::Instances { epoch, position }
            }
            Self::Shards(stream) => DataPosition::Shards {
                sampler: stream.consumed.clone(),
            },
        }
    }

    /// Continues from a saved [`TrainBatches::position`] (before the first step).
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming `file` when the position is of the other kind of data
    /// (shards against corpus instances) or does not fit this loader.
    pub(crate) fn restore(
        &mut self,
        position: &DataPosition,
        file: &std::path::Path,
    ) -> Result<(), TrainError> {
        let restored = match (self, position) {
            (Self::Instances(loader), DataPosition::Instances { epoch, position }) => {
                loader.restore(*epoch, *position)
            }
            (Self::Shards(stream), DataPosition::Shards { sampler }) => {
                debug_assert_eq!(stream.prefetcher.in_flight(), 0, "restore before any draw");
                stream.consumed = sampler.clone();
                stream.sampler.restore(sampler)
            }
            _ => {
                return Err(TrainError::Checkpoint {
                    path: file.to_path_buf(),
                    reason: "the saved data position is of the other kind of data (shards against corpus instances)".into(),
                });
            }
        };
        restored.map_err(|e| TrainError::Checkpoint {
            path: file.to_path_buf(),
            reason: e.to_string(),
        })
    }
}

/// One rank's view of the data: its training batches, the held-out set, and what the logs say
/// about them.
pub(crate) struct RankData {
    pub batches: TrainBatches,
    pub eval: InstanceLoader,
    /// Training samples in the whole run (all ranks).
    pub num_train: usize,
    /// Mean real tokens per training sample.
    pub mean_len: f64,
    /// Masked-LM accuracy of always predicting the most frequent masked token, and that token.
    pub unigram_baseline: f64,
    pub unigram_token: String,
}

impl RankData {
    /// This rank's loaders over `data`. Ranks on shards check that they read the same shards.
    ///
    /// # Errors
    /// [`TrainError::Data`]: a batch larger than the data, a bad sampler setting, an unreadable
    /// shard; [`TrainError::RankMismatch`]: ranks that list different shards.
    pub(crate) fn new<B: Backend>(
        config: &TrainConfig,
        data: &PreparedData,
        comm: &CommThread<B>,
    ) -> Result<Self, TrainError> {
        let (rank, world_size) = (comm.rank(), comm.world_size());
        let seq_len = config.instances.max_seq_length;
        let batch_size = config.train.batch_size;
        let grad_accum = config.parallel.grad_accum;
        let (unigram_id, unigram_baseline, num_train, mean_len, batches) = match &data.shards {
            None => {
                let (id, acc) = unigram_baseline(data.train.iter(), &data.eval);
                let mean_len = data.train.iter().map(|i| i.len()).sum::<usize>() as f64
                    / data.train.len().max(1) as f64;
                let loader = InstanceLoader::for_rank(
                    data.train.clone(),
                    batch_size,
                    seq_len,
                    config.train.seed,
                    "training set",
                    rank,
                    world_size,
                )?;
                let n = data.train.len();
                (id, acc, n, mean_len, TrainBatches::Instances(loader))
            }
            Some(dataset) => {
                let vocab_size = data.tokenizer.vocab_size();
                // The baseline's most frequent masked token and the mean length, from the
                // first samples of each bin (one read per bin, not the whole dataset).
                let mut reader = ShardReader::new(dataset, vocab_size, MAX_OPEN_SHARDS);
                let per_bin = BASELINE_SAMPLES / dataset.bins.len().max(1);
                let refs: Vec<SampleRef> = (0..dataset.shard_sizes.len())
                    .flat_map(|bin| {
                        let size: usize = dataset.shard_sizes[bin].iter().sum();
                        let n = size.min(per_bin.max(1));
                        (0..n).map(move |index| SampleRef {
                            bin: bin as u32,
                            index: index as u32,
                        })
                    })
                    .collect();
                let some = ember_data::SampleSource::fetch(&mut reader, &refs)?;
                let (id, acc) = unigram_baseline(some.iter(), &data.eval);
                let n = dataset.num_samples();
                let mean_len =
                    some.iter().map(|s| s.len() as f64).sum::<f64>() / some.len().max(1) as f64;
                let sampler = SamplerConfig {
                    kind: config.data.sampler,
                    local_batch: batch_size * grad_accum,
                    presort_group: config.data.presort_group,
                    bin_quota: config.data.local_bin_quota(batch_size, grad_accum),
                    seed: config.train.seed,
                    // Presort deals with the lengths the ranks send (one rank: its own).
                    exchange: true,
                };
                let loader = ShardLoader::new(
                    dataset,
                    Box::new(ShardReader::new(dataset, vocab_size, MAX_OPEN_SHARDS)),
                    &sampler,
                    config.data.padding,
                    grad_accum,
                    seq_len,
                    rank,
                    world_size,
                )?;
                if rank == 0 {
                    report_shards(config, dataset, &loader);
                }
                // Every rank must read the same shards (a shard skipped on one node only would
                // shift the others' sample indices).
                check_agreement(comm, "training shards", shard_listing(dataset))?;
                let (sampler, maker) = loader.into_parts();
                let depth = config.data.prefetch.max(1);
                let stream = ShardStream {
                    lengths: ShardReader::new(dataset, vocab_size, MAX_OPEN_SHARDS),
                    consumed: sampler.state(),
                    sampler,
                    prefetcher: BatchPrefetcher::spawn(maker, depth)?,
                    depth,
                    pending: VecDeque::new(),
                };
                (id, acc, n, mean_len, TrainBatches::Shards(Box::new(stream)))
            }
        };
        let eval_instances: Vec<TrainingInstance> = data
            .eval
            .iter()
            .take(config.train.eval_samples)
            .cloned()
            .collect();
        // Evaluation needs no full batches: a small held-out set is evaluated in smaller ones.
        let eval_batch_size = batch_size.min(64).min(eval_instances.len().max(1));
        let eval = InstanceLoader::new(
            eval_instances,
            eval_batch_size,
            seq_len,
            0,
            "evaluation set",
        )?;
        Ok(Self {
            batches,
            eval,
            num_train,
            mean_len,
            unigram_baseline,
            unigram_token: data.tokenizer.id_to_token(unigram_id).unwrap_or_default(),
        })
    }
}

/// Logs the shards and warns about length bins the sampler never draws.
fn report_shards(config: &TrainConfig, dataset: &ShardedDataset, loader: &ShardLoader) {
    let quota = loader.sampler().quota();
    for (b, bin) in dataset.bins.iter().enumerate() {
        let size: usize = dataset.shard_sizes[b].iter().sum();
        if quota.len() > 1 && quota[b] == 0 && size > 0 {
            tracing::warn!(
                "length bin {}-{} ({} samples) has quota 0 and is never drawn; set \
                 data.bin_quota (--bin-quota) to include it",
                bin.lo,
                bin.hi,
                size
            );
        }
    }
    info!(
        shards = %dataset.root.display(),
        samples = dataset.num_samples(),
        bins = dataset.bins.len(),
        sampler = %config.data.sampler,
        padding = ?config.data.padding,
        quota = ?quota,
        "training on shards"
    );
}

/// One line per shard, `<bin> <file> <samples>`, for the ranks to compare.
fn shard_listing(dataset: &ShardedDataset) -> String {
    let listing: Vec<String> = dataset
        .bins
        .iter()
        .zip(&dataset.shards)
        .zip(&dataset.shard_sizes)
        .flat_map(|((bin, files), sizes)| {
            files.iter().zip(sizes).map(move |(f, n)| {
                let name = f.file_name().unwrap_or_default().to_string_lossy();
                format!("{} {name} {n}", bin.dir_name())
            })
        })
        .collect();
    listing.join("\n")
}
