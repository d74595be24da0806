//! Streaming shards: the batches a rank gets by reading samples from the shards when they are
//! drawn (`ShardReader`, through the background `BatchPrefetcher` too) are the batches of the
//! in-memory loader, for every sampler, rank and world size; real instances of the embedded
//! corpus, gzip and uncompressed shards, plain and stratified folders.

use std::path::Path;

use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::sampler::{Padding, SamplerConfig, SamplerKind};
use ember_data::shard::Compression;
use ember_data::stratify::stratify;
use ember_data::{
    BatchPrefetcher, InMemorySamples, PretrainingConfig, RankSampler, SampleRef, SampleSource,
    ShardLoader, ShardReader, ShardedDataset, WordPieceTokenizer, decode_draw, default_vocab_path,
    encode_draw,
};

fn shards(dir: &Path, compression: Compression) -> std::path::PathBuf {
    let text = ember_data::embedded::corpus_text();
    let slice: Vec<&str> = text.split("\n\n").take(300).collect();
    std::fs::create_dir_all(dir).unwrap();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, slice.join("\n\n")).unwrap();
    let tokenizer = WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap()).unwrap();
    let out = dir.join("shards");
    let options = PrepareOptions {
        instances: PretrainingConfig {
            max_seq_length: 128,
            dupe_factor: 1,
            ..PretrainingConfig::default()
        },
        num_shards: 5,
        compression,
        jobs: 1,
        holdout_documents: 10,
        strict: false,
    };
    prepare_shards(&corpus, &tokenizer, &out, &options, &|_, _| {}).unwrap();
    out
}

fn sampler(kind: SamplerKind, local_batch: usize, bins: usize) -> SamplerConfig {
    SamplerConfig {
        kind,
        local_batch,
        presort_group: 2,
        bin_quota: (bins > 1 && kind != SamplerKind::Random).then(|| {
            let mut quota = vec![local_batch / bins; bins];
            quota[0] += local_batch - quota.iter().sum::<usize>();
            quota
        }),
        seed: 7,
        exchange: false,
    }
}

#[test]
fn streamed_batches_equal_the_in_memory_ones() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap())
        .unwrap()
        .vocab_size();
    let plain_gzip = shards(&dir.path().join("gzip"), Compression::Gzip(1));
    let plain = shards(&dir.path().join("none"), Compression::None);
    let strat = dir.path().join("strat");
    stratify(&plain, &strat, &[64, 128], 2, Compression::None, vocab).unwrap();
    let mut compared = 0;
    for root in [&plain_gzip, &plain, &strat] {
        let (dataset, samples) = ShardedDataset::load(root, vocab, false).unwrap();
        let opened = ShardedDataset::open(root, false).unwrap();
        assert_eq!(opened.lengths, dataset.lengths);
        let bins = dataset.bins.len();
        for kind in [
            SamplerKind::Random,
            SamplerKind::Stratified,
            SamplerKind::Presort,
        ] {
            if kind == SamplerKind::Stratified && bins == 1 {
                continue;
            }
            for world_size in [1, 2] {
                for rank in 0..world_size {
                    let config = sampler(kind, 8, bins);
                    let loader = |source: Box<dyn SampleSource>| {
                        ShardLoader::new(
                            &opened,
                            source,
                            &config,
                            Padding::Grouped,
                            2,
                            128,
                            rank,
                            world_size,
                        )
                        .unwrap()
                    };
                    let mut memory = loader(Box::new(InMemorySamples(samples.clone())));
                    let mut streamed = loader(Box::new(ShardReader::new(&opened, vocab, 2)));
                    let (mut sampler, maker) =
                        loader(Box::new(ShardReader::new(&opened, vocab, 3))).into_parts();
                    let mut prefetcher = BatchPrefetcher::spawn(maker, 2).unwrap();
                    for step in 0..6 {
                        let expected = memory.next_step().unwrap();
                        assert_eq!(expected.len(), 2);
                        assert_eq!(
                            streamed.next_step().unwrap(),
                            expected,
                            "{} {kind:?} rank {rank}/{world_size} step {step}",
                            root.display()
                        );
                        while prefetcher.in_flight() < 2 {
                            prefetcher.submit(sampler.next_batch());
                        }
                        let (prefetched, _waited) = prefetcher.receive().unwrap();
                        assert_eq!(prefetched, expected, "prefetched, step {step}");
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared >= 6 * 3 * 2 * 3);
}

#[test]
fn a_reference_outside_the_dataset_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let root = shards(dir.path(), Compression::None);
    let opened = ShardedDataset::open(&root, false).unwrap();
    let mut reader = ShardReader::new(&opened, 30522, 1);
    let n = opened.num_samples() as u32;
    // Reads across every shard with one shard open at a time: samples equal read_shard's.
    let all: Vec<SampleRef> = (0..n)
        .rev()
        .map(|index| SampleRef { bin: 0, index })
        .collect();
    let read = reader.fetch(&all).unwrap();
    let (_, samples) = ShardedDataset::load(&root, 30522, false).unwrap();
    let expected: Vec<_> = samples[0].iter().rev().cloned().collect();
    assert_eq!(read, expected);
    assert_eq!(reader.samples_read, u64::from(n));
    for bad in [
        SampleRef { bin: 0, index: n },
        SampleRef { bin: 1, index: 0 },
    ] {
        let error = reader.fetch(&[bad]).unwrap_err().to_string();
        assert!(error.contains("not in the dataset"), "{error}");
    }
}

/// The training path of presort: the dataset scanned (no lengths read), each rank reads only
/// its own draw's lengths and sends them with the references; the batches equal the
/// simulation's, which knows every length.
#[test]
fn presort_with_exchanged_lengths_deals_as_the_simulation() {
    let dir = tempfile::tempdir().unwrap();
    let vocab = 30522;
    let plain = shards(&dir.path().join("none"), Compression::None);
    let strat = dir.path().join("strat");
    stratify(&plain, &strat, &[64, 128], 2, Compression::None, vocab).unwrap();
    let full = ShardedDataset::open(&strat, false).unwrap();
    let scanned = ShardedDataset::scan(&strat, false).unwrap();
    assert_eq!(scanned.shard_sizes, full.shard_sizes);
    assert_eq!(scanned.num_samples(), full.num_samples());
    assert!(scanned.lengths.iter().all(Vec::is_empty));
    let world = 2;
    let config = sampler(SamplerKind::Presort, 8, 2);
    let exchanging = SamplerConfig {
        exchange: true,
        ..config.clone()
    };
    let mut simulation =
        RankSampler::new(&config, &full.shard_sizes, full.lengths.clone(), 0, world).unwrap();
    let mut ranks: Vec<RankSampler> = (0..world)
        .map(|r| {
            RankSampler::new(
                &exchanging,
                &scanned.shard_sizes,
                scanned.lengths.clone(),
                r,
                world,
            )
            .unwrap()
        })
        .collect();
    let mut readers: Vec<ShardReader> = (0..world)
        .map(|_| ShardReader::new(&scanned, vocab, 4))
        .collect();
    for step in 0..6 {
        let expected = simulation.next_group_batches();
        let draws: Vec<Vec<(SampleRef, u16)>> = ranks
            .iter_mut()
            .zip(&mut readers)
            .map(|(sampler, reader)| {
                let own = sampler.draw_own();
                let lengths = reader.lengths(&own).unwrap();
                for (r, &len) in own.iter().zip(&lengths) {
                    assert_eq!(len, full.lengths[r.bin as usize][r.index as usize]);
                }
                let bytes = encode_draw(&own.into_iter().zip(lengths).collect::<Vec<_>>());
                assert_eq!(bytes.len(), 8 * 10);
                decode_draw(&bytes).unwrap()
            })
            .collect();
        for (r, sampler) in ranks.iter().enumerate() {
            assert_eq!(
                sampler.deal_with_lengths(&draws),
                expected[r],
                "step {step}, rank {r}"
            );
        }
    }
    assert!(decode_draw(&[0u8; 9]).is_err());
}
