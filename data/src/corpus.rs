//! Corpus reading in the format of Google's `create_pretraining_data.py`: one sentence per line,
//! a blank line between documents.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use crate::{DataError, WordPieceTokenizer};

/// A tokenised document: its sentences, each a list of token ids (no special tokens).
pub type Document = Vec<Vec<u32>>;

/// The corpus files of `path`: the file itself, or every `*.txt` file of a folder in name order.
///
/// # Errors
/// [`DataError::Io`] if the folder cannot be read.
pub fn corpus_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|error| DataError::Io {
            path: path.to_path_buf(),
            error,
        })?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    Ok(files)
}

/// Streams the documents of corpus files one at a time (a document's sentences, each a line),
/// holding one document in memory. Blank (or whitespace-only) lines separate documents; a file
/// end ends a document.
///
/// Real corpora are dirty; as Google's `create_pretraining_data.py` (which strips each line)
/// and more forgiving: CRLF line ends and a byte-order mark at a file's start are removed; a
/// line that is not UTF-8 is skipped with a warning naming the file, line and byte offset
/// (counted in [`DocumentStream::skipped_lines`]), or is an error with
/// [`DocumentStream::strict`]. Control characters stay in the sentence: the tokenizer removes
/// them, as BERT's `BasicTokenizer._clean_text`.
pub struct DocumentStream {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<OpenFile>,
    strict: bool,
    warn: bool,
    skipped: usize,
}

/// A corpus file being read: its reader, the next line's number and byte offset.
struct OpenFile {
    path: PathBuf,
    reader: BufReader<std::fs::File>,
    line: usize,
    offset: u64,
}

impl DocumentStream {
    /// A stream over `files`, in order, skipping lines that are not UTF-8.
    pub fn new(files: Vec<PathBuf>) -> Self {
        Self {
            files: files.into_iter(),
            current: None,
            strict: false,
            warn: true,
            skipped: 0,
        }
    }

    /// Skips lines that are not UTF-8 without a warning (a second pass over files whose
    /// first pass warned).
    pub fn quiet(mut self) -> Self {
        self.warn = false;
        self
    }

    /// `true`: a line that is not UTF-8 ends the stream with [`DataError::InvalidUtf8`].
    pub fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Lines skipped so far because they were not UTF-8.
    pub fn skipped_lines(&self) -> usize {
        self.skipped
    }
}

impl Iterator for DocumentStream {
    /// A document, or the error (naming the file) that stopped the stream.
    type Item = Result<Vec<String>, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut document = Vec::new();
        let mut bytes = Vec::new();
        loop {
            if self.current.is_none() {
                let path = self.files.next()?;
                match std::fs::File::open(&path) {
                    Ok(f) => {
                        self.current = Some(OpenFile {
                            path,
                            reader: BufReader::new(f),
                            line: 0,
                            offset: 0,
                        })
                    }
                    Err(error) => return Some(Err(DataError::Io { path, error })),
                }
            }
            let file = self.current.as_mut().expect("a file is open");
            bytes.clear();
            match file.reader.read_until(b'\n', &mut bytes) {
                Ok(0) => {
                    self.current = None;
                    if !document.is_empty() {
                        return Some(Ok(document));
                    }
                }
                Ok(n) => {
                    let start = file.offset;
                    file.offset += n as u64;
                    file.line += 1;
                    let mut raw = bytes.as_slice();
                    if file.line == 1 {
                        raw = raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw);
                    }
                    let bom = (bytes.len() - raw.len()) as u64;
                    let line = match std::str::from_utf8(raw) {
                        Ok(line) => line,
                        Err(e) => {
                            let (path, line) = (file.path.clone(), file.line);
                            let offset = start + bom + e.valid_up_to() as u64;
                            if self.strict {
                                self.current = None;
                                self.files = Vec::new().into_iter();
                                return Some(Err(DataError::InvalidUtf8 { path, line, offset }));
                            }
                            if self.warn {
                                tracing::warn!(
                                    "{}: line {line} is not valid UTF-8 (byte offset {offset}): \
                                 skipped (--strict makes this an error)",
                                    path.display()
                                );
                            }
                            self.skipped += 1;
                            continue;
                        }
                    };
                    let line = line.trim();
                    if !line.is_empty() {
                        document.push(line.to_string());
                    } else if !document.is_empty() {
                        return Some(Ok(document));
                    }
                }
                Err(error) => {
                    let path = file.path.clone();
                    self.current = None;
                    self.files = Vec::new().into_iter();
                    return Some(Err(DataError::Io { path, error }));
                }
            }
        }
    }
}

/// A corpus read whole: its documents, and the lines skipped because they were not UTF-8.
#[derive(Debug, Clone, PartialEq)]
pub struct Corpus {
    /// Each document's sentences.
    pub documents: Vec<Vec<String>>,
    /// Lines skipped (not UTF-8).
    pub skipped_lines: usize,
}

/// Reads the documents of a corpus file, or of every `*.txt` file of a folder (in name order),
/// as lists of sentences, as [`DocumentStream`] reads them (`strict`: a line that is not UTF-8
/// is an error, else it is skipped with a warning and counted).
///
/// # Errors
/// [`DataError::Io`] naming the file that is missing or unreadable;
/// [`DataError::InvalidUtf8`] (strict) naming the file, line and byte offset;
/// [`DataError::EmptyCorpus`] if there is no sentence at all.
pub fn read_corpus(path: &Path, strict: bool) -> Result<Corpus, DataError> {
    let mut stream = DocumentStream::new(corpus_files(path)?).strict(strict);
    let documents = stream.by_ref().collect::<Result<Vec<_>, _>>()?;
    if documents.is_empty() {
        return Err(DataError::EmptyCorpus {
            path: path.to_path_buf(),
        });
    }
    Ok(Corpus {
        documents,
        skipped_lines: stream.skipped_lines(),
    })
}

/// [`read_corpus`] without `strict`, only the documents.
///
/// # Errors
/// As [`read_corpus`].
pub fn read_documents(path: &Path) -> Result<Vec<Vec<String>>, DataError> {
    read_corpus(path, false).map(|c| c.documents)
}

/// Tokenises every sentence. Sentences that tokenise to nothing are dropped, and so are
/// documents left empty, as the reference does.
///
/// # Errors
/// [`DataError::Tokenizer`] if the tokenizer fails.
pub fn tokenize_documents(
    tokenizer: &WordPieceTokenizer,
    documents: &[Vec<String>],
) -> Result<Vec<Document>, DataError> {
    let sentences: Vec<&str> = documents.iter().flatten().map(String::as_str).collect();
    let mut ids = tokenizer.encode_batch(&sentences)?.into_iter();
    let tokenized = documents
        .iter()
        .map(|doc| {
            doc.iter()
                .map(|_| ids.next().expect("one encoding per sentence"))
                .filter(|sentence| !sentence.is_empty())
                .collect::<Document>()
        })
        .filter(|doc| !doc.is_empty())
        .collect();
    Ok(tokenized)
}

/// Splits off the last `held_out` documents as the evaluation set, keeping at least one
/// document for training: `held_out` is lowered to `len / 10` (at least 1) on small corpora.
/// Returns `(train, eval)`.
///
/// # Errors
/// [`DataError::TooFewDocuments`] (naming `path`) if there are fewer than 2 documents.
pub fn split_held_out<T>(
    mut documents: Vec<T>,
    held_out: usize,
    path: &Path,
) -> Result<(Vec<T>, Vec<T>), DataError> {
    let n = documents.len();
    if n < 2 {
        return Err(DataError::TooFewDocuments {
            path: path.to_path_buf(),
            documents: n,
        });
    }
    let eval = documents.split_off(n - held_out_count(n, held_out));
    Ok((documents, eval))
}

/// How many of `n` documents [`split_held_out`] holds out when asked for `requested`:
/// `requested`, lowered to `n / 10` (at least 1). `prepare-data` leaves the same documents out
/// of its shards, so that training on shards evaluates on documents it never saw.
pub fn held_out_count(n: usize, requested: usize) -> usize {
    requested.min((n / 10).max(1))
}
