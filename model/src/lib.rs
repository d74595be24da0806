//! BERT for pre-training, written once against Burn's backend API.
//!
//! The modules mirror Hugging Face's `transformers/models/bert/modeling_bert.py` class for class
//! ([`BertEmbeddings`], [`BertSelfAttention`], [`BertLayer`], [`BertEncoder`], [`BertModel`],
//! [`BertForPreTraining`]) and their parameter paths map onto Hugging Face's state-dict keys (see
//! [`checkpoint`]), so Hub checkpoints load and ember checkpoints open in `transformers`.
//!
//! The model is post-LN BERT (Devlin et al. 2019): embeddings + LayerNorm, N encoder layers
//! (self-attention with a padding mask, then a GELU feed-forward: erf, or the tanh form of
//! `hidden_act = "gelu_new"`; each followed by dropout, a residual add and LayerNorm), a tanh
//! pooler, a masked-LM head tied to the word embeddings and evaluated only at the masked
//! positions (MLPerf's `dense_seq_output`), and a next-sentence head.
//!
//! # Shapes
//! Letters used in every `# Shapes` section of this crate:
//! B batch, S sequence (padded length of the batch), H `hidden_size`, nh attention heads,
//! hd head dim (H / nh), I `intermediate_size`, P masked positions per sample (padded), V vocab.
//!
//! # Use as a plain Burn module
//! ```no_run
//! use burn::backend::NdArray;
//! use burn::tensor::{Int, Tensor};
//! use ember_model::{BertConfig, BertModel, Preset};
//!
//! let device = Default::default();
//! let model: BertModel<NdArray> = BertConfig::preset(Preset::Tiny).init_bert_model(&device);
//! let input_ids = Tensor::<NdArray, 2, Int>::from_ints([[101, 7592, 2088, 102]], &device);
//! let segment_ids = input_ids.zeros_like();
//! let input_mask = input_ids.ones_like();
//! let out = model.forward(input_ids, segment_ids, input_mask.clone());
//! let sentence = ember_model::mean_pool(out.sequence_output, input_mask); // [1, 128]
//! ```

mod attention;
mod bert;
pub mod checkpoint;
pub mod composed;
mod config;
mod embed;
mod error;
mod flops;
mod hook;
mod layer;
mod precision;
mod pretrained;
mod pretraining;
mod unpad;
mod vocab_padding;
mod weight_casts;

pub use attention::{BertSelfAttention, BertSelfOutput};
pub use bert::{
    BertEmbeddings, BertEncoder, BertModel, BertModelOutput, BertPooler, gelu, gelu_tanh,
    hidden_act, mean_pool,
};
pub use config::{BertConfig, Preset};
pub use embed::{Activation, Embedder, Hit, Pooling, cos_sim, normalize, semantic_search};
pub use ember_backend_ext::{FusedOp, Gelu, Kernels, QkvProjections, ReferenceOps};
pub use error::ModelError;
pub use flops::StepGemm;
pub use hook::{ForwardHook, NoHook};
pub use layer::{BertAttention, BertIntermediate, BertLayer, BertOutput};
pub use precision::{Precision, cast_to, dense_as, layer_norm_f32, softmax_f32};
pub use pretrained::{LoadReport, WeightsFile};
pub use pretraining::{
    BertForPreTraining, BertLMPredictionHead, BertPreTrainingHeads, BertPredictionHeadTransform,
    PreTrainingLoss, PreTrainingOutput, cross_entropy,
};
pub use unpad::Unpadding;
pub use vocab_padding::padded_vocab_size;
