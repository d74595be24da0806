//! A vocabulary padded to a multiple (Note [Padded vocabulary]): the padded size, resizing the
//! two vocabulary-sized parameters of a [`BertForPreTraining`], and loading weights of the
//! unpadded vocabulary into a padded model.
//!
//! Note [Padded vocabulary]: NVIDIA's BERT (DeepLearningExamples' and its MLPerf submissions'
//! `run_pretraining.py`, "Padding for divisibility by 8") and Samsung's MLPerf v1.1 BERT, which
//! is built on it, round `vocab_size` up to a multiple of 8 before building the model: BERT's
//! 30,522 WordPiece tokens become 30,528 rows of the word embeddings (the tied MLM decoder) and
//! of the MLM output bias. Megatron-LM does the same with `--make-vocab-size-divisible-by`
//! (default 128, times the tensor-parallel size there), the name ember's setting takes (`model.make_vocab_size_divisible_by`,
//! default 1: no padding, Hugging Face's model). The reason is the largest GEMMs of a step:
//! the decoder's `[N, H]·[H, V]` and its two gradients have V as a leading dimension, and
//! tensor-core GEMMs (cuBLASLt, CubeCL's) want leading dimensions that are multiples of 16
//! bytes (8 half values) and vectorise by a line width that divides them: the largest power of
//! two dividing 30,522 is 2. With 128, the f32 output bias (30,592 × 4 bytes) is also a
//! multiple of CUDA's 512-byte allocation alignment, so it no longer shifts the parts after it
//! in a gradient bucket off that alignment (`bucket_ops.rs`; the NSP bias's 2 values still
//! do); with 8 it does not (30,528 × 4 bytes is 238.5 × 512).
//!
//! What the padding rows are, as in those sources:
//! - No token id reaches them (the tokenizer's ids are below its vocabulary's size), so the
//!   embedding lookup never reads them and only the decoder trains them.
//! - They are classes of the masked-LM softmax like any other: their logits enter the loss's
//!   normaliser and the accuracy's argmax (NVIDIA's loss is a cross-entropy over all
//!   `config.vocab_size` logits). A padded model therefore computes another loss than the
//!   unpadded one from the same weights; it learns to push those logits down.
//! - A fresh model draws them as every row, N(0, `initializer_range`²) (NVIDIA builds the
//!   padded model and initialises it whole).
//! - Weights of the unpadded vocabulary loaded into a padded model get zero rows, as NVIDIA's
//!   `modeling.load_tf_weights_in_bert` fills a padded tensor from a smaller TensorFlow one
//!   ("If copying smaller into larger, assume padded": zeroed, then the leading slice copied;
//!   its `convert_tf_checkpoint.py` makes the MLPerf phase-1 checkpoint so) and DeepSpeed's
//!   `convert_bert_ckpt_to_deepspeed.py` pads a Hugging Face or TensorFlow checkpoint for its
//!   8-aligned BERT ([`BertForPreTraining::load_pretrained_padded`]).
//!   Hugging Face's `resize_token_embeddings` draws new rows instead (or their mean); ember
//!   follows the BERT pre-training code.
//! - The padding changes how many values the word embeddings draw at initialisation. On
//!   NdArray, whose generator is one stream, every parameter drawn after them then differs
//!   from the unpadded model's with the same seed; CubeCL's backends seed each random tensor
//!   from the host generator, so there only the word embeddings differ.
//! - FLOP counts (`BertConfig::train_step_flops`, MFU) count the padded V, as Megatron-LM's:
//!   compare a padded and an unpadded run by time, not TFLOP/s.
//! - Saved checkpoints keep the padded rows and say `vocab_size` = the padded size in their
//!   `config.json`: `transformers` loads them as they are (its tokenizer's ids stay below).

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::{BertForPreTraining, LoadReport, ModelError, WeightsFile};

/// `vocab_size` rounded up to a multiple of `multiple` (Note [Padded vocabulary]); a multiple
/// of 0 or 1 leaves it as it is.
///
/// ```
/// assert_eq!(ember_model::padded_vocab_size(30522, 8), 30528);
/// assert_eq!(ember_model::padded_vocab_size(30522, 128), 30592);
/// assert_eq!(ember_model::padded_vocab_size(30522, 1), 30522);
/// ```
pub fn padded_vocab_size(vocab_size: usize, multiple: usize) -> usize {
    vocab_size.next_multiple_of(multiple.max(1))
}

/// `tensor`'s first `rows` rows along dimension 0, with zero rows appended where `rows` is more
/// than it has; a parameter's tensor keeps its autodiff flag.
fn with_rows<B: Backend, const D: usize>(tensor: Tensor<B, D>, rows: usize) -> Tensor<B, D> {
    let tracked = tensor.is_require_grad();
    let mut dims = tensor.dims();
    let have = dims[0];
    let tensor = tensor.detach();
    let resized = if rows <= have {
        tensor.narrow(0, 0, rows)
    } else {
        dims[0] = rows - have;
        let zeros = Tensor::<B, D>::zeros(dims, (&tensor.device(), tensor.dtype()));
        Tensor::cat(vec![tensor, zeros], 0)
    };
    // A leaf again (an op's output, even of detached inputs, is not one under autodiff).
    let resized = resized.detach();
    if tracked {
        resized.require_grad()
    } else {
        resized
    }
}

impl<B: Backend> BertForPreTraining<B> {
    /// Rows of the vocabulary-sized parameters: the word embeddings' (the tied decoder's) and
    /// the MLM output bias's, `V`.
    pub fn vocab_size(&self) -> usize {
        self.cls.predictions.bias.dims()[0]
    }

    /// The model with `rows` vocabulary rows (Note [Padded vocabulary]): the word embeddings
    /// `[V, H]` (the tied decoder) and the MLM output bias `[V]` keep their first rows, and
    /// rows beyond `V` are zeros (DeepSpeed's padding of a checkpoint). The parameters keep
    /// their ids, so a trainer's bucket plan and optimizer still name them.
    pub fn with_vocab_rows(mut self, rows: usize) -> Self {
        let embeddings = &mut self.bert.embeddings.word_embeddings;
        embeddings.weight = embeddings.weight.clone().map(|t| with_rows(t, rows));
        let bias = &mut self.cls.predictions.bias;
        *bias = bias.clone().map(|t| with_rows(t, rows));
        self
    }

    /// [`BertForPreTraining::load_pretrained`] into a model whose vocabulary may be padded
    /// beyond the `vocab_rows` tokens of its tokenizer (`model.make_vocab_size_divisible_by`,
    /// Note [Padded vocabulary]): a file whose word embeddings have `vocab_rows` rows (a
    /// Hugging Face BERT of the same vocabulary, or one converted from TensorFlow) loads into
    /// the first rows, the padding rows zero, as NVIDIA's and DeepSpeed's converters pad them;
    /// any other file loads as [`BertForPreTraining::load_pretrained`] loads it (one of the
    /// model's own size, or a file with neither the word embeddings nor the output bias, whose
    /// padding rows stay as initialised). The file's vocabulary size is its word embeddings'
    /// rows, else its output bias's: a file with the bias alone, of the tokenizer's size, also
    /// zeroes the word embeddings' padding rows.
    ///
    /// # Errors
    /// As [`BertForPreTraining::load_pretrained`]. A file whose vocabulary has another number
    /// of rows is refused naming both shapes and what the model takes: the tokenizer's
    /// `vocab_rows` or the padded size, or (an unpadded model given more rows than its
    /// tokenizer has: perhaps a padded run's weights) the setting that would pad it.
    pub fn load_pretrained_padded(
        self,
        file: &WeightsFile,
        vocab_rows: usize,
    ) -> Result<(Self, LoadReport), ModelError> {
        let padded = self.vocab_size();
        let rows = file_vocab_rows(file)?;
        let hint = match rows {
            Some(rows) if rows == vocab_rows && rows < padded => {
                let (model, report) = self.with_vocab_rows(vocab_rows).load_pretrained(file)?;
                return Ok((model.with_vocab_rows(padded), report));
            }
            Some(rows) if rows != padded && padded > vocab_rows => format!(
                "the model's vocabulary is {vocab_rows} tokens padded to {padded} rows by \
                 model.make_vocab_size_divisible_by; it takes either size, not {rows}"
            ),
            Some(rows) if rows > padded => format!(
                "the file's vocabulary has {rows} rows, more than the tokenizer's {vocab_rows}: \
                 if these are the weights of a run whose vocabulary was padded, set \
                 model.make_vocab_size_divisible_by so that {vocab_rows} rounds up to {rows}"
            ),
            _ => return self.load_pretrained(file),
        };
        self.load_pretrained(file).map_err(|e| match e {
            ModelError::Checkpoint { path, reason } => ModelError::Checkpoint {
                path,
                reason: format!("{reason} ({hint})"),
            },
            other => other,
        })
    }
}

/// Rows of the word embeddings in `file` (else of its MLM output bias); `None` when it has
/// neither (an encoder-only file without embeddings).
fn file_vocab_rows(file: &WeightsFile) -> Result<Option<usize>, ModelError> {
    const KEYS: [&str; 2] = [
        "bert.embeddings.word_embeddings.weight",
        "cls.predictions.bias",
    ];
    let mut store = crate::pretrained::Store::open(file);
    for key in KEYS {
        if let Some(rows) = store.rows(key)? {
            return Ok(Some(rows));
        }
    }
    Ok(None)
}
