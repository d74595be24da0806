//! MLPerf HDF5 shards: files written by h5py (fixtures from `fixtures/make_shards.py`) load
//! with the right values in every layout, ember's own shards round-trip and load in h5py, and
//! each malformed file gives its own error.

use std::path::{Path, PathBuf};
use std::process::Command;

use ember_data::shard::{self, Compression, Layout};
use ember_data::{DataError, TrainingInstance};

const VOCAB: usize = 30522;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn from_json(value: &serde_json::Value) -> Vec<TrainingInstance> {
    let ints = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|s| TrainingInstance {
            input_ids: ints(&s["input_ids"]),
            segment_ids: ints(&s["segment_ids"])
                .into_iter()
                .map(|x| x as u8)
                .collect(),
            masked_lm_positions: ints(&s["masked_lm_positions"]),
            masked_lm_ids: ints(&s["masked_lm_ids"]),
            next_sentence_label: s["next_sentence_label"].as_u64().unwrap() as u8,
        })
        .collect()
}

fn expected() -> Vec<TrainingInstance> {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    from_json(&serde_json::from_str(&text).unwrap())
}

#[test]
fn h5py_fixtures_load_in_every_layout() {
    let want = expected();
    assert_eq!(want.len(), 5);
    assert_eq!(want[4].len(), 13);
    for name in [
        "fixed.hdf5",
        "fixed_gzip.hdf5",
        "nvidia_i2.hdf5",
        "varlen.hdf5",
    ] {
        let got =
            shard::read_shard(&fixture(name), VOCAB).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, want, "{name}");
        let lengths = shard::read_lengths(&fixture(name)).unwrap();
        assert_eq!(lengths, vec![5, 7, 9, 11, 13], "{name}");
    }
    let info = shard::shard_info(&fixture("varlen.hdf5")).unwrap();
    assert_eq!((info.layout, info.num_samples), (Layout::VarLen, 5));
    let info = shard::shard_info(&fixture("fixed_gzip.hdf5")).unwrap();
    assert_eq!(
        (info.layout, info.num_samples, info.seq_len),
        (Layout::Fixed, 5, 16)
    );
}

#[test]
fn write_then_read_gives_identical_samples() {
    let dir = tempfile::tempdir().unwrap();
    let want = expected();
    for (name, compression) in [
        ("plain.hdf5", Compression::None),
        ("gz.hdf5", Compression::Gzip(6)),
    ] {
        let path = dir.path().join(name);
        shard::write_shard(&path, &want, 16, 4, compression).unwrap();
        assert_eq!(shard::read_shard(&path, VOCAB).unwrap(), want, "{name}");
        let info = shard::shard_info(&path).unwrap();
        assert_eq!((info.num_samples, info.seq_len), (5, 16));
    }
    // No temporary file is left beside the shards.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["gz.hdf5", "plain.hdf5"]);
    // Readable by others, as any file written without a temporary name would be.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("gz.hdf5"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
    }
    assert_eq!(shard::list_shards(dir.path()).unwrap().len(), 2);
    // A sample longer than the shard's S is refused before anything is written.
    let err = shard::write_shard(&dir.path().join("x.hdf5"), &want, 12, 4, Compression::None)
        .unwrap_err();
    assert!(err.to_string().contains("sample 4 has 13 tokens"), "{err}");
    assert!(!dir.path().join("x.hdf5").exists());
}

/// A Python with h5py: `EMBER_PYTHON`, else `python3`. `.ci/run` installs h5py, so CI runs
/// this check; elsewhere it is reported as not run.
fn python_with_h5py() -> Option<String> {
    let python = std::env::var("EMBER_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", "import h5py"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(python)
}

#[test]
fn shards_we_write_load_in_h5py() {
    let Some(python) = python_with_h5py() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have h5py (.ci/run installs it) to check ember's shards"
        );
        eprintln!("h5py not found: the h5py check of ember's shards was not run");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let want = expected();
    let path = dir.path().join("ours.hdf5");
    shard::write_shard(&path, &want, 16, 4, Compression::Gzip(4)).unwrap();
    let out = Command::new(python)
        .arg(fixture("make_shards.py"))
        .arg("--check")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "h5py check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = from_json(&serde_json::from_slice(&out.stdout).unwrap());
    assert_eq!(read, want);
}

#[test]
fn malformed_shards_give_their_own_errors() {
    let err = |name: &str| shard::read_shard(&fixture(name), VOCAB).unwrap_err();
    match err("bad_float_ids.hdf5") {
        DataError::WrongDtype { field, found, .. } => {
            assert_eq!((field.as_str(), found.as_str()), ("input_ids", "f4"))
        }
        e => panic!("float ids: {e}"),
    }
    match err("bad_missing_field.hdf5") {
        DataError::MissingField { field, .. } => assert_eq!(field, "masked_lm_ids"),
        e => panic!("missing field: {e}"),
    }
    match err("bad_shape.hdf5") {
        DataError::ShapeMismatch { field, shape, .. } => {
            assert_eq!((field.as_str(), shape), ("segment_ids", vec![5, 15]))
        }
        e => panic!("shape: {e}"),
    }
    match err("bad_vocab.hdf5") {
        DataError::IdOutOfRange {
            field, sample, id, ..
        } => {
            assert_eq!((field.as_str(), sample, id), ("input_ids", 2, 30622))
        }
        e => panic!("vocab: {e}"),
    }
    assert!(matches!(
        err("bad_empty.hdf5"),
        DataError::EmptyShard { .. }
    ));
    match err("bad_zero_width.hdf5") {
        DataError::ShapeMismatch { field, shape, .. } => {
            assert_eq!((field.as_str(), shape), ("input_ids", vec![5, 0]))
        }
        e => panic!("zero width: {e}"),
    }
    for e in [
        err("bad_mask.hdf5"),
        shard::read_lengths(&fixture("bad_mask.hdf5")).unwrap_err(),
    ] {
        let text = e.to_string();
        assert!(
            text.contains("input_mask") && text.contains("sample 1") && text.contains("bad_mask"),
            "{text}"
        );
    }
    assert!(matches!(
        err("bad_truncated.hdf5"),
        DataError::NotHdf5 { .. }
    ));
    assert!(matches!(
        err("bad_not_hdf5.hdf5"),
        DataError::NotHdf5 { .. }
    ));
    assert!(matches!(err("no_such_shard.hdf5"), DataError::Io { .. }));
    // Every message names the file.
    for name in ["bad_float_ids.hdf5", "bad_truncated.hdf5", "bad_vocab.hdf5"] {
        assert!(err(name).to_string().contains(name), "{name}");
    }
    // A smaller vocabulary turns a valid shard's ids out of range too.
    assert!(matches!(
        shard::read_shard(&fixture("fixed.hdf5"), 1500).unwrap_err(),
        DataError::IdOutOfRange { .. }
    ));
}
