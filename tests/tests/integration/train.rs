//! End to end through the library API: a short pre-training run on the embedded corpus, and
//! every bad input refused before the first step with the file or setting named.

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, NdArray};
use ember_model::BertForPreTraining;
use ember_trainer::{RunOptions, TrainConfig, TrainError, train};

type B = Autodiff<NdArray>;

/// A quick configuration: tiny model, sequences of 64, batch 8, one pass of instances.
fn quick_config(out: &Path, steps: u64) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.instances.max_seq_length = 64;
    config.instances.max_predictions_per_seq = 10;
    config.instances.dupe_factor = 1;
    config.optimizer.lr = 3e-3;
    config.schedule.warmup_steps = Some(3);
    config.train.steps = steps;
    config.train.batch_size = 8;
    config.train.eval_every = Some(steps);
    config.train.eval_samples = 64;
    config.train.log_every = 5;
    config.train.out = out.to_path_buf();
    config
}

fn run(config: &TrainConfig) -> Result<ember_trainer::TrainSummary, TrainError> {
    train::<B>(config, &Default::default(), RunOptions::default())
}

#[test]
fn short_run_lowers_the_loss_and_writes_metrics_and_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let config = quick_config(&out, 40);
    let summary = run(&config).unwrap();

    assert_eq!(summary.steps, 40);
    assert_eq!(summary.losses.len(), 40);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&summary.losses[..5]), mean(&summary.losses[35..]));
    assert!(
        first > 10.5,
        "a fresh model starts near ln(30522) + ln(2) = 11.0, got {first}"
    );
    assert!(
        last < first - 0.5,
        "the loss did not fall: first five {first:.3}, last five {last:.3}"
    );
    assert!(summary.eval.num_predictions > 0 && summary.eval.num_samples == 64);
    assert!((0.0..=1.0).contains(&summary.eval.mlm_accuracy));
    assert!(summary.unigram_baseline > 0.03 && summary.unigram_baseline < 0.2);

    // Metrics: one start line, a train line every 5 steps, one eval, one end line.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(events.iter().filter(|e| **e == "train").count(), 8);
    assert_eq!(events.iter().filter(|e| **e == "eval").count(), 1);
    assert_eq!((events[0], events[events.len() - 1]), ("start", "end"));
    let last_train = lines.iter().rev().find(|l| l["event"] == "train").unwrap();
    assert_eq!(last_train["step"], 40);
    assert!((last_train["loss"].as_f64().unwrap() - summary.losses[39]).abs() < 1e-6);

    // Checkpoint: Hugging Face config + weights, and no temporary file left behind.
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for expected in [
        "model.safetensors",
        "config.json",
        "train_config.toml",
        "metrics.jsonl",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    let bert = ember_model::BertConfig::load_json(&out.join("config.json")).unwrap();
    assert_eq!((bert.hidden_size, bert.vocab_size), (128, 30522));
    let reloaded: BertForPreTraining<NdArray> = bert
        .init_for_pretraining(&Default::default())
        .load_hf_safetensors(&summary.checkpoint)
        .unwrap();
    let saved_config = TrainConfig::load(&out.join("train_config.toml")).unwrap();
    assert_eq!(saved_config, config);
    // The reloaded model evaluates to the run's final accuracy.
    let prepared = ember_trainer::prepare_data(&config).unwrap();
    let loader = ember_data::InstanceLoader::new(
        prepared.eval.iter().take(64).cloned().collect::<Vec<_>>(),
        8,
        64,
        0,
        "eval",
    )
    .unwrap();
    let again =
        ember_trainer::eval::evaluate(&reloaded, loader.sequential_batches(), &Default::default());
    assert!((again.mlm_accuracy - summary.eval.mlm_accuracy).abs() < 1e-9);
}

/// `model.unpad` (Note [Padding removed]) through the whole trainer on the embedded corpus
/// (each batch padded to its longest sample, dropout on, the gradient hooks at the packed
/// layer inputs, the evaluation unpadded too): every step's loss and the held-out accuracy
/// are the padded run's, within f32 rounding summed over 12 steps.
#[test]
fn unpadded_training_follows_the_padded_run() {
    let dir = tempfile::tempdir().unwrap();
    let runs: Vec<_> = [false, true]
        .into_iter()
        .map(|unpad| {
            let mut config = quick_config(&dir.path().join(format!("unpad-{unpad}")), 12);
            config.model.unpad = unpad;
            run(&config).unwrap()
        })
        .collect();
    let (padded, unpadded) = (&runs[0], &runs[1]);
    for (step, (a, b)) in padded.losses.iter().zip(&unpadded.losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * a.abs(),
            "step {}: padded loss {a}, unpadded {b}",
            step + 1
        );
    }
    // At most two of the held-out predictions' argmax flipped by rounding.
    let predictions = padded.eval.num_predictions as f64;
    assert_eq!(padded.eval.num_predictions, unpadded.eval.num_predictions);
    assert!(
        (padded.eval.mlm_accuracy - unpadded.eval.mlm_accuracy).abs() <= 2.0 / predictions,
        "held-out accuracy padded {}, unpadded {}",
        padded.eval.mlm_accuracy,
        unpadded.eval.mlm_accuracy
    );
}

/// `checkpoint.init_from` starts from another run's weights: with a learning rate too small to
/// move them, the run ends where the other ended, not where its own seed starts.
#[test]
fn init_from_starts_from_the_given_weights() {
    let dir = tempfile::tempdir().unwrap();
    init_from_a_first_run(dir.path(), |_| {});

    let ((_, a), (_, b)) = (
        exported_word_embeddings(&dir.path().join("first")),
        exported_word_embeddings(&dir.path().join("second")),
    );
    let largest = largest_difference(&a, &b);
    assert!(
        largest < 1e-6,
        "the second run moved away from the first's weights by {largest}"
    );
}

/// A 3-step run in `dir/first`, then a run in `dir/second` (`edit`ed) started from its weights
/// with its own seed and a learning rate too small to move them; checks that every parameter
/// of the 2-layer BertForPreTraining was loaded and none initialised.
fn init_from_a_first_run(dir: &Path, edit: impl Fn(&mut TrainConfig)) {
    run(&quick_config(&dir.join("first"), 3)).unwrap();
    let mut second = quick_config(&dir.join("second"), 3);
    second.checkpoint.init_from = Some(dir.join("first"));
    second.optimizer.lr = 1e-12;
    second.train.seed += 1;
    edit(&mut second);
    let summary = run(&second).unwrap();
    let init = summary.init.expect("init_from reports what it loaded");
    assert!(init.initialised.is_empty(), "{:?}", init.initialised);
    assert_eq!(
        init.loaded.len(),
        46,
        "every parameter of a 2-layer BertForPreTraining: {:?}",
        init.loaded
    );
}

/// The vocabulary size and the word-embedding table a run exported (its `config.json` and
/// `model.safetensors`).
fn exported_word_embeddings(run: &Path) -> (usize, Vec<f32>) {
    let config = ember_model::BertConfig::load_json(&run.join("config.json")).unwrap();
    let model: BertForPreTraining<NdArray> = config
        .init_for_pretraining(&Default::default())
        .load_hf_safetensors(&run.join("model.safetensors"))
        .unwrap();
    let weight = model.bert.embeddings.word_embeddings.weight.val();
    (
        config.vocab_size,
        weight.into_data().to_vec::<f32>().unwrap(),
    )
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// `model.make_vocab_size_divisible_by`: a run started from another run's weights of the
/// tokenizer's 30,522 tokens pads them to 30,592 rows (128), saves the padded size in its
/// `config.json`, and its padding rows start at zero (a learning rate too small to move them).
#[test]
fn init_from_pads_the_vocabulary_with_zero_rows() {
    let dir = tempfile::tempdir().unwrap();
    init_from_a_first_run(dir.path(), |second| {
        second.model.make_vocab_size_divisible_by = 128;
    });

    let ((v, a), (padded, b)) = (
        exported_word_embeddings(&dir.path().join("first")),
        exported_word_embeddings(&dir.path().join("second")),
    );
    assert_eq!((v, padded), (30_522, 30_592));
    let hidden = a.len() / v;
    assert!(
        largest_difference(&a, &b[..a.len()]) < 1e-6,
        "the vocabulary's rows moved"
    );
    assert_eq!(b.len(), padded * hidden);
    assert!(
        b[a.len()..].iter().all(|x| x.abs() < 1e-6),
        "the padding rows do not start at zero"
    );
}

fn expect_error(config: &TrainConfig, needles: &[&str]) {
    let err = run(config).expect_err("the run should be refused");
    let text = err.to_string();
    for needle in needles {
        assert!(
            text.contains(needle),
            "error {text:?} should mention {needle:?}"
        );
    }
}

#[test]
fn bad_inputs_are_refused_before_training_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let base = quick_config(&out, 5);

    // Missing corpus.
    let mut config = base.clone();
    config.data.corpus = Some(PathBuf::from("/nonexistent/corpus.txt"));
    expect_error(&config, &["/nonexistent/corpus.txt"]);

    // Empty corpus.
    let empty = dir.path().join("empty-corpus.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    config.data.corpus = Some(empty);
    expect_error(&config, &["empty-corpus.txt", "empty"]);

    // A vocabulary without the special tokens.
    let mut config = base.clone();
    let vocab = dir.path().join("plain-vocab.txt");
    std::fs::write(&vocab, "[PAD]\n[UNK]\nthe\nof\n").unwrap();
    config.data.vocab = Some(vocab);
    expect_error(&config, &["plain-vocab.txt", "[CLS]"]);

    // Sequences longer than the model's positions.
    let mut config = base.clone();
    config.instances.max_seq_length = 1024;
    expect_error(&config, &["1024", "max_position_embeddings 512"]);

    // A batch larger than the data: a corpus of 3 short documents.
    let mut config = base.clone();
    let small = dir.path().join("small-corpus.txt");
    std::fs::write(
        &small,
        "The cat sat.\nIt purred.\n\nDogs bark.\nThey run.\n\nBirds fly.\nThey sing.\n",
    )
    .unwrap();
    config.data.corpus = Some(small);
    config.train.batch_size = 64;
    expect_error(&config, &["batch size 64", "training set"]);

    // An output folder that cannot be created (its parent is a file).
    let mut config = base.clone();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    config.train.out = file.join("run");
    expect_error(&config, &["a-file/run"]);

    // Settings that make no sense.
    let mut config = base.clone();
    config.train.batch_size = 0;
    expect_error(&config, &["train.batch_size"]);
    let mut config = base;
    config.optimizer.lr = -1.0;
    expect_error(&config, &["optimizer.lr"]);

    // None of the refused runs wrote metrics.
    assert!(!out.join("metrics.jsonl").exists());
}

#[test]
fn config_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.toml");
    std::fs::write(&path, "[train]\nstepz = 10\n").unwrap();
    let err = TrainConfig::load(&path).unwrap_err().to_string();
    assert!(err.contains("typo.toml") && err.contains("stepz"), "{err}");
    let err = TrainConfig::load(&dir.path().join("missing.toml"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("missing.toml"), "{err}");
    // The shipped default config parses and validates.
    let shipped =
        TrainConfig::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny-cpu.toml"))
            .unwrap();
    shipped.validate().unwrap();
}

/// The test binary runs on this CPU's OpenBLAS kernels (`openblas_kernels_of_this_cpu!` in
/// main.rs), as ember's own binary does.
#[test]
fn this_test_binary_runs_this_cpus_openblas_kernels() {
    ember_tests::assert_this_cpus_openblas_kernels();
}

/// The test binary allocates as ember's binary does (`ember_binarys_allocator!` in main.rs): mimalloc, keeping the pages it frees.
#[test]
fn this_test_binary_allocates_as_embers_binary() {
    ember_tests::assert_ember_binarys_allocator();
}
