//! Sentence embeddings from a BERT checkpoint, as sentence-transformers computes them: text →
//! WordPiece ids with `[CLS]`/`[SEP]` → [`BertModel`] over a padded batch → mean (over the real
//! tokens) or `[CLS]` pooling → optionally L2-normalised.
//!
//! ```no_run
//! # fn main() -> Result<(), ember_model::ModelError> {
//! use burn::backend::NdArray;
//! use ember_model::{Embedder, Pooling};
//!
//! let device = Default::default();
//! let embedder = Embedder::<NdArray>::from_pretrained("all-MiniLM-L6-v2".as_ref(), &device)?
//!     .with_pooling(Pooling::Mean)
//!     .with_normalize(true);
//! let embeddings = embedder.encode(&["A sentence.", "Another, longer sentence."])?; // [2, 384]
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use ember_backend_ext::FusedOps;
use tokenizers::Tokenizer;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;

use crate::{BertConfig, BertModel, ModelError, mean_pool};

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// Mean over the real (unpadded) tokens, `[CLS]` and `[SEP]` included:
    /// sentence-transformers' `pooling_mode_mean_tokens` (all-MiniLM-L6-v2's).
    #[default]
    Mean,
    /// The last layer's `[CLS]` vector: `pooling_mode_cls_token`.
    Cls,
}

impl std::str::FromStr for Pooling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Self::Mean),
            "cls" => Ok(Self::Cls),
            other => Err(format!("unknown pooling `{other}` (expected mean or cls)")),
        }
    }
}

/// A BERT encoder with its tokenizer, turning texts into embeddings on any Burn backend (use
/// an inference backend such as `NdArray`, not `Autodiff`).
pub struct Embedder<B: Backend> {
    model: BertModel<B>,
    tokenizer: Tokenizer,
    max_positions: usize,
    vocab_size: usize,
    pad_id: u32,
    pooling: Pooling,
    normalize: bool,
    batch_size: usize,
    device: B::Device,
    dir: PathBuf,
}

fn tokenizer_error(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason: format!("tokenizer: {e}"),
    }
}

/// The folder's tokenizer: `tokenizer.json` with its padding and truncation switched off (the
/// embedder pads its own batches and truncates to the model's positions), else `vocab.txt`
/// with BERT's uncased pipeline (`BertNormalizer` lower-casing, `BertPreTokenizer`, WordPiece
/// with `##` continuations, `[CLS] … [SEP]`).
fn load_tokenizer(dir: &Path) -> Result<Tokenizer, ModelError> {
    let json = dir.join("tokenizer.json");
    if json.is_file() {
        let mut tokenizer = Tokenizer::from_file(&json).map_err(|e| tokenizer_error(&json, e))?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| tokenizer_error(&json, e))?;
        return Ok(tokenizer);
    }
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

impl<B: FusedOps> Embedder<B> {
    /// Reads a model folder: `config.json`, `model.safetensors` (a `BertModel`, keys with or
    /// without `bert.`, or a `BertForPreTraining`, whose heads are ignored), and
    /// `tokenizer.json` or `vocab.txt`. Dropout is switched off. Pooling defaults to mean,
    /// without normalisation, in batches of 32.
    ///
    /// # Errors
    /// [`ModelError::Io`] naming the folder when it has no vocabulary, or a missing file;
    /// [`ModelError::ConfigJson`], [`ModelError::Checkpoint`] for a bad config, weights or
    /// tokenizer file.
    pub fn from_pretrained(dir: &Path, device: &B::Device) -> Result<Self, ModelError> {
        let tokenizer = load_tokenizer(dir)?;
        let mut config = BertConfig::load_json(&dir.join("config.json"))?;
        config.hidden_dropout_prob = 0.0;
        config.attention_probs_dropout_prob = 0.0;
        let model = config
            .init_bert_model(device)
            .load_hf_safetensors(&dir.join("model.safetensors"))?;
        let pad_id = tokenizer.token_to_id("[PAD]").unwrap_or(0);
        Ok(Self {
            model,
            tokenizer,
            max_positions: config.max_position_embeddings,
            vocab_size: config.vocab_size,
            pad_id,
            pooling: Pooling::Mean,
            normalize: false,
            batch_size: 32,
            device: device.clone(),
            dir: dir.to_path_buf(),
        })
    }

    /// Mean or `[CLS]` pooling.
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        self.pooling = pooling;
        self
    }

    /// L2-normalise each embedding (sentence-transformers' `Normalize`, ε = 1e-12).
    pub fn with_normalize(mut self, normalize: bool) -> Self {
        self.normalize = normalize;
        self
    }

    /// Texts per forward pass (at least 1).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The model's hidden size, the length of an embedding.
    pub fn dim(&self) -> usize {
        self.model.embeddings.word_embeddings.weight.val().dims()[1]
    }

    /// A text's token ids, `[CLS]` and `[SEP]` included. A text longer than the model's
    /// positions is cut to its first `max_position_embeddings − 1` tokens and `[SEP]`, with a
    /// warning.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] when the tokenizer fails or gives an id outside the model's
    /// vocabulary (a tokenizer of another model).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| tokenizer_error(&self.dir, e))?;
        let mut ids = encoding.get_ids().to_vec();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(tokenizer_error(
                &self.dir,
                format!(
                    "token id {bad} is outside the model's vocabulary of {}",
                    self.vocab_size
                ),
            ));
        }
        if ids.len() > self.max_positions {
            tracing::warn!(
                tokens = ids.len(),
                max_positions = self.max_positions,
                "a text is longer than the model's positions; truncated: {:?}",
                text.chars().take(60).collect::<String>()
            );
            let sep = *ids.last().expect("a long text has tokens");
            ids.truncate(self.max_positions - 1);
            ids.push(sep);
        }
        Ok(ids)
    }

    /// The embeddings of `texts`, `[n, hidden]`, in order, computed in padded batches.
    ///
    /// # Errors
    /// As [`Embedder::token_ids`].
    pub fn encode(&self, texts: &[&str]) -> Result<Tensor<B, 2>, ModelError> {
        let ids = texts
            .iter()
            .map(|t| self.token_ids(t))
            .collect::<Result<Vec<_>, _>>()?;
        let mut parts = Vec::new();
        for chunk in ids.chunks(self.batch_size) {
            parts.push(self.encode_ids(chunk));
        }
        if parts.is_empty() {
            return Ok(Tensor::zeros([0, self.dim()], &self.device));
        }
        Ok(Tensor::cat(parts, 0))
    }

    /// One padded batch of token ids → `[n, hidden]`.
    fn encode_ids(&self, ids: &[Vec<u32>]) -> Tensor<B, 2> {
        let (n, seq) = (ids.len(), ids.iter().map(Vec::len).max().unwrap_or(1));
        let mut input_ids = vec![self.pad_id as i64; n * seq];
        let mut input_mask = vec![0i64; n * seq];
        for (row, sample) in ids.iter().enumerate() {
            for (col, &id) in sample.iter().enumerate() {
                input_ids[row * seq + col] = i64::from(id);
                input_mask[row * seq + col] = 1;
            }
        }
        let tensor = |values: Vec<i64>| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(values, [n, seq]), &self.device)
        };
        let input_mask = tensor(input_mask);
        let output = self.model.forward(
            tensor(input_ids),
            tensor(vec![0; n * seq]),
            input_mask.clone(),
        );
        let pooled = match self.pooling {
            Pooling::Mean => mean_pool(output.sequence_output, input_mask),
            Pooling::Cls => {
                let hidden = output.sequence_output.dims()[2];
                output
                    .sequence_output
                    .slice([0..n, 0..1, 0..hidden])
                    .reshape([n, hidden])
            }
        };
        if self.normalize {
            let norm = pooled.clone().square().sum_dim(1).sqrt().clamp_min(1e-12);
            pooled / norm
        } else {
            pooled
        }
    }
}
