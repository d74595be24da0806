//! Text corpus → MLPerf HDF5 shards, as MLPerf's data preparation does it: the documents are
//! split into `num_shards` contiguous parts, and each part becomes one shard through
//! `create_pretraining_data` (its own `dupe_factor` passes, random next sentences drawn from
//! the same part, seed `seed + shard index`), exactly as the reference is run once per text
//! chunk (`results4/part-00XXX-of-00500`).
//!
//! Documents are streamed: a first pass counts them, a second hands each part to a pool of
//! workers as soon as it is read. At most `jobs + 2` parts are held in memory at a time (one per worker, one queued, one being
//! read), so
//! memory is bounded by the part size, not the corpus. The output depends only on the corpus,
//! the settings and the seed, not on `jobs`. The last documents can be held out (as the
//! trainer holds them out for evaluation), so that a run on the shards evaluates on unseen text.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};

use crate::corpus::{DocumentStream, corpus_files};
use crate::shard::{self, Compression};
use crate::{
    DataError, PretrainingConfig, WordPieceTokenizer, create_training_instances, held_out_count,
    tokenize_documents,
};

/// Settings of [`prepare_shards`].
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Instance creation (S = `max_seq_length`, P = `max_predictions_per_seq`, dupe factor,
    /// seed).
    pub instances: PretrainingConfig,
    /// Number of shards to write.
    pub num_shards: usize,
    /// Storage of the shards.
    pub compression: Compression,
    /// Worker threads (at least 1).
    pub jobs: usize,
    /// Documents at the end of the corpus left out of the shards (as many as the trainer's
    /// `data.eval_documents` holds out for evaluation, see [`held_out_count`]); 0 keeps all.
    pub holdout_documents: usize,
    /// A corpus line that is not UTF-8 is an error instead of a skipped line (with a warning).
    pub strict: bool,
}

/// What [`prepare_shards`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareSummary {
    /// The shards, in order.
    pub shards: Vec<PathBuf>,
    /// Documents in the shards.
    pub documents: usize,
    /// Documents left out at the end of the corpus.
    pub held_out: usize,
    /// Samples written.
    pub samples: usize,
    /// Real tokens written (the sum of `input_mask` over all samples).
    pub tokens: usize,
    /// Corpus lines skipped because they were not UTF-8.
    pub skipped_lines: usize,
}

/// The name of shard `index` of `count`: `part-00003-of-00016.hdf5`.
pub fn shard_name(index: usize, count: usize) -> String {
    format!("part-{index:05}-of-{count:05}.hdf5")
}

/// Writes the shards of the corpus at `corpus` (a file, or a folder of `*.txt` files) into
/// `out` (created if needed; it must hold no shards yet). `progress` is called with the number
/// of documents each finished shard held and the number of documents all shards hold
/// shard held.
///
/// # Errors
/// [`DataError::Io`] naming an unreadable corpus file or an unwritable `out`;
/// [`DataError::EmptyCorpus`]; [`DataError::InvalidSetting`] for invalid instance settings,
/// `num_shards` 0 or more shards than documents, or a part that yields no sample;
/// [`DataError::Tokenizer`]; the errors of [`shard::write_shard`].
pub fn prepare_shards(
    corpus: &Path,
    tokenizer: &WordPieceTokenizer,
    out: &Path,
    options: &PrepareOptions,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<PrepareSummary, DataError> {
    options.instances.validate()?;
    let num_shards = options.num_shards;
    if num_shards == 0 {
        return Err(DataError::InvalidSetting {
            field: "num_shards",
            reason: "must be at least 1".into(),
        });
    }
    let files = corpus_files(corpus)?;
    let mut documents = 0usize;
    let mut first_pass = DocumentStream::new(files.clone()).strict(options.strict);
    for document in first_pass.by_ref() {
        document?;
        documents += 1;
    }
    let skipped_lines = first_pass.skipped_lines();
    if documents == 0 {
        return Err(DataError::EmptyCorpus {
            path: corpus.to_path_buf(),
        });
    }
    let held_out = if options.holdout_documents == 0 {
        0
    } else {
        held_out_count(documents, options.holdout_documents)
    };
    let documents = documents - held_out;
    if num_shards > documents {
        return Err(DataError::InvalidSetting {
            field: "num_shards",
            reason: format!(
                "{}: {num_shards} shards from {documents} documents (each shard needs at least one)",
                corpus.display()
            ),
        });
    }
    shard::ensure_no_shards(out)?;
    std::fs::create_dir_all(out).map_err(|error| DataError::Io {
        path: out.to_path_buf(),
        error,
    })?;

    // Part k holds documents [k·D/N, (k+1)·D/N).
    let part_end = |k: usize| (k + 1) * documents / num_shards;
    let jobs = options.jobs.max(1);
    let (sender, receiver) = mpsc::sync_channel::<(usize, Vec<Vec<String>>)>(1);
    // Owned by the workers only: if they all stop, `send` fails instead of blocking.
    let receiver = std::sync::Arc::new(Mutex::new(receiver));
    let failed = AtomicBool::new(false);
    let errors = Mutex::new(Vec::<(usize, DataError)>::new());
    let (samples, tokens) = (AtomicUsize::new(0), AtomicUsize::new(0));

    let work = |k: usize, part: Vec<Vec<String>>| -> Result<(usize, usize), DataError> {
        let n_docs = part.len();
        let tokenized = tokenize_documents(tokenizer, &part)?;
        drop(part);
        let config = PretrainingConfig {
            seed: options.instances.seed.wrapping_add(k as u64),
            ..options.instances.clone()
        };
        let instances = create_training_instances(
            &tokenized,
            &config,
            tokenizer.special(),
            tokenizer.vocab_size(),
        )?;
        if instances.is_empty() {
            return Err(DataError::InvalidSetting {
                field: "num_shards",
                reason: format!(
                    "{}: shard {k} ({n_docs} documents) yields no sample; use fewer shards",
                    corpus.display()
                ),
            });
        }
        let path = out.join(shard_name(k, num_shards));
        shard::write_shard(
            &path,
            &instances,
            config.max_seq_length,
            config.max_predictions_per_seq,
            options.compression,
        )?;
        progress(n_docs, documents);
        Ok((instances.len(), instances.iter().map(|i| i.len()).sum()))
    };

    let read_result = std::thread::scope(|scope| {
        for _ in 0..jobs {
            let receiver = receiver.clone();
            let (work, failed, errors, samples, tokens) =
                (&work, &failed, &errors, &samples, &tokens);
            scope.spawn(move || {
                loop {
                    let next = receiver.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok((k, part)) = next else { break };
                    if failed.load(Ordering::Relaxed) {
                        continue;
                    }
                    match work(k, part) {
                        Ok((n, t)) => {
                            samples.fetch_add(n, Ordering::Relaxed);
                            tokens.fetch_add(t, Ordering::Relaxed);
                        }
                        Err(e) => {
                            failed.store(true, Ordering::Relaxed);
                            errors
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((k, e));
                        }
                    }
                }
            });
        }
        drop(receiver);
        let mut part = Vec::new();
        let mut k = 0;
        for (index, document) in DocumentStream::new(files)
            .quiet()
            .take(documents)
            .enumerate()
        {
            part.push(document?);
            if index + 1 == part_end(k) {
                if failed.load(Ordering::Relaxed)
                    || sender.send((k, std::mem::take(&mut part))).is_err()
                {
                    break;
                }
                k += 1;
            }
        }
        drop(sender);
        Ok::<(), DataError>(())
    });
    read_result?;
    let mut errors = errors.into_inner().unwrap_or_else(|e| e.into_inner());
    errors.sort_by_key(|(k, _)| *k);
    if let Some((_, error)) = errors.into_iter().next() {
        return Err(error);
    }
    Ok(PrepareSummary {
        shards: (0..num_shards)
            .map(|k| out.join(shard_name(k, num_shards)))
            .collect(),
        documents,
        held_out,
        samples: samples.into_inner(),
        tokens: tokens.into_inner(),
        skipped_lines,
    })
}
