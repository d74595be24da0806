//! Dataset stratification: reshards samples by real length (the sum of `input_mask`) into one
//! folder per length bin, so that a sampler can take a fixed quota from each bin.
//!
//! Bin b holds lengths `(edges[b-1], edges[b]]` (the first starts at 1) and lives in
//! `out/len_<lo>-<hi>/` as `part-XXXXX-of-YYYYY.hdf5` shards with the MLPerf fields in the
//! fixed layout (i4 ids and positions, i1 masks and labels, whatever the input's variant), S the
//! input's S (or its longest sample, for vlen input) and P the most predictions of any sample.
//! Samples keep their input order inside a bin; shards of a bin differ in size by at most one
//! sample. Two passes over the input (the first reads and validates every sample and counts
//! the bins, the second distributes them) keep at most one shard per bin in memory.

use std::path::{Path, PathBuf};

use crate::prepare::shard_name;
use crate::shard::{self, Compression, Layout};
use crate::{DataError, TrainingInstance};

/// One length bin of a stratified dataset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LengthBin {
    /// Shortest length of the bin (inclusive).
    pub lo: usize,
    /// Longest length of the bin (inclusive).
    pub hi: usize,
}

impl LengthBin {
    /// The folder name of the bin: `len_1-128`.
    pub fn dir_name(&self) -> String {
        format!("len_{}-{}", self.lo, self.hi)
    }

    /// Parses a folder name written by [`LengthBin::dir_name`].
    pub fn parse(name: &str) -> Option<Self> {
        let (lo, hi) = name.strip_prefix("len_")?.split_once('-')?;
        let (lo, hi) = (lo.parse().ok()?, hi.parse().ok()?);
        (lo >= 1 && lo <= hi).then_some(Self { lo, hi })
    }
}

/// The bins of ascending `edges`: `[1, e0], [e0+1, e1], …`.
///
/// # Errors
/// [`DataError::InvalidSetting`] if `edges` is empty, not strictly ascending or starts at 0.
pub fn bins_from_edges(edges: &[usize]) -> Result<Vec<LengthBin>, DataError> {
    let invalid = |reason: String| DataError::InvalidSetting {
        field: "bins",
        reason,
    };
    if edges.is_empty() || edges[0] == 0 {
        return Err(invalid(format!(
            "{edges:?}: give ascending upper edges, e.g. 128,256,384,512"
        )));
    }
    if edges.windows(2).any(|w| w[0] >= w[1]) {
        return Err(invalid(format!("{edges:?} is not strictly ascending")));
    }
    let mut lo = 1;
    Ok(edges
        .iter()
        .map(|&hi| {
            let bin = LengthBin { lo, hi };
            lo = hi + 1;
            bin
        })
        .collect())
}

/// What [`stratify`] wrote, per bin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StratifySummary {
    /// The bins, with their sample counts and shards (a bin with no sample has no shard).
    pub bins: Vec<(LengthBin, usize, Vec<PathBuf>)>,
}

/// Reshards the shards of `input` (a folder or one file) into length bins under `out` (which
/// must hold no shards yet), at most `shards_per_bin` shards per bin.
///
/// # Errors
/// [`DataError::InvalidSetting`] for bad edges, `shards_per_bin` 0, or a sample longer than the
/// last edge; the errors of [`shard::read_shard`] (naming the bad input shard) and
/// [`shard::write_shard`].
pub fn stratify(
    input: &Path,
    out: &Path,
    edges: &[usize],
    shards_per_bin: usize,
    compression: Compression,
    vocab_size: usize,
) -> Result<StratifySummary, DataError> {
    let bins = bins_from_edges(edges)?;
    if shards_per_bin == 0 {
        return Err(DataError::InvalidSetting {
            field: "num_shards",
            reason: "must be at least 1".into(),
        });
    }
    let inputs = shard::list_shards(input)?;
    shard::ensure_no_shards(out)?;
    let bin_of = |len: usize| bins.iter().position(|b| len <= b.hi);

    // Pass 1: counts per bin, S and P.
    let mut counts = vec![0usize; bins.len()];
    let (mut seq_len, mut max_predictions) = (0usize, 1usize);
    for path in &inputs {
        let info = shard::shard_info(path)?;
        let samples = shard::read_shard(path, vocab_size)?;
        if info.layout == Layout::Fixed {
            seq_len = seq_len.max(info.seq_len);
        }
        for (i, s) in samples.iter().enumerate() {
            let Some(b) = bin_of(s.len()) else {
                return Err(DataError::InvalidSetting {
                    field: "bins",
                    reason: format!(
                        "{}: sample {i} has {} tokens, beyond the last edge {}",
                        path.display(),
                        s.len(),
                        edges[edges.len() - 1]
                    ),
                });
            };
            counts[b] += 1;
            seq_len = seq_len.max(s.len());
            max_predictions = max_predictions.max(s.masked_lm_positions.len());
        }
    }

    // Pass 2: fill each bin's shards in order, writing a shard as soon as it is full.
    let plan: Vec<Vec<usize>> = counts
        .iter()
        .map(|&count| {
            let n = shards_per_bin.min(count);
            (0..n)
                .map(|j| (j + 1) * count / n - j * count / n)
                .collect()
        })
        .collect();
    let mut written: Vec<Vec<PathBuf>> = vec![Vec::new(); bins.len()];
    let mut buffers: Vec<Vec<TrainingInstance>> = vec![Vec::new(); bins.len()];
    for (b, bin) in bins.iter().enumerate() {
        if counts[b] > 0 {
            let dir = out.join(bin.dir_name());
            std::fs::create_dir_all(&dir).map_err(|error| DataError::Io { path: dir, error })?;
        }
    }
    let changed = |path: &Path| DataError::Shard {
        path: path.to_path_buf(),
        field: "(file)".into(),
        problem: "changed while it was being stratified".into(),
    };
    for path in &inputs {
        for sample in shard::read_shard(path, vocab_size)? {
            let b = bin_of(sample.len()).ok_or_else(|| changed(path))?;
            let j = written[b].len();
            if j == plan[b].len() {
                return Err(changed(path));
            }
            buffers[b].push(sample);
            if buffers[b].len() == plan[b][j] {
                let file = out
                    .join(bins[b].dir_name())
                    .join(shard_name(j, plan[b].len()));
                shard::write_shard(&file, &buffers[b], seq_len, max_predictions, compression)?;
                buffers[b].clear();
                written[b].push(file);
            }
        }
    }
    if buffers.iter().any(|b| !b.is_empty()) {
        return Err(changed(&inputs[inputs.len() - 1]));
    }
    Ok(StratifySummary {
        bins: bins
            .into_iter()
            .zip(counts)
            .zip(written)
            .map(|((bin, count), files)| (bin, count, files))
            .collect(),
    })
}
