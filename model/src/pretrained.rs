//! Starting from another BERT's weights: finding the weights file of a path (a Hugging Face
//! folder, an ember run or checkpoint folder, a `.safetensors` or PyTorch `.bin` file) and
//! loading it into a [`BertForPreTraining`] that may have parts the file lacks.
//!
//! Accepted key layouts: `BertForPreTraining` (`bert.…`, `cls.…`) and `BertModel` (no `bert.`
//! prefix: sentence-transformers models, `BertModel.save_pretrained`). The tied decoder
//! (`cls.predictions.decoder.*`) and the `position_ids` buffer of older checkpoints are not
//! parameters and are ignored; any other tensor the model has no place for is an error, never
//! skipped silently.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn_store::{
    ApplyError, ApplyResult, ModuleSnapshot, ModuleStore, PyTorchToBurnAdapter, PytorchStore,
    SafetensorsStore,
};

use crate::checkpoint::ember_path_to_hf;
use crate::{BertForPreTraining, ModelError};

/// A weights file and its format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightsFile {
    /// safetensors (`model.safetensors`, `safetensors.torch.save_file`).
    Safetensors(PathBuf),
    /// PyTorch's pickle format (`pytorch_model.bin`, `torch.save(state_dict)`).
    PyTorch(PathBuf),
}

impl WeightsFile {
    /// The file.
    pub fn path(&self) -> &Path {
        match self {
            Self::Safetensors(p) | Self::PyTorch(p) => p,
        }
    }

    /// The weights file of `path`: the file itself (`.safetensors`, `.bin`, `.pt`, `.pth`),
    /// or in a folder `model.safetensors`, else `pytorch_model.bin`; an ember run folder
    /// without either gives the newest `checkpoints/step-*/model.safetensors`.
    ///
    /// # Errors
    /// [`ModelError::Io`] naming `path` when it does not exist or holds no weights file.
    pub fn find(path: &Path) -> Result<Self, ModelError> {
        let not_found = |what: String| ModelError::Io {
            path: path.to_path_buf(),
            error: std::io::Error::new(std::io::ErrorKind::NotFound, what),
        };
        if path.is_file() {
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            return match ext {
                "safetensors" => Ok(Self::Safetensors(path.to_path_buf())),
                "bin" | "pt" | "pth" => Ok(Self::PyTorch(path.to_path_buf())),
                _ => Err(not_found(format!(
                    "not a weights file (expected .safetensors, or .bin/.pt/.pth from PyTorch), got .{ext}"
                ))),
            };
        }
        if !path.is_dir() {
            return Err(not_found("no such file or folder".into()));
        }
        let safetensors = path.join("model.safetensors");
        if safetensors.is_file() {
            return Ok(Self::Safetensors(safetensors));
        }
        let bin = path.join("pytorch_model.bin");
        if bin.is_file() {
            return Ok(Self::PyTorch(bin));
        }
        let mut steps: Vec<PathBuf> = std::fs::read_dir(path.join("checkpoints"))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.join("manifest.json").is_file())
            .collect();
        steps.sort();
        match steps.pop() {
            Some(step) => Ok(Self::Safetensors(step.join("model.safetensors"))),
            None => Err(not_found(
                "no model.safetensors, pytorch_model.bin or complete checkpoints/step-* in this folder"
                    .into(),
            )),
        }
    }
}

/// What a load of pre-trained weights did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadReport {
    /// Parameters taken from the file, as Hugging Face keys.
    pub loaded: Vec<String>,
    /// Parameters the file lacks, left as initialised (Hugging Face keys): the pre-training
    /// heads when starting from a `BertModel`, for instance.
    pub initialised: Vec<String>,
}

/// File keys that are not parameters: the tied decoder and the position-id buffer.
fn ignorable(key: &str) -> bool {
    key.starts_with("cls.predictions.decoder.") || key.ends_with("position_ids")
}

/// Key remappings from a file's names to ember's module paths (regex, replacement).
const TO_EMBER: [(&str, &str); 3] = [
    (r"^(embeddings|encoder|pooler)\.", "bert.$1."),
    (r"\.self\.", ".self_attention."),
    (r"\.LayerNorm\.", ".layer_norm."),
];

fn load_error(path: &Path, reason: String) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason,
    }
}

/// Names a shape mismatch with both shapes; other apply errors as burn-store reports them.
fn describe(error: &ApplyError) -> String {
    match error {
        ApplyError::ShapeMismatch {
            path,
            expected,
            found,
        } => format!(
            "{}: shape {:?} in the file, {:?} in the model",
            ember_path_to_hf(path),
            found.as_slice(),
            expected.as_slice()
        ),
        other => format!("{other:?}"),
    }
}

fn report(file: &WeightsFile, result: ApplyResult) -> Result<LoadReport, ModelError> {
    let path = file.path();
    if !result.errors.is_empty() {
        let errors: Vec<String> = result.errors.iter().map(describe).collect();
        return Err(load_error(
            path,
            format!("tensors that do not fit the model: {}", errors.join("; ")),
        ));
    }
    // burn-store lists a LayerNorm's `weight`/`bias` as unused even when the adapter applied
    // them as Burn's `gamma`/`beta`.
    let applied_as = |key: &str| {
        let renamed = key
            .strip_suffix(".weight")
            .map(|stem| format!("{stem}.gamma"))
            .or_else(|| key.strip_suffix(".bias").map(|stem| format!("{stem}.beta")));
        renamed.is_some_and(|r| result.applied.contains(&r))
    };
    let unexpected: Vec<&String> = result
        .unused
        .iter()
        .filter(|k| !ignorable(k) && !applied_as(k))
        .collect();
    if result.applied.is_empty() {
        return Err(load_error(
            path,
            format!(
                "not a BERT checkpoint: none of its tensors is a BERT parameter (first: {})",
                unexpected
                    .iter()
                    .take(3)
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if !unexpected.is_empty() {
        return Err(load_error(
            path,
            format!(
                "{} tensor(s) the model has no place for: {}",
                unexpected.len(),
                unexpected
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    Ok(LoadReport {
        loaded: result.applied.iter().map(|p| ember_path_to_hf(p)).collect(),
        initialised: result
            .missing
            .iter()
            .map(|(p, _)| ember_path_to_hf(p))
            .collect(),
    })
}

impl<B: Backend> BertForPreTraining<B> {
    /// Loads the parameters `file` holds and keeps the others as initialised (listed in the
    /// report): a `BertForPreTraining` checkpoint fills everything, a `BertModel` one the
    /// encoder only.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] naming the file: unreadable, not a BERT checkpoint, a tensor
    /// of another shape (naming it and both shapes), a tensor the model has no place for.
    pub fn load_pretrained(mut self, file: &WeightsFile) -> Result<(Self, LoadReport), ModelError> {
        let path = file.path();
        let result = match Store::open(file) {
            Store::Safetensors(mut store, _) => {
                self.load_from(&mut store).map_err(|e| e.to_string())
            }
            Store::PyTorch(mut store, _) => self.load_from(&mut store).map_err(|e| e.to_string()),
        }
        .map_err(|e| load_error(path, e))?;
        let report = report(file, result)?;
        Ok((self, report))
    }
}

/// A weights file opened with ember's key remappings (tensors read lazily).
pub(crate) enum Store<'a> {
    Safetensors(SafetensorsStore, &'a Path),
    PyTorch(PytorchStore, &'a Path),
}

impl<'a> Store<'a> {
    pub(crate) fn open(file: &'a WeightsFile) -> Self {
        let path = file.path();
        match file {
            WeightsFile::Safetensors(_) => {
                let mut store = SafetensorsStore::from_file(path)
                    .with_from_adapter(PyTorchToBurnAdapter)
                    .allow_partial(true);
                for (from, to) in TO_EMBER {
                    store = store.with_key_remapping(from, to);
                }
                Self::Safetensors(store, path)
            }
            WeightsFile::PyTorch(_) => {
                let mut store = PytorchStore::from_file(path).allow_partial(true);
                for (from, to) in TO_EMBER {
                    store = store.with_key_remapping(from, to);
                }
                Self::PyTorch(store, path)
            }
        }
    }

    /// Dimension 0 of the tensor ember's module path `key` names in the file (its header
    /// only); `None` when the file has no such tensor.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] naming the file when it cannot be read.
    pub(crate) fn rows(&mut self, key: &str) -> Result<Option<usize>, ModelError> {
        fn first_dim<S: ModuleStore>(store: &mut S, key: &str) -> Result<Option<usize>, String> {
            let snapshot = store.get_snapshot(key).map_err(|e| e.to_string())?;
            Ok(snapshot.and_then(|s| s.shape.first().copied()))
        }
        match self {
            Self::Safetensors(store, _) => first_dim(store, key),
            Self::PyTorch(store, _) => first_dim(store, key),
        }
        .map_err(|e| load_error(self.path(), e))
    }

    fn path(&self) -> &Path {
        match self {
            Self::Safetensors(_, path) | Self::PyTorch(_, path) => path,
        }
    }
}
