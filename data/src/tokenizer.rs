//! WordPiece tokenisation as BERT uncased does it, through Hugging Face's `tokenizers` crate:
//! `BertNormalizer` (clean control characters, space out CJK characters, lower-case, strip
//! accents), `BertPreTokenizer` (split on whitespace and punctuation), then greedy
//! longest-match-first WordPiece with `##` continuations and `[UNK]` for words over 100 chars.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;

use crate::DataError;

/// Ids of BERT's special tokens in a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `[PAD]`, the id of padding (0 in bert-base-uncased).
    pub pad: u32,
    /// `[UNK]`, out-of-vocabulary words (100).
    pub unk: u32,
    /// `[CLS]`, first token of every sequence (101).
    pub cls: u32,
    /// `[SEP]`, end of each segment (102).
    pub sep: u32,
    /// `[MASK]`, the replacement of 80% of masked tokens (103).
    pub mask: u32,
}

impl SpecialTokens {
    /// Whether `id` is one of the special tokens (never chosen for masking).
    pub fn contains(&self, id: u32) -> bool {
        [self.pad, self.unk, self.cls, self.sep, self.mask].contains(&id)
    }
}

/// A BERT uncased WordPiece tokenizer built from a `vocab.txt` (one token per line; the line
/// number is the id).
pub struct WordPieceTokenizer {
    inner: Tokenizer,
    special: SpecialTokens,
    vocab_size: usize,
    path: PathBuf,
}

impl std::fmt::Debug for WordPieceTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WordPieceTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .finish()
    }
}

impl WordPieceTokenizer {
    /// Reads `vocab.txt` and builds the tokenizer (lower-casing and accent stripping on, as
    /// bert-base-uncased).
    ///
    /// # Errors
    /// [`DataError::Io`] if the file cannot be read, [`DataError::EmptyCorpus`]-style
    /// [`DataError::Tokenizer`] if it has no tokens, [`DataError::MissingSpecialToken`] if one
    /// of `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]` is absent.
    pub fn from_vocab_file(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(path).map_err(|error| DataError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        // The reference `load_vocab` keeps every line, so ids are line numbers.
        let tokens: Vec<&str> = text.lines().map(|l| l.trim_end()).collect();
        if tokens.iter().all(|t| t.is_empty()) {
            return Err(DataError::Tokenizer {
                path: path.to_path_buf(),
                message: "the vocabulary file has no tokens".into(),
            });
        }
        let vocab: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.to_string(), id as u32))
            .collect();
        let find = |token: &'static str| {
            vocab
                .get(token)
                .copied()
                .ok_or(DataError::MissingSpecialToken {
                    path: path.to_path_buf(),
                    token,
                })
        };
        let special = SpecialTokens {
            pad: find("[PAD]")?,
            unk: find("[UNK]")?,
            cls: find("[CLS]")?,
            sep: find("[SEP]")?,
            mask: find("[MASK]")?,
        };
        let wordpiece_vocab =
            WordPiece::read_bytes(text.as_bytes()).map_err(|e| DataError::Tokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let model = WordPiece::builder()
            .vocab(wordpiece_vocab)
            .unk_token("[UNK]".into())
            .continuing_subword_prefix("##".into())
            .max_input_chars_per_word(100)
            .build()
            .map_err(|e| DataError::Tokenizer {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let mut inner = Tokenizer::new(model);
        inner.with_normalizer(Some(BertNormalizer::new(true, true, None, true)));
        inner.with_pre_tokenizer(Some(BertPreTokenizer));
        Ok(Self {
            inner,
            special,
            vocab_size: tokens.len(),
            path: path.to_path_buf(),
        })
    }

    /// Token ids of a text, without `[CLS]`/`[SEP]`.
    ///
    /// # Errors
    /// [`DataError::Tokenizer`] if the tokenizer library fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self.encoding(text)?.get_ids().to_vec())
    }

    /// Token ids of many texts at once (in parallel), without `[CLS]`/`[SEP]`.
    ///
    /// # Errors
    /// As [`WordPieceTokenizer::encode`].
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>, DataError> {
        let encodings = self
            .inner
            .encode_batch(texts.to_vec(), false)
            .map_err(|e| self.error(e))?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// WordPiece strings of a text (`["un", "##aff", "##able"]`), for inspection and tests.
    ///
    /// # Errors
    /// As [`WordPieceTokenizer::encode`].
    pub fn tokenize(&self, text: &str) -> Result<Vec<String>, DataError> {
        Ok(self.encoding(text)?.get_tokens().to_vec())
    }

    /// The token of an id, if the id is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of lines of the vocabulary file, the model's `vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids of the special tokens.
    pub fn special(&self) -> SpecialTokens {
        self.special
    }

    /// The vocabulary file this tokenizer was built from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn encoding(&self, text: &str) -> Result<tokenizers::Encoding, DataError> {
        self.inner.encode(text, false).map_err(|e| self.error(e))
    }

    fn error(&self, e: tokenizers::Error) -> DataError {
        DataError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}
