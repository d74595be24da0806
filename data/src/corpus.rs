//! Corpus reading in the format of Google's `create_pretraining_data.py`: one sentence per line,
//! a blank line between documents.

use std::path::{Path, PathBuf};

use crate::{DataError, WordPieceTokenizer};

/// A tokenised document: its sentences, each a list of token ids (no special tokens).
pub type Document = Vec<Vec<u32>>;

/// Reads the documents of a corpus file, or of every `*.txt` file of a folder (in name order),
/// as lists of sentences. Blank lines separate documents; whitespace-only lines count as blank.
///
/// # Errors
/// [`DataError::Io`] naming the file that is missing or unreadable (or not UTF-8);
/// [`DataError::EmptyCorpus`] if there is no sentence at all.
pub fn read_documents(path: &Path) -> Result<Vec<Vec<String>>, DataError> {
    let io_error = |path: &Path, error| DataError::Io {
        path: path.to_path_buf(),
        error,
    };
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| io_error(path, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        files.sort();
        files
    } else {
        vec![path.to_path_buf()]
    };

    let mut documents = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).map_err(|e| io_error(file, e))?;
        let mut current: Vec<String> = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() {
                if !current.is_empty() {
                    documents.push(std::mem::take(&mut current));
                }
            } else {
                current.push(line.to_string());
            }
        }
        if !current.is_empty() {
            documents.push(current);
        }
    }
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
    let held_out = held_out.min((n / 10).max(1));
    let eval = documents.split_off(n - held_out);
    Ok((documents, eval))
}
