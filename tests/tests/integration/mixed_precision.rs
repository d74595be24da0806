//! Mixed precision through the real training loop on wgpu (Mesa's lavapipe in CI, which has
//! f16 but, as all of WGSL, no bf16): 25 steps of the tiny model computing in fp16 with
//! dynamic loss scaling against the same run in f32 (Note [Autocast] in `ember_model`'s
//! `precision.rs`). Dropout on, several masked positions per sample; the two runs see the same
//! batches and dropout masks.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use burn::backend::Autodiff;
use burn::backend::wgpu::WgpuDevice;
use ember_model::Precision;
use ember_trainer::{PreparedData, RunOptions, TrainConfig, TrainSummary, prepare_data};

type B = Autodiff<crate::Wgpu>;

/// Steps of each run: 25 (50 took over 6 minutes for the two runs on 2 cores of lavapipe, the
/// second-slowest test of the suite); the scaler's first growth is not among them either
/// way (`loss_scale.growth_interval`), its skips and backoff have their own tests.
const STEPS: u64 = 25;

fn config(out: &Path, precision: Precision) -> TrainConfig {
    let mut config = ember_tests::dropout_and_masks_config(out);
    config.train.batch_size = 8;
    config.train.steps = STEPS;
    config.train.eval_every = Some(STEPS);
    config.train.eval_samples = 8;
    config.train.precision = Some(precision);
    config
}

fn data() -> Arc<PreparedData> {
    static DATA: OnceLock<Arc<PreparedData>> = OnceLock::new();
    DATA.get_or_init(|| {
        Arc::new(prepare_data(&config(Path::new("unused"), Precision::F32)).unwrap())
    })
    .clone()
}

fn run(config: &TrainConfig) -> TrainSummary {
    ember_trainer::train_in_process_with_data::<B>(
        config,
        1,
        &WgpuDevice::DefaultDevice,
        RunOptions::default(),
        Some(data()),
    )
    .unwrap()
}

#[test]
fn fp16_with_loss_scaling_trains_as_f32() {
    let dir = tempfile::tempdir().unwrap();
    let full = run(&config(&dir.path().join("f32"), Precision::F32));
    let half = run(&config(&dir.path().join("fp16"), Precision::Fp16));
    assert_eq!(full.precision, Precision::F32);
    assert_eq!(half.precision, Precision::Fp16);
    assert_eq!(full.loss_scale, None, "f32 does not scale");
    let scale = half.loss_scale.expect("fp16 scales the loss by default");
    assert!(scale >= 1.0, "{scale}");
    assert_eq!(half.steps, STEPS);
    let worst = full
        .losses
        .iter()
        .zip(&half.losses)
        .map(|(a, b)| ((a - b) / a).abs())
        .fold(0.0, f64::max);
    eprintln!(
        "fp16 against f32, {STEPS} steps: worst loss difference {worst:.2e} (relative), final \
         losses {:.4} / {:.4}, loss scale {scale}, skipped steps {}, training {:.1} s / {:.1} s",
        full.losses[STEPS as usize - 1],
        half.losses[STEPS as usize - 1],
        half.skipped_steps,
        full.train_seconds,
        half.train_seconds
    );
    for (step, (a, b)) in full.losses.iter().zip(&half.losses).enumerate() {
        assert!(
            ((a - b) / a).abs() < 0.02,
            "step {}: f32 loss {a}, fp16 loss {b}",
            step + 1
        );
    }
    // The master weights stay f32: the checkpoint's tensors are F32 and finite.
    let bytes = std::fs::read(&half.checkpoint).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, view) in file.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    }
    let (a, b) = (
        ember_tests::read_safetensors(&full.checkpoint),
        ember_tests::read_safetensors(&half.checkpoint),
    );
    let (mut diff, mut norm, mut worst_abs) = (0.0, 0.0, 0.0f64);
    for (name, x) in &a {
        for (x, y) in x.iter().zip(&b[name]) {
            assert!(y.is_finite(), "{name}");
            diff += (x - y) * (x - y);
            norm += x * x;
            worst_abs = worst_abs.max((x - y).abs());
        }
    }
    let relative = (diff / norm).sqrt();
    eprintln!("weights: relative L2 difference {relative:.2e}, largest {worst_abs:.2e}");
    assert!(relative < 0.01, "weights part: {relative}");
}

/// Asserts that most of a gradient's nonzero `values` carry bits f16 has not (written in f32,
/// not rounded to the half type).
fn assert_beyond_f16(name: &str, values: Vec<f32>) {
    let nonzero = values.iter().filter(|v| **v != 0.0).count();
    let beyond_f16 = values
        .iter()
        .filter(|v| burn::tensor::f16::from_f32(**v).to_f32() != **v)
        .count();
    assert!(
        nonzero > 0 && beyond_f16 * 2 > nonzero,
        "{name}: {beyond_f16} of {nonzero} nonzero gradients carry bits f16 has not"
    );
}

/// What runs in half and what in f32 (Note [Autocast]): with fp16 the encoder's output and
/// the logits are f16 (as `torch.autocast` returns them), the loss f32, the parameters and
/// their gradients f32; the loss is near the f32
/// model's on the same weights and batch (fp16 rounds to 11 significant bits: within 1e-2
/// relative). The dense layers' weight gradients are written in f32 by the GEMM (Note [Weight
/// gradients in f32] in backend-ext's `linear.rs`): the packed Q weight's, a plain dense
/// layer's and the tied decoder's (the word embeddings') carry bits f16 has not, and so do the
/// biases', γ's and β's, summed in f32 by the fused ops' backward. The model
/// comes from `initial_model`, which draws its weights while no other test's run initialises
/// (the device's generator is shared).
#[test]
fn fp16_computes_the_encoder_and_logits_in_half_and_the_loss_and_gradients_in_f32() {
    use burn::tensor::{DType, Int, Tensor};
    let device = WgpuDevice::DefaultDevice;
    let train = config(Path::new("unused"), Precision::F32);
    let mut model = ember_trainer::initial_model::<B>(&train, 30522, &device).unwrap();
    let ids: Vec<i64> = (0..2 * 16).map(|i| 1000 + 37 * i).collect();
    let input_ids = Tensor::<B, 1, Int>::from_data(ids.as_slice(), &device).reshape([2, 16]);
    let segment_ids = Tensor::<B, 2, Int>::zeros([2, 16], &device);
    let input_mask = Tensor::<B, 2, Int>::ones([2, 16], &device);
    let positions = Tensor::<B, 1, Int>::from_data([1, 5, 17, 30].as_slice(), &device);
    let labels = Tensor::<B, 1, Int>::from_data([7, 8, 9, 10].as_slice(), &device);
    let nsp = Tensor::<B, 1, Int>::from_data([0, 1].as_slice(), &device);
    let loss_of = |model: &ember_model::BertForPreTraining<B>| {
        let out = model.forward(
            input_ids.clone(),
            segment_ids.clone(),
            input_mask.clone(),
            positions.clone(),
        );
        (
            out.mlm_logits.dtype(),
            model.loss(&out, labels.clone(), nsp.clone()).total,
        )
    };
    let (_, full) = loss_of(&model);
    model.set_precision(Precision::Fp16);
    let encoded = model
        .bert
        .forward(input_ids.clone(), segment_ids.clone(), input_mask.clone());
    assert_eq!(encoded.sequence_output.dtype(), DType::F16);
    let (logits_dtype, half) = loss_of(&model);
    // The logits in the heads' dtype (as autocast returns them); the loss in f32.
    assert_eq!(logits_dtype, DType::F16);
    assert_eq!(half.dtype(), DType::F32);
    let grads = half.clone().backward();
    let layer = &model.bert.encoder.layer[0];
    for (name, weight) in [
        ("query", &layer.attention.self_attention.query.weight),
        ("output", &layer.output.dense.weight),
        (
            "word embeddings",
            &model.bert.embeddings.word_embeddings.weight,
        ),
    ] {
        assert_eq!(weight.val().dtype(), DType::F32, "{name}");
        let grad = weight.grad(&grads).unwrap();
        assert_eq!(grad.dtype(), DType::F32, "{name}");
        assert_beyond_f16(name, grad.into_data().to_vec::<f32>().unwrap());
    }
    // The biases', γ's and β's, summed by the fused ops' backward in f32 (Note [Parameter
    // gradients in f32] in backend-ext's `masters.rs`). Not the Q bias's: without loss
    // scaling its rows of gradient are f16 subnormals (~1e-6), multiples of 2⁻²⁴ whose sums
    // under 2⁻¹³ are f16 values whatever the sum's type (the dense op's test checks it).
    let transform = &model.cls.predictions.transform;
    for (name, vector) in [
        (
            "bias + GELU bias",
            layer.intermediate.dense.bias.as_ref().unwrap(),
        ),
        (
            "attention output bias",
            layer.attention.output.dense.bias.as_ref().unwrap(),
        ),
        (
            "attention LayerNorm γ",
            &layer.attention.output.layer_norm.gamma,
        ),
        (
            "output LayerNorm β",
            layer.output.layer_norm.beta.as_ref().unwrap(),
        ),
        ("MLM transform γ", &transform.layer_norm.gamma),
    ] {
        let grad = vector.grad(&grads).unwrap();
        assert_eq!(grad.dtype(), DType::F32, "{name}");
        assert_beyond_f16(name, grad.into_data().to_vec::<f32>().unwrap());
    }
    let (full, half) = (full.into_scalar(), half.into_scalar());
    assert!(
        ((full - half) / full).abs() < 1e-2,
        "f32 {full}, fp16 {half}"
    );
    assert_ne!(full, half, "fp16 rounding changed nothing: not in use?");
}

/// bf16 device buckets need bf16 on the device: wgpu has none, and the run says so before
/// its first step, naming the setting.
#[test]
fn bf16_device_buckets_on_wgpu_are_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = config(dir.path(), Precision::F32);
    c.train.steps = 2;
    c.parallel.buckets = ember_trainer::parallel::BucketStorage::Device;
    c.parallel.allreduce_dtype = ember_trainer::parallel::AllreduceDtype::Bf16;
    let error = ember_trainer::train_in_process_with_data::<B>(
        &c,
        2,
        &WgpuDevice::DefaultDevice,
        RunOptions::default(),
        Some(data()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("parallel.allreduce_dtype") && error.contains("no bf16"),
        "{error}"
    );
}

/// Note [Parameters ordered after their layer's input] (`ember_model`'s `weight_casts.rs`):
/// each encoder layer's weights reach it through a cast under a half precision (Note
/// [Autocast]) and the packed Q, K and V weights through a concatenation (Note [Packed QKV];
/// lavapipe packs), and the gradient hook at the layer's input must still see their final
/// gradients, so that their buckets' allreduce overlaps the rest of backward. The probe the
/// trainer runs (`ready_order`, which compares each hooked gradient with the final one, bit
/// for bit) must find every parameter but the embeddings' hooked, in fp16 as in f32, with the
/// weights cast together or each where used, and with Q, K and V packed or apart. (Before:
/// none in fp16; in f32 all but the embeddings' and the packed Q, K, V's.) That the values
/// are right is the other tests' business: the fused path against Hugging Face's gradients
/// (`hf_parity.rs`), fp16 training against f32 (above).
#[test]
fn fp16_hooks_deliver_the_parameters_f32_hooks_do() {
    use ember_trainer::grads::named_params;
    use ember_trainer::parallel::ready_order;
    let device = WgpuDevice::DefaultDevice;
    let train = config(Path::new("unused"), Precision::F32);
    let mut model = ember_trainer::initial_model::<B>(&train, 30522, &device).unwrap();
    let loader = ember_data::InstanceLoader::new(data().eval.clone(), 2, 64, 0, "eval").unwrap();
    let batch = loader
        .sequential_batches()
        .next()
        .unwrap()
        .to_device::<B>(&device);
    let names: std::collections::HashMap<_, _> = named_params::<B, _>(&model)
        .into_iter()
        .map(|(name, id)| (id, name))
        .collect();
    let mut expected: Vec<String> = names
        .values()
        .filter(|name| !name.starts_with("bert.embeddings."))
        .cloned()
        .collect();
    expected.sort();
    assert!(
        expected
            .iter()
            .any(|n| n == "bert.encoder.layer.1.attention.self_attention.query.weight"),
        "{expected:?}"
    );
    let hooked = |model: &ember_model::BertForPreTraining<B>| {
        let order = ready_order(model, batch.clone(), None);
        let mut hooked: Vec<String> = order
            .hooked_set()
            .iter()
            .map(|id| names[id].clone())
            .collect();
        hooked.sort();
        hooked
    };
    assert_eq!(hooked(&model), expected, "hooked in f32");
    model.set_precision(Precision::Fp16);
    assert_eq!(hooked(&model), expected, "hooked in fp16");
    model.bert.set_cast_weights_together(false);
    assert_eq!(
        hooked(&model),
        expected,
        "hooked in fp16, each weight cast where used"
    );
    model.bert.set_cast_weights_together(true);
    model
        .bert
        .encoder
        .set_qkv_projections(ember_model::QkvProjections::Separate);
    assert_eq!(hooked(&model), expected, "hooked in fp16, Q, K, V apart");
}
