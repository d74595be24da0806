//! What several of xtask's test binaries share.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The JSON result a benchmark wrote in `out`: its path and its contents.
pub fn result_json(out: &Path) -> (PathBuf, Value) {
    let json = std::fs::read_dir(out)
        .expect("the results folder")
        .map(|entry| entry.expect("an entry").path())
        .find(|path| path.extension().is_some_and(|e| e == "json"))
        .expect("a JSON result");
    let results =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    (json, results)
}
