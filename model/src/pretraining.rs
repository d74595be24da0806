//! The pre-training heads (masked LM and next sentence) and their loss. Mirrors Hugging Face
//! `BertForPreTraining`, with the MLM head evaluated only at the masked positions (MLPerf's
//! `dense_seq_output`: the vocabulary projection is the largest matmul of a step, and only
//! ~15% of positions carry a label).

use burn::module::{Module, Param};
use burn::nn::{LayerNorm, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use ember_backend_ext::{DropoutSpec, FusedOp, FusedOps, Gelu, Kernels, ReferenceOps};

use crate::BertConfig;
use crate::bert::{BertModel, dense, hidden_act, layer_norm};
use crate::hook::{ForwardHook, NoHook};
use crate::precision::{Precision, cast_to, dense_as, dense_parts, layer_norm_f32};
use crate::weight_casts::{LayerParams, layer_scope, param_pair};
use crate::weight_casts::{bias_pair, gamma_beta_pairs};

/// Dense + GELU + LayerNorm before the vocabulary projection.
/// Mirrors Hugging Face `BertPredictionHeadTransform`.
#[derive(Module, Debug)]
pub struct BertPredictionHeadTransform<B: Backend> {
    pub dense: Linear<B>,
    /// Hugging Face key `LayerNorm`.
    pub layer_norm: LayerNorm<B>,
    /// The GELU, `hidden_act`'s form (Hugging Face's `transform_act_fn`; Note [Two GELUs] in
    /// `ember-backend-ext`'s `gelu.rs`).
    #[module(skip)]
    pub hidden_act: Gelu,
}

/// The masked-LM head. Its decoder weight is the word-embedding table (tied), so only the
/// transform and the output bias are parameters of their own.
/// Mirrors Hugging Face `BertLMPredictionHead`.
#[derive(Module, Debug)]
pub struct BertLMPredictionHead<B: Backend> {
    pub transform: BertPredictionHeadTransform<B>,
    /// Output bias, `[V]`; Hugging Face key `cls.predictions.bias` (also `decoder.bias`, tied).
    pub bias: Param<Tensor<B, 1>>,
}

/// Masked-LM and next-sentence heads. Mirrors Hugging Face `BertPreTrainingHeads`.
#[derive(Module, Debug)]
pub struct BertPreTrainingHeads<B: Backend> {
    pub predictions: BertLMPredictionHead<B>,
    /// Next-sentence classifier on the pooled output, H → 2.
    pub seq_relationship: Linear<B>,
}

/// BERT with its two pre-training heads. Mirrors Hugging Face `BertForPreTraining`.
#[derive(Module, Debug)]
pub struct BertForPreTraining<B: Backend> {
    pub bert: BertModel<B>,
    pub cls: BertPreTrainingHeads<B>,
}

/// What [`BertForPreTraining::forward`] returns.
#[derive(Debug, Clone)]
pub struct PreTrainingOutput<B: Backend> {
    /// Vocabulary logits at the packed masked positions, `[N, V]`, in the dtype the heads
    /// compute in (f32, or the half type under mixed precision, as `torch.autocast` returns
    /// them; Note [Autocast]).
    pub mlm_logits: Tensor<B, 2>,
    /// Next-sentence logits, `[B, 2]`, in the heads' dtype; class 1 is "B is a random
    /// sentence", as the reference `create_pretraining_data.py` labels it.
    pub nsp_logits: Tensor<B, 2>,
}

/// The pre-training loss and its two terms, each a scalar tensor `[1]`.
#[derive(Debug, Clone)]
pub struct PreTrainingLoss<B: Backend> {
    /// `mlm + nsp`, Hugging Face's `total_loss`.
    pub total: Tensor<B, 1>,
    /// Cross-entropy of the masked tokens, averaged over the real (weight 1) predictions.
    pub mlm: Tensor<B, 1>,
    /// Cross-entropy of the next-sentence labels, averaged over the batch.
    pub nsp: Tensor<B, 1>,
}

impl BertConfig {
    /// Builds a randomly initialised [`BertForPreTraining`] (see
    /// [`BertConfig::init_bert_model`]); the MLM output bias starts at 0.
    pub fn init_for_pretraining<B: Backend>(&self, device: &B::Device) -> BertForPreTraining<B> {
        let (h, std) = (self.hidden_size, self.initializer_range);
        BertForPreTraining {
            bert: self.init_bert_model(device),
            cls: BertPreTrainingHeads {
                predictions: BertLMPredictionHead {
                    transform: BertPredictionHeadTransform {
                        dense: dense(h, h, std, device),
                        layer_norm: layer_norm(self, device),
                        hidden_act: self.gelu(),
                    },
                    bias: Param::from_tensor(Tensor::zeros([self.vocab_size], device)),
                },
                seq_relationship: dense(h, 2, std, device),
            },
        }
    }
}

impl<B: Backend> BertForPreTraining<B> {
    /// Chooses the implementation of the encoder layers (see [`BertEncoder::set_kernels`]).
    ///
    /// [`BertEncoder::set_kernels`]: crate::BertEncoder::set_kernels
    pub fn set_kernels(&mut self, kernels: Kernels) {
        self.bert.encoder.set_kernels(kernels);
    }

    /// Chooses the dtype the model computes in (see [`crate::BertModel::set_precision`]).
    pub fn set_precision(&mut self, precision: Precision) {
        self.bert.set_precision(precision);
    }

    /// Builder form of [`BertForPreTraining::set_kernels`].
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.set_kernels(kernels);
        self
    }

    /// Takes ops out of the fused path, the heads' and the losses' included (see
    /// [`BertEncoder::set_reference_ops`]).
    ///
    /// [`BertEncoder::set_reference_ops`]: crate::BertEncoder::set_reference_ops
    pub fn set_reference_ops(&mut self, ops: ReferenceOps) {
        self.bert.encoder.set_reference_ops(ops);
    }

    /// Builder form of [`BertForPreTraining::set_reference_ops`].
    pub fn with_reference_ops(mut self, ops: ReferenceOps) -> Self {
        self.set_reference_ops(ops);
        self
    }

    /// Runs the encoder layers on the real tokens alone (see [`BertEncoder::set_unpad`]):
    /// the same outputs and, up to rounding, the same gradients, without the padded rows'
    /// work.
    ///
    /// [`BertEncoder::set_unpad`]: crate::BertEncoder::set_unpad
    pub fn set_unpad(&mut self, unpad: bool) {
        self.bert.set_unpad(unpad);
    }

    /// Builder form of [`BertForPreTraining::set_unpad`].
    pub fn with_unpad(mut self, unpad: bool) -> Self {
        self.set_unpad(unpad);
        self
    }
}

impl<B: FusedOps> BertForPreTraining<B> {
    /// Runs the encoder and both heads; the MLM head only at the masked positions.
    ///
    /// The masked positions come packed, as MLPerf's `dense_seq_output`: only the N real
    /// predictions of the batch, each as the row `b·S + position` of the flattened
    /// `[B·S, H]` hidden states. Padding predictions are never computed (with dynamic padding
    /// about a third of a `[B, P]` layout is padding, and the vocabulary projection plus its
    /// softmax is the largest cost of a small model's step).
    ///
    /// # Shapes
    /// - `input_ids`, `segment_ids`, `input_mask`: `[B, S]`
    /// - `masked_lm_flat_positions`: `[N]`, values in `0..B·S`
    /// - output: `mlm_logits` `[N, V]`, `nsp_logits` `[B, 2]`
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
        masked_lm_flat_positions: Tensor<B, 1, Int>,
    ) -> PreTrainingOutput<B> {
        self.forward_hooked(
            input_ids,
            segment_ids,
            input_mask,
            masked_lm_flat_positions,
            &NoHook,
        )
    }

    /// [`BertForPreTraining::forward`] with `hook` at every encoder layer's input and at the
    /// input of the pooler and heads (see [`ForwardHook`]).
    pub fn forward_hooked(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
        masked_lm_flat_positions: Tensor<B, 1, Int>,
        hook: &dyn ForwardHook<B>,
    ) -> PreTrainingOutput<B> {
        self.forward_hooked_with_rows(
            input_ids,
            segment_ids,
            input_mask,
            masked_lm_flat_positions,
            None,
            hook,
        )
    }

    /// [`BertForPreTraining::forward_hooked`] with the real tokens' rows given (`[T]`, see
    /// [`crate::BertModel::forward_hooked_with_rows`]): an unpadded encoder then reads no
    /// mask back. Ignored when the encoder keeps the padding.
    pub fn forward_hooked_with_rows(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
        masked_lm_flat_positions: Tensor<B, 1, Int>,
        real_rows: Option<Tensor<B, 1, Int>>,
        hook: &dyn ForwardHook<B>,
    ) -> PreTrainingOutput<B> {
        let out =
            self.bert
                .forward_hooked_with_rows(input_ids, segment_ids, input_mask, real_rows, hook);
        let predictions = &self.cls.predictions;
        let dtype = out.sequence_output.dtype();
        let encoder = &self.bert.encoder;
        let (fused_gelu, fused_norm) = (
            encoder.runs_fused(FusedOp::BiasGelu),
            encoder.runs_fused(FusedOp::LayerNorm),
        );
        // The heads' parameters ordered after their hooked input, cast together (Note
        // [Parameters ordered after their layer's input] in `weight_casts.rs`); the transform's
        // γ and β where the fused LayerNorm takes them.
        let norm = [&predictions.transform.layer_norm];
        let _scope = layer_scope(
            LayerParams::of(
                &[&predictions.transform.dense, &self.cls.seq_relationship],
                if fused_norm { &norm } else { &[] },
            )
            .and_vector(&predictions.bias),
            &out.sequence_output,
            dtype,
            self.bert.cast_weights_together,
        );
        let [batch, seq_len, hidden] = out.sequence_output.dims();
        let masked_states =
            ember_backend_ext::reshape(out.sequence_output, [batch * seq_len, hidden])
                .select(0, masked_lm_flat_positions); // [N, H]

        let transform = &predictions.transform;
        // GELU(x·W + b) and LayerNorm as the encoder's fused ops (zero bias and residual, no
        // dropout inside: LayerNorm(0 + (h + 0)) is LayerNorm(h)), each where it runs fused
        // (Note [Fused where it pays]); the bias, γ and β as masters beside their copies (Note
        // [Parameter gradients in f32] in `ember-backend-ext`'s `masters.rs`).
        let hidden = if fused_gelu {
            let (bias, bias_copy) = bias_pair(&transform.dense, dtype);
            ember_backend_ext::bias_gelu_of_master(
                dense_parts(masked_states, &transform.dense.weight, None),
                bias,
                bias_copy,
                transform.hidden_act,
            )
        } else {
            hidden_act(
                dense_as(&transform.dense, masked_states),
                transform.hidden_act,
            )
        };
        let transformed = if fused_norm {
            let (gamma, beta) = gamma_beta_pairs(&transform.layer_norm, dtype);
            let zero_bias = (gamma.0.zeros_like(), gamma.1.zeros_like());
            ember_backend_ext::bias_dropout_add_layer_norm_of_masters(
                hidden.clone(),
                zero_bias,
                hidden.zeros_like(),
                (gamma, beta),
                DropoutSpec::NONE,
                self.bert.embeddings.layer_norm_eps,
            )
        } else {
            layer_norm_f32(&transform.layer_norm, hidden)
        };
        // [H, V]: the word embeddings (tied), transposed; cast to the heads' dtype after the
        // hook.
        let decoder = hook.decoder_weight(
            self.bert.embeddings.word_embeddings.weight.val(),
            &transformed,
        );
        let bias = param_pair(&predictions.bias, dtype);
        // [N, V]; the decoder's gradient (the tied table's share) in f32 (Note [Weight
        // gradients in f32] in `ember-backend-ext`'s `linear.rs`).
        let copy = cast_to(decoder.clone(), dtype);
        let mlm_logits =
            ember_backend_ext::dense_of_masters(transformed, decoder, copy, Some(bias));

        // The logits in the heads' dtype, as `torch.autocast`'s linear layers return them: the
        // losses read them as they are and compute in f32 (Note [Autocast]).
        PreTrainingOutput {
            mlm_logits,
            nsp_logits: dense_as(&self.cls.seq_relationship, out.pooled_output),
        }
    }

    /// The pre-training loss of an output: masked-LM cross-entropy averaged over the N
    /// predictions, plus next-sentence cross-entropy averaged over the batch (Hugging Face
    /// `BertForPreTraining`'s `total_loss`; Google's `run_pretraining.py` likewise). In f32
    /// whatever the logits' dtype.
    ///
    /// # Shapes
    /// - `masked_lm_labels`: `[N]`, the original token ids at the packed masked positions
    /// - `next_sentence_labels`: `[B]`, 0 = B follows A, 1 = B is random
    pub fn loss(
        &self,
        output: &PreTrainingOutput<B>,
        masked_lm_labels: Tensor<B, 1, Int>,
        next_sentence_labels: Tensor<B, 1, Int>,
    ) -> PreTrainingLoss<B> {
        let loss = if self.bert.encoder.runs_fused(FusedOp::CrossEntropy) {
            cross_entropy
        } else {
            crate::composed::cross_entropy
        };
        let mlm = loss(output.mlm_logits.clone(), masked_lm_labels);
        let nsp = loss(output.nsp_logits.clone(), next_sentence_labels);

        PreTrainingLoss {
            total: mlm.clone() + nsp.clone(),
            mlm,
            nsp,
        }
    }
}

/// Mean cross-entropy of logits against class labels, `mean_i(logsumexp(x_i) − x_i[label_i])`
/// (`torch.nn.functional.cross_entropy`).
///
/// Through [`ember_backend_ext::cross_entropy`]: its own backward from the saved log-sum-exp;
/// one row kernel forward and one element-wise kernel backward on GPUs (CubeCL), one fused
/// pass per row on NdArray, where the `[N, 30522]` masked-LM logits made the composition's
/// passes a large share of the step. Half logits are read as they are; the loss is f32.
///
/// # Shapes
/// - `logits`: `[N, C]`
/// - `labels`: `[N]`, values in `0..C`
/// - output: `[1]`
pub fn cross_entropy<B: FusedOps>(logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    ember_backend_ext::cross_entropy(logits, labels)
}
