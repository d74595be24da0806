//! The files ember ships inside its binary: the default corpus (zstd-compressed) and BERT's
//! uncased vocabulary. A binary copied to another machine, or installed with `cargo install`,
//! trains its smoke run without the checkout it was built in.
//!
//! Note [Embedded files]: the bytes are compiled in with `include_bytes!`; nothing is looked up
//! at the build machine's paths. The pipeline reads files (the corpus is read by byte ranges
//! in parallel, its errors name a file and line), so on first use each file is written once
//! to ember's cache folder ([`cache_dir`]) under a name that carries a hash of its bytes: a
//! binary with other bytes writes another file, and a file already there is reused. Writes
//! go through a temporary name and a rename, so ranks starting at once on a shared folder
//! never read a half-written file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::DataError;

/// The default corpus, zstd level 19: lead sections of 10,033 Wikipedia vital articles, one
/// sentence per line, a blank line between documents (CC BY-SA 4.0; `corpus/ATTRIBUTION.md`).
const CORPUS_ZST: &[u8] = include_bytes!("../corpus/wiki_vital_en.txt.zst");

/// The BERT-base uncased WordPiece vocabulary (30,522 tokens, Apache-2.0).
pub const VOCAB_TXT: &str = include_str!("../corpus/vocab.txt");

/// The file name the corpus is written under (before its hash).
const CORPUS_NAME: &str = "wiki_vital_en.txt";
/// The file name the vocabulary is written under (before its hash).
const VOCAB_NAME: &str = "vocab.txt";

/// The environment variable that names ember's cache folder.
pub const CACHE_DIR_VAR: &str = "EMBER_CACHE_DIR";

/// ember's cache folder: `$EMBER_CACHE_DIR`, else `$XDG_CACHE_HOME/ember`, else
/// `$HOME/.cache/ember` (the XDG base directory default), else `<temp dir>/ember-cache`.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(|name| std::env::var_os(name).filter(|v| !v.is_empty()))
}

/// [`cache_dir`] with the environment read through `var`.
fn cache_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    if let Some(dir) = var(CACHE_DIR_VAR) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("ember");
    }
    if let Some(home) = var("HOME") {
        return PathBuf::from(home).join(".cache").join("ember");
    }
    std::env::temp_dir().join("ember-cache")
}

/// The default corpus as text (decompressed once per process, 4.9 MB).
///
/// # Panics
/// Never on user input: the bytes are the binary's own, checked by the crate's tests.
pub fn corpus_text() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let bytes = zstd::decode_all(CORPUS_ZST).expect("the embedded corpus is valid zstd");
        String::from_utf8(bytes).expect("the embedded corpus is UTF-8")
    })
}

/// The default corpus as a file in the cache folder, written there on first use (Note
/// [Embedded files]).
///
/// # Errors
/// [`DataError::Io`] naming the file when the cache folder cannot be written (set
/// `EMBER_CACHE_DIR`, or pass a corpus of your own).
pub fn default_corpus_path() -> Result<PathBuf, DataError> {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    cached(&PATH, || {
        materialize(&cache_dir(), CORPUS_NAME, corpus_text().as_bytes())
    })
}

/// The shipped vocabulary as a file in the cache folder, written there on first use.
///
/// # Errors
/// As [`default_corpus_path`].
pub fn default_vocab_path() -> Result<PathBuf, DataError> {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    cached(&PATH, || {
        materialize(&cache_dir(), VOCAB_NAME, VOCAB_TXT.as_bytes())
    })
}

/// The path in `cell`, made by `make` the first time it succeeds.
fn cached(
    cell: &OnceLock<PathBuf>,
    make: impl FnOnce() -> Result<PathBuf, DataError>,
) -> Result<PathBuf, DataError> {
    if let Some(path) = cell.get() {
        return Ok(path.clone());
    }
    let path = make()?;
    Ok(cell.get_or_init(|| path).clone())
}

/// FNV-1a, 64 bits: names a file by its content (not a security measure).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Writes `bytes` to `dir/embedded/<stem>-<hash>.<ext>` unless a file of that name and size is
/// there, and returns its path.
fn materialize(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, DataError> {
    let (stem, ext) = name.rsplit_once('.').unwrap_or((name, "bin"));
    let folder = dir.join("embedded");
    let path = folder.join(format!("{stem}-{:016x}.{ext}", fnv1a(bytes)));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64) {
        return Ok(path);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error: std::io::Error| DataError::Io {
            path,
            error: std::io::Error::new(
                error.kind(),
                format!(
                    "writing ember's embedded {name} there: {error} (set {CACHE_DIR_VAR} to a \
                     writable folder)"
                ),
            ),
        }
    };
    std::fs::create_dir_all(&folder).map_err(io(&folder))?;
    let mut temp = tempfile::NamedTempFile::new_in(&folder).map_err(io(&folder))?;
    temp.write_all(bytes).map_err(io(temp.path()))?;
    // Readable by every user of a shared cache folder (a temporary file starts as 0600).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        temp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(io(temp.path()))?;
    }
    temp.as_file().sync_all().map_err(io(temp.path()))?;
    // Another process may have renamed its copy there first: same name, same bytes.
    temp.persist(&path).map_err(|e| io(&path)(e.error))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpus_decompresses_to_the_documents_the_attribution_describes() {
        let text = corpus_text();
        let documents = text.split("\n\n").filter(|d| !d.trim().is_empty()).count();
        assert_eq!(documents, 10_033);
        assert_eq!(VOCAB_TXT.lines().count(), 30_522);
        assert_eq!(VOCAB_TXT.lines().next(), Some("[PAD]"));
    }

    #[test]
    fn files_are_written_once_under_their_hash_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = materialize(dir.path(), "vocab.txt", b"[PAD]\n[UNK]\n").unwrap();
        assert_eq!(std::fs::read(&first).unwrap(), b"[PAD]\n[UNK]\n");
        assert!(first.starts_with(dir.path().join("embedded")));
        let name = first.file_name().unwrap().to_string_lossy().to_string();
        assert!(
            name.starts_with("vocab-") && name.ends_with(".txt"),
            "{name}"
        );
        let modified = std::fs::metadata(&first).unwrap().modified().unwrap();
        assert_eq!(
            materialize(dir.path(), "vocab.txt", b"[PAD]\n[UNK]\n").unwrap(),
            first
        );
        assert_eq!(
            std::fs::metadata(&first).unwrap().modified().unwrap(),
            modified
        );
        // Other bytes, another file; no temporary file is left behind.
        let other = materialize(dir.path(), "vocab.txt", b"[PAD]\n").unwrap();
        assert_ne!(other, first);
        assert_eq!(
            std::fs::read_dir(dir.path().join("embedded"))
                .unwrap()
                .count(),
            2
        );
    }

    #[test]
    fn an_unwritable_cache_folder_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("not-a-folder");
        std::fs::write(&blocker, b"x").unwrap();
        let error = materialize(&blocker, "vocab.txt", b"x")
            .unwrap_err()
            .to_string();
        assert!(error.contains("not-a-folder"), "{error}");
        assert!(error.contains(CACHE_DIR_VAR), "{error}");
    }

    #[test]
    fn the_cache_folder_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        const ALL: &[(&str, &str)] = &[
            ("EMBER_CACHE_DIR", "/e"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(cache_dir_from(env(ALL)), PathBuf::from("/e"));
        assert_eq!(cache_dir_from(env(&ALL[1..])), PathBuf::from("/x/ember"));
        assert_eq!(
            cache_dir_from(env(&ALL[2..])),
            PathBuf::from("/h/.cache/ember")
        );
        assert_eq!(
            cache_dir_from(env(&[])),
            std::env::temp_dir().join("ember-cache")
        );
    }
}
