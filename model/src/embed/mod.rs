//! Sentence embeddings from a BERT checkpoint or a sentence-transformers folder, as
//! sentence-transformers computes them: text → WordPiece ids with `[CLS]`/`[SEP]`, cut to the
//! folder's `max_seq_length` → [`BertModel`] over length-sorted, padded batches → the folder's
//! pooling modes → its Dense and Normalize modules (Note [sentence-transformers folders] in
//! `folder.rs`). Runs on any Burn backend (CPU, CUDA, wgpu: use an inference backend, not
//! `Autodiff`); [`semantic_search`] finds the nearest embeddings.
//!
//! ```no_run
//! # fn main() -> Result<(), ember_model::ModelError> {
//! use burn::backend::NdArray;
//! use ember_model::{Embedder, semantic_search};
//!
//! let device = Default::default();
//! // all-MiniLM-L6-v2: mean pooling, Normalize, 256 tokens, from its own files.
//! let embedder = Embedder::<NdArray>::from_pretrained("all-MiniLM-L6-v2".as_ref(), &device)?;
//! let corpus = embedder.encode(&["A cat sat on the mat.", "Stocks fell sharply."])?; // [2, 384]
//! let query = embedder.encode(&["Where did the cat sit?"])?;
//! let hits = semantic_search(query, corpus, 1); // hits[0][0].corpus_id == 0
//! # Ok(()) }
//! ```

mod dense;
mod folder;
mod pooling;
mod search;
mod tokenizer;

pub use folder::Activation;
pub use pooling::Pooling;
pub use search::{Hit, cos_sim, normalize, semantic_search};

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use ember_backend_ext::FusedOps;
use tokenizers::Tokenizer;

use self::dense::Dense;
use self::folder::{Pipeline, Stage};
use self::tokenizer::{load_tokenizer, tokenizer_error};
use crate::{BertConfig, BertModel, ModelError};

/// A module after the pooling, loaded.
#[derive(Debug)]
enum Loaded<B: Backend> {
    Dense(Dense<B>),
    Normalize,
}

/// A BERT encoder with its tokenizer and the modules after it, turning texts into embeddings
/// on any Burn backend.
pub struct Embedder<B: Backend> {
    model: BertModel<B>,
    tokenizer: Tokenizer,
    /// Tokens per text at most, `[CLS]` and `[SEP]` included.
    max_len: usize,
    max_positions: usize,
    vocab_size: usize,
    hidden_size: usize,
    pad_id: u32,
    pooling: Vec<Pooling>,
    stages: Vec<Loaded<B>>,
    batch_size: usize,
    device: B::Device,
    dir: PathBuf,
}

impl<B: FusedOps> Embedder<B> {
    /// Reads a model folder as sentence-transformers does (Note [sentence-transformers
    /// folders]): `modules.json` with its Pooling, Dense and Normalize modules, the
    /// Transformer's `sentence_bert_config.json` (`max_seq_length`, `do_lower_case`) or
    /// `tokenizer_config.json` (`model_max_length`); the encoder from `config.json` and
    /// `model.safetensors` (a `BertModel`, keys with or without `bert.`, or a
    /// `BertForPreTraining`, whose heads are ignored) and `tokenizer.json` or `vocab.txt`. A
    /// folder without `modules.json` is pooled by the mean, not normalised, as
    /// sentence-transformers does. Dropout is off; batches of 32 texts.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] naming the file and the key for what ember does not run (a
    /// module, pooling mode, activation or setting), or for a bad weights or tokenizer file;
    /// [`ModelError::Io`] naming the folder when it has no vocabulary, or a missing file;
    /// [`ModelError::ConfigJson`] for a bad `config.json`.
    pub fn from_pretrained(dir: &Path, device: &B::Device) -> Result<Self, ModelError> {
        let pipeline = Pipeline::read(dir)?;
        let transformer = &pipeline.transformer_dir;
        let tokenizer = load_tokenizer(transformer, pipeline.do_lower_case)?;
        let mut config = BertConfig::load_json(&transformer.join("config.json"))?;
        config.hidden_dropout_prob = 0.0;
        config.attention_probs_dropout_prob = 0.0;
        let model = config
            .init_bert_model(device)
            .load_hf_safetensors(&transformer.join("model.safetensors"))?;
        if let Some(dim) = pipeline.pooling_dimension
            && dim != config.hidden_size
        {
            return Err(ModelError::Checkpoint {
                path: dir.join("1_Pooling/config.json"),
                reason: format!(
                    "the pooling's embedding dimension is {dim}, the model's hidden size {}",
                    config.hidden_size
                ),
            });
        }
        let mut width = config.hidden_size * pipeline.pooling.len();
        let mut stages = Vec::new();
        for stage in &pipeline.stages {
            stages.push(match stage {
                Stage::Dense(spec) => {
                    if spec.in_features != width {
                        return Err(ModelError::Checkpoint {
                            path: spec.dir.join("config.json"),
                            reason: format!(
                                "in_features is {}, but the module before gives {width} values",
                                spec.in_features
                            ),
                        });
                    }
                    width = spec.out_features;
                    Loaded::Dense(Dense::load(spec, device)?)
                }
                Stage::Normalize => Loaded::Normalize,
            });
        }
        let max_positions = config.max_position_embeddings;
        let pad_id = tokenizer.token_to_id("[PAD]").unwrap_or(0);
        Ok(Self {
            model,
            tokenizer,
            max_len: pipeline
                .max_seq_length
                .unwrap_or(max_positions)
                .clamp(2, max_positions),
            max_positions,
            vocab_size: config.vocab_size,
            hidden_size: config.hidden_size,
            pad_id,
            pooling: pipeline.pooling,
            stages,
            batch_size: 32,
            device: device.clone(),
            dir: dir.to_path_buf(),
        })
    }

    /// Pools with `pooling` alone instead of the folder's modes (logged when it differs).
    pub fn with_pooling(mut self, pooling: Pooling) -> Self {
        if self.pooling != [pooling] {
            tracing::info!(
                "pooling: {pooling} (the folder says {})",
                names(&self.pooling)
            );
            self.pooling = vec![pooling];
        }
        self
    }

    /// L2-normalises each embedding last (sentence-transformers' `Normalize`, ε 1e-12), or
    /// removes the folder's `Normalize` modules (logged when it changes the folder's choice).
    pub fn with_normalize(mut self, normalize: bool) -> Self {
        let has = self.stages.iter().any(|s| matches!(s, Loaded::Normalize));
        if normalize && !matches!(self.stages.last(), Some(Loaded::Normalize)) {
            tracing::info!("normalize: on (the folder has no Normalize module last)");
            self.stages.push(Loaded::Normalize);
        } else if !normalize && has {
            tracing::info!("normalize: off (the folder's Normalize module is left out)");
            self.stages.retain(|s| !matches!(s, Loaded::Normalize));
        }
        self
    }

    /// Cuts texts to `tokens` tokens, `[CLS]` and `[SEP]` included, instead of the folder's
    /// `max_seq_length` (at most the model's positions; logged when it differs).
    pub fn with_max_seq_length(mut self, tokens: usize) -> Self {
        let tokens = tokens.clamp(2, self.max_positions);
        if tokens != self.max_len {
            tracing::info!(
                "max_seq_length: {tokens} (the folder says {})",
                self.max_len
            );
            self.max_len = tokens;
        }
        self
    }

    /// Texts per forward pass (at least 1).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The length of an embedding: the last Dense module's outputs, else the hidden size
    /// times the number of pooling modes.
    pub fn dim(&self) -> usize {
        self.stages
            .iter()
            .rev()
            .find_map(|s| match s {
                Loaded::Dense(d) => Some(d.out_features()),
                Loaded::Normalize => None,
            })
            .unwrap_or(self.hidden_size * self.pooling.len())
    }

    /// Tokens per text at most, `[CLS]` and `[SEP]` included.
    pub fn max_seq_length(&self) -> usize {
        self.max_len
    }

    /// The pooling modes, concatenated in this order.
    pub fn pooling(&self) -> &[Pooling] {
        &self.pooling
    }

    /// A text's token ids, `[CLS]` and `[SEP]` included, cut to [`Embedder::max_seq_length`]
    /// (its first tokens, then `[SEP]`, as transformers truncates).
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
        if ids.len() > self.max_len {
            let sep = *ids.last().expect("a long text has tokens");
            ids.truncate(self.max_len - 1);
            ids.push(sep);
        }
        Ok(ids)
    }

    /// The embeddings of `texts`, `[n, dim]`, in their order. As sentence-transformers, the
    /// texts are sorted by length (here: tokens, longest first) and cut into batches, each
    /// padded to its own longest text; the result does not depend on the batches.
    ///
    /// # Errors
    /// As [`Embedder::token_ids`].
    pub fn encode(&self, texts: &[&str]) -> Result<Tensor<B, 2>, ModelError> {
        let ids = texts
            .iter()
            .map(|t| self.token_ids(t))
            .collect::<Result<Vec<_>, _>>()?;
        if ids.is_empty() {
            return Ok(Tensor::zeros([0, self.dim()], &self.device));
        }
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
        let parts: Vec<Tensor<B, 2>> = order
            .chunks(self.batch_size)
            .map(|chunk| {
                let batch: Vec<&[u32]> = chunk.iter().map(|&i| ids[i].as_slice()).collect();
                self.encode_ids(&batch)
            })
            .collect();
        // Row r of the sorted result is text order[r]: back to the input order.
        let mut back = vec![0i64; order.len()];
        for (row, &text) in order.iter().enumerate() {
            back[text] = row as i64;
        }
        let back = Tensor::<B, 1, Int>::from_data(TensorData::new(back, [ids.len()]), &self.device);
        Ok(Tensor::cat(parts, 0).select(0, back))
    }

    /// One padded batch of token ids → `[n, dim]`.
    fn encode_ids(&self, ids: &[&[u32]]) -> Tensor<B, 2> {
        let (n, seq) = (ids.len(), ids.iter().map(|i| i.len()).max().unwrap_or(1));
        let mut input_ids = vec![i64::from(self.pad_id); n * seq];
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
        let lengths: Vec<usize> = ids.iter().map(|i| i.len()).collect();
        let mut x = pooling::pool(&self.pooling, output.sequence_output, input_mask, &lengths);
        for stage in &self.stages {
            x = match stage {
                Loaded::Dense(dense) => dense.forward(x),
                Loaded::Normalize => normalize(x),
            };
        }
        x
    }
}

fn names(modes: &[Pooling]) -> String {
    modes
        .iter()
        .map(|m| m.name())
        .collect::<Vec<_>>()
        .join(" + ")
}
