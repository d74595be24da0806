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

/// One matrix product of a training step, as ember lays out its operands: `batch` products
/// of an `[m, k]` matrix by a `[k, n]` matrix, each operand row-major or, where `trans_a` /
/// `trans_b` is set, the transpose of a row-major matrix (a transposed view, as `dx = g·Wᵀ`
/// reads the weight). `count` is how many times a step runs it (per layer, times the layers).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StepGemm {
    /// What it computes, `{part} {fwd|dx|dW}` (`dW` is the weight's gradient).
    pub name: String,
    /// Times per training step.
    pub count: usize,
    /// Independent products (attention: batch × heads).
    pub batch: usize,
    /// Rows of the output.
    pub m: usize,
    /// The reduced dimension.
    pub k: usize,
    /// Columns of the output.
    pub n: usize,
    /// `a` is the transpose of a row-major `[k, m]`.
    pub trans_a: bool,
    /// `b` is the transpose of a row-major `[n, k]`.
    pub trans_b: bool,
}

impl StepGemm {
    /// FLOPs of one run, `2·batch·m·k·n`.
    pub fn flops(&self) -> f64 {
        2.0 * (self.batch * self.m * self.k * self.n) as f64
    }
}

impl BertConfig {
    /// The matrix products of one training step (the module's formula, product by product):
    /// every dense layer's forward `y = x·W`, `dx = g·Wᵀ` and `dW = xᵀ·g` (the MLM decoder
    /// multiplies by the tied word embeddings `[V, H]` transposed), attention's `Q·Kᵀ` and
    /// `P·V` and their four gradients, per (batch × heads) product. Their FLOPs times their
    /// counts sum to [`BertConfig::train_step_flops`]. The shapes `cargo xtask bench gemm`
    /// times.
    pub fn train_step_gemms(
        &self,
        batch_size: usize,
        seq_len: usize,
        predictions: usize,
    ) -> Vec<StepGemm> {
        let (h, i, v, l) = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_hidden_layers,
        );
        let (heads, tokens) = (self.num_attention_heads, batch_size * seq_len);
        let head_dim = h / heads.max(1);
        let gemm = |name: String, count, batch, m, k, n, trans_a, trans_b| StepGemm {
            name,
            count,
            batch,
            m,
            k,
            n,
            trans_a,
            trans_b,
        };
        let mut gemms = Vec::new();
        // A dense layer [rows, din] -> [rows, dout], `count` times per step.
        let mut dense = |part: &str, count: usize, rows: usize, din: usize, dout: usize| {
            gemms.push(gemm(
                format!("{part} fwd"),
                count,
                1,
                rows,
                din,
                dout,
                false,
                false,
            ));
            gemms.push(gemm(
                format!("{part} dx"),
                count,
                1,
                rows,
                dout,
                din,
                false,
                true,
            ));
            gemms.push(gemm(
                format!("{part} dW"),
                count,
                1,
                din,
                rows,
                dout,
                true,
                false,
            ));
        };
        dense("qkv+attn-out", 4 * l, tokens, h, h);
        dense("ffn-in", l, tokens, h, i);
        dense("ffn-out", l, tokens, i, h);
        dense("pooler", 1, batch_size, h, h);
        dense("nsp", 1, batch_size, h, 2);
        dense("mlm-transform", 1, predictions, h, h);
        let (p, b) = (predictions, batch_size * heads);
        let (s, d) = (seq_len, head_dim);
        gemms.extend([
            // The decoder: logits = x·Eᵀ, dx = g·E, dE = gᵀ·x.
            gemm("mlm-decoder fwd".into(), 1, 1, p, h, v, false, true),
            gemm("mlm-decoder dx".into(), 1, 1, p, v, h, false, false),
            gemm("mlm-decoder dW".into(), 1, 1, v, p, h, true, false),
            // Attention, per (sample, head): scores = Q·Kᵀ, out = P·V.
            gemm("attn Q·Kᵀ fwd".into(), l, b, s, d, s, false, true),
            gemm("attn P·V fwd".into(), l, b, s, s, d, false, false),
            gemm("attn dP = dO·Vᵀ".into(), l, b, s, d, s, false, true),
            gemm("attn dV = Pᵀ·dO".into(), l, b, s, s, d, true, false),
            gemm("attn dQ = dS·K".into(), l, b, s, s, d, false, false),
            gemm("attn dK = dSᵀ·Q".into(), l, b, s, s, d, true, false),
        ]);
        gemms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step's products, counted, add up to the step's FLOPs, and their shapes are the
    /// dense layers' and attention's (BERT-large at MLPerf's 512 × 16 with 76 predictions
    /// per sample).
    #[test]
    fn step_gemms_add_up_to_the_step_flops() {
        let config = BertConfig::preset(crate::Preset::Large);
        let (b, s, p) = (16, 512, 16 * 76);
        let gemms = config.train_step_gemms(b, s, p);
        let total: f64 = gemms.iter().map(|g| g.count as f64 * g.flops()).sum();
        let expected = config.train_step_flops(b, s, p);
        assert!(
            (total - expected).abs() <= 1e-12 * expected,
            "{total} vs {expected}"
        );
        let find = |name: &str| gemms.iter().find(|g| g.name == name).unwrap().clone();
        let ffn_dw = find("ffn-in dW");
        assert_eq!(
            (ffn_dw.count, ffn_dw.m, ffn_dw.k, ffn_dw.n, ffn_dw.trans_a),
            (24, 1024, 8192, 4096, true)
        );
        let scores = find("attn Q·Kᵀ fwd");
        assert_eq!(
            (scores.batch, scores.m, scores.k, scores.n, scores.trans_b),
            (16 * 16, 512, 64, 512, true)
        );
        assert_eq!(find("mlm-decoder fwd").n, 30522);
    }

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
