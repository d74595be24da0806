//! `ember_model::Embedder` against sentence-transformers (`tests/fixtures/st_tiny`, made by
//! `tests/fixtures/make_embedding_golden.py`): a small random `BertModel`, five sentences of
//! 4 to 19 tokens in one padded batch, mean and CLS pooling, normalised and not, within 1e-5;
//! the same ids from `tokenizer.json`, from `vocab.txt`, and from a `tokenizer.json` that has
//! padding and truncation built in.

use std::path::{Path, PathBuf};

use burn::backend::NdArray;
use ember_model::{Embedder, Pooling};

type B = NdArray;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/st_tiny")
}

fn golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("golden.json")).unwrap()).unwrap()
}

fn sentences(golden: &serde_json::Value) -> Vec<String> {
    golden["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// A model folder with the fixture's config and weights and the given tokenizer file.
fn folder_with(dir: &Path, tokenizer: &Path, name: &str) -> PathBuf {
    let folder = dir.join(name.replace('.', "_"));
    std::fs::create_dir_all(&folder).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(file), folder.join(file)).unwrap();
    }
    std::fs::copy(tokenizer, folder.join(name)).unwrap();
    folder
}

#[test]
fn embeddings_equal_sentence_transformers() {
    let golden = golden();
    let texts = sentences(&golden);
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let device = Default::default();
    for (key, pooling, normalize) in [
        ("mean", Pooling::Mean, false),
        ("mean_normalized", Pooling::Mean, true),
        ("cls", Pooling::Cls, false),
        ("cls_normalized", Pooling::Cls, true),
    ] {
        let embedder = Embedder::<B>::from_pretrained(&fixture(), &device)
            .unwrap()
            .with_pooling(pooling)
            .with_normalize(normalize);
        assert_eq!(embedder.dim(), 32);
        let got = embedder.encode(&texts).unwrap();
        assert_eq!(got.dims(), [5, 32]);
        let got = got.into_data().to_vec::<f32>().unwrap();
        let expected: Vec<f64> = golden["embeddings"][key]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect();
        let worst = got
            .iter()
            .zip(&expected)
            .map(|(g, e)| (f64::from(*g) - e).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-5, "{key}: largest difference {worst:e}");
        // Batches of two give the same rows as one batch of five (padding changes nothing).
        let small = embedder
            .with_batch_size(2)
            .encode(&texts)
            .unwrap()
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        let worst = got
            .iter()
            .zip(&small)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-6, "{key}: batch of 2 against 5: {worst:e}");
    }
}

#[test]
fn every_tokenizer_file_gives_the_same_ids() {
    let golden = golden();
    let texts = sentences(&golden);
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let folders = [
        fixture(),
        folder_with(dir.path(), &fixture().join("vocab.txt"), "vocab.txt"),
        folder_with(
            dir.path(),
            &fixture().join("tokenizer_padded/tokenizer.json"),
            "tokenizer.json",
        ),
    ];
    for folder in &folders {
        let embedder = Embedder::<B>::from_pretrained(folder, &device).unwrap();
        for (text, expected) in texts.iter().zip(golden["input_ids"].as_array().unwrap()) {
            let expected: Vec<u32> = expected
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                embedder.token_ids(text).unwrap(),
                expected,
                "{text:?} through {}",
                folder.display()
            );
        }
    }
}

#[test]
fn a_text_longer_than_the_positions_is_truncated_and_a_folder_without_vocabulary_is_refused() {
    let device = Default::default();
    let embedder = Embedder::<B>::from_pretrained(&fixture(), &device).unwrap();
    let long = "the cat sat on the mat ".repeat(20); // 120 words, 64 positions
    let ids = embedder.token_ids(&long).unwrap();
    assert_eq!(ids.len(), 64);
    assert_eq!((ids[0], ids[63]), (2, 3), "[CLS] first, [SEP] last");
    assert_eq!(embedder.encode(&[&long]).unwrap().dims(), [1, 32]);

    let dir = tempfile::tempdir().unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(file), dir.path().join(file)).unwrap();
    }
    let error = Embedder::<B>::from_pretrained(dir.path(), &device)
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains(&dir.path().display().to_string()) && error.contains("vocab.txt"),
        "{error}"
    );
}
