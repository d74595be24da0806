//! A checkpoint's `manifest.json`: format version, step, world size, and the size and SHA-256
//! of every file. Written last; a checkpoint folder without a manifest that verifies is
//! incomplete and is never resumed from.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::TrainError;

/// The manifest's format version; a checkpoint of another version is skipped on resume.
pub const FORMAT_VERSION: u32 = 1;

/// The file a checkpoint folder's completeness hangs on.
pub const MANIFEST: &str = "manifest.json";

/// Size and SHA-256 (lower-case hex) of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, 64 hex digits.
    pub sha256: String,
}

impl FileDigest {
    /// Reads `path` and digests it.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the file when it cannot be read.
    pub fn of_file(path: &Path) -> Result<Self, TrainError> {
        let mut file = std::fs::File::open(path).map_err(|e| checkpoint_error(path, e))?;
        let mut hasher = Sha256::new();
        let mut buffer = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file
                .read(&mut buffer)
                .map_err(|e| checkpoint_error(path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            bytes += n as u64;
        }
        Ok(Self {
            bytes,
            sha256: hex(&hasher.finalize()),
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn checkpoint_error(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// What `manifest.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// Optimizer steps done when the checkpoint was taken.
    pub step: u64,
    /// Ranks of the run that wrote it (each wrote `rank-NNNNN.json`).
    pub world_size: usize,
    /// Every other file of the folder, by name.
    pub files: BTreeMap<String, FileDigest>,
}

impl Manifest {
    /// Reads `dir/manifest.json` and checks its format version, not the files it lists.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the manifest: missing, unparsable, another version.
    pub fn read(dir: &Path) -> Result<Self, TrainError> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            checkpoint_error(
                &path,
                format!("{e} (the checkpoint is incomplete: the manifest is written last)"),
            )
        })?;
        let manifest: Self = serde_json::from_str(&text)
            .map_err(|e| checkpoint_error(&path, format!("not a checkpoint manifest: {e}")))?;
        if manifest.format_version != FORMAT_VERSION {
            return Err(checkpoint_error(
                &path,
                format!(
                    "format version {} (this ember reads version {FORMAT_VERSION})",
                    manifest.format_version
                ),
            ));
        }
        Ok(manifest)
    }

    /// Checks that `dir/name` is listed and has the listed size and SHA-256.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming the file: unlisted, missing, truncated or altered.
    pub fn check_file(&self, dir: &Path, name: &str) -> Result<(), TrainError> {
        let file = dir.join(name);
        let Some(expected) = self.files.get(name) else {
            return Err(checkpoint_error(&file, "not listed in the manifest"));
        };
        let found = FileDigest::of_file(&file)?;
        if found.bytes != expected.bytes {
            return Err(checkpoint_error(
                &file,
                format!(
                    "{} bytes, the manifest says {} (truncated?)",
                    found.bytes, expected.bytes
                ),
            ));
        }
        if found.sha256 != expected.sha256 {
            return Err(checkpoint_error(
                &file,
                format!(
                    "SHA-256 {} differs from the manifest's {}",
                    found.sha256, expected.sha256
                ),
            ));
        }
        Ok(())
    }

    /// [`Manifest::read`], then [`Manifest::check_file`] for every file listed.
    ///
    /// # Errors
    /// As those two.
    pub fn verify(dir: &Path) -> Result<Self, TrainError> {
        let manifest = Self::read(dir)?;
        for name in manifest.files.keys() {
            manifest.check_file(dir, name)?;
        }
        Ok(manifest)
    }
}

/// `OUT/checkpoints`.
pub fn checkpoints_dir(out: &Path) -> PathBuf {
    out.join("checkpoints")
}

/// `OUT/checkpoints/step-NNNNNNN` (seven digits, more when needed).
pub fn step_dir(out: &Path, step: u64) -> PathBuf {
    checkpoints_dir(out).join(format!("step-{step:07}"))
}

/// The checkpoint folders under `OUT/checkpoints`, newest (highest step) first, complete or
/// not. A missing `checkpoints` folder gives an empty list.
pub fn list_step_dirs(out: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(checkpoints_dir(out)) else {
        return Vec::new();
    };
    let mut dirs: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.0));
    dirs
}

/// The newest checkpoint of `out` whose manifest verifies, with the checkpoints skipped on
/// the way (folder and reason, for a warning each).
///
/// # Errors
/// [`TrainError::NoCheckpoint`] when none verifies, listing why each was skipped.
pub fn newest_complete(out: &Path) -> Result<(PathBuf, Manifest, Vec<String>), TrainError> {
    let mut skipped = Vec::new();
    for (_, dir) in list_step_dirs(out) {
        match Manifest::verify(&dir) {
            Ok(manifest) => return Ok((dir, manifest, skipped)),
            Err(e) => skipped.push(e.to_string()),
        }
    }
    Err(TrainError::NoCheckpoint {
        dir: checkpoints_dir(out),
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_checkpoint(dir: &Path, step: u64, files: &[(&str, &[u8])]) {
        std::fs::create_dir_all(dir).unwrap();
        let mut listed = BTreeMap::new();
        for (name, contents) in files {
            std::fs::write(dir.join(name), contents).unwrap();
            listed.insert(
                name.to_string(),
                FileDigest::of_file(&dir.join(name)).unwrap(),
            );
        }
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            step,
            world_size: 1,
            files: listed,
        };
        std::fs::write(
            dir.join(MANIFEST),
            serde_json::to_string(&manifest).unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn sha256_of_a_known_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("abc");
        std::fs::write(&path, b"abc").unwrap();
        let digest = FileDigest::of_file(&path).unwrap();
        assert_eq!(digest.bytes, 3);
        // FIPS 180-2, appendix B.1.
        assert_eq!(
            digest.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    /// Each way a checkpoint can be broken is skipped with its file named, and the newest
    /// good one is chosen; nothing is deleted.
    #[test]
    fn broken_checkpoints_fall_back_to_the_newest_good_one() {
        let out = tempfile::tempdir().unwrap();
        let out = out.path();
        write_checkpoint(&step_dir(out, 10), 10, &[("a.bin", b"first")]);
        // Truncated file.
        write_checkpoint(&step_dir(out, 20), 20, &[("a.bin", b"second!")]);
        std::fs::write(step_dir(out, 20).join("a.bin"), b"sec").unwrap();
        // Same size, other contents.
        write_checkpoint(&step_dir(out, 30), 30, &[("a.bin", b"third")]);
        std::fs::write(step_dir(out, 30).join("a.bin"), b"THIRD").unwrap();
        // No manifest.
        std::fs::create_dir_all(step_dir(out, 40)).unwrap();
        std::fs::write(step_dir(out, 40).join("a.bin"), b"fourth").unwrap();
        // Another format version.
        write_checkpoint(&step_dir(out, 50), 50, &[("a.bin", b"fifth")]);
        let path = step_dir(out, 50).join(MANIFEST);
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("\"format_version\":1", "\"format_version\":99");
        std::fs::write(&path, text).unwrap();

        let (dir, manifest, skipped) = newest_complete(out).unwrap();
        assert_eq!(dir, step_dir(out, 10));
        assert_eq!(manifest.step, 10);
        assert_eq!(skipped.len(), 4, "{skipped:#?}");
        assert!(skipped[0].contains("step-0000050") && skipped[0].contains("format version 99"));
        assert!(skipped[1].contains("step-0000040") && skipped[1].contains("incomplete"));
        assert!(skipped[2].contains("step-0000030") && skipped[2].contains("SHA-256"));
        assert!(skipped[3].contains("step-0000020") && skipped[3].contains("truncated"));
        assert_eq!(list_step_dirs(out).len(), 5, "nothing is deleted");

        // With the good one broken too: an error listing every folder.
        std::fs::remove_file(step_dir(out, 10).join(MANIFEST)).unwrap();
        let error = newest_complete(out).unwrap_err().to_string();
        assert!(error.contains("no complete checkpoint"), "{error}");
        assert!(error.contains("step-0000010"), "{error}");
    }

    #[test]
    fn a_run_folder_without_checkpoints_is_a_clear_error() {
        let out = tempfile::tempdir().unwrap();
        let error = newest_complete(out.path()).unwrap_err().to_string();
        assert!(error.contains("checkpoints"), "{error}");
        assert!(error.contains("no complete checkpoint"), "{error}");
    }
}
