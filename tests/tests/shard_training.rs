//! Training on MLPerf shards through the samplers: two in-process ranks, presort with
//! length-grouped micro-batches, the sampler state saved per rank; bad shard settings refused
//! before the first step.

use std::path::Path;

use burn::backend::{Autodiff, NdArray};
use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::shard::Compression;
use ember_data::stratify::stratify;
use ember_data::{
    Padding, PretrainingConfig, SamplerKind, SamplerState, WordPieceTokenizer,
    default_corpus_path, default_vocab_path,
};
use ember_trainer::{RunOptions, TrainConfig, TrainError, train, train_in_process};

type B = Autodiff<NdArray>;

/// Stratified shards (S = 64) of the first 400 documents of the embedded corpus, 40 of them
/// held out, and the corpus slice itself (its last 40 documents are the evaluation set).
fn shards(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let text = std::fs::read_to_string(default_corpus_path()).unwrap();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, text.split("\n\n").take(400).collect::<Vec<_>>().join("\n\n")).unwrap();
    let tokenizer = WordPieceTokenizer::from_vocab_file(&default_vocab_path()).unwrap();
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
    };
    let plain = dir.join("shards");
    prepare_shards(&corpus, &tokenizer, &plain, &options, &|_| {}).unwrap();
    let strat = dir.join("strat");
    stratify(&plain, &strat, &[32, 48, 64], 2, Compression::None, tokenizer.vocab_size()).unwrap();
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
    config.train.eval_every = 4;
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
    for rank in 0..2 {
        let path = out.join(format!("sampler_state.rank{rank}.json"));
        let state: SamplerState =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(state.steps, 4);
        // Presort: each rank simulates its group of 2, with one stream per bin.
        assert_eq!(state.streams.len(), 2);
        assert_eq!(state.streams[0].len(), 3);
        // 4 steps of a local batch of 8 were drawn across the bins.
        let drawn: usize = state.streams[rank].iter().map(|s| s.position).sum();
        assert_eq!(drawn, 4 * 8);
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
