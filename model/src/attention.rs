//! The self-attention block (Hugging Face's `BertSelfAttention` and `BertSelfOutput`) and the
//! packed projection of its query, key and value (Note [Packed QKV] in `ember-backend-ext`'s
//! `qkv.rs`).

use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, LayerNorm, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use ember_backend_ext::FusedOps;

use crate::BertConfig;
use crate::bert::{dense, layer_norm, reference_dropout};
use crate::precision::{dense_as, layer_norm_f32, softmax_f32};
use crate::weight_casts::{bias_pair, packed_qkv_pair, param_pair};

/// Multi-head scaled dot-product self-attention with a padding mask.
/// Mirrors Hugging Face `BertSelfAttention` (eager attention).
#[derive(Module, Debug)]
pub struct BertSelfAttention<B: Backend> {
    pub query: Linear<B>,
    pub key: Linear<B>,
    pub value: Linear<B>,
    /// Dropout on the attention probabilities.
    pub dropout: Dropout,
    pub num_attention_heads: usize,
}

impl<B: Backend> BertSelfAttention<B> {
    pub fn new(config: &BertConfig, device: &B::Device) -> Self {
        let h = config.hidden_size;
        let std = config.initializer_range;
        Self {
            query: dense(h, h, std, device),
            key: dense(h, h, std, device),
            value: dense(h, h, std, device),
            dropout: DropoutConfig::new(config.attention_probs_dropout_prob).init(),
            num_attention_heads: config.num_attention_heads,
        }
    }
}

impl<B: FusedOps> BertSelfAttention<B> {
    /// The query, key and value projections as one dense layer (Note [Packed QKV] in
    /// `ember-backend-ext`'s `qkv.rs`: NVIDIA's and Samsung's MLPerf BERT's fused QKV): the
    /// three weights side by side and the three biases likewise, each as `(parameters, their
    /// copy in dtype)` for [`ember_backend_ext::dense_of_masters`] (the copies from the layer's
    /// scope; the same tensor where `dtype` is the parameters'; Note [Weight gradients in f32]
    /// in `ember-backend-ext`'s `linear.rs`). Under autodiff each parameter's gradient is its
    /// slice of the packed gradient (`ember_backend_ext::concat_columns`: one launch each way
    /// on CubeCL). Within the layer's scope the concatenations and their copies are the
    /// scope's (Note [Packed QKV cast once] in `weight_casts.rs`); outside one, a half
    /// precision concatenates the copies too, one launch more.
    ///
    /// # Shapes
    /// weight `[H, 3·H]` (columns: query's, key's, value's), bias `[3·H]` (zeros for a
    /// projection without bias)
    #[allow(clippy::type_complexity)]
    pub fn packed_qkv(
        &self,
        dtype: DType,
    ) -> ((Tensor<B, 2>, Tensor<B, 2>), (Tensor<B, 1>, Tensor<B, 1>)) {
        // The layer's scope packed and cast them (Note [Packed QKV cast once] in
        // `weight_casts.rs`).
        if let Some(pair) = packed_qkv_pair(self.query.weight.id, dtype) {
            return pair;
        }
        let projections = [&self.query, &self.key, &self.value];
        let (weights, weight_copies): (Vec<_>, Vec<_>) = projections
            .iter()
            .map(|linear| param_pair(&linear.weight, dtype))
            .unzip();
        let (biases, bias_copies): (Vec<_>, Vec<_>) = projections
            .iter()
            .map(|linear| bias_pair(linear, dtype))
            .unzip();
        // Whether the parameters take gradients (an intermediate autodiff tensor, as the
        // scope's, reports none of its own).
        let tracked = self.query.weight.val().is_require_grad();
        (
            packed_pair(weights, weight_copies, dtype, tracked),
            packed_pair(biases, bias_copies, dtype, tracked),
        )
    }
}

/// The parameters `masters` side by side, and their `copies` in `dtype` side by side: the
/// same tensor where the masters are in `dtype`, or take no gradient (not `tracked`: the
/// masters' f32 concatenation would serve nothing but their gradients).
fn packed_pair<B: FusedOps, const D: usize>(
    masters: Vec<Tensor<B, D>>,
    copies: Vec<Tensor<B, D>>,
    dtype: DType,
    tracked: bool,
) -> (Tensor<B, D>, Tensor<B, D>) {
    if masters.first().is_some_and(|m| m.dtype() == dtype) {
        let master = ember_backend_ext::concat_columns(masters);
        return (master.clone(), master);
    }
    if !tracked {
        let copy = ember_backend_ext::concat_columns(copies);
        return (copy.clone(), copy);
    }
    (
        ember_backend_ext::concat_columns(masters),
        ember_backend_ext::concat_columns(copies),
    )
}

impl<B: FusedOps> BertSelfAttention<B> {
    /// `softmax(Q·Kᵀ/√hd + mask_bias) · V`, heads concatenated.
    ///
    /// # Shapes
    /// - `hidden_states`: `[B, S, H]`
    /// - `mask_bias`: `[B, S]`, 0 for real keys, a large negative number for padded ones
    /// - output: `[B, S, H]`
    pub fn forward(&self, hidden_states: Tensor<B, 3>, mask_bias: Tensor<B, 2>) -> Tensor<B, 3> {
        let [batch, seq_len, hidden] = hidden_states.dims();
        let heads = self.num_attention_heads;
        let head_dim = hidden / heads;
        let split_heads = |x: Tensor<B, 3>| {
            x.reshape([batch, seq_len, heads, head_dim]).swap_dims(1, 2) // [B, nh, S, hd]
        };
        let q = split_heads(dense_as(&self.query, hidden_states.clone()));
        let k = split_heads(dense_as(&self.key, hidden_states.clone()));
        let v = split_heads(dense_as(&self.value, hidden_states));

        let scores = q.matmul(k.swap_dims(2, 3)) / (head_dim as f64).sqrt(); // [B, nh, S, S]
        let mask_bias = mask_bias.reshape([batch, 1, 1, seq_len]);
        // Note [Autocast]: the softmax in f32.
        let probs = reference_dropout(softmax_f32(scores + mask_bias, 3), &self.dropout);
        probs
            .matmul(v) // [B, nh, S, hd]
            .swap_dims(1, 2) // [B, S, nh, hd]
            .reshape([batch, seq_len, hidden])
    }
}

/// Output projection of the attention, dropout, residual add, LayerNorm.
/// Mirrors Hugging Face `BertSelfOutput`.
#[derive(Module, Debug)]
pub struct BertSelfOutput<B: Backend> {
    pub dense: Linear<B>,
    /// Hugging Face key `LayerNorm`.
    pub layer_norm: LayerNorm<B>,
    pub dropout: Dropout,
}

impl<B: Backend> BertSelfOutput<B> {
    pub fn new(config: &BertConfig, device: &B::Device) -> Self {
        let h = config.hidden_size;
        Self {
            dense: dense(h, h, config.initializer_range, device),
            layer_norm: layer_norm(config, device),
            dropout: DropoutConfig::new(config.hidden_dropout_prob).init(),
        }
    }
}

impl<B: FusedOps> BertSelfOutput<B> {
    /// `LayerNorm(input + dropout(dense(hidden_states)))`.
    ///
    /// # Shapes
    /// - `hidden_states`, `input`: `[B, S, H]`
    /// - output: `[B, S, H]`
    pub fn forward(&self, hidden_states: Tensor<B, 3>, input: Tensor<B, 3>) -> Tensor<B, 3> {
        let x = reference_dropout(dense_as(&self.dense, hidden_states), &self.dropout);
        layer_norm_f32(&self.layer_norm, x + input)
    }
}
