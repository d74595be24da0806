//! The embedder's tokenizer, set up as transformers and sentence-transformers set it up.

use std::path::Path;

use tokenizers::Tokenizer;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::normalizers::{Lowercase, NormalizerWrapper, Sequence};
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;

use crate::ModelError;

pub(crate) fn tokenizer_error(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("tokenizer: {e}"),
    }
}

/// The folder's tokenizer: `tokenizer.json` with its padding and truncation switched off (the
/// embedder pads its own batches and truncates to its limit), else `vocab.txt` with BERT's
/// uncased pipeline (`BertNormalizer` lower-casing, `BertPreTokenizer`, WordPiece with `##`
/// continuations, `[CLS] … [SEP]`). A BERT normalizer takes `do_lower_case`, `strip_accents`
/// and `tokenize_chinese_chars` from `tokenizer_config.json`, lower-casing when it does not
/// say, as transformers' `BertTokenizer` does (a cased model's folder says
/// `"do_lower_case": false`). With `do_lower_case` (sentence-transformers' Transformer
/// setting) a `Lowercase` normalizer goes first unless the tokenizer lower-cases already, as
/// sentence-transformers adds it.
///
/// # Errors
/// [`ModelError::Io`] naming the folder when it has no vocabulary;
/// [`ModelError::Checkpoint`] for a tokenizer file that does not load.
pub(crate) fn load_tokenizer(dir: &Path, do_lower_case: bool) -> Result<Tokenizer, ModelError> {
    let json = dir.join("tokenizer.json");
    let mut tokenizer = if json.is_file() {
        let mut tokenizer = Tokenizer::from_file(&json).map_err(|e| tokenizer_error(&json, e))?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| tokenizer_error(&json, e))?;
        tokenizer
    } else {
        from_vocab(dir)?
    };
    apply_tokenizer_config(dir, &mut tokenizer)?;
    if do_lower_case && !lowercases(tokenizer.get_normalizer()) {
        let mut steps = vec![NormalizerWrapper::Lowercase(Lowercase)];
        steps.extend(tokenizer.get_normalizer().cloned());
        tokenizer.with_normalizer(Some(NormalizerWrapper::Sequence(Sequence::new(steps))));
    }
    Ok(tokenizer)
}

/// Whether `normalizer` lower-cases.
fn lowercases(normalizer: Option<&NormalizerWrapper>) -> bool {
    match normalizer {
        Some(NormalizerWrapper::Lowercase(_)) => true,
        Some(NormalizerWrapper::BertNormalizer(n)) => n.lowercase,
        Some(NormalizerWrapper::Sequence(s)) => s.as_ref().iter().any(|n| lowercases(Some(n))),
        _ => false,
    }
}

/// `tokenizer_config.json`'s settings of a BERT normalizer (transformers' `BertTokenizer`).
fn apply_tokenizer_config(dir: &Path, tokenizer: &mut Tokenizer) -> Result<(), ModelError> {
    let Some(NormalizerWrapper::BertNormalizer(current)) = tokenizer.get_normalizer().cloned()
    else {
        return Ok(());
    };
    let path = dir.join("tokenizer_config.json");
    let config: serde_json::Value = if path.is_file() {
        let text = std::fs::read_to_string(&path).map_err(|error| ModelError::Io {
            path: path.clone(),
            error,
        })?;
        serde_json::from_str(&text).map_err(|e| tokenizer_error(&path, e))?
    } else {
        serde_json::Value::Null
    };
    if config["tokenizer_class"]
        .as_str()
        .is_some_and(|class| !class.starts_with("Bert"))
    {
        return Ok(());
    }
    let normalizer = BertNormalizer::new(
        current.clean_text,
        config["tokenize_chinese_chars"].as_bool().unwrap_or(true),
        config["strip_accents"].as_bool(),
        config["do_lower_case"].as_bool().unwrap_or(true),
    );
    tokenizer.with_normalizer(Some(NormalizerWrapper::BertNormalizer(normalizer)));
    Ok(())
}

/// BERT's uncased pipeline over `vocab.txt`.
fn from_vocab(dir: &Path) -> Result<Tokenizer, ModelError> {
    let vocab = dir.join("vocab.txt");
    if !vocab.is_file() {
        return Err(ModelError::Io {
            path: dir.to_path_buf(),
            error: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no tokenizer.json or vocab.txt in this folder: the embedder needs the model's vocabulary",
            ),
        });
    }
    let wordpiece = WordPiece::from_file(&vocab.to_string_lossy())
        .unk_token("[UNK]".into())
        .continuing_subword_prefix("##".into())
        .build()
        .map_err(|e| tokenizer_error(&vocab, e))?;
    let id = |token: &str| {
        tokenizers::Model::token_to_id(&wordpiece, token)
            .ok_or_else(|| tokenizer_error(&vocab, format!("{token} is not in the vocabulary")))
    };
    let (cls, sep) = (id("[CLS]")?, id("[SEP]")?);
    let mut tokenizer = Tokenizer::new(wordpiece);
    tokenizer.with_normalizer(Some(BertNormalizer::new(true, true, None, true)));
    tokenizer.with_pre_tokenizer(Some(BertPreTokenizer));
    tokenizer.with_post_processor(Some(BertProcessing::new(
        ("[SEP]".into(), sep),
        ("[CLS]".into(), cls),
    )));
    Ok(tokenizer)
}
