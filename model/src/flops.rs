//! Model FLOPs of a BERT pre-training step: the numerator of MFU (model FLOPs utilisation).
//!
//! Counted as the field counts them (Kaplan et al. 2020, "Scaling Laws", §2.1; Megatron-LM's
//! MFU; PaLM's appendix B): the multiply-adds of the matrix products, 2 FLOPs each, attention's
//! two batched products included; a training step is forward + backward, and backward costs
//! twice the forward (one product for the input's gradient, one for the weight's), so a step is
//! 3× the forward. Elementwise work (softmax, GELU, LayerNorm, the losses, the optimizer) and the
//! embedding lookups are not counted: MFU measures the products against the GEMM peak.
//!
//! Forward FLOPs, with T = B·S tokens, L layers, hidden H, FFN I, vocabulary V, N predictions:
//! - each layer, per token: Q, K, V and the attention output projection `4 · 2H²`, the FFN
//!   `2 · 2HI`, the scores `QKᵀ` `2SH` and the weighted values `PV` `2SH` (summed over heads):
//!   `8H² + 4HI + 4SH`;
//! - pooler `2H²` and next-sentence head `2·2H` per sample;
//! - masked-LM head at the N masked positions only (as NVIDIA's and ember's step): transform
//!   `2H²` and decoder `2HV` per prediction.

use crate::BertConfig;

impl BertConfig {
    /// Model FLOPs of one training step (forward and backward) of a batch of `batch_size`
    /// sequences of `seq_len` tokens with `predictions` masked-LM predictions in all: 3× the
    /// forward's matrix-product FLOPs (see the module's formula). Units: FLOP (a multiply-add is 2).
    pub fn train_step_flops(&self, batch_size: usize, seq_len: usize, predictions: usize) -> f64 {
        3.0 * self.forward_flops(batch_size, seq_len, predictions)
    }

    /// Model FLOPs of one forward pass (see the module's formula). Units: FLOP.
    pub fn forward_flops(&self, batch_size: usize, seq_len: usize, predictions: usize) -> f64 {
        let (h, i, v) = (
            self.hidden_size as f64,
            self.intermediate_size as f64,
            self.vocab_size as f64,
        );
        let (b, s, n) = (batch_size as f64, seq_len as f64, predictions as f64);
        let per_token_per_layer = 8.0 * h * h + 4.0 * h * i + 4.0 * s * h;
        let encoder = self.num_hidden_layers as f64 * b * s * per_token_per_layer;
        let pooler_and_nsp = b * (2.0 * h * h + 4.0 * h);
        let mlm_head = n * (2.0 * h * h + 2.0 * h * v);
        encoder + pooler_and_nsp + mlm_head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One layer, H 4, 2 heads, FFN 8, V 10; one sequence of 2 tokens, 1 prediction, counted
    /// product by product: each product of an [m, k] by a [k, n] matrix is 2·m·k·n.
    #[test]
    fn train_step_flops_equal_a_hand_count() {
        let config = BertConfig {
            vocab_size: 10,
            hidden_size: 4,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            intermediate_size: 8,
            ..BertConfig::default()
        };
        let product = |m: f64, k: f64, n: f64| 2.0 * m * k * n;
        let (t, h, d, heads) = (2.0, 4.0, 2.0, 2.0);
        let layer = 3.0 * product(t, h, h) // Q, K, V: [2, 4] x [4, 4]
            + heads * product(t, d, t)      // scores per head: [2, 2] x [2, 2]
            + heads * product(t, t, d)      // probabilities x values per head
            + product(t, h, h)              // attention output projection
            + product(t, h, 8.0)            // FFN in: [2, 4] x [4, 8]
            + product(t, 8.0, h); //            FFN out
        let pooler = product(1.0, h, h); //       [CLS] of the one sequence
        let nsp = product(1.0, h, 2.0);
        let mlm = product(1.0, h, h) + product(1.0, h, 10.0); // transform, decoder
        let forward = layer + pooler + nsp + mlm;
        assert_eq!(forward, 736.0);
        assert_eq!(config.forward_flops(1, 2, 1), forward);
        assert_eq!(config.train_step_flops(1, 2, 1), 3.0 * 736.0);
    }

    /// BERT-base at batch 8, seq 128, 20 predictions per sequence: the per-layer count against
    /// the 6·(parameters in products)·tokens rule plus attention (within the heads' share).
    #[test]
    fn base_step_is_six_flops_per_product_weight_per_token_plus_attention() {
        let config = BertConfig::preset(crate::Preset::Base);
        let (b, s, n) = (8.0, 128.0, 160.0);
        let layer_weights = 4.0 * 768.0 * 768.0 + 2.0 * 768.0 * 3072.0;
        let attention = 3.0 * 12.0 * b * s * (4.0 * s * 768.0); // 3 x layers x tokens x 4SH
        let expected = 6.0 * layer_weights * b * s * 12.0
            + attention
            + 6.0 * (768.0 * 768.0 + 768.0 * 2.0) * b
            + 6.0 * (768.0 * 768.0 + 768.0 * 30522.0) * n;
        assert_eq!(config.train_step_flops(8, 128, 160), expected);
    }
}
