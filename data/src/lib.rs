//! ember's data pipeline, as stages with one verb each:
//!
//! ```text
//! text ─read_documents→ sentences per document ─WordPieceTokenizer::encode→ token ids
//!      ─create_training_instances→ TrainingInstance (masked, with next-sentence label)
//!      ─InstanceLoader::next_batch→ collate (dynamic padding) → Batch<B> tensors
//! ```
//!
//! Field names are those of Google's `create_pretraining_data.py` and MLPerf's HDF5 shards:
//! `input_ids`, `input_mask`, `segment_ids`, `masked_lm_positions`, `masked_lm_ids`,
//! `masked_lm_weights`, `next_sentence_labels`.
//!
//! # Shapes
//! B batch, S padded sequence length of the batch, P padded number of predictions of the batch.

pub mod balance;
pub mod batch;
pub mod corpus;
pub mod dataset;
pub mod embedded;
mod error;
pub mod instances;
pub mod loader;
pub mod prepare;
pub mod sampler;
pub mod shard;
pub mod shard_loader;
pub mod stratify;
pub mod tokenizer;

pub use batch::{Batch, HostBatch, collate, collate_padded, real_rows};
pub use corpus::{
    Corpus, Document, DocumentStream, corpus_files, held_out_count, read_corpus, read_documents,
    split_held_out, tokenize_documents,
};
pub use dataset::{ShardedDataset, read_eval_set};
pub use error::DataError;
pub use instances::{PretrainingConfig, TrainingInstance, create_training_instances};
pub use loader::InstanceLoader;
pub use sampler::{
    Padding, RankSampler, SampleRef, SamplerConfig, SamplerKind, SamplerState, decode_draw,
    decode_refs, encode_draw, encode_refs,
};
pub use shard_loader::{
    BatchMaker, BatchPrefetcher, InMemorySamples, SampleSource, ShardLoader, ShardReader,
    micro_batches,
};
pub use tokenizer::{SpecialTokens, WordPieceTokenizer};

pub use embedded::{default_corpus_path, default_vocab_path};
