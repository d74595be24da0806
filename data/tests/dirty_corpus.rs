//! A dirty corpus as users have them: a byte-order mark, CRLF line ends, a line that is not
//! UTF-8, control characters and an empty document. Without `strict` the bad line is skipped
//! and counted, the rest reads as if clean; with `strict` it is an error naming the file, line
//! and byte offset; `prepare_shards` does the same.

use ember_data::prepare::{PrepareOptions, prepare_shards};
use ember_data::shard::Compression;
use ember_data::{
    DataError, PretrainingConfig, WordPieceTokenizer, default_vocab_path, read_corpus,
    tokenize_documents,
};

/// 41 lines: a BOM, CRLF ends, line 5 not UTF-8, control characters on line 8, an empty
/// (whitespace-only) document, and 30 clean documents of one sentence.
fn dirty() -> Vec<u8> {
    let mut bytes = b"\xEF\xBB\xBFThe first sentence.\r\nA second one.\r\n\r\n".to_vec();
    bytes.extend_from_slice(b"Another document.\r\n");
    bytes.extend_from_slice(b"Caf\xE9 au lait, in Latin-1.\n"); // line 5
    bytes.extend_from_slice(b"Its second sentence.\n\n");
    bytes.extend_from_slice(b"Bell\x07 and\x1b escape\x0b here.\n\n");
    bytes.extend_from_slice(b"   \t \n\n");
    for i in 0..15 {
        bytes.extend_from_slice(format!("Clean document number {i}.\n\n").as_bytes());
    }
    bytes
}

#[test]
fn a_dirty_corpus_reads_as_if_clean_and_strict_names_the_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dirty.txt");
    let bytes = dirty();
    assert_eq!(bytes.iter().filter(|&&b| b == b'\n').count(), 41);
    std::fs::write(&path, &bytes).unwrap();

    let corpus = read_corpus(&path, false).unwrap();
    assert_eq!(corpus.skipped_lines, 1);
    assert_eq!(corpus.documents.len(), 3 + 15);
    assert_eq!(
        corpus.documents[0],
        ["The first sentence.", "A second one."],
        "BOM and CR removed"
    );
    assert_eq!(
        corpus.documents[1],
        ["Another document.", "Its second sentence."]
    );
    assert_eq!(corpus.documents[3], ["Clean document number 0."]);

    // The tokenizer drops the control characters, as BERT's `_clean_text`.
    let tokenizer = WordPieceTokenizer::from_vocab_file(&default_vocab_path().unwrap()).unwrap();
    let tokens = tokenize_documents(&tokenizer, &corpus.documents).unwrap();
    let clean = tokenize_documents(
        &tokenizer,
        &[
            vec!["The first sentence.".into()],
            vec!["Bell and escape here.".into()],
        ],
    )
    .unwrap();
    assert_eq!(tokens[0][0], clean[0][0]);
    assert_eq!(tokens[2][0], clean[1][0]);
    assert!(!tokens[2][0].contains(&tokenizer.special().unk));

    let strict = read_corpus(&path, true).unwrap_err();
    let bad = bytes.iter().position(|&b| b == 0xE9).unwrap() as u64;
    assert!(
        matches!(strict, DataError::InvalidUtf8 { line: 5, offset, .. } if offset == bad),
        "{strict:?}, the bad byte at {bad}"
    );
    let message = strict.to_string();
    assert!(
        message.contains("dirty.txt") && message.contains("line 5"),
        "{message}"
    );

    // prepare-data: the same documents, the skipped line counted; strict stops.
    let options = |strict| PrepareOptions {
        instances: PretrainingConfig {
            max_seq_length: 32,
            dupe_factor: 1,
            ..PretrainingConfig::default()
        },
        num_shards: 1,
        compression: Compression::None,
        jobs: 1,
        holdout_documents: 0,
        strict,
    };
    let summary = prepare_shards(
        &path,
        &tokenizer,
        &dir.path().join("out"),
        &options(false),
        &|_, _| {},
    )
    .unwrap();
    assert_eq!((summary.documents, summary.skipped_lines), (18, 1));
    let error = prepare_shards(
        &path,
        &tokenizer,
        &dir.path().join("out2"),
        &options(true),
        &|_, _| {},
    )
    .unwrap_err();
    assert!(
        matches!(error, DataError::InvalidUtf8 { line: 5, .. }),
        "{error}"
    );
}
