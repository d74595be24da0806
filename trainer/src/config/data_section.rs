//! The `[data]` section: where the text or shards come from and how they are read.

use std::path::PathBuf;

use ember_data::{Padding, SamplerKind};
use serde::{Deserialize, Serialize};

/// The most local batches `data.prefetch` may read ahead.
pub const MAX_PREFETCH: usize = 64;

/// Where the text comes from and how instances are made of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// Corpus file or folder of `*.txt` (one sentence per line, blank line between documents).
    /// Default: the embedded Wikipedia corpus.
    #[arg(long)]
    pub corpus: Option<PathBuf>,
    /// WordPiece `vocab.txt`, holding `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]` and `[MASK]`.
    /// Default: the shipped bert-base-uncased vocabulary.
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// Documents held out at the end of the corpus for evaluation. Default: 300.
    #[arg(long)]
    pub eval_documents: usize,
    /// Train on MLPerf HDF5 shards (a folder, or a stratified folder of `len_<lo>-<hi>/`
    /// bins) instead of instances made from the corpus. Each rank streams the samples it is
    /// dealt from the shards (`ember_data::ShardReader`); evaluation uses `eval_shards` when
    /// set, else the corpus's held-out documents (`prepare-data` leaves the same ones out of
    /// its shards).
    #[arg(long = "data", value_name = "DIR")]
    pub shards: Option<PathBuf>,
    /// The evaluation set: an HDF5 shard or a folder of them, of which the first
    /// `train.eval_samples` samples are evaluated (MLPerf: the first 10,000 of its eval shard).
    /// Unset: the corpus's held-out documents. Default: unset.
    #[arg(long = "eval-data", value_name = "PATH")]
    pub eval_shards: Option<PathBuf>,
    /// Local batches the background reader prepares ahead of the step that needs them
    /// (shards only; at most 64). Default: 2.

    #[arg(long)]
    pub prefetch: usize,
    /// Sampler over the shards: random, stratified or presort. Default: random.
    #[arg(long)]
    pub sampler: SamplerKind,
    /// Ranks per presort group (consecutive ranks). Default: 8 (one node).
    #[arg(long)]
    pub presort_group: usize,
    /// Samples per length bin in each local batch (stratified, presort), summing to
    /// `train.batch_size × parallel.grad_accum`; a quota summing to `train.batch_size` is per
    /// micro-batch, and each step draws `grad_accum` times it (the micro-batches are then cut
    /// from the step's samples as `padding` says). Unset: proportional to the bins' sizes.
    #[arg(long, value_delimiter = ',')]
    pub bin_quota: Option<Vec<usize>>,
    /// Padding of shard batches: max, dynamic or grouped (the local batch sorted by length
    /// before it is cut into `parallel.grad_accum` micro-batches). Default: dynamic.
    #[arg(long)]
    pub padding: Padding,
    /// Skip unreadable or invalid shards with a warning instead of stopping. Default: false.
    #[arg(long)]
    pub skip_bad_shards: bool,
    /// Stop at a corpus line that is not UTF-8 instead of skipping it with a warning that
    /// names the file, line and byte offset (`ember_data::DocumentStream`). Default: false.
    #[arg(long)]
    pub strict: bool,
}

impl DataSection {
    /// The quota per local batch of a step ([`DataSection::bin_quota`]): as given, or a
    /// per-micro-batch quota (summing to `batch_size`) times `grad_accum`.
    pub fn local_bin_quota(&self, batch_size: usize, grad_accum: usize) -> Option<Vec<usize>> {
        self.bin_quota.as_ref().map(|quota| {
            if grad_accum > 1 && quota.iter().sum::<usize>() == batch_size {
                quota.iter().map(|q| q * grad_accum).collect()
            } else {
                quota.clone()
            }
        })
    }
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            corpus: None,
            vocab: None,
            eval_documents: 300,
            shards: None,
            eval_shards: None,
            prefetch: 2,
            sampler: SamplerKind::Random,
            presort_group: 8,
            bin_quota: None,
            padding: Padding::Dynamic,
            skip_bad_shards: false,
            strict: false,
        }
    }
}
