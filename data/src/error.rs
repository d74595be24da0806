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
    /// A corpus line that is not UTF-8, with `strict` reading (else the line is skipped with a
    /// warning).
    #[error("{}: line {line} is not valid UTF-8 (byte offset {offset} in the file); without --strict such lines are skipped with a warning", path.display())]
    InvalidUtf8 {
        /// The corpus file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// The offset of the first invalid byte in the file.
        offset: u64,
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
    /// A file that is not HDF5, or is truncated.
    #[error("{}: not a readable HDF5 file (truncated or another format): {reason}", path.display())]
    NotHdf5 {
        /// The file.
        path: PathBuf,
        /// HDF5's message.
        reason: String,
    },
    /// A shard without one of the MLPerf fields.
    #[error("{}: no field `{field}` (an MLPerf shard has input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels)", path.display())]
    MissingField {
        /// The file.
        path: PathBuf,
        /// The missing field.
        field: String,
    },
    /// A shard field of a type other than integer (e.g. float ids).
    #[error("{}: field `{field}` has dtype {found}; expected an integer type (i1/i2/i4/i8)", path.display())]
    WrongDtype {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// The dtype found.
        found: String,
    },
    /// A shard field whose shape disagrees with the others.
    #[error("{}: field `{field}` has shape {shape:?}, expected {expected} to agree with input_ids", path.display())]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The shape it should have.
        expected: String,
    },
    /// A token id outside the vocabulary.
    #[error("{}: field `{field}`, sample {sample}: id {id} is not below the vocabulary size {vocab_size} (was the shard made with another vocab?)", path.display())]
    IdOutOfRange {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// The sample (row).
        sample: usize,
        /// The id.
        id: i64,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// A shard with zero samples.
    #[error("{}: the shard holds zero samples", path.display())]
    EmptyShard {
        /// The file.
        path: PathBuf,
    },
    /// A folder without `*.hdf5`/`*.h5` files.
    #[error("{}: no HDF5 shards (*.hdf5, *.h5) found", path.display())]
    NoShards {
        /// The folder.
        path: PathBuf,
    },
    /// Any other problem with a shard's field.
    #[error("{}: field `{field}`: {problem}", path.display())]
    Shard {
        /// The file.
        path: PathBuf,
        /// The field (or "(file)").
        field: String,
        /// What is wrong.
        problem: String,
    },
}
