//! Training on MLPerf shards through the samplers: two in-process ranks, presort with
//! length-grouped micro-batches, the sampler state saved per rank; bad shard settings refused
//! before the first step.

use std::path::Path;

use burn::backend::{Autodiff, NdArray};
use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::shard::Compression;
use ember_data::stratify::stratify;
use ember_data::{Padding, PretrainingConfig, SamplerKind, WordPieceTokenizer, default_vocab_path};
use ember_trainer::checkpoint::{DataPosition, RankState};
use ember_trainer::{RunOptions, TrainConfig, TrainError, train, train_in_process};

type B = Autodiff<NdArray>;

/// Stratified shards (S = 64) of the first 400 documents of the embedded corpus, 40 of them
/// held out, and the corpus slice itself (its last 40 documents are the evaluation set).
fn shards(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let text = ember_data::embedded::corpus_text();
    let corpus = dir.join("corpus.txt");
    std::fs::write(
        &corpus,
        text.split("\n\n")
            .take(400)
            .collect::<Vec<_>>()
            .join("\n\n"),
    )
    .unwrap();
    let tokenizer = WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap()).unwrap();
    let options = PrepareOptions {
        instances: PretrainingConfig {
            max_seq_length: 64,
            max_predictions_per_seq: 10,
            dupe_factor: 1,
            ..PretrainingConfig::default()
        },
        num_shards: 4,
        compression: Compression::None,
        jobs: 1,
        holdout_documents: 40,
        strict: false,
    };
    let plain = dir.join("shards");
    prepare_shards(&corpus, &tokenizer, &plain, &options, &|_, _| {}).unwrap();
    let strat = dir.join("strat");
    stratify(
        &plain,
        &strat,
        &[32, 48, 64],
        2,
        Compression::None,
        tokenizer.vocab_size(),
    )
    .unwrap();
    (corpus, strat)
}

fn config(corpus: &Path, shards: &Path, out: &Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.data.corpus = Some(corpus.to_path_buf());
    config.data.eval_documents = 40;
    config.data.shards = Some(shards.to_path_buf());
    config.data.sampler = SamplerKind::Presort;
    config.data.presort_group = 2;
    config.data.padding = Padding::Grouped;
    config.instances.max_seq_length = 64;
    config.instances.max_predictions_per_seq = 10;
    config.instances.dupe_factor = 1;
    config.parallel.grad_accum = 2;
    config.schedule.warmup_steps = Some(1);
    config.train.steps = 4;
    config.train.batch_size = 4;
    config.train.eval_every = Some(4);
    config.train.eval_samples = 32;
    config.train.out = out.to_path_buf();
    config
}

#[test]
fn two_ranks_train_on_stratified_shards_with_presort_and_save_the_sampler_state() {
    let dir = tempfile::tempdir().unwrap();
    let (corpus, strat) = shards(dir.path());
    let out = dir.path().join("run");
    let config = config(&corpus, &strat, &out);
    let summary =
        train_in_process::<B>(&config, 2, &Default::default(), RunOptions::default()).unwrap();
    assert_eq!(summary.steps, 4);
    assert_eq!(summary.global_batch_size, 16);
    assert!(summary.losses.iter().all(|l| l.is_finite()));
    assert!(summary.eval.num_samples > 0);
    assert_eq!(
        summary.last_checkpoint,
        out.join("checkpoints/step-0000004")
    );
    for rank in 0..2 {
        let path = summary
            .last_checkpoint
            .join(format!("rank-0000{rank}.json"));
        let saved: RankState =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(saved.rank, rank);
        let DataPosition::Shards { sampler: state } = saved.data else {
            panic!("rank {rank}: not a shard position: {saved:?}");
        };
        assert_eq!(state.steps, 4);
        // Presort across ranks exchanges the draws: each rank's state holds only its own
        // streams, one per bin.
        assert_eq!(state.streams.len(), 1);
        assert_eq!(state.streams[0].len(), 3);
        // 4 steps of a local batch of 8 were drawn across the bins (within the first epoch).
        let drawn: usize = state.streams[0].iter().map(|s| s.position).sum();
        assert_eq!(drawn, 4 * 8, "rank {rank}");
    }
}

#[test]
fn shard_settings_are_checked_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let (corpus, strat) = shards(dir.path());
    let out = dir.path().join("run");
    let run = |c: &TrainConfig| train::<B>(c, &Default::default(), RunOptions::default());
    let text = |r: Result<_, TrainError>| r.map(|_| ()).unwrap_err().to_string();

    // Sampler settings without shards.
    let mut c = config(&corpus, &strat, &out);
    c.data.shards = None;
    assert!(text(run(&c)).contains("data.shards"));
    // A quota that does not sum to the local batch (batch 4 × grad-accum 2).
    let mut c = config(&corpus, &strat, &out);
    c.data.bin_quota = Some(vec![1, 1, 1]);
    assert!(text(run(&c)).contains("not the local batch 8"));
    // Samples longer than the model's sequence length.
    let mut c = config(&corpus, &strat, &out);
    c.instances.max_seq_length = 32;
    assert!(text(run(&c)).contains("more than the model's 32"));
    // A missing shard folder names it.
    let mut c = config(&corpus, &strat, &out);
    c.data.shards = Some(dir.path().join("no-such-shards"));
    assert!(text(run(&c)).contains("no-such-shards"));
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn presort_exchange_through_in_process_collectives_equals_the_group_simulation() {
    use ember_data::{RankSampler, SamplerConfig, decode_refs, encode_refs};
    use ember_trainer::parallel::{Collective, InProcess};
    use std::sync::Arc;
    // Two bins of 64 and 48 samples in 4 shards each, lengths varying inside each bin.
    let sizes = vec![vec![16; 4], vec![12; 4]];
    let lengths: Arc<Vec<Vec<u16>>> = Arc::new(vec![
        (0..64).map(|i| 20 + (i * 37 % 100) as u16).collect(),
        (0..48).map(|i| 130 + (i * 11 % 120) as u16).collect(),
    ]);
    let simulate = SamplerConfig {
        kind: SamplerKind::Presort,
        local_batch: 4,
        presort_group: 2,
        bin_quota: None,
        seed: 3,
        exchange: false,
    };
    let exchange = SamplerConfig {
        exchange: true,
        ..simulate.clone()
    };
    let world = 4;
    let batches: Vec<Vec<Vec<ember_data::SampleRef>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = InProcess::group(world, std::time::Duration::from_secs(30))
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                let (sizes, lengths, exchange) = (&sizes, lengths.clone(), &exchange);
                scope.spawn(move || {
                    let mut sampler =
                        RankSampler::new(exchange, sizes, lengths, rank, world).unwrap();
                    (0..5)
                        .map(|_| {
                            let own = encode_refs(&sampler.draw_own());
                            let all = comm.allgather(&own).unwrap();
                            let draws: Vec<_> =
                                all.iter().map(|b| decode_refs(b).unwrap()).collect();
                            sampler.deal_from(&draws)
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, exchanged) in batches.iter().enumerate() {
        let mut sim = RankSampler::new(&simulate, &sizes, lengths.clone(), rank, world).unwrap();
        for (step, batch) in exchanged.iter().enumerate() {
            assert_eq!(batch, &sim.next_batch(), "rank {rank}, step {step}");
        }
    }
    // The group {0, 1} shares its 8 samples per step, disjointly.
    for step in 0..5 {
        let mut group: Vec<_> = batches[0][step].iter().chain(&batches[1][step]).collect();
        group.sort();
        group.dedup();
        assert_eq!(group.len(), 8);
    }
}
