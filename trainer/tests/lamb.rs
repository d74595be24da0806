//! LAMB against the MLPerf reference's formula (apex `FusedLAMB`, `use_nvlamb=False` and
//! `True`), three steps on a weight (decayed, adapted) and a bias (neither), goldens from
//! `fixtures/make_lamb_golden.py`. Both ember paths: Burn's adaptor tensor by tensor and the
//! multi-tensor ops.

use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use ember_trainer::OptimizerKind;
use ember_trainer::config::OptimizerConfig;
use ember_trainer::optim::PreTrainingOptimizer;
use serde_json::Value;

type B = Autodiff<NdArray>;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn lamb_equals_the_mlperf_reference() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lamb_golden.json"
    );
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let device = Default::default();
    let hyper = |k: &str| golden[k].as_f64().unwrap();
    for fused in [false, true] {
        for (nvlamb, expected) in [(false, &golden["mlperf"]), (true, &golden["nvlamb"])] {
            let config = OptimizerConfig {
                name: OptimizerKind::Lamb,
                beta1: hyper("beta1") as f32,
                beta2: hyper("beta2") as f32,
                epsilon: hyper("epsilon") as f32,
                weight_decay: hyper("weight_decay") as f32,
                nvlamb,
                ..Default::default()
            };
            let mut model: Linear<B> = LinearConfig::new(4, 3).init(&device);
            let initial = &golden["initial"];
            model.weight = Param::from_tensor(Tensor::from_data(
                TensorData::new(floats(&initial["weight"]), [4, 3]),
                &device,
            ));
            model.bias = Some(Param::from_tensor(Tensor::from_data(
                TensorData::new(floats(&initial["bias"]), [3]),
                &device,
            )));
            let mut optimizer = PreTrainingOptimizer::new(&config, &model, fused);
            for step in golden["grads"].as_array().unwrap() {
                let mut grads = GradientsParams::new();
                grads.register::<NdArray, 2>(
                    model.weight.id,
                    Tensor::from_data(TensorData::new(floats(&step["weight"]), [4, 3]), &device),
                );
                grads.register::<NdArray, 1>(
                    model.bias.as_ref().unwrap().id,
                    Tensor::from_data(TensorData::new(floats(&step["bias"]), [3]), &device),
                );
                model = optimizer.step(hyper("lr"), model, grads);
            }
            let got_weight = model.weight.val().into_data().to_vec::<f32>().unwrap();
            let got_bias = model
                .bias
                .unwrap()
                .val()
                .into_data()
                .to_vec::<f32>()
                .unwrap();
            for (name, got, want) in [
                ("weight", got_weight, floats(&expected["weight"])),
                ("bias", got_bias, floats(&expected["bias"])),
            ] {
                for (g, w) in got.iter().zip(&want) {
                    // f32 arithmetic in another order: a few ulp of the step (lr = 1e-2).
                    assert!(
                        (g - w).abs() <= 2e-6,
                        "fused {fused}, nvlamb {nvlamb}, {name}: {got:?} vs {want:?}"
                    );
                }
            }
        }
    }
}
