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
pub struct DocumentStream {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<(PathBuf, std::io::Lines<BufReader<std::fs::File>>)>,
}

impl DocumentStream {
    /// A stream over `files`, in order.
    pub fn new(files: Vec<PathBuf>) -> Self {
        Self {
            files: files.into_iter(),
            current: None,
        }
    }
}

impl Iterator for DocumentStream {
    /// A document, or the I/O error (naming the file) that stopped the stream.
    type Item = Result<Vec<String>, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut document = Vec::new();
        loop {
            if self.current.is_none() {
                let file = self.files.next()?;
                match std::fs::File::open(&file) {
                    Ok(f) => self.current = Some((file, BufReader::new(f).lines())),
                    Err(error) => return Some(Err(DataError::Io { path: file, error })),
                }
            }
            let (file, lines) = self.current.as_mut().expect("a file is open");
            match lines.next() {
                Some(Ok(line)) => {
                    let line = line.trim();
                    if !line.is_empty() {
                        document.push(line.to_string());
                    } else if !document.is_empty() {
                        return Some(Ok(document));
                    }
                }
                Some(Err(error)) => {
                    let path = file.clone();
                    self.current = None;
                    self.files = Vec::new().into_iter();
                    return Some(Err(DataError::Io { path, error }));
                }
                None => {
                    self.current = None;
                    if !document.is_empty() {
                        return Some(Ok(document));
                    }
                }
            }
        }
    }
}

/// Reads the documents of a corpus file, or of every `*.txt` file of a folder (in name order),
/// as lists of sentences. Blank lines separate documents; whitespace-only lines count as blank.
///
/// # Errors
/// [`DataError::Io`] naming the file that is missing or unreadable (or not UTF-8);
/// [`DataError::EmptyCorpus`] if there is no sentence at all.
pub fn read_documents(path: &Path) -> Result<Vec<Vec<String>>, DataError> {
    let documents = DocumentStream::new(corpus_files(path)?).collect::<Result<Vec<_>, _>>()?;
    if documents.is_empty() {
        return Err(DataError::EmptyCorpus {
            path: path.to_path_buf(),
        });
    }
    Ok(documents)
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
