//! Text → shards → length bins → samplers, on a slice of the embedded corpus.

use std::collections::HashMap;
use std::path::Path;

use ember_data::balance::{BalanceSettings, balance_report};
use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::sampler::{Padding, SamplerKind};
use ember_data::shard::{self, Compression};
use ember_data::stratify::stratify;
use ember_data::{
    DataError, PretrainingConfig, ShardedDataset, TrainingInstance, WordPieceTokenizer,
    default_vocab_path,
};

/// The first `documents` documents of the embedded corpus, as a corpus file in `dir`.
fn corpus_slice(dir: &Path, documents: usize) -> std::path::PathBuf {
    let text = ember_data::embedded::corpus_text();
    let slice: Vec<&str> = text.split("\n\n").take(documents).collect();
    let path = dir.join("corpus.txt");
    std::fs::write(&path, slice.join("\n\n")).unwrap();
    path
}

fn options(jobs: usize) -> PrepareOptions {
    PrepareOptions {
        instances: PretrainingConfig {
            max_seq_length: 128,
            dupe_factor: 2,
            ..PretrainingConfig::default()
        },
        num_shards: 4,
        compression: Compression::Gzip(1),
        jobs,
        holdout_documents: 60,
        strict: false,
    }
}

fn read_all(dir: &Path, vocab: usize) -> Vec<TrainingInstance> {
    shard::list_shards(dir)
        .unwrap()
        .iter()
        .flat_map(|p| shard::read_shard(p, vocab).unwrap())
        .collect()
}

/// A checksum of a sample's ids that does not depend on where the sample is.
fn key(s: &TrainingInstance) -> (Vec<u32>, Vec<u32>, u8) {
    (
        s.input_ids.clone(),
        s.masked_lm_positions.clone(),
        s.next_sentence_label,
    )
}

#[test]
fn prepare_is_deterministic_stratify_loses_nothing_and_presort_balances() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = corpus_slice(dir.path(), 600);
    let tokenizer = WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap()).unwrap();
    let vocab = tokenizer.vocab_size();

    // Prepare with 1 and 2 workers: the same shards.
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let docs = std::sync::atomic::AtomicUsize::new(0);
    let count = |n: usize, total: usize| {
        assert_eq!(total, 540);
        docs.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    };
    let summary = prepare_shards(&corpus, &tokenizer, &one, &options(1), &count).unwrap();
    prepare_shards(&corpus, &tokenizer, &two, &options(2), &|_, _| {}).unwrap();
    // 60 held out (600 / 10 caps it at 60).
    assert_eq!((summary.documents, summary.held_out), (540, 60));
    assert_eq!(
        docs.into_inner(),
        540,
        "progress reports every document once"
    );
    assert_eq!(summary.shards.len(), 4);
    let samples = read_all(&one, vocab);
    assert_eq!(samples.len(), summary.samples);
    assert_eq!(
        samples.iter().map(|s| s.len()).sum::<usize>(),
        summary.tokens
    );
    assert_eq!(samples, read_all(&two, vocab));
    // A folder that already holds shards is refused, and nothing in it changes.
    let err = prepare_shards(&corpus, &tokenizer, &one, &options(1), &|_, _| {}).unwrap_err();
    assert!(err.to_string().contains("already holds part-"), "{err}");
    assert_eq!(read_all(&one, vocab), samples);
    assert!(
        samples
            .iter()
            .all(|s| s.len() <= 128 && s.masked_lm_positions.len() <= 20)
    );

    // Stratify into 4 bins of at most 2 shards: every sample in exactly one bin, in range.
    let strat = dir.path().join("strat");
    let result = stratify(
        &one,
        &strat,
        &[32, 64, 96, 128],
        2,
        Compression::None,
        vocab,
    )
    .unwrap();
    let mut before: HashMap<_, usize> = HashMap::new();
    for s in &samples {
        *before.entry(key(s)).or_default() += 1;
    }
    let mut after: HashMap<_, usize> = HashMap::new();
    let mut total = 0;
    for (bin, count, files) in &result.bins {
        let mut n = 0;
        for file in files {
            for s in shard::read_shard(file, vocab).unwrap() {
                assert!(
                    (bin.lo..=bin.hi).contains(&s.len()),
                    "{} in {bin:?}",
                    s.len()
                );
                *after.entry(key(&s)).or_default() += 1;
                n += 1;
            }
        }
        assert_eq!(n, *count);
        total += n;
    }
    assert_eq!(total, samples.len());
    assert_eq!(before, after, "no sample lost or duplicated");
    assert!(result.bins.iter().filter(|(_, c, _)| *c > 0).count() >= 3);

    // The stratified folder loads as four bins with the same samples.
    let (dataset, loaded) = ShardedDataset::load(&strat, vocab, false).unwrap();
    assert_eq!(dataset.bins.len(), 4);
    assert_eq!(loaded.iter().map(|b| b.len()).sum::<usize>(), samples.len());
    let lengths = ShardedDataset::open(&strat, false).unwrap().lengths;
    assert_eq!(lengths, dataset.lengths);
    // Stratify refuses a folder with bins in it; overlapping bin folders (two stratify runs
    // with other edges) are refused when read.
    let again = stratify(&one, &strat, &[64, 128], 2, Compression::None, vocab).unwrap_err();
    assert!(again.to_string().contains("already holds"), "{again}");
    let mixed = dir.path().join("mixed");
    stratify(&one, &mixed, &[64, 128], 1, Compression::None, vocab).unwrap();
    std::fs::rename(strat.join("len_33-64"), mixed.join("len_33-64")).unwrap();
    let err = ShardedDataset::open(&mixed, false).unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");

    // On real lengths, presort balances ranks better than random, with the same padding.
    let settings = BalanceSettings {
        world_size: 8,
        local_batch: 16,
        steps: 20,
        max_seq_length: 128,
        hidden: 1024,
        presort_group: 8,
        bin_quota: None,
        seed: 1,
    };
    let rows = balance_report(&dataset, &settings, &[2, 4]).unwrap();
    assert_eq!(rows.len(), 3 * 4);
    let row = |kind, padding, k| {
        rows.iter()
            .find(|r| r.sampler == kind && r.padding == padding && r.micro_batches == k)
            .unwrap()
    };
    let random_max = row(SamplerKind::Random, Padding::Max, 1);
    assert_eq!(
        (random_max.imbalance, random_max.step_time_ratio),
        (1.0, 1.0)
    );
    // Dynamic padding of B = 16 at S = 128 pads nearly every batch to 128: balanced but
    // wasteful. Length-grouped micro-batches cut the padding, and then random's ranks differ;
    // presort evens them out again.
    let random_k4 = row(SamplerKind::Random, Padding::Grouped, 4);
    let presort_dyn = row(SamplerKind::Presort, Padding::Dynamic, 1);
    let presort_k4 = row(SamplerKind::Presort, Padding::Grouped, 4);
    assert!(
        presort_k4.imbalance < random_k4.imbalance && random_k4.imbalance > 1.03,
        "presort {} vs random {}",
        presort_k4.imbalance,
        random_k4.imbalance
    );
    assert!(presort_k4.imbalance < 1.03, "{}", presort_k4.imbalance);
    assert!(presort_k4.padding_efficiency > presort_dyn.padding_efficiency + 0.1);
    assert!(presort_k4.step_time_ratio < random_k4.step_time_ratio);
    assert!(random_max.padding_efficiency < 0.9);
}

#[test]
fn a_bad_shard_stops_the_run_unless_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    std::fs::copy(fixtures.join("fixed.hdf5"), dir.path().join("a.hdf5")).unwrap();
    std::fs::copy(
        fixtures.join("bad_truncated.hdf5"),
        dir.path().join("b.hdf5"),
    )
    .unwrap();
    let err = ShardedDataset::load(dir.path(), 30522, false).unwrap_err();
    assert!(
        matches!(err, DataError::NotHdf5 { ref path, .. } if path.ends_with("b.hdf5")),
        "{err}"
    );
    let (dataset, samples) = ShardedDataset::load(dir.path(), 30522, true).unwrap();
    assert_eq!(samples[0].len(), 5);
    assert_eq!(dataset.skipped.len(), 1);
    assert!(dataset.skipped[0].contains("b.hdf5"));
    // Nothing readable at all is an error even when skipping.
    std::fs::remove_file(dir.path().join("a.hdf5")).unwrap();
    assert!(matches!(
        ShardedDataset::load(dir.path(), 30522, true).unwrap_err(),
        DataError::NoShards { .. }
    ));
}
