//! The example app as a user runs it: `index` over the first sentences of the embedded corpus
//! with a sentence-transformers folder (the tests' small random model, `tests/fixtures/st_tiny`
//! with mean pooling and Normalize), then `query` with a sentence of the index: it comes back
//! first, with a cosine of 1, and the scores fall.

use std::path::Path;
use std::process::Command;

fn app(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_ember-semantic-search"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{args:?}: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn an_indexed_sentence_finds_itself_first() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/st_tiny");
    let model = dir.path().join("model");
    std::fs::create_dir_all(model.join("1_Pooling")).unwrap();
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(file), model.join(file)).unwrap();
    }
    std::fs::write(
        model.join("modules.json"),
        r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
            {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
            {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
    )
    .unwrap();
    std::fs::write(
        model.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 32, "pooling_mode_mean_tokens": true}"#,
    )
    .unwrap();
    let index = dir.path().join("index");
    let (model_arg, index_arg) = (model.to_str().unwrap(), index.to_str().unwrap());
    let out = app(&[
        "index", "--model", model_arg, "--out", index_arg, "--limit", "40",
    ]);
    assert!(
        out.contains("indexed 40 sentences (32 dimensions)"),
        "{out}"
    );
    let sentences = std::fs::read_to_string(index.join("sentences.txt")).unwrap();
    let target = sentences.lines().nth(17).unwrap();
    let out = app(&["query", "--index", index_arg, "-k", "3", target]);
    let hits: Vec<(f32, &str)> = out
        .lines()
        .map(|l| {
            let (score, text) = l.split_once("  ").unwrap();
            (score.parse().unwrap(), text)
        })
        .collect();
    assert_eq!(hits.len(), 3, "{out}");
    assert_eq!(hits[0].1, target, "{out}");
    assert!((hits[0].0 - 1.0).abs() < 1e-4, "{out}");
    assert!(hits[0].0 >= hits[1].0 && hits[1].0 >= hits[2].0, "{out}");
    // No index there: an error naming it.
    let missing = Command::new(env!("CARGO_BIN_EXE_ember-semantic-search"))
        .args([
            "query",
            "--index",
            dir.path().join("none").to_str().unwrap(),
            "x",
        ])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("index.json"));
}
