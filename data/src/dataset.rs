//! A folder of shards as a dataset: plain (`*.hdf5` files, one length bin) or stratified (the
//! `len_<lo>-<hi>/` folders written by [`crate::stratify::stratify`], one bin each).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::shard::{self, list_shards};
use crate::stratify::LengthBin;
use crate::{DataError, TrainingInstance};

/// The shards of a dataset, by length bin, with every sample's real length.
#[derive(Debug, Clone)]
pub struct ShardedDataset {
    /// The folder (or file) given.
    pub root: PathBuf,
    /// The length bins; one bin `[1, longest]` for a plain folder.
    pub bins: Vec<LengthBin>,
    /// `[bin][shard]`: the shards read (bad ones skipped are not here).
    pub shards: Vec<Vec<PathBuf>>,
    /// `[bin][shard]`: their sample counts.
    pub shard_sizes: Vec<Vec<usize>>,
    /// `[bin][index]`: each sample's real length (the sum of `input_mask`); empty bins after
    /// [`ShardedDataset::scan`], which reads no sample.
    pub lengths: Arc<Vec<Vec<u16>>>,
    /// The shards skipped (with `skip_bad_shards`): each error message (it names the file).
    pub skipped: Vec<String>,
}

/// The bins and their shard files under `root`.
fn layout(root: &Path) -> Result<Vec<(Option<LengthBin>, Vec<PathBuf>)>, DataError> {
    if root.is_dir() {
        let entries = std::fs::read_dir(root).map_err(|error| DataError::Io {
            path: root.to_path_buf(),
            error,
        })?;
        let mut bins: Vec<(LengthBin, PathBuf)> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .filter_map(|p| {
                let bin = LengthBin::parse(&p.file_name()?.to_string_lossy())?;
                Some((bin, p))
            })
            .collect();
        if !bins.is_empty() {
            bins.sort_by_key(|(b, _)| (b.lo, b.hi));
            // Bin folders of two stratify runs (other edges) would make a sample count twice.
            if let Some(w) = bins.windows(2).find(|w| w[1].0.lo <= w[0].0.hi) {
                return Err(DataError::InvalidSetting {
                    field: "shards",
                    reason: format!(
                        "{}: the length bins {} and {} overlap (folders of two stratify runs?)",
                        root.display(),
                        w[0].0.dir_name(),
                        w[1].0.dir_name()
                    ),
                });
            }
            return bins
                .into_iter()
                .map(|(bin, dir)| Ok((Some(bin), list_shards(&dir)?)))
                .collect();
        }
    }
    Ok(vec![(None, list_shards(root)?)])
}

impl ShardedDataset {
    /// Reads the lengths of every sample (only `input_mask`, or the vlen row lengths).
    ///
    /// # Errors
    /// [`DataError::Io`]/[`DataError::NoShards`] for a missing or empty folder; a shard's
    /// error (naming it) unless `skip_bad_shards`, when it is recorded in `skipped` instead.
    pub fn open(root: &Path, skip_bad_shards: bool) -> Result<Self, DataError> {
        Self::read(root, skip_bad_shards, |path| {
            shard::read_lengths(path).map(|l| (l, ()))
        })
        .map(|(dataset, _)| dataset)
    }

    /// Reads each shard's metadata only (sample count, layout): what training needs, since
    /// ranks read the lengths and samples they draw when they draw them
    /// ([`crate::ShardReader`]). `lengths` stays empty; a plain folder's bin is `[1, S]` (the
    /// shards' widest sequence length). Unlike [`ShardedDataset::open`], it does not check that
    /// a bin folder's samples have the bin's lengths (that needs every sample's mask).
    ///
    /// # Errors
    /// As [`ShardedDataset::open`].
    pub fn scan(root: &Path, skip_bad_shards: bool) -> Result<Self, DataError> {
        let (mut dataset, widths) = Self::read(root, skip_bad_shards, |path| {
            let info = shard::shard_info(path)?;
            Ok((Vec::new(), (info.num_samples, info.seq_len)))
        })?;
        // `read` measured sizes by the (empty) lengths: take them from the metadata.
        let mut any = false;
        for (b, bin) in widths.iter().enumerate() {
            dataset.shard_sizes[b] = bin.iter().map(|&(n, _)| n).collect();
            any |= !bin.is_empty();
            let widest = bin.iter().map(|&(_, s)| s).max().unwrap_or(1).max(1);
            if dataset.bins[b].lo == 1 && dataset.bins[b].hi <= 1 {
                dataset.bins[b].hi = widest;
            }
        }
        if !any {
            return Err(DataError::NoShards {
                path: root.to_path_buf(),
            });
        }
        dataset.lengths = Arc::new(vec![Vec::new(); dataset.bins.len()]);
        Ok(dataset)
    }

    /// Reads and validates every sample: `samples[bin]` in the order of
    /// [`ShardedDataset::lengths`].
    ///
    /// # Errors
    /// As [`ShardedDataset::open`], with the validation of [`shard::read_shard`].
    pub fn load(
        root: &Path,
        vocab_size: usize,
        skip_bad_shards: bool,
    ) -> Result<(Self, Vec<Arc<[TrainingInstance]>>), DataError> {
        let (dataset, per_shard) = Self::read(root, skip_bad_shards, |path| {
            let samples = shard::read_shard(path, vocab_size)?;
            let lengths = samples
                .iter()
                .map(|s| u16::try_from(s.len()).unwrap_or(u16::MAX))
                .collect();
            Ok((lengths, samples))
        })?;
        let samples = per_shard
            .into_iter()
            .map(|bin| bin.into_iter().flatten().collect::<Vec<_>>().into())
            .collect();
        Ok((dataset, samples))
    }

    fn read<T>(
        root: &Path,
        skip_bad_shards: bool,
        read: impl Fn(&Path) -> Result<(Vec<u16>, T), DataError>,
    ) -> Result<(Self, Vec<Vec<T>>), DataError> {
        let mut dataset = Self {
            root: root.to_path_buf(),
            bins: Vec::new(),
            shards: Vec::new(),
            shard_sizes: Vec::new(),
            lengths: Arc::new(Vec::new()),
            skipped: Vec::new(),
        };
        let mut lengths = Vec::new();
        let mut payload = Vec::new();
        for (bin, files) in layout(root)? {
            let (mut kept, mut sizes, mut bin_lengths, mut bin_payload) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for file in files {
                match read(&file) {
                    Ok((l, t)) => {
                        if let Some(bin) = &bin
                            && let Some(&bad) = l
                                .iter()
                                .find(|&&x| (x as usize) < bin.lo || x as usize > bin.hi)
                        {
                            let error = DataError::Shard {
                                path: file.clone(),
                                field: "input_mask".into(),
                                problem: format!(
                                    "a sample of length {bad} in the bin folder {}",
                                    bin.dir_name()
                                ),
                            };
                            if !skip_bad_shards {
                                return Err(error);
                            }
                            dataset.skipped.push(error.to_string());
                            continue;
                        }
                        sizes.push(l.len());
                        bin_lengths.extend(l);
                        bin_payload.push(t);
                        kept.push(file);
                    }
                    Err(error) if skip_bad_shards => dataset.skipped.push(error.to_string()),
                    Err(error) => return Err(error),
                }
            }
            let bin = bin.unwrap_or(LengthBin {
                lo: 1,
                hi: bin_lengths.iter().copied().max().unwrap_or(1).max(1) as usize,
            });
            dataset.bins.push(bin);
            dataset.shards.push(kept);
            dataset.shard_sizes.push(sizes);
            lengths.push(bin_lengths);
            payload.push(bin_payload);
        }
        if payload.iter().all(|bin: &Vec<T>| bin.is_empty()) {
            return Err(DataError::NoShards {
                path: root.to_path_buf(),
            });
        }
        dataset.lengths = Arc::new(lengths);
        Ok((dataset, payload))
    }

    /// Number of samples.
    pub fn num_samples(&self) -> usize {
        self.shard_sizes.iter().flatten().sum()
    }
}

/// The evaluation set of `path` (an HDF5 shard, or a folder of them read in file-name order):
/// its first `limit` samples, as MLPerf evaluates the first 10,000 samples of its eval shard.
///
/// # Errors
/// Naming the file: [`DataError::Io`] for a missing path, [`DataError::NoShards`] for a folder
/// without shards, [`DataError::EmptyShard`], a shard's read and validation errors (ids at or
/// above `vocab_size`: [`DataError::IdOutOfRange`], "made with another vocabulary?"), and
/// [`DataError::Shard`] when the shard's sequence length is not `max_seq_length` or a sample
/// is longer than it.
pub fn read_eval_set(
    path: &Path,
    vocab_size: usize,
    max_seq_length: usize,
    limit: usize,
) -> Result<Vec<TrainingInstance>, DataError> {
    let mut samples = Vec::new();
    for file in list_shards(path)? {
        if samples.len() >= limit {
            break;
        }
        let shard = shard::OpenShard::open(&file)?;
        let info = &shard.info;
        if info.layout == shard::Layout::Fixed && info.seq_len != max_seq_length {
            return Err(DataError::Shard {
                path: file.clone(),
                field: "input_ids".into(),
                problem: format!(
                    "sequences of {} tokens, but the model's max_seq_length is {max_seq_length} \
                     (an eval shard of another sequence length?)",
                    info.seq_len
                ),
            });
        }
        let take = (limit - samples.len()).min(info.num_samples);
        let read = shard.read(vocab_size, 0..take)?;
        if let Some((i, long)) = read
            .iter()
            .enumerate()
            .find(|(_, s)| s.len() > max_seq_length)
        {
            return Err(DataError::Shard {
                path: file.clone(),
                field: "input_ids".into(),
                problem: format!(
                    "sample {i} has {} tokens, more than the model's max_seq_length \
                     {max_seq_length}",
                    long.len()
                ),
            });
        }
        samples.extend(read);
    }
    Ok(samples)
}
