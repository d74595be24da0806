//! Model tests on the CPU (NdArray): shapes, the loss of a fresh model, gradient flow, padding
//! invariance, overfitting one batch. In this binary, not in `model/tests/`, so that Burn and
//! the model are monomorphised for NdArray once for both (main.rs).

use burn::backend::{Autodiff, NdArray};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use ember_model::{BertConfig, BertForPreTraining, Preset};

type B = Autodiff<NdArray>;

/// NdArray's generator is the process's: each test here seeds it and draws its model's weights
/// (lazily, at first use), so it holds the trainer's initialisation lock throughout, and no
/// other test's run initialises in between.
fn init_lock() -> std::sync::MutexGuard<'static, ()> {
    ember_trainer::initialisation_lock()
}

/// A small config with a real-sized vocabulary, so that ln(V) is BERT's.
fn small_config() -> BertConfig {
    BertConfig {
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 128,
        max_position_embeddings: 64,
        ..BertConfig::default()
    }
}

struct Batch {
    input_ids: Tensor<B, 2, Int>,
    segment_ids: Tensor<B, 2, Int>,
    input_mask: Tensor<B, 2, Int>,
    masked_lm_flat_positions: Tensor<B, 1, Int>,
    masked_lm_labels: Tensor<B, 1, Int>,
    next_sentence_labels: Tensor<B, 1, Int>,
}

/// Two samples, S 16 (the second padded after 10 tokens); five predictions, packed as rows of
/// the flattened [B·S] positions.
fn batch(vocab: i64) -> Batch {
    let device = Default::default();
    let ids: Vec<i64> = (0..32).map(|i| 1000 + (i * 37) % (vocab - 1000)).collect();
    let mut input_ids = ids.clone();
    let mut mask = vec![1i64; 32];
    for i in 26..32 {
        input_ids[i] = 0;
        mask[i] = 0;
    }
    let int2 = |v: Vec<i64>, cols: usize| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [2, cols]), &device)
    };
    let segments: Vec<i64> = (0..32).map(|i| i64::from(i % 16 >= 8)).collect();
    Batch {
        input_ids: int2(input_ids, 16),
        segment_ids: int2(segments, 16),
        input_mask: int2(mask, 16),
        masked_lm_flat_positions: Tensor::from_data(
            TensorData::new(vec![1i64, 4, 9, 16 + 2, 16 + 5], [5]),
            &device,
        ),
        masked_lm_labels: Tensor::from_data(
            TensorData::new(vec![2000i64, 2001, 2002, 2003, 2004], [5]),
            &device,
        ),
        next_sentence_labels: Tensor::from_data(TensorData::new(vec![0i64, 1], [2]), &device),
    }
}

fn total_loss(model: &BertForPreTraining<B>, b: &Batch) -> Tensor<B, 1> {
    let out = model.forward(
        b.input_ids.clone(),
        b.segment_ids.clone(),
        b.input_mask.clone(),
        b.masked_lm_flat_positions.clone(),
    );
    model
        .loss(
            &out,
            b.masked_lm_labels.clone(),
            b.next_sentence_labels.clone(),
        )
        .total
}

fn scalar(t: Tensor<B, 1>) -> f64 {
    f64::from(t.into_data().to_vec::<f32>().unwrap()[0])
}

#[test]
fn forward_shapes() {
    let _init = init_lock();
    let device = Default::default();
    B::seed(&device, 1);
    let config = small_config();
    let model: BertForPreTraining<B> = config.init_for_pretraining(&device);
    let b = batch(config.vocab_size as i64);
    let encoded = model.bert.forward(
        b.input_ids.clone(),
        b.segment_ids.clone(),
        b.input_mask.clone(),
    );
    assert_eq!(encoded.sequence_output.dims(), [2, 16, 64]);
    assert_eq!(encoded.pooled_output.dims(), [2, 64]);
    let out = model.forward(
        b.input_ids,
        b.segment_ids,
        b.input_mask,
        b.masked_lm_flat_positions,
    );
    assert_eq!(out.mlm_logits.dims(), [5, 30522]);
    assert_eq!(out.nsp_logits.dims(), [2, 2]);
    let pooled = ember_model::mean_pool(encoded.sequence_output, batch(30522).input_mask);
    assert_eq!(pooled.dims(), [2, 64]);
}

/// With N(0, 0.02²) weights the logits are near zero, so the predictions are near uniform and
/// the loss is ln(V) + ln(2) = 10.326 + 0.693. Each MLM logit still has a spread of about
/// 0.02·‖LayerNorm output‖ = 0.02·√64 = 0.16, and with 5 predictions the mean of the label
/// logits varies by ≈ 0.07: hence 0.2.
#[test]
fn fresh_model_loss_is_uniform_cross_entropy() {
    let _init = init_lock();
    let device = Default::default();
    B::seed(&device, 2);
    let config = small_config();
    let model: BertForPreTraining<B> = config.init_for_pretraining(&device);
    let loss = scalar(total_loss(&model, &batch(30522)));
    let expected = (30522f64).ln() + 2f64.ln();
    assert!(
        (loss - expected).abs() < 0.2,
        "fresh loss {loss}, expected ≈ {expected}"
    );
}

/// Every parameter gets a non-zero gradient, including the tied word embeddings, the MLM
/// bias, the pooler and both layers.
#[test]
fn gradients_reach_every_parameter() {
    let _init = init_lock();
    let device = Default::default();
    B::seed(&device, 3);
    let model: BertForPreTraining<B> = small_config().init_for_pretraining(&device);
    let grads = GradientsParams::from_grads(total_loss(&model, &batch(30522)).backward(), &model);

    struct Check<'a> {
        grads: &'a GradientsParams,
        stack: Vec<String>,
        checked: usize,
    }
    impl ModuleVisitor<B> for Check<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.stack.join(".");
            let grad = self
                .grads
                .get::<NdArray, D>(param.id)
                .unwrap_or_else(|| panic!("{path} has no gradient"));
            let norm: f32 = grad.abs().sum().into_scalar();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{path}: gradient norm {norm}"
            );
            self.checked += 1;
        }
    }
    let mut check = Check {
        grads: &grads,
        stack: vec![],
        checked: 0,
    };
    model.visit(&mut check);
    // 5 embedding tensors, 16 per layer × 2, pooler 2, MLM bias + transform 4, NSP 2.
    assert_eq!(check.checked, 5 + 16 * 2 + 2 + 5 + 2);
}

/// Changing the tokens at padded positions changes no real output (the padding mask works).
#[test]
fn padding_does_not_change_real_outputs() {
    let _init = init_lock();
    let device = Default::default();
    NdArray::<f32>::seed(&device, 4);
    let model = small_config().init_for_pretraining::<B>(&device).valid();
    let b = batch(30522);
    let run = |ids: Tensor<NdArray, 2, Int>| {
        let out = model.bert.forward(
            ids,
            b.segment_ids.clone().inner(),
            b.input_mask.clone().inner(),
        );
        out.sequence_output
            .slice([1..2, 0..10])
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let ids = b.input_ids.clone().inner();
    let changed = ids
        .clone()
        .slice_assign([1..2, 10..16], Tensor::full([1, 6], 1234, &device));
    let (a, c) = (run(ids), run(changed));
    let diff = a
        .iter()
        .zip(&c)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        diff < 1e-5,
        "real outputs moved by {diff} when only padding changed"
    );
}

/// A tiny model memorises one batch: the loss falls from ≈ 11 to below 0.5 in 60 AdamW steps.
#[test]
fn tiny_model_overfits_one_batch() {
    let _init = init_lock();
    let device = Default::default();
    B::seed(&device, 5);
    let config = BertConfig {
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        ..BertConfig::preset(Preset::Tiny)
    };
    let mut model: BertForPreTraining<B> = config.init_for_pretraining(&device);
    let mut optimizer = AdamWConfig::new().with_weight_decay(0.0).init();
    let b = batch(30522);
    let first = scalar(total_loss(&model, &b));
    let mut last = first;
    for _ in 0..60 {
        let loss = total_loss(&model, &b);
        last = scalar(loss.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(3e-3, model, grads);
    }
    assert!(first > 10.0, "first loss {first}");
    assert!(
        last < 0.5,
        "loss after 60 steps on one batch: {last} (from {first})"
    );
}
