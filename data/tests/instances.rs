//! Data pipeline tests on the shipped vocabulary and the embedded real corpus.

use std::collections::HashSet;
use std::sync::OnceLock;

use ember_data::instances::num_predictions;
use ember_data::{
    DataError, Document, InstanceLoader, PretrainingConfig, TrainingInstance, WordPieceTokenizer,
    collate, create_training_instances, default_corpus_path, default_vocab_path, read_documents,
    split_held_out, tokenize_documents,
};

fn tokenizer() -> &'static WordPieceTokenizer {
    static TOKENIZER: OnceLock<WordPieceTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap()).unwrap()
    })
}

/// The first 1500 documents of the embedded corpus, tokenised.
fn documents() -> &'static Vec<Document> {
    static DOCS: OnceLock<Vec<Document>> = OnceLock::new();
    DOCS.get_or_init(|| {
        let mut raw = read_documents(&default_corpus_path().unwrap()).unwrap();
        raw.truncate(1500);
        tokenize_documents(tokenizer(), &raw).unwrap()
    })
}

fn config() -> PretrainingConfig {
    PretrainingConfig {
        max_seq_length: 128,
        max_predictions_per_seq: 20,
        dupe_factor: 2,
        seed: 7,
        ..PretrainingConfig::default()
    }
}

fn instances() -> &'static Vec<TrainingInstance> {
    static INSTANCES: OnceLock<Vec<TrainingInstance>> = OnceLock::new();
    INSTANCES.get_or_init(|| {
        create_training_instances(
            documents(),
            &config(),
            tokenizer().special(),
            tokenizer().vocab_size(),
        )
        .unwrap()
    })
}

/// Expected ids from Hugging Face's `BertTokenizer` on the same vocab.txt (transformers 5.24).
#[test]
fn tokenizer_matches_bert_base_uncased() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), 30522);
    let s = t.special();
    assert_eq!(
        (s.pad, s.unk, s.cls, s.sep, s.mask),
        (0, 100, 101, 102, 103)
    );
    assert_eq!(t.encode("Hello world").unwrap(), vec![7592, 2088]);
    assert_eq!(
        t.tokenize("unaffable").unwrap(),
        vec!["una", "##ffa", "##ble"]
    );
    assert_eq!(t.encode("unaffable").unwrap(), vec![14477, 20961, 3468]);
    assert_eq!(
        t.encode("The Eiffel Tower in 1889.").unwrap(),
        vec![1996, 1041, 13355, 2884, 3578, 1999, 6478, 1012]
    );
    // Lower-casing and accent stripping, as BERT uncased.
    assert_eq!(
        t.tokenize("Héllo, Wörld! Café RÉSUMÉ naïve").unwrap(),
        vec!["hello", ",", "world", "!", "cafe", "resume", "naive"]
    );
    assert_eq!(
        t.encode("Héllo, Wörld! Café RÉSUMÉ naïve").unwrap(),
        vec![7592, 1010, 2088, 999, 7668, 13746, 15743]
    );
    assert_eq!(t.id_to_token(2088).as_deref(), Some("world"));
}

#[test]
fn corpus_has_documents_of_sentences() {
    let raw = read_documents(&default_corpus_path().unwrap()).unwrap();
    assert_eq!(raw.len(), 10033, "one document per Wikipedia article");
    assert!(raw.iter().all(|d| !d.is_empty()));
    let (train, eval) = split_held_out(raw, 300, &default_corpus_path().unwrap()).unwrap();
    assert_eq!((train.len(), eval.len()), (9733, 300));
}

#[test]
fn instances_respect_the_reference_invariants() {
    let t = tokenizer();
    let s = t.special();
    let config = config();
    let instances = instances();
    assert!(instances.len() > 2 * 1500, "{} instances", instances.len());
    let mut short = 0;
    for inst in instances {
        let n = inst.input_ids.len();
        assert!(n <= config.max_seq_length);
        assert_eq!(inst.segment_ids.len(), n);
        // [CLS] A [SEP] B [SEP], segment 0 then 1.
        assert_eq!(inst.input_ids[0], s.cls);
        assert_eq!(inst.input_ids[n - 1], s.sep);
        let seps: Vec<usize> = (0..n).filter(|&i| inst.input_ids[i] == s.sep).collect();
        let first_sep = seps[0];
        assert!(
            first_sep >= 2 && first_sep <= n - 3,
            "A and B are non-empty"
        );
        assert!(inst.segment_ids[..=first_sep].iter().all(|&x| x == 0));
        assert!(inst.segment_ids[first_sep + 1..].iter().all(|&x| x == 1));
        // Number of predictions as the reference computes it, all distinct, sorted, and never
        // at [CLS] or [SEP]. (The input may show [SEP] at a masked position only when a random
        // replacement drew it, so check the original label and the position's role.)
        assert_eq!(inst.masked_lm_positions.len(), num_predictions(n, &config));
        assert_eq!(inst.masked_lm_ids.len(), inst.masked_lm_positions.len());
        assert!(inst.masked_lm_positions.windows(2).all(|w| w[0] < w[1]));
        for (&p, &label) in inst.masked_lm_positions.iter().zip(&inst.masked_lm_ids) {
            let p = p as usize;
            assert!(
                p != 0 && p != first_sep && p != n - 1,
                "a special position was masked"
            );
            assert!(label != s.cls && label != s.sep);
        }
        assert!(inst.next_sentence_label <= 1);
        if n < config.max_seq_length / 2 {
            short += 1;
        }
    }
    assert!(short > 0);
    let random_next = instances
        .iter()
        .filter(|i| i.next_sentence_label == 1)
        .count() as f64;
    let fraction = random_next / instances.len() as f64;
    // Above 0.5: a one-sentence chunk always takes a random B (the reference does the same).
    assert!(
        (0.5..0.75).contains(&fraction),
        "random-next fraction {fraction}"
    );
}

/// 80% [MASK], 10% kept, 10% random, each within 5 standard deviations of its expectation.
#[test]
fn masking_split_is_80_10_10() {
    let mask = tokenizer().special().mask;
    let (mut masked, mut kept, mut replaced) = (0usize, 0usize, 0usize);
    for inst in instances() {
        for (&p, &label) in inst.masked_lm_positions.iter().zip(&inst.masked_lm_ids) {
            let shown = inst.input_ids[p as usize];
            if shown == mask {
                masked += 1;
            } else if shown == label {
                kept += 1;
            } else {
                replaced += 1;
            }
        }
    }
    let total = (masked + kept + replaced) as f64;
    assert!(total > 50_000.0, "{total} predictions");
    // A random replacement draws the original token 1 time in 30522: negligible.
    for (name, count, p) in [
        ("mask", masked, 0.8),
        ("kept", kept, 0.1),
        ("random", replaced, 0.1),
    ] {
        let sd = (total * p * (1.0 - p)).sqrt();
        let dev = (count as f64 - total * p).abs();
        assert!(
            dev < 5.0 * sd,
            "{name}: {count} of {total}, expected {:.0} ± {sd:.0}",
            total * p
        );
    }
}

#[test]
fn same_seed_gives_identical_instances_and_another_seed_does_not() {
    let t = tokenizer();
    let docs = &documents()[..200];
    let make = |seed| {
        let c = PretrainingConfig { seed, ..config() };
        create_training_instances(docs, &c, t.special(), t.vocab_size()).unwrap()
    };
    assert_eq!(make(7), make(7));
    assert_ne!(make(7), make(8));
}

#[test]
fn dynamic_padding_over_real_instances() {
    let batch: Vec<&TrainingInstance> = instances().iter().take(16).collect();
    let longest = batch.iter().map(|i| i.len()).max().unwrap();
    let host = collate(&batch, 128);
    assert_eq!(host.seq_len % 8, 0);
    assert!(host.seq_len >= longest && host.seq_len < longest + 8);
    assert_eq!(
        host.num_tokens(),
        batch.iter().map(|i| i.len()).sum::<usize>()
    );
    let (flat, labels) = host.packed_predictions();
    assert_eq!(
        flat.len(),
        batch
            .iter()
            .map(|i| i.masked_lm_positions.len())
            .sum::<usize>()
    );
    // Each packed position points at the masked token of its row.
    let ids: HashSet<i64> = labels.iter().copied().collect();
    assert!(!ids.is_empty());
    for (&f, &label) in flat.iter().zip(&labels) {
        let (row, pos) = (f as usize / host.seq_len, f as usize % host.seq_len);
        let inst = batch[row];
        let k = inst
            .masked_lm_positions
            .iter()
            .position(|&p| p as usize == pos)
            .unwrap();
        assert_eq!(i64::from(inst.masked_lm_ids[k]), label);
    }
}

#[test]
fn bad_inputs_name_the_file() {
    let dir = std::env::temp_dir().join(format!("ember-data-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("no-such-corpus.txt");
    let err = read_documents(&missing).unwrap_err();
    assert!(
        matches!(err, DataError::Io { .. }) && err.to_string().contains("no-such-corpus.txt"),
        "{err}"
    );

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "\n \n\n").unwrap();
    let err = read_documents(&empty).unwrap_err();
    assert!(
        matches!(err, DataError::EmptyCorpus { .. }) && err.to_string().contains("empty.txt"),
        "{err}"
    );

    let one_doc = dir.join("one.txt");
    std::fs::write(&one_doc, "A single sentence.\nAnother one.\n").unwrap();
    let err = split_held_out(read_documents(&one_doc).unwrap(), 10, &one_doc).unwrap_err();
    assert!(
        err.to_string().contains("one.txt") && err.to_string().contains("1 document"),
        "{err}"
    );

    let vocab = dir.join("vocab-without-mask.txt");
    std::fs::write(&vocab, "[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n").unwrap();
    let err = WordPieceTokenizer::from_vocab_file(&vocab).unwrap_err();
    assert!(
        err.to_string().contains("vocab-without-mask.txt") && err.to_string().contains("[MASK]"),
        "{err}"
    );

    let err = WordPieceTokenizer::from_vocab_file(&dir.join("absent-vocab.txt")).unwrap_err();
    assert!(err.to_string().contains("absent-vocab.txt"), "{err}");

    let bad = PretrainingConfig {
        max_seq_length: 4,
        ..config()
    };
    let err =
        create_training_instances(documents(), &bad, tokenizer().special(), 30522).unwrap_err();
    assert!(err.to_string().contains("max_seq_length"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_draw_disjoint_slices_of_the_one_rank_batch() {
    let all = instances().clone();
    let mut one = InstanceLoader::new(all.clone(), 6, 128, 9, "train").unwrap();
    let mut ranks: Vec<InstanceLoader> = (0..3)
        .map(|r| InstanceLoader::for_rank(all.clone(), 2, 128, 9, "train", r, 3).unwrap())
        .collect();
    for _ in 0..4 {
        let whole = one.next_batch();
        let parts: Vec<_> = ranks.iter_mut().map(|l| l.next_batch()).collect();
        // Concatenated, the ranks' samples are the one-rank batch's, in order.
        let ids = |b: &ember_data::HostBatch| -> Vec<Vec<i64>> {
            b.input_ids
                .chunks(b.seq_len)
                .map(|row| row.iter().copied().filter(|&t| t != 0).collect())
                .collect()
        };
        let joined: Vec<Vec<i64>> = parts.iter().flat_map(|p| ids(p)).collect();
        assert_eq!(joined, ids(&whole));
    }
    let error = InstanceLoader::for_rank(all, 2, 128, 9, "train", 3, 3).unwrap_err();
    assert!(error.to_string().contains("rank 3"), "{error}");
}
