//! A run's data: the corpus read into training and held-out instances (or the training shards),
//! and each rank's share of it.

use std::sync::Arc;

use burn::tensor::backend::Backend;
use ember_data::{
    HostBatch, InstanceLoader, SamplerConfig, ShardLoader, ShardedDataset, TrainingInstance,
    WordPieceTokenizer, create_training_instances, decode_refs, encode_refs, read_documents,
    split_held_out, tokenize_documents,
};
use tracing::info;

use crate::checkpoint::DataPosition;
use crate::eval::unigram_baseline;
use crate::parallel::{CommThread, check_agreement};
use crate::{TrainConfig, TrainError};

/// Training and held-out instances of a configuration, with the tokenizer that made them.
pub struct PreparedData {
    pub tokenizer: WordPieceTokenizer,
    /// Shared, so that in-process ranks read one copy. Empty when training on shards.
    pub train: Arc<[TrainingInstance]>,
    pub eval: Arc<[TrainingInstance]>,
    /// The training shards (`data.shards`) and their samples per length bin.
    pub shards: Option<(ShardedDataset, Vec<Arc<[TrainingInstance]>>)>,
}

/// Reads the vocabulary and corpus of `config`, holds out the last `eval_documents`
/// documents, and creates the training instances (`dupe_factor` passes) and the evaluation
/// instances (one pass, another seed).
///
/// # Errors
/// [`TrainError::Data`] naming the file: missing or empty corpus, bad vocabulary, too few
/// documents.
pub fn prepare_data(config: &TrainConfig) -> Result<PreparedData, TrainError> {
    let vocab_path = config.vocab_path();
    let corpus_path = config.corpus_path();
    let tokenizer = WordPieceTokenizer::from_vocab_file(&vocab_path)?;
    // Held out before tokenising, by raw document count, as `prepare-data` holds them out of
    // its shards.
    let (train_docs, eval_docs) = split_held_out(
        read_documents(&corpus_path)?,
        config.data.eval_documents,
        &corpus_path,
    )?;
    let eval_docs = tokenize_documents(&tokenizer, &eval_docs)?;
    let special = tokenizer.special();
    let shards = match &config.data.shards {
        Some(path) => {
            let (dataset, samples) =
                ShardedDataset::load(path, tokenizer.vocab_size(), config.data.skip_bad_shards)?;
            for skipped in &dataset.skipped {
                tracing::warn!("skipped a bad shard: {skipped}");
            }
            Some((dataset, samples))
        }
        None => None,
    };
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
    let eval_config = ember_data::PretrainingConfig {
        dupe_factor: 1,
        seed: config.instances.seed.wrapping_add(1),
        ..config.instances.clone()
    };
    let eval =
        create_training_instances(&eval_docs, &eval_config, special, tokenizer.vocab_size())?;
    Ok(PreparedData {
        tokenizer,
        train: train.into(),
        eval: eval.into(),
        shards,
    })
}

/// Where a rank's training batches come from.
pub(crate) enum TrainBatches {
    /// Instances made from the corpus: a shared permutation dealt out to ranks.
    Instances(InstanceLoader),
    /// Shards, through a sampler.
    Shards(ShardLoader),
}

impl TrainBatches {
    /// The `k` micro-batches of the next step. Presort exchanges the ranks' own draws through
    /// an allgather (sample references, 8 bytes each; every rank holds the samples).
    pub(crate) fn next_step<B: Backend>(
        &mut self,
        k: usize,
        comm: &CommThread<B>,
    ) -> Result<Vec<HostBatch>, TrainError> {
        Ok(match self {
            Self::Instances(loader) => (0..k).map(|_| loader.next_batch()).collect(),
            Self::Shards(loader) if loader.exchanges() => {
                let own = encode_refs(&loader.draw_own());
                let world = comm.call(move |c| c.allgather(&own))?;
                let draws = world
                    .iter()
                    .map(|bytes| decode_refs(bytes))
                    .collect::<Result<Vec<_>, _>>()?;
                loader.batches_from(&draws)
            }
            Self::Shards(loader) => loader.next_step(),
        })
    }
}

impl TrainBatches {
    /// Where this rank's data stands, for a checkpoint.
    pub(crate) fn position(&self) -> DataPosition {
        match self {
            Self::Instances(loader) => {
                let (epoch, position) = loader.position();
                DataPosition::Instances { epoch, position }
            }
            Self::Shards(loader) => DataPosition::Shards {
                sampler: loader.sampler().state(),
            },
        }
    }

    /// Continues from a saved [`TrainBatches::position`].
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
            (Self::Shards(loader), DataPosition::Shards { sampler }) => loader.restore(sampler),
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
    /// [`TrainError::Data`]: a batch larger than the data, a bad sampler setting;
    /// [`TrainError::RankMismatch`]: ranks that list different shards.
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
            Some((dataset, samples)) => {
                let all = || samples.iter().flat_map(|bin| bin.iter());
                let (id, acc) = unigram_baseline(all(), &data.eval);
                let n = dataset.num_samples();
                let mean_len = all().map(|i| i.len()).sum::<usize>() as f64 / n.max(1) as f64;
                let sampler = SamplerConfig {
                    kind: config.data.sampler,
                    local_batch: batch_size * grad_accum,
                    presort_group: config.data.presort_group,
                    bin_quota: config.data.bin_quota.clone(),
                    seed: config.train.seed,
                    exchange: world_size > 1,
                };
                let loader = ShardLoader::new(
                    dataset,
                    samples.clone(),
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
                (id, acc, n, mean_len, TrainBatches::Shards(loader))
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
        if quota.len() > 1 && quota[b] == 0 && !dataset.lengths[b].is_empty() {
            tracing::warn!(
                "length bin {}-{} ({} samples) has quota 0 and is never drawn; set \
                 data.bin_quota (--bin-quota) to include it",
                bin.lo,
                bin.hi,
                dataset.lengths[b].len()
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
