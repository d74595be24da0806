//! The BERT encoder: embeddings, encoder layers and pooler, module for module Hugging Face's
//! `modeling_bert.py`.

use burn::module::{Initializer, Module, Param};
use burn::nn::{
    Dropout, DropoutConfig, Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear,
    LinearConfig,
};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use ember_backend_ext::{
    DropoutSpec, FusedOp, FusedOps, Gelu, Kernels, QkvProjections, ReferenceOps,
};

use crate::hook::{ForwardHook, NoHook};
use crate::precision::{Precision, cast_to, dense_as};
use crate::weight_casts::{LayerParams, gamma_beta_pairs, layer_scope};

use crate::BertConfig;
use crate::layer::BertLayer;
use crate::unpad::Unpadding;

/// Additive attention bias of a padded key: exp(-10000 - max) underflows to exactly 0 in f32,
/// so padded keys get no weight, and a fully padded row stays finite (uniform) instead of NaN.
/// The value of Google's reference `modeling.py`.
const MASKED_SCORE: f32 = -10000.0;

/// GELU with the exact erf form, `x · ½ · (1 + erf(x / √2))` (Hendrycks & Gimpel 2016), as
/// Hugging Face's `"gelu"` and the first release of Google's BERT (which later switched to the
/// tanh form, [`gelu_tanh`]).
///
/// Composed of Burn ops on purpose: Burn 0.21's own `gelu` has the erf forward but the tanh
/// approximation's derivative (2.7e-3 off in dx), and BERT's gradients must match PyTorch's.
///
/// # Shapes
/// any shape; the output has the input's shape.
pub fn gelu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    ember_backend_ext::reference::gelu(x, Gelu::Erf)
}

/// GELU with the tanh approximation, `x · ½ · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, as
/// Google's BERT `modeling.py`, NVIDIA's MLPerf BERT and Hugging Face's `"gelu_new"`, computed
/// as `x · σ(2u)` (Note [Two GELUs] in `ember-backend-ext`'s `gelu.rs`).
///
/// # Shapes
/// any shape; the output has the input's shape.
pub fn gelu_tanh<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    ember_backend_ext::reference::gelu(x, Gelu::Tanh)
}

/// The GELU `hidden_act` chose: [`gelu`] (erf, `"gelu"`) or [`gelu_tanh`] (`"gelu_new"`).
///
/// # Shapes
/// any shape; the output has the input's shape.
pub fn hidden_act<B: Backend, const D: usize>(x: Tensor<B, D>, form: Gelu) -> Tensor<B, D> {
    ember_backend_ext::reference::gelu(x, form)
}

/// Mean of the token vectors over the real (unpadded) positions: sentence-transformers' pooling.
///
/// # Shapes
/// - `sequence_output`: `[B, S, H]`
/// - `input_mask`: `[B, S]`, 1 for real tokens, 0 for padding
/// - output: `[B, H]`
pub fn mean_pool<B: Backend>(
    sequence_output: Tensor<B, 3>,
    input_mask: Tensor<B, 2, Int>,
) -> Tensor<B, 2> {
    let mask = input_mask.float().unsqueeze_dim::<3>(2); // [B, S, 1]
    let summed = (sequence_output * mask.clone())
        .sum_dim(1)
        .squeeze_dim::<2>(1); // [B, H]
    let counts = mask.sum_dim(1).squeeze_dim::<2>(1).clamp_min(1.0); // [B, 1]
    summed / counts
}

/// A dense layer initialised as BERT: weight N(0, std²), bias 0.
pub(crate) fn dense<B: Backend>(
    d_input: usize,
    d_output: usize,
    std: f64,
    device: &B::Device,
) -> Linear<B> {
    let mut linear = LinearConfig::new(d_input, d_output)
        .with_initializer(Initializer::Normal { mean: 0.0, std })
        .init(device);
    linear.bias = Some(Param::from_tensor(Tensor::zeros([d_output], device)));
    linear
}

/// LayerNorm initialised as BERT: weight 1, bias 0.
pub(crate) fn layer_norm<B: Backend>(config: &BertConfig, device: &B::Device) -> LayerNorm<B> {
    LayerNormConfig::new(config.hidden_size)
        .with_epsilon(config.layer_norm_eps)
        .init(device)
}

fn embedding<B: Backend>(n: usize, config: &BertConfig, device: &B::Device) -> Embedding<B> {
    EmbeddingConfig::new(n, config.hidden_size)
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: config.initializer_range,
        })
        .init(device)
}

/// Word, position and token-type embeddings, summed, then LayerNorm and dropout.
/// Mirrors Hugging Face `BertEmbeddings`.
#[derive(Module, Debug)]
pub struct BertEmbeddings<B: Backend> {
    /// `[V, H]`; also the MLM decoder's weight (tied).
    pub word_embeddings: Embedding<B>,
    /// `[max_position_embeddings, H]`.
    pub position_embeddings: Embedding<B>,
    /// `[type_vocab_size, H]`.
    pub token_type_embeddings: Embedding<B>,
    /// Hugging Face key `LayerNorm`.
    pub layer_norm: LayerNorm<B>,
    pub dropout: Dropout,
    /// ε of the LayerNorm (Burn's `LayerNorm` keeps its own private), for the fused op.
    #[module(skip)]
    pub layer_norm_eps: f64,
}

impl<B: Backend> BertEmbeddings<B> {
    /// Builds the embeddings: N(0, `initializer_range`²) tables, the `[PAD]` row zeroed as
    /// Hugging Face's `_init_weights` does.
    pub fn new(config: &BertConfig, device: &B::Device) -> Self {
        let mut word_embeddings = embedding(config.vocab_size, config, device);
        let pad = config.pad_token_id;
        // `Param::map` would keep the result's require-grad flag, which slice_assign clears on
        // an autodiff backend: build a fresh parameter (and leaf tensor) instead.
        let weight = word_embeddings.weight.val();
        let [_, hidden] = weight.dims();
        let weight = weight.slice_assign(
            [pad..pad + 1, 0..hidden],
            Tensor::zeros([1, hidden], device),
        );
        word_embeddings.weight = Param::from_tensor(weight.detach());
        Self {
            word_embeddings,
            position_embeddings: embedding(config.max_position_embeddings, config, device),
            token_type_embeddings: embedding(config.type_vocab_size, config, device),
            layer_norm: layer_norm(config, device),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
            layer_norm_eps: config.layer_norm_eps,
        }
    }
}

impl<B: FusedOps> BertEmbeddings<B> {
    /// The sum of the three lookups, LayerNorm, then dropout (while training: the keyed masks
    /// of [`ember_backend_ext::dropout`]).
    ///
    /// # Shapes
    /// - `input_ids`, `segment_ids`: `[B, S]`
    /// - output: `[B, S, H]`
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
    ) -> Tensor<B, 3> {
        self.forward_with(input_ids, segment_ids, Kernels::Reference)
    }

    /// [`BertEmbeddings::forward`], with the LayerNorm as the fused
    /// [`ember_backend_ext::bias_dropout_add_layer_norm`] (a zero bias, no dropout inside:
    /// `LayerNorm(token_type + (word + position))`, the same sum in the same order) when
    /// `kernels` says so for this backend, else Burn's `LayerNorm` (composed ops: on NdArray
    /// each a pass on one thread).
    ///
    /// # Shapes
    /// - `input_ids`, `segment_ids`: `[B, S]`
    /// - output: `[B, S, H]`
    pub fn forward_with(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        kernels: Kernels,
    ) -> Tensor<B, 3> {
        let [_, seq_len] = input_ids.dims();
        let device = input_ids.device();
        let position_ids = Tensor::<B, 1, Int>::arange(0..seq_len as i64, &device).unsqueeze::<2>(); // [1, S]
        // Burn's `Embedding::forward` through `FusedOps::embedding_lookup` (NdArray builds the
        // tables' gradients without Burn's element-by-element zeros).
        let lookup =
            |table: &Embedding<B>, ids| ember_backend_ext::embedding(table.weight.val(), ids);
        let words = lookup(&self.word_embeddings, input_ids)
            + lookup(&self.position_embeddings, position_ids); // [1, S, H], broadcast over B
        let token_types = lookup(&self.token_type_embeddings, segment_ids);
        let embedded = if kernels.fused::<B>() {
            let (gamma, beta) = gamma_beta_pairs(&self.layer_norm, words.dtype());
            let zero_bias = (gamma.0.zeros_like(), gamma.1.zeros_like());
            ember_backend_ext::bias_dropout_add_layer_norm_of_masters(
                words,
                zero_bias,
                token_types,
                (gamma, beta),
                DropoutSpec::NONE,
                self.layer_norm_eps,
            )
        } else {
            self.layer_norm.forward(words + token_types)
        };
        if training(&embedded) {
            ember_backend_ext::dropout(embedded, DropoutSpec::draw(self.dropout.prob))
        } else {
            embedded
        }
    }
}

/// Whether dropout applies: autodiff is on, as for Burn's `Dropout`.
pub(crate) fn training<B: Backend, const D: usize>(x: &Tensor<B, D>) -> bool {
    B::ad_enabled(&x.device())
}

/// Dropout of the module-by-module path: Burn's `Dropout` with the keyed masks of
/// `ember-backend-ext` ([`DropoutSpec::draw`]: per sample and position, keyed by the thread's
/// `DropoutScope`), composed from Burn ops.
pub(crate) fn reference_dropout<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dropout: &Dropout,
) -> Tensor<B, D> {
    if training(&x) {
        ember_backend_ext::reference::dropout(x, DropoutSpec::draw(dropout.prob))
    } else {
        x
    }
}

/// The stack of encoder layers. Mirrors Hugging Face `BertEncoder`.
#[derive(Module, Debug)]
pub struct BertEncoder<B: Backend> {
    /// Hugging Face keys `layer.0`, `layer.1`, ...
    pub layer: Vec<BertLayer<B>>,
    /// Whether the layers run on the real tokens alone (Note [Padding removed] in
    /// `unpad.rs`; `model.unpad`, NVIDIA's `--unpad`). Default: false.
    #[module(skip)]
    pub unpad: bool,
}

impl<B: Backend> BertEncoder<B> {
    /// Chooses the implementation every layer runs: [`Kernels::Fused`] (the fused ops of
    /// `ember-backend-ext`, kernels on CubeCL backends), [`Kernels::Reference`] (Burn ops
    /// composed module by module) or [`Kernels::Auto`] (fused where the backend has kernels or,
    /// as NdArray, host loops: `FusedOps::FUSED_BY_DEFAULT`; the default).
    pub fn set_kernels(&mut self, kernels: Kernels) {
        for layer in &mut self.layer {
            layer.kernels = kernels;
        }
    }

    /// How the fused path runs each layer's query, key and value projections:
    /// [`QkvProjections::Packed`] (one dense layer, the three weights side by side: Note
    /// [Packed QKV] in `ember-backend-ext`'s `qkv.rs`), [`QkvProjections::Separate`] (three,
    /// as Hugging Face) or [`QkvProjections::Auto`] (packed where the backend has kernels; the
    /// default). The same parameters and, up to the GEMMs' rounding, the same values either
    /// way; the reference path always runs three, and so does the fused path with `attention`
    /// among its reference ops ([`BertEncoder::set_reference_ops`]).
    pub fn set_qkv_projections(&mut self, projections: QkvProjections) {
        for layer in &mut self.layer {
            layer.qkv_projections = projections;
        }
    }

    /// Whether the layers run on the batch's real tokens alone, packed into `[1, T, H]` rows
    /// (Note [Padding removed] in `unpad.rs`): the same values at the real tokens and the
    /// same dropout masks, without the padded rows' work; `sequence_output` is then 0 at
    /// padded positions, and [`ForwardHook::layer_input`] sees the packed rows.
    pub fn set_unpad(&mut self, unpad: bool) {
        self.unpad = unpad;
    }

    /// The implementation the layers run (that of the first layer; all agree after
    /// [`BertEncoder::set_kernels`]).
    pub fn kernels(&self) -> Kernels {
        self.layer.first().map(|l| l.kernels).unwrap_or_default()
    }

    /// Takes `ops` out of the fused path: each runs as the reference path's composition
    /// instead, in the layers, the embeddings' LayerNorm, the pre-training heads and the
    /// losses (`model.reference_ops`; Note [Fused where it pays] in `ember-backend-ext`'s
    /// `reference_ops.rs`). Default: none.
    pub fn set_reference_ops(&mut self, ops: ReferenceOps) {
        for layer in &mut self.layer {
            layer.reference_ops = ops;
        }
    }

    /// The ops the fused path runs as their reference composition (those of the first layer;
    /// all agree after [`BertEncoder::set_reference_ops`]).
    pub fn reference_ops(&self) -> ReferenceOps {
        self.layer
            .first()
            .map(|l| l.reference_ops)
            .unwrap_or_default()
    }
}

impl<B: FusedOps> BertEncoder<B> {
    /// Whether `op` runs fused on this backend ([`ReferenceOps::runs_fused`] of the layers'
    /// kernels and reference ops).
    pub fn runs_fused(&self, op: FusedOp) -> bool {
        self.reference_ops().runs_fused::<B>(op, self.kernels())
    }

    /// The kernels choice of `op`: [`Kernels::Reference`] where it does not run fused, else the
    /// layers'.
    pub fn kernels_for(&self, op: FusedOp) -> Kernels {
        if self.runs_fused(op) {
            self.kernels()
        } else {
            Kernels::Reference
        }
    }
}

impl<B: FusedOps> BertEncoder<B> {
    /// # Shapes
    /// - `hidden_states`: `[B, S, H]`
    /// - `input_mask`: `[B, S]`, 1 for real tokens, 0 for padding
    /// - output: `[B, S, H]`
    pub fn forward(
        &self,
        hidden_states: Tensor<B, 3>,
        input_mask: Tensor<B, 2, Int>,
    ) -> Tensor<B, 3> {
        self.forward_hooked(hidden_states, input_mask, &NoHook)
    }

    /// [`BertEncoder::forward`] with `hook.layer_input(i, ..)` applied to each layer's input.
    pub fn forward_hooked(
        &self,
        hidden_states: Tensor<B, 3>,
        input_mask: Tensor<B, 2, Int>,
        hook: &dyn ForwardHook<B>,
    ) -> Tensor<B, 3> {
        self.forward_scoped(hidden_states, input_mask, None, hook, true)
    }

    /// [`BertEncoder::forward_hooked`], each layer's parameters held by a scope of their own
    /// (Note [Parameters ordered after their layer's input] in `weight_casts.rs`), cast
    /// together under a half precision where `together` (Note [Weights cast together]);
    /// unpadded, the real tokens' rows from `real_rows` where given, else read from
    /// `input_mask`.
    pub(crate) fn forward_scoped(
        &self,
        hidden_states: Tensor<B, 3>,
        input_mask: Tensor<B, 2, Int>,
        real_rows: Option<Tensor<B, 1, Int>>,
        hook: &dyn ForwardHook<B>,
        together: bool,
    ) -> Tensor<B, 3> {
        let dtype = hidden_states.dtype();
        let [batch, seq_len] = input_mask.dims();
        let unpadding = self.unpad.then(|| match real_rows {
            Some(rows) => Unpadding::from_rows(rows, batch, seq_len),
            None => Unpadding::of(&input_mask),
        });
        // In the layers' dtype (Note [Autocast]); −10000 is exact in f16 and bf16.
        let mask_bias = cast_to(attention_mask_bias(input_mask), dtype);
        let rows = match &unpadding {
            Some(u) => u.unpad(hidden_states),
            None => hidden_states,
        };
        let rows = self.layer.iter().enumerate().fold(rows, |x, (i, layer)| {
            let x = hook.layer_input(i, x);
            let _scope = layer_scope(layer.params(), &x, dtype, together);
            match &unpadding {
                Some(u) => layer.forward_unpadded(x, mask_bias.clone(), u),
                None => layer.forward(x, mask_bias.clone()),
            }
        });
        match &unpadding {
            Some(u) => u.pad(rows),
            None => rows,
        }
    }
}

/// The additive attention bias of a padding mask: 0 where `input_mask` is 1, [`MASKED_SCORE`]
/// where it is 0 (Hugging Face's "extended attention mask").
///
/// # Shapes
/// - `input_mask`: `[B, S]`
/// - output: `[B, S]`
fn attention_mask_bias<B: Backend>(input_mask: Tensor<B, 2, Int>) -> Tensor<B, 2> {
    let padding = input_mask.float().neg().add_scalar(1.0); // 1 where padded
    padding * MASKED_SCORE
}

/// Dense + tanh on the first token (`[CLS]`). Mirrors Hugging Face `BertPooler`.
#[derive(Module, Debug)]
pub struct BertPooler<B: Backend> {
    pub dense: Linear<B>,
}

impl<B: Backend> BertPooler<B> {}

impl<B: FusedOps> BertPooler<B> {
    /// # Shapes
    /// - `sequence_output`: `[B, S, H]`
    /// - output: `[B, H]`
    pub fn forward(&self, sequence_output: Tensor<B, 3>) -> Tensor<B, 2> {
        let [batch, _, hidden] = sequence_output.dims();
        let first = sequence_output
            .slice([0..batch, 0..1])
            .reshape([batch, hidden]);
        dense_as(&self.dense, first).tanh()
    }
}

/// The BERT encoder with embeddings and pooler, without pre-training heads: what embedding and
/// fine-tuning users call. Mirrors Hugging Face `BertModel`.
#[derive(Module, Debug)]
pub struct BertModel<B: Backend> {
    pub embeddings: BertEmbeddings<B>,
    pub encoder: BertEncoder<B>,
    pub pooler: BertPooler<B>,
    /// The dtype the encoder, pooler and heads compute in (Note [Autocast]); the parameters
    /// stay f32. Default: f32.
    #[module(skip)]
    pub precision: Precision,
    /// Whether a half-precision forward casts the dense layers' weights together first
    /// (Note [Weights cast together] in `weight_casts.rs`). Default: true.
    #[module(skip)]
    pub cast_weights_together: bool,
}

/// What [`BertModel::forward`] returns.
#[derive(Debug, Clone)]
pub struct BertModelOutput<B: Backend> {
    /// Last layer's hidden states, `[B, S, H]`.
    pub sequence_output: Tensor<B, 3>,
    /// Pooler output (tanh of a dense layer on `[CLS]`), `[B, H]`.
    pub pooled_output: Tensor<B, 2>,
}

impl BertConfig {
    /// Builds a randomly initialised [`BertModel`] (weights N(0, `initializer_range`²),
    /// biases 0, LayerNorm 1 and 0, as Hugging Face's `_init_weights`), drawing from the
    /// backend's RNG (seed it with `B::seed` for a reproducible model).
    ///
    /// Call [`BertConfig::validate`] first on configurations from users: a hidden size that is
    /// not a multiple of the head count panics here.
    pub fn init_bert_model<B: Backend>(&self, device: &B::Device) -> BertModel<B> {
        assert!(
            self.hidden_size % self.num_attention_heads == 0,
            "hidden_size must be a multiple of num_attention_heads (BertConfig::validate)"
        );
        BertModel {
            embeddings: BertEmbeddings::new(self, device),
            encoder: BertEncoder {
                layer: (0..self.num_hidden_layers)
                    .map(|_| BertLayer::new(self, device))
                    .collect(),
                unpad: false,
            },
            pooler: BertPooler {
                dense: dense(
                    self.hidden_size,
                    self.hidden_size,
                    self.initializer_range,
                    device,
                ),
            },
            precision: Precision::F32,
            cast_weights_together: true,
        }
    }
}

impl<B: Backend> BertModel<B> {
    /// Chooses the implementation of the encoder layers (see [`BertEncoder::set_kernels`]).
    pub fn set_kernels(&mut self, kernels: Kernels) {
        self.encoder.set_kernels(kernels);
    }

    /// Takes ops out of the fused path (see [`BertEncoder::set_reference_ops`]).
    pub fn set_reference_ops(&mut self, ops: ReferenceOps) {
        self.encoder.set_reference_ops(ops);
    }

    /// Runs the encoder layers on the real tokens alone (see [`BertEncoder::set_unpad`]).
    pub fn set_unpad(&mut self, unpad: bool) {
        self.encoder.set_unpad(unpad);
    }

    /// Chooses the dtype the model computes in (Note [Autocast] in `precision.rs`); check
    /// [`Precision::supported`] first: a backend without the type fails in its first op.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Whether a half-precision forward casts the dense layers' weights in one multi-tensor
    /// cast first (true, the default) or each where it is used (Note [Weights cast together]
    /// in `weight_casts.rs`); the same values either way.
    pub fn set_cast_weights_together(&mut self, together: bool) {
        self.cast_weights_together = together;
    }
}

impl<B: FusedOps> BertModel<B> {
    /// Encodes a batch of (possibly padded) token sequences.
    ///
    /// # Shapes
    /// - `input_ids`, `segment_ids`: `[B, S]`
    /// - `input_mask`: `[B, S]`, 1 for real tokens, 0 for padding
    /// - output: `sequence_output` `[B, S, H]`, `pooled_output` `[B, H]`
    ///
    /// # Panics
    /// If S exceeds `max_position_embeddings` or an id is out of its table (Burn's embedding
    /// lookup); the data pipeline checks both before a batch reaches the model.
    pub fn forward(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
    ) -> BertModelOutput<B> {
        self.forward_hooked(input_ids, segment_ids, input_mask, &NoHook)
    }

    /// [`BertModel::forward`] with `hook` at every encoder layer's input and at the pooler's
    /// input (`heads_input`; the returned `sequence_output` is the hooked one).
    pub fn forward_hooked(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
        hook: &dyn ForwardHook<B>,
    ) -> BertModelOutput<B> {
        self.forward_hooked_with_rows(input_ids, segment_ids, input_mask, None, hook)
    }

    /// [`BertModel::forward_hooked`] with the real tokens' rows given: `real_rows` `[T]`,
    /// `b·S + s` of each real token, ascending (`ember_data::Batch::real_rows`, built on the
    /// host), so that an unpadded encoder ([`BertEncoder::set_unpad`]) does not read
    /// `input_mask` back (on a GPU, a wait for the device's queue). Ignored when the encoder
    /// keeps the padding; `None` reads the mask.
    pub fn forward_hooked_with_rows(
        &self,
        input_ids: Tensor<B, 2, Int>,
        segment_ids: Tensor<B, 2, Int>,
        input_mask: Tensor<B, 2, Int>,
        real_rows: Option<Tensor<B, 1, Int>>,
        hook: &dyn ForwardHook<B>,
    ) -> BertModelOutput<B> {
        let embedded = self.embeddings.forward_with(
            input_ids,
            segment_ids,
            self.encoder.kernels_for(FusedOp::LayerNorm),
        );
        let dtype = self.precision.dtype().into();
        let embedded = cast_to(embedded, dtype);
        let encoded = self.encoder.forward_scoped(
            embedded,
            input_mask,
            real_rows,
            hook,
            self.cast_weights_together,
        );
        let sequence_output = hook.heads_input(encoded);
        let pooled_output = {
            let _scope = layer_scope(
                LayerParams::of(&[&self.pooler.dense], &[]),
                &sequence_output,
                dtype,
                self.cast_weights_together,
            );
            self.pooler.forward(sequence_output.clone())
        };
        BertModelOutput {
            sequence_output,
            pooled_output,
        }
    }

    /// Number of learned positions (the longest sequence the model accepts).
    pub fn max_position_embeddings(&self) -> usize {
        self.embeddings.position_embeddings.weight.dims()[0]
    }
}
