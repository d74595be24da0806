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

/// `tests/fixtures/st_pipelines` (made by `tests/fixtures/make_st_pipelines.py`): a
/// sentence-transformers folder per case, assembled as the script assembled it (st_tiny's
/// encoder, its tokenizer or the cased one, then the case's module files).
fn pipeline_folder(dir: &Path, case: &str) -> PathBuf {
    let pipelines = fixture().with_file_name("st_pipelines");
    let folder = dir.join(case);
    std::fs::create_dir_all(&folder).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture().join(file), folder.join(file)).unwrap();
    }
    let cased = case == "cased" || case == "lower_case";
    let tokenizer = if cased {
        pipelines.join("cased/tokenizer.json")
    } else {
        fixture().join("tokenizer.json")
    };
    std::fs::copy(tokenizer, folder.join("tokenizer.json")).unwrap();
    copy_tree(&pipelines.join(case), &folder);
    folder
}

fn copy_tree(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Every case's vectors within 1e-5 of sentence-transformers': each pooling mode, several at
/// once, both config formats, a text past `max_seq_length` (8 tokens; 12 from
/// tokenizer_config.json), Dense with and without bias and activation, Normalize, and
/// `do_lower_case` with a cased tokenizer (upper-case text equals lower-case text there, and
/// not without it); batches of 2 give the same rows.
#[test]
fn sentence_transformers_folders_give_their_vectors() {
    let pipelines = fixture().with_file_name("st_pipelines");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pipelines.join("golden.json")).unwrap())
            .unwrap();
    let texts = sentences(&golden);
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    let cases = golden["embeddings"].as_object().unwrap();
    assert_eq!(cases.len(), 11);
    for (case, expected) in cases {
        let folder = pipeline_folder(dir.path(), case);
        let load = || {
            Embedder::<B>::from_pretrained(&folder, &device)
                .unwrap_or_else(|e| panic!("{case}: {e}"))
        };
        let embedder = load();
        let rows: Vec<Vec<f64>> = expected
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect()
            })
            .collect();
        assert_eq!(embedder.dim(), rows[0].len(), "{case}");
        for batch_size in [32, 2] {
            let got = load().with_batch_size(batch_size).encode(&texts).unwrap();
            assert_eq!(got.dims(), [texts.len(), rows[0].len()], "{case}");
            let got = got.into_data().to_vec::<f32>().unwrap();
            let worst = got
                .iter()
                .zip(rows.iter().flatten())
                .map(|(g, e)| (f64::from(*g) - e).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-5,
                "{case}, batches of {batch_size}: largest difference {worst:e}"
            );
        }
    }
    // The settings the folders carry, read back.
    let read =
        |case: &str| Embedder::<B>::from_pretrained(&dir.path().join(case), &device).unwrap();
    assert_eq!(read("mean_legacy").max_seq_length(), 8);
    let concat = read("concat_dense_normalize");
    assert_eq!(concat.max_seq_length(), 12);
    assert_eq!(
        concat.pooling(),
        [Pooling::Cls, Pooling::Mean, Pooling::Max]
    );
    assert_eq!(concat.dim(), 16);
    assert_eq!(read("weightedmean").max_seq_length(), 64);
    let (lower, cased) = (read("lower_case"), read("cased"));
    assert_eq!(
        lower.token_ids("THE CAT").unwrap(),
        lower.token_ids("the cat").unwrap()
    );
    assert_ne!(
        cased.token_ids("THE CAT").unwrap(),
        cased.token_ids("the cat").unwrap()
    );
}

/// What a folder asks for that ember does not do is refused, naming the file and the key or
/// module; the builder's settings override the folder's.
#[test]
fn unsupported_folder_settings_are_named_and_builders_override() {
    let dir = tempfile::tempdir().unwrap();
    let device = Default::default();
    let refusal = |case: &str, file: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let folder = pipeline_folder(&dir.path().join(format!("{case}-{file}")), case);
        let path = folder.join(file);
        let mut value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut value);
        std::fs::write(&path, value.to_string()).unwrap();
        Embedder::<B>::from_pretrained(&folder, &device)
            .err()
            .unwrap_or_else(|| panic!("{case}/{file} was accepted"))
            .to_string()
    };
    let e = refusal("max", "modules.json", &|v| {
        v[1]["type"] = "sentence_transformers.models.LSTM".into();
    });
    assert!(e.contains("modules.json") && e.contains("LSTM"), "{e}");
    let e = refusal("max", "1_Pooling/config.json", &|v| {
        v["pooling_mode"] = "median".into();
    });
    assert!(
        e.contains("1_Pooling/config.json") && e.contains("median"),
        "{e}"
    );
    let e = refusal("max", "1_Pooling/config.json", &|v| {
        v["pooling_mode_attention"] = true.into();
    });
    assert!(e.contains("pooling_mode_attention"), "{e}");
    let e = refusal("dense_identity_nobias", "2_Dense/config.json", &|v| {
        v["activation_function"] = "torch.nn.modules.activation.Softplus".into();
    });
    assert!(
        e.contains("2_Dense/config.json") && e.contains("Softplus"),
        "{e}"
    );
    let e = refusal("dense_identity_nobias", "2_Dense/config.json", &|v| {
        v["in_features"] = 31.into();
    });
    assert!(e.contains("in_features is 31"), "{e}");
    let e = refusal("mean_legacy", "sentence_bert_config.json", &|v| {
        v["model_args"] = serde_json::json!({"trust_remote_code": true});
    });
    assert!(
        e.contains("sentence_bert_config.json") && e.contains("model_args"),
        "{e}"
    );
    // An unknown key that asks for nothing is accepted.
    let folder = pipeline_folder(&dir.path().join("quiet"), "max");
    let path = folder.join("1_Pooling/config.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    value["pooling_mode_attention"] = false.into();
    std::fs::write(&path, value.to_string()).unwrap();
    let embedder = Embedder::<B>::from_pretrained(&folder, &device).unwrap();
    // Builders: mean instead of max, normalised, 6 tokens.
    let embedder = embedder
        .with_pooling(Pooling::Mean)
        .with_normalize(true)
        .with_max_seq_length(6);
    assert_eq!(embedder.pooling(), [Pooling::Mean]);
    assert_eq!(embedder.max_seq_length(), 6);
    let v = embedder
        .encode(&["the cat sat on the mat and the dog sat too"])
        .unwrap();
    let norm: f32 = v.clone().square().sum().into_scalar();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    assert_eq!(
        embedder.token_ids("the cat sat on the mat").unwrap().len(),
        6
    );
}
