//! The commands that talk to other tools' files. `convert`: the Hugging Face parity fixture (a
//! random `BertForPreTraining` saved by transformers, `tests/fixtures/make_hf_parity.py`) out
//! to a folder whose tensors equal the original's exactly. `embed`: sentence-transformers'
//! embeddings of a small random model (`tests/fixtures/make_embedding_golden.py`). Bad inputs
//! are clear errors naming the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf_tiny_bert")
}

fn tensors(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.shape().to_vec(), view.data().to_vec())))
        .collect()
}

fn convert(from: &Path, to: &Path) -> (bool, String) {
    ember(&[
        "convert",
        "--from",
        from.to_str().unwrap(),
        "--to",
        to.to_str().unwrap(),
    ])
}

#[test]
fn a_hugging_face_folder_converts_to_the_same_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("converted");
    let (ok, text) = convert(&fixture(), &out);
    assert!(ok, "{text}");
    assert!(text.contains("46 parameters"), "{text}");
    let (original, converted) = (
        tensors(&fixture().join("model.safetensors")),
        tensors(&out.join("model.safetensors")),
    );
    assert_eq!(original.len(), converted.len());
    for (name, tensor) in &original {
        assert!(converted.get(name) == Some(tensor), "{name} differs");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "BertForPreTraining");
    assert_eq!(config["hidden_size"], 32);
}

#[test]
fn bad_sources_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = convert(&dir.path().join("nothing-here"), &dir.path().join("out"));
    assert!(!ok);
    assert!(
        text.contains("nothing-here") && text.contains("no such file"),
        "{text}"
    );

    // Weights without a config.json beside them.
    let lone = dir.path().join("lone");
    std::fs::create_dir_all(&lone).unwrap();
    std::fs::copy(
        fixture().join("model.safetensors"),
        lone.join("model.safetensors"),
    )
    .unwrap();
    let (ok, text) = convert(&lone, &dir.path().join("out"));
    assert!(!ok);
    assert!(
        text.contains("no config.json beside") && text.contains("--config"),
        "{text}"
    );
    assert!(!dir.path().join("out").exists(), "nothing written on error");
}

fn ember(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn embed_writes_one_array_per_line_equal_to_sentence_transformers() {
    let model = fixture().with_file_name("st_tiny");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("golden.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("texts.txt");
    let sentences: Vec<&str> = golden["sentences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    std::fs::write(&input, sentences.join("\n")).unwrap();
    let out = dir.path().join("embeddings.jsonl");
    let (ok, text) = ember(&[
        "embed",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--normalize",
    ]);
    assert!(ok, "{text}");
    let lines: Vec<Vec<f64>> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), sentences.len());
    for (row, expected) in lines
        .iter()
        .zip(golden["embeddings"]["mean_normalized"].as_array().unwrap())
    {
        assert_eq!(row.len(), 32);
        for (x, e) in row.iter().zip(expected.as_array().unwrap()) {
            assert!((x - e.as_f64().unwrap()).abs() < 1e-5, "{x} vs {e}");
        }
    }

    // A model folder without a vocabulary.
    let bare = dir.path().join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(model.join(file), bare.join(file)).unwrap();
    }
    let (ok, text) = ember(&[
        "embed",
        "--model",
        bare.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        text.contains("bare") && text.contains("vocab.txt"),
        "{text}"
    );
}

/// An encoder-only folder (`tests/fixtures/st_tiny`, a `BertModel` as sentence-transformers
/// models ship) converts as what it holds, `BertModel`, with the same tensors; asked for
/// `BertForPreTraining` it is refused naming the heads it lacks, and `--init-missing` adds them
/// fresh and names them.
#[test]
fn an_encoder_only_folder_converts_as_bert_model_or_with_fresh_heads() {
    let source = fixture().with_file_name("st_tiny");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("encoder");
    let (ok, text) = convert(&source, &out);
    assert!(ok && text.contains("as BertModel"), "{text}");
    let (original, converted) = (
        tensors(&source.join("model.safetensors")),
        tensors(&out.join("model.safetensors")),
    );
    assert_eq!(original.len(), converted.len());
    for (name, tensor) in &original {
        assert!(converted.get(name) == Some(tensor), "{name} differs");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "BertModel");

    let args = |extra: &[&str], to: &str| {
        let mut all = vec![
            "convert".to_string(),
            "--from".into(),
            source.display().to_string(),
            "--to".into(),
            dir.path().join(to).display().to_string(),
        ];
        all.extend(extra.iter().map(|s| s.to_string()));
        all
    };
    let run = |all: Vec<String>| {
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        ember(&all)
    };
    let (ok, text) = run(args(&["--architecture", "bert-for-pretraining"], "refused"));
    assert!(!ok);
    assert!(
        text.contains("lacks 7 parameter(s) of BertForPreTraining")
            && text.contains("cls.seq_relationship.weight")
            && text.contains("--init-missing"),
        "{text}"
    );
    assert!(
        !dir.path().join("refused").exists(),
        "nothing written on error"
    );
    let (ok, text) = run(args(&["--init-missing"], "heads"));
    assert!(ok && text.contains("as BertForPreTraining"), "{text}");
    assert!(
        text.contains("initialised fresh") && text.contains("cls.predictions.bias"),
        "{text}"
    );
    let heads = tensors(&dir.path().join("heads/model.safetensors"));
    assert!(heads.contains_key("cls.seq_relationship.weight"));
    assert!(
        heads.get("bert.embeddings.word_embeddings.weight")
            == original.get("embeddings.word_embeddings.weight")
    );
}
