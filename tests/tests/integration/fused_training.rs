//! One training step of the tiny model through the fused ops equals the reference composition
//! (dropout off): the loss, every parameter's gradient, and the loss after one optimizer step
//! (AdamW and LAMB, the fused optimizer ops against Burn's AdamW and the composed LAMB).
//! On NdArray the fused path is the ops' reference bodies with the custom backward passes; on
//! wgpu (Mesa's lavapipe in CI) it is the CubeCL kernels.
//!
//! Tolerances: losses within 1e-5 relative; each gradient tensor within 1e-4 of its largest
//! entry (summation orders differ between the kernels and the composition).

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use ember_backend_ext::FusedOps;
use ember_model::{BertConfig, BertForPreTraining, Kernels, Preset, QkvProjections};
use ember_trainer::OptimizerKind;
use ember_trainer::config::OptimizerConfig;
use ember_trainer::optim::PreTrainingOptimizer;

pub(crate) struct Batch<B: AutodiffBackend> {
    pub(crate) input_ids: Tensor<B, 2, Int>,
    pub(crate) segment_ids: Tensor<B, 2, Int>,
    pub(crate) input_mask: Tensor<B, 2, Int>,
    pub(crate) positions: Tensor<B, 1, Int>,
    pub(crate) labels: Tensor<B, 1, Int>,
    pub(crate) next_sentence_labels: Tensor<B, 1, Int>,
}

/// Three sequences of 37 tokens, the second padded after 20, the third after 1.
pub(crate) fn batch<B: AutodiffBackend>(vocab: usize, device: &B::Device) -> Batch<B> {
    let (b, s) = (3usize, 37usize);
    let lengths = [37usize, 20, 1];
    let ids: Vec<i64> = (0..b * s)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    let mask: Vec<i64> = (0..b * s)
        .map(|i| (i % s < lengths[i / s]) as i64)
        .collect();
    let segments: Vec<i64> = (0..b * s).map(|i| (i % s >= 10) as i64).collect();
    let positions: Vec<i64> = vec![3, 5, 30, s as i64 + 2, s as i64 + 19, 2 * s as i64];
    let labels: Vec<i64> = positions.iter().map(|p| p * 31 % vocab as i64).collect();
    let int2 = |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [b, s]), device);
    let int1 = |v: Vec<i64>| {
        let n = v.len();
        Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), device)
    };
    Batch {
        input_ids: int2(ids),
        segment_ids: int2(segments),
        input_mask: int2(mask),
        positions: int1(positions),
        labels: int1(labels),
        next_sentence_labels: int1(vec![0, 1, 0]),
    }
}

fn loss<B: AutodiffBackend + FusedOps>(
    model: &BertForPreTraining<B>,
    batch: &Batch<B>,
) -> Tensor<B, 1> {
    let out = model.forward(
        batch.input_ids.clone(),
        batch.segment_ids.clone(),
        batch.input_mask.clone(),
        batch.positions.clone(),
    );
    model
        .loss(
            &out,
            batch.labels.clone(),
            batch.next_sentence_labels.clone(),
        )
        .total
}

struct Collect<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    out: HashMap<ParamId, Vec<f32>>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .get::<B::InnerBackend, D>(param.id)
            .expect("every parameter has a gradient");
        let values = grad.into_data().convert::<f32>().to_vec().unwrap();
        self.out.insert(param.id, values);
    }
}

fn scalar<B: AutodiffBackend>(t: Tensor<B, 1>) -> f64 {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap()[0]
}

/// The model of `config` from generator seed `seed`, its parameters drawn.
pub(crate) fn seeded_model<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    config: &BertConfig,
    seed: u64,
    device: &B::Device,
) -> BertForPreTraining<B> {
    // The device's generator is shared with the runs of other tests (wgpu) or the process
    // (NdArray): seed and draw under the trainer's initialisation lock.
    let _guard = ember_trainer::initialisation_lock();
    B::seed(device, seed);
    let model: BertForPreTraining<B> = config.init_for_pretraining(device);
    // Burn draws parameters lazily, at first use, and each clone would draw its own: draw
    // them now so that runs of clones start from the same weights.
    struct Materialize;
    impl<B: AutodiffBackend> ModuleVisitor<B> for Materialize {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    model.visit(&mut Materialize);
    model
}

/// The loss of one forward pass and every parameter's gradient, by parameter.
pub(crate) fn loss_and_gradients<B: AutodiffBackend + FusedOps>(
    model: &BertForPreTraining<B>,
    batch: &Batch<B>,
) -> (f64, HashMap<ParamId, Vec<f32>>) {
    let loss_value = loss(model, batch);
    let value = scalar(loss_value.clone());
    let grads = GradientsParams::from_grads(loss_value.backward(), model);
    let mut collect = Collect::<B> {
        grads: &grads,
        out: HashMap::new(),
        _b: std::marker::PhantomData,
    };
    model.visit(&mut collect);
    (value, collect.out)
}

/// Every parameter's gradient in `actual` within 1e-4 of the largest entry of its `expected`
/// gradient (the module's tolerance).
fn assert_gradients_close(
    actual: &HashMap<ParamId, Vec<f32>>,
    expected: &HashMap<ParamId, Vec<f32>>,
) {
    assert_gradients_within(actual, expected, 1e-4, 1e-6);
}

/// Every gradient within `tolerance` × its largest entry of `expected`'s, or × `floor` where
/// that entry is smaller.
pub(crate) fn assert_gradients_within(
    actual: &HashMap<ParamId, Vec<f32>>,
    expected: &HashMap<ParamId, Vec<f32>>,
    tolerance: f32,
    floor: f32,
) {
    assert_eq!(actual.len(), expected.len());
    for (id, expected) in expected {
        let actual = &actual[id];
        let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = actual
            .iter()
            .zip(expected)
            .fold(0f32, |m, (a, e)| m.max((a - e).abs()));
        assert!(
            diff <= tolerance * scale.max(floor),
            "gradient of {id}: max diff {diff:e} > {tolerance:e} × {scale:e}"
        );
    }
}

fn one_step<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(device: &B::Device) {
    let mut config = BertConfig::preset(Preset::Tiny);
    config.vocab_size = 211;
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    let model = seeded_model::<B>(&config, 5, device);
    let batch = batch::<B>(config.vocab_size, device);

    for optimizer in [OptimizerKind::AdamW, OptimizerKind::Lamb] {
        let optimizer = OptimizerConfig {
            name: optimizer,
            ..OptimizerConfig::default()
        };
        compare_step(&model, &batch, &optimizer);
    }

    // `hidden_act = "gelu_new"` (Note [Two GELUs]): the same weights with the tanh GELU in
    // every layer and the MLM transform. Both paths compute it (the fused step equals the
    // reference), and the masked-LM logits are the erf model's moved by the activation alone:
    // with the GELUs' biases set to 1, where the two forms differ by 1.5e-4 (at the initial
    // weights' pre-activations near 0 they differ by under 1e-6, and the loss by one ulp).
    let biased = |model: BertForPreTraining<B>| {
        let mut model = model;
        let one = |bias: Option<Param<Tensor<B, 1>>>| {
            bias.map(|b| b.map(|t| t.ones_like().require_grad()))
        };
        for layer in &mut model.bert.encoder.layer {
            layer.intermediate.dense.bias = one(layer.intermediate.dense.bias.take());
        }
        let transform = &mut model.cls.predictions.transform;
        transform.dense.bias = one(transform.dense.bias.take());
        model.with_kernels(Kernels::Reference)
    };
    config.hidden_act = "gelu_new".into();
    let erf_model = biased(model.clone());
    let tanh_model = biased(
        config
            .init_for_pretraining::<B>(device)
            .load_record(model.clone().into_record()),
    );
    let logits = |model: &BertForPreTraining<B>| {
        let out = model.forward(
            batch.input_ids.clone(),
            batch.segment_ids.clone(),
            batch.input_mask.clone(),
            batch.positions.clone(),
        );
        out.mlm_logits.into_data().to_vec::<f32>().unwrap()
    };
    for layer in &tanh_model.bert.encoder.layer {
        assert_eq!(layer.hidden_act, ember_model::Gelu::Tanh);
    }
    assert_eq!(
        tanh_model.cls.predictions.transform.hidden_act,
        ember_model::Gelu::Tanh
    );
    let (erf_logits, tanh_logits) = (logits(&erf_model), logits(&tanh_model));
    let moved = erf_logits
        .iter()
        .zip(&tanh_logits)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("largest masked-LM logit moved by the tanh GELU: {moved:e}");
    assert!(
        moved > 5e-5 && moved < 5e-4,
        "the logits moved by {moved:e}"
    );
    compare_step(&tanh_model, &batch, &OptimizerConfig::default());
}

fn compare_step<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    model: &BertForPreTraining<B>,
    batch: &Batch<B>,
    optimizer: &OptimizerConfig,
) {
    let run = |kernels: Kernels| {
        let model = model.clone().with_kernels(kernels);
        let loss_value = loss(&model, batch);
        let before = scalar(loss_value.clone());
        let grads = GradientsParams::from_grads(loss_value.backward(), &model);
        let mut collect = Collect::<B> {
            grads: &grads,
            out: HashMap::new(),
            _b: Default::default(),
        };
        model.visit(&mut collect);
        let collected = collect.out;
        let fused = kernels == Kernels::Fused;
        let mut optimizer = PreTrainingOptimizer::new(optimizer, &model, fused);
        let model = optimizer.step(1e-3, model, grads);
        let after = scalar(loss(&model, batch));
        (before, collected, after)
    };
    let (loss_ref, grads_ref, after_ref) = run(Kernels::Reference);
    let (loss_fused, grads_fused, after_fused) = run(Kernels::Fused);

    assert!(
        (loss_fused - loss_ref).abs() <= 1e-5 * loss_ref.abs(),
        "loss: fused {loss_fused} vs reference {loss_ref}"
    );
    assert_gradients_close(&grads_fused, &grads_ref);
    assert!(
        (after_fused - after_ref).abs() <= 1e-5 * after_ref.abs(),
        "loss after one {:?} step: fused {after_fused} vs reference {after_ref}",
        optimizer.name
    );
    assert!(
        after_ref < loss_ref,
        "the {:?} step lowered the loss",
        optimizer.name
    );
}

#[test]
fn one_step_fused_equals_reference_on_ndarray() {
    one_step::<burn::backend::Autodiff<burn::backend::NdArray>>(&Default::default());
}

#[test]
fn one_step_fused_equals_reference_on_wgpu_kernels() {
    one_step::<burn::backend::Autodiff<crate::Wgpu>>(
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
    );
}

/// Note [Weights cast together] (`ember_model`'s `weight_casts.rs`): a half-precision step
/// whose dense weights are cast in one multi-tensor launch is the step that casts each where
/// it is used, bit for bit (the loss and every parameter's gradient; dropout on, the same
/// masks from the same dropout seed), with fewer kernel launches. fp16 on lavapipe (WGSL has
/// no bf16; the CUDA kernel tests run the same kernel in bf16 through the half-precision
/// training step of `scripts/gpu-check.sh`).
#[test]
fn fp16_weights_cast_together_equal_casts_where_used() {
    use ember_backend_ext::HostSyncs;
    use ember_model::Precision;
    type B = burn::backend::Autodiff<crate::Wgpu>;
    let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
    let mut config = BertConfig::preset(Preset::Tiny);
    config.vocab_size = 211;
    let mut model = seeded_model::<B>(&config, 11, &device);
    model.set_precision(Precision::Fp16);
    let batch = batch::<B>(config.vocab_size, &device);
    let run = |together: bool| {
        let mut model = model.clone();
        model.bert.set_cast_weights_together(together);
        ember_backend_ext::reseed_dropout(3);
        let before = HostSyncs::now();
        let (value, gradients) = loss_and_gradients(&model, &batch);
        let launches = HostSyncs::now().since(before).launches;
        (value, gradients, launches)
    };
    let _ = run(true); // compile the kernels of both runs before counting
    let _ = run(false);
    let (loss_together, grads_together, launches_together) = run(true);
    let (loss_each, grads_each, launches_each) = run(false);
    assert!(loss_together.is_finite());
    assert_eq!(loss_together.to_bits(), loss_each.to_bits());
    assert_eq!(grads_together.len(), grads_each.len());
    for (id, grad) in &grads_each {
        let together = &grads_together[id];
        assert!(
            grad.iter()
                .zip(together)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "parameter {id}: gradients differ"
        );
    }
    // Each layer's 12 casts (packed Q, K, V, as `auto` has it on wgpu: the two
    // concatenations, the three other weights and biases, two γ and two β; Note [Packed QKV
    // cast once]), the pooler's 2 and the heads' 7 in a launch each (lavapipe binds up to 15
    // tensors of two buffers per launch), against a cast where each is used: 11 fewer per
    // layer, 1 for the pooler, 6 for the heads.
    let layers = config.num_hidden_layers as u64;
    assert!(
        launches_together + 11 * layers + 7 <= launches_each,
        "{launches_together} launches with the weights cast together, {launches_each} without"
    );
}

/// Note [Packed QKV] (backend-ext/src/qkv.rs): a training step whose layers run the query,
/// key and value projections as one dense layer equals the step with three (Hugging Face's
/// layout), with dropout on (the same masks: the same dropout seed, drawn in the same order),
/// a padded batch, several masked positions and random Q, K and V biases (a model's start at
/// zero, which would hide a bias in the wrong place): in f32 the loss within 1e-5 relative,
/// every parameter's gradient within 1e-4 of its largest entry (the GEMMs' blocking differs);
/// in a half `precision` (Note [Packed QKV cast once] in `ember_model`'s `weight_casts.rs`:
/// the packed copies cast from the f32 concatenations) the loss within `loss_tolerance` and
/// the gradients within `tolerance`. Returns the kernel launches of each step where `launches`
/// counts them.
fn packed_qkv_equals_three_projections<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    device: &B::Device,
    launches: Option<fn() -> u64>,
    precision: ember_model::Precision,
    loss_tolerance: f64,
    tolerance: f32,
) -> Option<(u64, u64)> {
    let mut config = BertConfig::preset(Preset::Tiny);
    config.vocab_size = 211;
    assert!(config.hidden_dropout_prob > 0.0 && config.attention_probs_dropout_prob > 0.0);
    let mut model = seeded_model::<B>(&config, 13, device).with_kernels(Kernels::Fused);
    model.set_precision(precision);
    for layer in &mut model.bert.encoder.layer {
        let attention = &mut layer.attention.self_attention;
        for projection in [
            &mut attention.query,
            &mut attention.key,
            &mut attention.value,
        ] {
            let width = projection.weight.dims()[1];
            projection.bias = Some(Param::from_tensor(Tensor::random(
                [width],
                burn::tensor::Distribution::Normal(0.0, 0.5),
                device,
            )));
        }
    }
    let batch = batch::<B>(config.vocab_size, device);
    let run = |packed: bool| {
        let mut model = model.clone();
        model.bert.encoder.set_qkv_projections(if packed {
            QkvProjections::Packed
        } else {
            QkvProjections::Separate
        });
        ember_backend_ext::reseed_dropout(7);
        let before = launches.map(|count| count());
        let (value, gradients) = loss_and_gradients(&model, &batch);
        let launched = launches.zip(before).map(|(count, before)| count() - before);
        (value, gradients, launched)
    };
    let _ = run(true); // compile the kernels of both runs before counting
    let _ = run(false);
    let (loss_packed, grads_packed, launches_packed) = run(true);
    let (loss_three, grads_three, launches_three) = run(false);
    assert!(loss_packed.is_finite());
    assert!(
        (loss_packed - loss_three).abs() <= loss_tolerance.max(1e-5) * loss_three.abs(),
        "loss: packed {loss_packed} vs three projections {loss_three}"
    );
    // Without loss scaling, a half precision's activation gradients fall below its normal
    // range (f16: 2⁻¹⁴) into subnormals, whose step is absolute (2⁻²⁴); a parameter gradient
    // summed from them (the key bias's is 0 in exact arithmetic: a score row shifted by a
    // constant is the same softmax) is that rounding alone. Such gradients are compared
    // against f16's smallest normal, not their own largest entry.
    // In f32 the key bias's gradient (0 in exact arithmetic) is rounding of about 1e-10, with
    // the random biases: compared against 1e-5, far below every other gradient's entries.
    let floor = match precision {
        ember_model::Precision::F32 => 1e-5,
        _ => f32::powi(2.0, -14),
    };
    assert_gradients_within(&grads_packed, &grads_three, tolerance.max(1e-4), floor);
    launches_packed.zip(launches_three)
}

#[test]
fn packed_qkv_equals_three_projections_on_ndarray() {
    packed_qkv_equals_three_projections::<burn::backend::Autodiff<burn::backend::NdArray>>(
        &Default::default(),
        None,
        ember_model::Precision::F32,
        0.0,
        0.0,
    );
}

/// On the CubeCL kernels (lavapipe), where the launches are counted: per layer the packed
/// projections save two forward GEMMs, two bias adds, four backward GEMMs, two bias-gradient
/// sums and two gradient additions, and cost a concatenation each of the weights and biases
/// and a split each of their gradients: at least 8 launches fewer.
fn packed_qkv_on_wgpu_kernels(
    precision: ember_model::Precision,
    loss_tolerance: f64,
    tolerance: f32,
) {
    let (packed, three) =
        packed_qkv_equals_three_projections::<burn::backend::Autodiff<crate::Wgpu>>(
            &burn::backend::wgpu::WgpuDevice::DefaultDevice,
            Some(|| ember_backend_ext::HostSyncs::now().launches),
            precision,
            loss_tolerance,
            tolerance,
        )
        .expect("the counting runtime counts launches");
    let layers = BertConfig::preset(Preset::Tiny).num_hidden_layers as u64;
    assert!(
        packed + 8 * layers <= three,
        "{packed} launches with the projections packed, {three} with three"
    );
}

#[test]
fn packed_qkv_equals_three_projections_on_wgpu_kernels() {
    packed_qkv_on_wgpu_kernels(ember_model::Precision::F32, 0.0, 0.0);
}

/// The same in fp16 on lavapipe (WGSL has no bf16): the packed weight's and bias's half copies
/// are cast from their f32 concatenations in the layer's one multi-tensor cast (Note [Packed
/// QKV cast once]). The tolerances are fp16's (11 significant bits through a tiny model's
/// backward: the loss within 1e-3, the gradients within 1e-2). Checked against wrong packings:
/// the value's bias in the query's place moves the loss by 0.4%; the query's and key's biases
/// swapped (the subtlest: attention is near uniform at initialisation) a gradient by just over
/// its tolerance.
#[test]
fn packed_qkv_equals_three_projections_in_fp16_on_wgpu_kernels() {
    packed_qkv_on_wgpu_kernels(ember_model::Precision::Fp16, 1e-3, 1e-2);
}
