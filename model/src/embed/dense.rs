//! sentence-transformers' `Dense` module (`sentence_transformers/base/modules/dense.py`):
//! `activation(x · Wᵀ + b)` on the sentence embedding, its weights `linear.weight` `[out, in]`
//! and `linear.bias` in the module folder's `model.safetensors` (or `pytorch_model.bin`).

use std::path::Path;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::Tensor;
use burn::tensor::activation::{gelu, relu, sigmoid, tanh};
use burn::tensor::backend::Backend;
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, PytorchStore, SafetensorsStore};

use super::folder::{Activation, DenseSpec};
use crate::ModelError;

/// The module's parameters under sentence-transformers' names (`linear.weight`, `linear.bias`).
#[derive(Module, Debug)]
pub(crate) struct StDense<B: Backend> {
    linear: Linear<B>,
}

/// A loaded Dense module.
#[derive(Debug)]
pub(crate) struct Dense<B: Backend> {
    module: StDense<B>,
    activation: Activation,
}

impl<B: Backend> Dense<B> {
    /// Loads `spec`'s weights.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] naming the file: no weights file, a missing tensor or one of
    /// another shape than `config.json` says.
    pub fn load(spec: &DenseSpec, device: &B::Device) -> Result<Self, ModelError> {
        let module = StDense {
            linear: LinearConfig::new(spec.in_features, spec.out_features)
                .with_bias(spec.bias)
                .init(device),
        };
        let error = |path: &Path, reason: String| ModelError::Checkpoint {
            path: path.to_path_buf(),
            reason,
        };
        let safetensors = spec.dir.join("model.safetensors");
        let bin = spec.dir.join("pytorch_model.bin");
        let mut module = module;
        let (path, result) = if safetensors.is_file() {
            let mut store = SafetensorsStore::from_file(&safetensors)
                .with_from_adapter(PyTorchToBurnAdapter)
                .allow_partial(true);
            let result = module.load_from(&mut store).map_err(|e| e.to_string());
            (&safetensors, result)
        } else if bin.is_file() {
            let mut store = PytorchStore::from_file(&bin).allow_partial(true);
            let result = module.load_from(&mut store).map_err(|e| e.to_string());
            (&bin, result)
        } else {
            return Err(error(
                &spec.dir,
                "the Dense module has no model.safetensors or pytorch_model.bin".into(),
            ));
        };
        let result = result.map_err(|e| error(path, e))?;
        let mut expected = vec!["linear.weight"];
        if spec.bias {
            expected.push("linear.bias");
        }
        if !result.errors.is_empty() {
            return Err(error(path, format!("{:?}", result.errors)));
        }
        for name in expected {
            if !result.applied.iter().any(|a| a == name) {
                return Err(error(
                    path,
                    format!(
                        "no tensor {name} of the shape config.json gives ({} → {})",
                        spec.in_features, spec.out_features
                    ),
                ));
            }
        }
        Ok(Self {
            module,
            activation: spec.activation,
        })
    }

    /// Its output size.
    pub fn out_features(&self) -> usize {
        self.module.linear.weight.dims()[1]
    }

    /// `activation(x · Wᵀ + b)`.
    ///
    /// # Shapes
    /// `x` `[n, in]` → `[n, out]`
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = self.module.linear.forward(x);
        match self.activation {
            Activation::Tanh => tanh(y),
            Activation::Identity => y,
            Activation::Relu => relu(y),
            Activation::Sigmoid => sigmoid(y),
            Activation::Gelu => gelu(y),
        }
    }
}
