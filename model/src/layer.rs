//! One encoder layer (Hugging Face's `BertLayer`, `BertAttention`, `BertIntermediate`,
//! `BertOutput`) and its two forward paths: the fused ops of `ember-backend-ext`, with the
//! query, key and value projections as one dense layer (Note [Packed QKV] in
//! `ember-backend-ext`'s `qkv.rs`), and the module-by-module composition.

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, LayerNorm, Linear};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use ember_backend_ext::{
    DropoutSpec, FusedOp, FusedOps, Gelu, Kernels, QkvProjections, ReferenceOps,
};

use crate::BertConfig;
use crate::attention::{BertSelfAttention, BertSelfOutput};
use crate::bert::{dense, hidden_act, layer_norm, reference_dropout, training};
use crate::precision::{dense_as, dense_parts, layer_norm_f32};
use crate::unpad::Unpadding;
use crate::weight_casts::LayerParams;
use crate::weight_casts::{bias_pair, gamma_beta_pairs};

/// Self-attention and its output block. Mirrors Hugging Face `BertAttention`.
#[derive(Module, Debug)]
pub struct BertAttention<B: Backend> {
    /// Hugging Face key `self` (a Rust keyword): see [`crate::checkpoint`].
    pub self_attention: BertSelfAttention<B>,
    pub output: BertSelfOutput<B>,
}

/// First half of the feed-forward block: dense H → I and GELU.
/// Mirrors Hugging Face `BertIntermediate`.
#[derive(Module, Debug)]
pub struct BertIntermediate<B: Backend> {
    pub dense: Linear<B>,
}

/// Second half of the feed-forward block: dense I → H, dropout, residual add, LayerNorm.
/// Mirrors Hugging Face `BertOutput`.
#[derive(Module, Debug)]
pub struct BertOutput<B: Backend> {
    pub dense: Linear<B>,
    /// Hugging Face key `LayerNorm`.
    pub layer_norm: LayerNorm<B>,
    pub dropout: Dropout,
}

/// One post-LN transformer layer. Mirrors Hugging Face `BertLayer`.
#[derive(Module, Debug)]
pub struct BertLayer<B: Backend> {
    pub attention: BertAttention<B>,
    pub intermediate: BertIntermediate<B>,
    pub output: BertOutput<B>,
    /// Which implementation [`BertLayer::forward`] runs (see
    /// [`BertEncoder::set_kernels`](crate::BertEncoder::set_kernels)).
    #[module(skip)]
    pub kernels: Kernels,
    /// ε of the two LayerNorms (Burn's `LayerNorm` keeps its own private), for the fused ops.
    #[module(skip)]
    pub layer_norm_eps: f64,
    /// The intermediate layer's GELU, `hidden_act`'s form (Note [Two GELUs] in
    /// `ember-backend-ext`'s `gelu.rs`).
    #[module(skip)]
    pub hidden_act: Gelu,
    /// How the fused path runs the query, key and value projections (Note [Packed QKV]; see
    /// [`BertEncoder::set_qkv_projections`](crate::BertEncoder::set_qkv_projections)).
    #[module(skip)]
    pub qkv_projections: QkvProjections,
    /// The ops the fused path runs as their reference composition (Note [Fused where it pays]
    /// in `ember-backend-ext`'s `reference_ops.rs`; see
    /// [`BertEncoder::set_reference_ops`](crate::BertEncoder::set_reference_ops)).
    #[module(skip)]
    pub reference_ops: ReferenceOps,
}

impl<B: Backend> BertLayer<B> {
    pub fn new(config: &BertConfig, device: &B::Device) -> Self {
        let (h, i, std) = (
            config.hidden_size,
            config.intermediate_size,
            config.initializer_range,
        );
        Self {
            attention: BertAttention {
                self_attention: BertSelfAttention::new(config, device),
                output: BertSelfOutput::new(config, device),
            },
            intermediate: BertIntermediate {
                dense: dense(h, i, std, device),
            },
            output: BertOutput {
                dense: dense(i, h, std, device),
                layer_norm: layer_norm(config, device),
                dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
            },
            kernels: Kernels::default(),
            layer_norm_eps: config.layer_norm_eps,
            hidden_act: config.gelu(),
            qkv_projections: QkvProjections::default(),
            reference_ops: ReferenceOps::default(),
        }
    }
}

/// The input, without bias, of a dense layer whose bias goes into a fused op; the weight in
/// `x`'s dtype (Note [Autocast]).
fn dense_no_bias<B: FusedOps>(x: Tensor<B, 3>, linear: &Linear<B>) -> Tensor<B, 3> {
    dense_parts(x, &linear.weight, None)
}

impl<B: FusedOps> BertLayer<B> {
    /// The parameters a forward takes through the layer's scope (`weight_casts.rs`): the six
    /// dense layers' weights and biases (Q, K and V packed where the fused layer packs them),
    /// and the two LayerNorms' γ and β where the fused op takes them (Burn's `LayerNorm`, the
    /// reference path's and that of `layer_norm` among the reference ops, reads its own).
    pub(crate) fn params(&self) -> LayerParams<'_, B> {
        let attention = &self.attention.self_attention;
        let norms = [&self.attention.output.layer_norm, &self.output.layer_norm];
        let qkv = [&attention.query, &attention.key, &attention.value];
        let dense = [
            &self.attention.output.dense,
            &self.intermediate.dense,
            &self.output.dense,
        ];
        let norms: &[_] = if self.runs_fused(FusedOp::LayerNorm) {
            &norms
        } else {
            &[]
        };
        // Packed and taking gradients, the scope concatenates Q, K and V and casts the
        // concatenations (Note [Packed QKV cast once] in `weight_casts.rs`); without autodiff
        // `packed_qkv` concatenates the scope's half copies alone (no f32 concatenation).
        let tracked = attention.query.weight.val().is_require_grad();
        if self.packs_qkv() && tracked {
            return LayerParams::of(&dense, norms).and_packed_qkv(qkv);
        }
        LayerParams::of(&[qkv.as_slice(), &dense].concat(), norms)
    }

    /// The layer through the fused ops of `ember-backend-ext` when [`Kernels::fused`] says so
    /// for this backend, else through the module-by-module composition.
    ///
    /// # Shapes
    /// - `hidden_states`: `[B, S, H]`
    /// - `mask_bias`: `[B, S]`, 0 for real keys, −10000 for padded ones
    /// - output: `[B, S, H]`
    pub fn forward(&self, hidden_states: Tensor<B, 3>, mask_bias: Tensor<B, 2>) -> Tensor<B, 3> {
        self.forward_rows(hidden_states, mask_bias, None)
    }

    /// [`BertLayer::forward`] of the padding-free rows of Note [Padding removed] in
    /// `unpad.rs`: the same values at the real tokens, with the same dropout masks.
    ///
    /// # Shapes
    /// - `hidden_states`: `[1, T, H]`, the real tokens of `unpadding`'s batch
    /// - `mask_bias`: `[B, S]`, as for [`BertLayer::forward`]
    /// - output: `[1, T, H]`
    pub fn forward_unpadded(
        &self,
        hidden_states: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadding: &Unpadding<B>,
    ) -> Tensor<B, 3> {
        self.forward_rows(hidden_states, mask_bias, Some(unpadding))
    }

    fn forward_rows(
        &self,
        hidden_states: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadding: Option<&Unpadding<B>>,
    ) -> Tensor<B, 3> {
        if self.kernels.fused::<B>() {
            self.forward_fused(hidden_states, mask_bias, unpadding)
        } else {
            self.forward_reference(hidden_states, mask_bias, unpadding)
        }
    }

    /// Whether `op` runs fused in this layer ([`ReferenceOps::runs_fused`]).
    fn runs_fused(&self, op: FusedOp) -> bool {
        self.reference_ops.runs_fused::<B>(op, self.kernels)
    }

    /// Whether the fused path runs Q, K and V as one dense layer: where `qkv_projections`
    /// says so and the attention op that reads the packed output runs fused (composed, the
    /// attention takes three dense layers' outputs, as the reference path: slicing the packed
    /// output would cost a zero-filled `[B, S, 3·H]` gradient and a copy per slice backward).
    fn packs_qkv(&self) -> bool {
        self.runs_fused(FusedOp::Attention) && self.qkv_projections.packed::<B>()
    }

    /// The fused path: attention core, dense bias + dropout + residual + LayerNorm (twice) and
    /// dense bias + GELU each as one op; the GEMMs are Burn's. Dropout is applied when autodiff
    /// is on, as Burn's `Dropout` does. An op among the layer's reference ops runs as the
    /// reference path's composition instead, with the fused path's dropout op (Note [Fused
    /// where it pays]).
    ///
    /// With `unpadding`, the rows are the packed real tokens and the attention core runs on
    /// the padded layout (Note [Padding removed]).
    fn forward_fused(
        &self,
        hidden_states: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadding: Option<&Unpadding<B>>,
    ) -> Tensor<B, 3> {
        let [_, _, hidden] = hidden_states.dims();
        let [batch, seq_len] = mask_bias.dims();
        let pad = |x: Tensor<B, 3>| match unpadding {
            Some(u) => u.pad(x),
            None => x,
        };
        let dtype = hidden_states.dtype();
        let training = training(&hidden_states);
        let dropout = |p: f64| {
            if training {
                DropoutSpec::draw(p)
            } else {
                DropoutSpec::NONE
            }
        };
        let self_attention = &self.attention.self_attention;
        let heads = self_attention.num_attention_heads;
        let head_dim = hidden / heads;
        // Reshapes through `ember_backend_ext::reshape`: no copies of the contiguous dense
        // outputs (nor of the merged context's gradient) on NdArray.
        let split_heads = |x: Tensor<B, 3>| {
            // [B, nh, S, hd]
            ember_backend_ext::reshape(x, [batch, seq_len, heads, head_dim]).swap_dims(1, 2)
        };
        let scale = 1.0 / (head_dim as f64).sqrt();
        let attention_dropout = dropout(self_attention.dropout.prob);
        let context = if self.packs_qkv() {
            // One dense layer, [B, S, 3·H], read by the attention op as Q, K and V.
            let ((weight, weight_copy), bias) = self_attention.packed_qkv(dtype);
            let qkv = ember_backend_ext::dense_of_masters(
                hidden_states.clone(),
                weight,
                weight_copy,
                Some(bias),
            );
            ember_backend_ext::attention_qkv(pad(qkv), heads, mask_bias, scale, attention_dropout)
        } else {
            let project = |linear| split_heads(pad(dense_as(linear, hidden_states.clone())));
            let q = project(&self_attention.query);
            let k = project(&self_attention.key);
            let v = project(&self_attention.value);
            if self.runs_fused(FusedOp::Attention) {
                ember_backend_ext::attention(q, k, v, mask_bias, scale, attention_dropout)
            } else {
                crate::composed::attention(q, k, v, mask_bias, scale, attention_dropout)
            }
        }
        .swap_dims(1, 2);
        let context = ember_backend_ext::reshape(context, [batch, seq_len, hidden]);
        let context = match unpadding {
            Some(u) => u.unpad(context),
            None => context,
        };

        // The biases, γ and β as f32 masters beside their copies in `dtype`: their gradients
        // come out of the fused ops' backward in f32 (Note [Parameter gradients in f32] in
        // `ember-backend-ext`'s `masters.rs`).
        let output = &self.attention.output;
        let attention_output = self.dense_dropout_add_norm(
            context,
            (&output.dense, &output.layer_norm),
            hidden_states,
            dropout(output.dropout.prob),
            unpadding,
        );

        let dense = &self.intermediate.dense;
        let intermediate = if self.runs_fused(FusedOp::BiasGelu) {
            let (bias, bias_copy) = bias_pair(dense, dtype);
            ember_backend_ext::bias_gelu_of_master(
                dense_no_bias(attention_output.clone(), dense),
                bias,
                bias_copy,
                self.hidden_act,
            )
        } else {
            hidden_act(dense_as(dense, attention_output.clone()), self.hidden_act)
        }; // [B, S, I]
        self.dense_dropout_add_norm(
            intermediate,
            (&self.output.dense, &self.output.layer_norm),
            attention_output,
            dropout(self.output.dropout.prob),
            unpadding,
        )
    }

    /// `LayerNorm(residual + dropout(dense(x)))` of the fused path: the dense layer without
    /// its bias, then the fused bias + dropout + residual + LayerNorm of the masters and their
    /// copies, or (`layer_norm` among the reference ops) the dense layer with its bias, the
    /// dropout op, the sum and Burn's `LayerNorm` in f32, as the reference path.
    ///
    /// Packed rows with dropout (Note [Padding removed]): fused, the same op with each row's
    /// mask keyed through the row map ([`Unpadding::layer_norm`]); composed, the dense layer
    /// with its bias, the dropout of [`Unpadding::dropout`] (the padded rows' masks) and the
    /// LayerNorm of the sum.
    fn dense_dropout_add_norm(
        &self,
        x: Tensor<B, 3>,
        (dense, norm): (&Linear<B>, &LayerNorm<B>),
        residual: Tensor<B, 3>,
        dropout: DropoutSpec,
        unpadding: Option<&Unpadding<B>>,
    ) -> Tensor<B, 3> {
        if let Some(u) = unpadding.filter(|_| dropout.enabled()) {
            return if self.runs_fused(FusedOp::LayerNorm) {
                let dtype = x.dtype();
                u.layer_norm(
                    dense_no_bias(x, dense),
                    bias_pair(dense, dtype),
                    residual,
                    gamma_beta_pairs(norm, dtype),
                    dropout,
                    self.layer_norm_eps,
                )
            } else {
                let dropped = u.dropout(dense_as(dense, x), dropout);
                layer_norm_f32(norm, dropped + residual)
            };
        }
        if self.runs_fused(FusedOp::LayerNorm) {
            let dtype = x.dtype();
            ember_backend_ext::bias_dropout_add_layer_norm_of_masters(
                dense_no_bias(x, dense),
                bias_pair(dense, dtype),
                residual,
                gamma_beta_pairs(norm, dtype),
                dropout,
                self.layer_norm_eps,
            )
        } else {
            crate::composed::dropout_add_layer_norm(dense_as(dense, x), residual, norm, dropout)
        }
    }

    /// The module-by-module composition, Hugging Face's `BertLayer.forward`.
    ///
    /// With `unpadding` (Note [Padding removed]), the self-attention module, its Q, K and V
    /// projections included, runs on the padded layout; the rest on the packed rows, each
    /// dropout on the padded layout.
    fn forward_reference(
        &self,
        hidden_states: Tensor<B, 3>,
        mask_bias: Tensor<B, 2>,
        unpadding: Option<&Unpadding<B>>,
    ) -> Tensor<B, 3> {
        let attention = &self.attention;
        let Some(u) = unpadding else {
            let context = attention
                .self_attention
                .forward(hidden_states.clone(), mask_bias);
            let attention_output = attention.output.forward(context, hidden_states);
            return self.feed_forward_reference(attention_output, reference_dropout);
        };
        let context = u.around(hidden_states.clone(), |padded| {
            attention.self_attention.forward(padded, mask_bias)
        });
        let packed_dropout = |x: Tensor<B, 3>, dropout: &Dropout| {
            if training(&x) {
                u.around(x, |padded| reference_dropout(padded, dropout))
            } else {
                x
            }
        };
        let output = &attention.output;
        let x = packed_dropout(dense_as(&output.dense, context), &output.dropout);
        let attention_output = layer_norm_f32(&output.layer_norm, x + hidden_states);
        self.feed_forward_reference(attention_output, packed_dropout)
    }

    /// The reference path's feed-forward block: dense, GELU, dense, `dropout`, the residual
    /// add and LayerNorm.
    fn feed_forward_reference(
        &self,
        attention_output: Tensor<B, 3>,
        dropout: impl Fn(Tensor<B, 3>, &Dropout) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let intermediate = hidden_act(
            dense_as(&self.intermediate.dense, attention_output.clone()),
            self.hidden_act,
        ); // [B, S, I]
        let x = dropout(
            dense_as(&self.output.dense, intermediate),
            &self.output.dropout,
        );
        layer_norm_f32(&self.output.layer_norm, x + attention_output)
    }
}
