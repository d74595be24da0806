use std::path::PathBuf;

/// Errors of the data pipeline. Each names the file (or setting) at fault and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be opened or read.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not chained, so it prints once).
        error: std::io::Error,
    },
    /// A corpus file (or folder) that holds no text.
    #[error("{}: the corpus is empty (expected one sentence per line, a blank line between documents)", path.display())]
    EmptyCorpus {
        /// The corpus file or folder.
        path: PathBuf,
    },
    /// Too few documents to hold out an evaluation set and still train.
    #[error("{}: {documents} document(s) cannot be split into training and held-out evaluation documents (need at least 2; documents are separated by blank lines)", path.display())]
    TooFewDocuments {
        /// The corpus file.
        path: PathBuf,
        /// How many documents it has.
        documents: usize,
    },
    /// A vocabulary without one of BERT's special tokens.
    #[error("{}: the vocabulary has no {token} token (a BERT vocab.txt needs [PAD], [UNK], [CLS], [SEP] and [MASK])", path.display())]
    MissingSpecialToken {
        /// The vocab file.
        path: PathBuf,
        /// The missing token.
        token: &'static str,
    },
    /// The tokenizer library refused the vocabulary or a text.
    #[error("{}: {message}", path.display())]
    Tokenizer {
        /// The vocab file the tokenizer was built from.
        path: PathBuf,
        /// The tokenizer's message.
        message: String,
    },
    /// A pre-training setting outside what the algorithm can use.
    #[error("invalid data setting {field}: {reason}")]
    InvalidSetting {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A batch size larger than the number of examples.
    #[error(
        "{what}: the batch size {batch_size} is larger than the {available} examples there are (lower --batch-size or use a larger corpus)"
    )]
    BatchLargerThanData {
        /// Which data ("training set", "evaluation set").
        what: String,
        /// The requested batch size.
        batch_size: usize,
        /// The number of examples available.
        available: usize,
    },
}
