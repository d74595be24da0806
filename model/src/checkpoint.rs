//! Hugging Face checkpoints: safetensors files with `BertForPreTraining` (or `BertModel`) keys.
//!
//! Module paths follow the state-dict keys, so the mapping is short:
//! - `attention.self` ↔ `attention.self_attention` (`self` is a Rust keyword);
//! - `LayerNorm` ↔ `layer_norm` (Rust field case);
//! - LayerNorm `weight`/`bias` ↔ Burn's `gamma`/`beta`, and Linear weights transposed
//!   (`[out, in]` ↔ `[in, out]`): burn-store's PyTorch adapters do both.
//!
//! The tied MLM decoder (`cls.predictions.decoder.weight` = the word embeddings,
//! `cls.predictions.decoder.bias` = `cls.predictions.bias`) is not a parameter of its own: it is
//! skipped when present on load and not written on save, as `save_pretrained` does.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_store::{ApplyResult, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use safetensors::tensor::{Dtype, TensorView};

use crate::{BertForPreTraining, BertModel, ModelError};

/// Hugging Face key fragment → ember path fragment, as regex and replacement.
const HF_TO_EMBER: [(&str, &str); 2] = [
    (r"\.self\.", ".self_attention."),
    (r"\.LayerNorm\.", ".layer_norm."),
];

/// The Hugging Face state-dict key of an ember parameter path (Burn's `gamma`/`beta` become
/// `weight`/`bias` for LayerNorms). Linear weights additionally need a transpose.
///
/// `bert.encoder.layer.0.attention.self_attention.query.weight`
/// → `bert.encoder.layer.0.attention.self.query.weight`.
pub fn ember_path_to_hf(path: &str) -> String {
    let mut key = path
        .replace(".self_attention.", ".self.")
        .replace("layer_norm.", "LayerNorm.");
    if key.contains("LayerNorm.") {
        if let Some(stem) = key.strip_suffix(".gamma") {
            key = format!("{stem}.weight");
        } else if let Some(stem) = key.strip_suffix(".beta") {
            key = format!("{stem}.bias");
        }
    }
    key
}

fn checkpoint_error(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn hf_load_store(path: &Path) -> SafetensorsStore {
    let mut store = SafetensorsStore::from_file(path)
        .with_from_adapter(PyTorchToBurnAdapter)
        .allow_partial(true);
    for (from, to) in HF_TO_EMBER {
        store = store.with_key_remapping(from, to);
    }
    store
}

/// Turns burn-store's report into an error when a parameter was not loaded.
fn check_applied(path: &Path, result: ApplyResult) -> Result<(), ModelError> {
    if !result.errors.is_empty() {
        let errors: Vec<String> = result.errors.iter().map(|e| format!("{e:?}")).collect();
        return Err(checkpoint_error(
            path,
            format!("tensors do not fit the model: {}", errors.join("; ")),
        ));
    }
    if !result.missing.is_empty() {
        let missing: Vec<String> = result
            .missing
            .iter()
            .map(|(p, _)| ember_path_to_hf(p))
            .collect();
        return Err(checkpoint_error(
            path,
            format!(
                "{} parameter(s) missing from the checkpoint, first: {}",
                missing.len(),
                missing[..missing.len().min(5)].join(", ")
            ),
        ));
    }
    Ok(())
}

fn ensure_file(path: &Path) -> Result<(), ModelError> {
    if path.is_file() {
        Ok(())
    } else {
        Err(ModelError::Io {
            path: path.to_path_buf(),
            error: std::io::Error::new(std::io::ErrorKind::NotFound, "no such checkpoint file"),
        })
    }
}

impl<B: Backend> BertForPreTraining<B> {
    /// Loads every parameter from a Hugging Face `BertForPreTraining` safetensors file
    /// (`model.safetensors` of `save_pretrained`, or `safetensors.torch.save_file` of the
    /// state dict).
    ///
    /// # Errors
    /// [`ModelError::Io`] if the file does not exist; [`ModelError::Checkpoint`] if it is not
    /// safetensors, a parameter is missing, or a tensor's shape differs from the model's (e.g.
    /// a checkpoint of another size: build the model from the checkpoint's `config.json`).
    pub fn load_hf_safetensors(mut self, path: &Path) -> Result<Self, ModelError> {
        ensure_file(path)?;
        let result = self
            .load_from(&mut hf_load_store(path))
            .map_err(|e| checkpoint_error(path, e.to_string()))?;
        check_applied(path, result)?;
        Ok(self)
    }

    /// Writes every parameter under its Hugging Face key, so that
    /// `BertForPreTraining.from_pretrained(dir)` reads the file (with `config.json` from
    /// [`crate::BertConfig::to_hf_json`]). The file is written beside `path`, flushed to disk
    /// and renamed into place, so an interrupted save never leaves a half-written checkpoint.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] if the file cannot be written or renamed.
    pub fn save_hf_safetensors(&self, path: &Path) -> Result<(), ModelError> {
        write_hf_tensors(path, hf_tensors(self))
    }
}

/// Writes `tensors` (Hugging Face keys, f32) to a safetensors file at `path`, through a
/// temporary file, flushed to disk and renamed into place.
fn write_hf_tensors(path: &Path, tensors: Vec<(String, TensorData)>) -> Result<(), ModelError> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            TensorView::new(Dtype::F32, data.shape.as_slice().to_vec(), data.as_bytes())
                .map(|view| (name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| checkpoint_error(path, e.to_string()))?;
    let tmp = temp_path(path);
    let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let written = safetensors::serialize_to_file(views, Some(metadata), &tmp)
        .map_err(|e| checkpoint_error(path, e.to_string()))
        .and_then(|()| {
            // On disk before the rename: a crash of the node never leaves a renamed file
            // whose contents are still in the page cache only.
            std::fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .map_err(|e| checkpoint_error(path, e.to_string()))
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        checkpoint_error(
            path,
            format!("cannot rename {} into place: {e}", tmp.display()),
        )
    })
}

/// A tensor's values, read at memory speed even while another handle holds the tensor (a
/// module's parameter, an optimizer's moment).
///
/// Note [Reading shared tensors]: Burn's NdArray backend reads an array that is shared by
/// iterating it element by element through its dynamic-rank index (measured: 6.7 s for
/// BERT-base's 880 MB of Adam moments); a multiplication by one first makes an unshared copy
/// in a vectorised pass, which the read then takes over without copying (0.9 s). Exact:
/// x · 1 = x for every finite float. On other backends it costs one element-wise kernel.
pub fn read_unshared<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> TensorData {
    tensor.mul_scalar(1.0).into_data()
}

/// A row-major `[rows, cols]` f32 matrix transposed to `[cols, rows]`, in 64 × 64 tiles (a
/// transposed view read through Burn would be gathered element by element, Note [Writing
/// weights directly]).
fn transposed(data: &TensorData) -> TensorData {
    let [rows, cols] = [data.shape[0], data.shape[1]];
    let from = data.as_slice::<f32>().expect("f32 after convert");
    let mut to = vec![0f32; rows * cols];
    const TILE: usize = 64;
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    to[c * rows + r] = from[r * cols + c];
                }
            }
        }
    }
    TensorData::new(to, [cols, rows])
}

/// Every parameter of `module` as f32 under its Hugging Face key, in Hugging Face's layout
/// (Linear weights `[out, in]`; embeddings and LayerNorm parameters as they are).
///
/// Note [Writing weights directly]: burn-store's snapshot reads each parameter with Burn's
/// `into_data`, slow for tensors the module still holds (Note [Reading shared tensors]; BERT-
/// large's weights took 20 s to write); here each is read with [`read_unshared`] and Linear
/// weights are transposed on the host in tiles.
fn hf_tensors<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, TensorData)> {
    struct Collect {
        stack: Vec<String>,
        out: Vec<(String, TensorData)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.stack.join(".");
            let value = param.val();
            // A Linear's weight is Burn's `[in, out]`; embedding tables are `[rows, hidden]`
            // in both layouts.
            let linear = D == 2 && path.ends_with(".weight") && !path.contains("embeddings.");
            let data = read_unshared(value).convert::<f32>();
            let data = if linear { transposed(&data) } else { data };
            self.out.push((ember_path_to_hf(&path), data));
        }
    }
    let mut collect = Collect {
        stack: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}

impl<B: Backend> BertModel<B> {
    /// Loads the encoder from a Hugging Face safetensors file, with or without the `bert.` key
    /// prefix: a `BertModel` checkpoint (sentence-transformers models such as all-MiniLM-L6-v2)
    /// or a `BertForPreTraining` one, whose heads are ignored.
    ///
    /// # Errors
    /// As [`BertForPreTraining::load_hf_safetensors`].
    /// Writes the encoder's parameters under Hugging Face's `BertModel` keys (no `bert.`
    /// prefix), so that `BertModel.from_pretrained(dir)` and sentence-transformers read the
    /// file (with `config.json` from [`crate::BertConfig::to_hf_json_as`]); written as
    /// [`BertForPreTraining::save_hf_safetensors`] writes.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] if the file cannot be written or renamed.
    pub fn save_hf_safetensors(&self, path: &Path) -> Result<(), ModelError> {
        write_hf_tensors(path, hf_tensors(self))
    }

    pub fn load_hf_safetensors(mut self, path: &Path) -> Result<Self, ModelError> {
        ensure_file(path)?;
        let mut store = hf_load_store(path).with_key_remapping(r"^bert\.", "");
        let result = self
            .load_from(&mut store)
            .map_err(|e| checkpoint_error(path, e.to_string()))?;
        check_applied(path, result)?;
        Ok(self)
    }
}

/// `dir/name.ext` → `dir/.name.ext.tmp`: the same file system, so the final rename is atomic.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ember_paths_map_to_hf_keys() {
        assert_eq!(
            ember_path_to_hf("bert.encoder.layer.3.attention.self_attention.query.weight"),
            "bert.encoder.layer.3.attention.self.query.weight"
        );
        assert_eq!(
            ember_path_to_hf("bert.encoder.layer.0.output.layer_norm.gamma"),
            "bert.encoder.layer.0.output.LayerNorm.weight"
        );
        assert_eq!(
            ember_path_to_hf("cls.predictions.transform.layer_norm.beta"),
            "cls.predictions.transform.LayerNorm.bias"
        );
        assert_eq!(
            ember_path_to_hf("cls.predictions.bias"),
            "cls.predictions.bias"
        );
    }
}
