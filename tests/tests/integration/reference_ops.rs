//! Note [Fused where it pays] (`ember-backend-ext`'s `reference_ops.rs`): each fused op taken
//! out of the fused path (`model.reference_ops`) gives the fused step's loss and gradients, and
//! none of its kernels is launched. The tiny model with dropout on (the same keyed masks: the
//! same dropout seed, drawn in the same order), a padded batch, several masked positions, and
//! every bias, γ and β drawn at random (BERT starts them at 0 and 1, where a bias dropped or
//! added twice would not show).
//!
//! Tolerances: in f32 the loss within 1e-5 relative and each gradient within 1e-4 of its
//! largest entry, or of 1e-5 where that is smaller (the key bias's gradient, 0 in exact
//! arithmetic, is rounding of about 1e-10: the packed QKV test's floor), as the fused kernels
//! and the composition sum in different orders (`fused_training.rs`; measured at most 1.1e-5,
//! and 5e-2 with the attention's scale off by 5%, which leaves the tiny model's loss within
//! 2e-7). In fp16 (wgpu) the fused ops keep intermediate values in f32 where the composition
//! rounds them to f16 (GELU's `erf`, the dense output before its bias), and without loss
//! scaling the activations' gradients are largely subnormal: the loss within 1e-3 relative and
//! each gradient within 1e-1 of its largest entry (measured 3.2e-2, and 4.7e-2 with other
//! random vectors), a gradient whose largest entry is below f16's smallest normal (2⁻¹⁴: the
//! key bias's, 0 in exact arithmetic) against 2⁻¹⁴, as the packed QKV test does. That run
//! checks that every parameter gets its gradient through each composed op beside the fused
//! path's half copies and f32 masters (Note [Parameter gradients in f32]), roughly right; f32
//! checks the values.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};
use ember_backend_ext::FusedOps;
use ember_model::{BertConfig, FusedOp, Kernels, Precision, Preset, ReferenceOps};

use crate::fused_training::{assert_gradients_within, batch, loss_and_gradients, seeded_model};

/// Every vector parameter (biases, γ, β) drawn from N(0.2, 0.5).
pub(crate) struct RandomVectors<'a, B: AutodiffBackend> {
    pub(crate) device: &'a B::Device,
}

impl<B: AutodiffBackend> ModuleMapper<B> for RandomVectors<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if D != 1 {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let random = Tensor::random(tensor.dims(), Distribution::Normal(0.2, 0.5), self.device)
            .require_grad();
        Param::from_mapped_value(id, random, mapper)
    }
}

/// The kernels of each op, by a part of their names (`KernelLaunches`).
fn kernel_names(op: FusedOp) -> &'static [&'static str] {
    match op {
        FusedOp::BiasGelu => &["bias_gelu"],
        FusedOp::LayerNorm => &["layer_norm"],
        FusedOp::Attention => &["masked_softmax"],
        FusedOp::CrossEntropy => &["cross_entropy"],
    }
}

/// Each op of [`FusedOp::ALL`] alone, then all of them, as reference ops against the fused
/// step, in `precision` within `(loss_tolerance, tolerance)`; where `launches` records the
/// step's launches by kernel, none of a reference op's kernels is among them, and each is
/// among the fused step's.
fn each_reference_op_equals_the_fused_step<B>(
    device: &B::Device,
    precision: Precision,
    (loss_tolerance, tolerance): (f64, f32),
    launches: Option<fn(&mut dyn FnMut()) -> Vec<(&'static str, u64)>>,
) where
    B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps,
{
    let mut config = BertConfig::preset(Preset::Tiny);
    config.vocab_size = 211;
    assert!(config.hidden_dropout_prob > 0.0 && config.attention_probs_dropout_prob > 0.0);
    let model = seeded_model::<B>(&config, 17, device).with_kernels(Kernels::Fused);
    let mut model = {
        // The device's generator, seeded and drawn while no other test's run initialises.
        let _guard = ember_trainer::initialisation_lock();
        B::seed(device, 19);
        model.map(&mut RandomVectors::<B> { device })
    };
    model.set_precision(precision);
    let batch = batch::<B>(config.vocab_size, device);
    let run = |ops: ReferenceOps| {
        let model = model.clone().with_reference_ops(ops);
        let mut result = None;
        let mut step = || {
            // The masks keyed on this thread alone, as the trainer keys a micro-batch's.
            let _scope = ember_backend_ext::DropoutScope::enter(5, 0, 0, 0);
            result = Some(loss_and_gradients(&model, &batch));
        };
        let by_kernel = launches.map(|record| record(&mut step));
        if by_kernel.is_none() {
            step();
        }
        let (loss, gradients) = result.expect("the step ran");
        (loss, gradients, by_kernel.unwrap_or_default())
    };
    let (loss_fused, grads_fused, kernels_fused) = run(ReferenceOps::NONE);
    assert!(loss_fused.is_finite(), "fused loss {loss_fused}");
    let launched =
        |kernels: &[(&str, u64)], part: &str| kernels.iter().any(|(name, _)| name.contains(part));
    let mut cases: Vec<ReferenceOps> = FusedOp::ALL
        .into_iter()
        .map(|op| ReferenceOps::NONE.with(op))
        .collect();
    cases.push(FusedOp::ALL.into_iter().collect());
    for ops in cases {
        let (loss, grads, kernels) = run(ops);
        assert!(
            (loss - loss_fused).abs() <= loss_tolerance * loss_fused.abs(),
            "reference ops {ops}: loss {loss} against the fused step's {loss_fused}"
        );
        let floor = match precision {
            Precision::F32 => 1e-5,
            _ => f32::powi(2.0, -14),
        };
        let worst = grads_fused
            .iter()
            .map(|(id, expected)| {
                let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs())).max(floor);
                let diff = grads[id]
                    .iter()
                    .zip(expected)
                    .fold(0f32, |m, (a, e)| m.max((a - e).abs()));
                diff / scale
            })
            .fold(0f32, f32::max);
        eprintln!(
            "reference ops {ops}: loss {loss} against {loss_fused}; worst gradient {worst:e}"
        );
        assert!(worst.is_finite(), "reference ops {ops}: gradients {worst}");
        assert_gradients_within(&grads, &grads_fused, tolerance, floor);
        if launches.is_some() {
            for op in FusedOp::ALL {
                for part in kernel_names(op) {
                    assert!(
                        launched(&kernels_fused, part),
                        "the fused step launches no `{part}` kernel: {kernels_fused:?}"
                    );
                    assert_eq!(
                        launched(&kernels, part),
                        !ops.contains(op),
                        "reference ops {ops}: `{part}` kernels launched: {kernels:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn each_reference_op_equals_the_fused_step_on_ndarray() {
    each_reference_op_equals_the_fused_step::<burn::backend::Autodiff<burn::backend::NdArray>>(
        &Default::default(),
        Precision::F32,
        (1e-5, 1e-4),
        None,
    );
}

/// The launches of `step` by kernel, on this thread's stream.
fn launches_by_kernel(step: &mut dyn FnMut()) -> Vec<(&'static str, u64)> {
    use ember_backend_ext::KernelLaunches;
    KernelLaunches::record(true);
    let before = KernelLaunches::now();
    step();
    let launched = KernelLaunches::since(&KernelLaunches::now(), &before);
    KernelLaunches::record(false);
    launched
}

#[test]
fn each_reference_op_equals_the_fused_step_and_launches_none_of_its_kernels_on_wgpu() {
    each_reference_op_equals_the_fused_step::<burn::backend::Autodiff<crate::Wgpu>>(
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
        Precision::F32,
        (1e-5, 1e-4),
        Some(launches_by_kernel),
    );
}

/// In fp16 the fused path holds f32 masters beside half copies (Note [Parameter gradients in
/// f32]); each op composed takes its parameters as the reference path does, and their
/// gradients must still reach the masters.
#[test]
fn each_reference_op_equals_the_fused_step_in_fp16_on_wgpu() {
    each_reference_op_equals_the_fused_step::<burn::backend::Autodiff<crate::Wgpu>>(
        &burn::backend::wgpu::WgpuDevice::DefaultDevice,
        Precision::Fp16,
        (1e-3, 1e-1),
        Some(launches_by_kernel),
    );
}
