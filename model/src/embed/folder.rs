//! What a sentence-transformers folder says to run: `modules.json`'s pipeline (Transformer →
//! Pooling → Dense / Normalize / Dropout), the Transformer's sequence limit and lower-casing,
//! the pooling modes, each Dense layer's shape and activation.
//!
//! Note [sentence-transformers folders]: two formats are in use, and both are read.
//! sentence-transformers 2.x–5.x writes `sentence_transformers.models.Pooling`-style types,
//! `pooling_mode_*_tokens` booleans and `{"max_seq_length", "do_lower_case"}` in
//! `sentence_bert_config.json` (all-MiniLM-L6-v2); 6.x writes module paths
//! (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`), a `pooling_mode`
//! string or list, and the sequence limit as `model_max_length` in `tokenizer_config.json`.
//! As sentence-transformers does, the limit is `max_seq_length`, else the tokenizer's
//! `model_max_length` capped by the model's positions; several pooling modes are
//! concatenated in their order (the booleans' order: cls, max, mean, mean-sqrt-len,
//! weighted mean, last token); a folder without `modules.json` is a Transformer with mean
//! pooling. Whatever a folder asks for that ember does not do is an error naming the file and
//! the key; a key ember does not know is accepted only when it asks for nothing (false, null,
//! empty).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::pooling::Pooling;
use crate::ModelError;

/// A Dense module's activation (`activation_function`, a `torch.nn` class path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `torch.nn.Tanh`, sentence-transformers' default.
    Tanh,
    /// `torch.nn.Identity`.
    Identity,
    /// `torch.nn.ReLU`.
    Relu,
    /// `torch.nn.Sigmoid`.
    Sigmoid,
    /// `torch.nn.GELU` (the exact erf form).
    Gelu,
}

/// A Dense module: `activation(x · Wᵀ + b)`, weights in `dir`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DenseSpec {
    pub dir: PathBuf,
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
    pub activation: Activation,
}

/// A module after the pooling.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Stage {
    Dense(DenseSpec),
    Normalize,
}

/// The pipeline of a folder (Note [sentence-transformers folders]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pipeline {
    /// The Transformer's folder: `config.json`, the weights and the tokenizer.
    pub transformer_dir: PathBuf,
    /// `max_seq_length` (sentence_bert_config.json), else the tokenizer's `model_max_length`;
    /// `None`: the model's positions.
    pub max_seq_length: Option<usize>,
    /// Lower-case the texts before the tokenizer (`do_lower_case`).
    pub do_lower_case: bool,
    /// The pooling modes, concatenated in this order.
    pub pooling: Vec<Pooling>,
    /// The pooling's input size, when the folder states it (`embedding_dimension`).
    pub pooling_dimension: Option<usize>,
    /// Dense and Normalize modules, in order.
    pub stages: Vec<Stage>,
}

fn bad(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|error| ModelError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    serde_json::from_str(&text).map_err(|e| bad(path, format!("not JSON: {e}")))
}

fn object<'a>(path: &Path, value: &'a Value) -> Result<&'a Map<String, Value>, ModelError> {
    value
        .as_object()
        .ok_or_else(|| bad(path, "expected a JSON object"))
}

/// A value that asks for nothing: an unknown key holding it is ignored.
fn asks_nothing(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// Refuses the keys of `map` outside `known` that ask for something.
fn check_keys(path: &Path, map: &Map<String, Value>, known: &[&str]) -> Result<(), ModelError> {
    for (key, value) in map {
        if !known.contains(&key.as_str()) && !asks_nothing(value) {
            return Err(bad(
                path,
                format!("key {key:?} = {value}: ember does not implement it"),
            ));
        }
    }
    Ok(())
}

fn get_usize(
    path: &Path,
    map: &Map<String, Value>,
    key: &str,
) -> Result<Option<usize>, ModelError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| bad(path, format!("key {key:?} = {v}: expected a whole number"))),
    }
}

fn get_bool(path: &Path, map: &Map<String, Value>, key: &str) -> Result<Option<bool>, ModelError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad(path, format!("key {key:?} = {v}: expected true or false"))),
    }
}

/// A module's kind from its `type` (the class's last name; the prefix must be
/// sentence-transformers').
fn module_kind(type_name: &str) -> Option<&str> {
    type_name
        .starts_with("sentence_transformers.")
        .then(|| type_name.rsplit('.').next())
        .flatten()
}

impl Pipeline {
    /// Reads `dir`'s `modules.json` and the files of its modules; without `modules.json`, a
    /// Transformer in `dir` with mean pooling.
    ///
    /// # Errors
    /// [`ModelError::Checkpoint`] naming the file and the key: a module ember does not run, a
    /// pooling mode, activation or setting it does not implement, a malformed file;
    /// [`ModelError::Io`] for an unreadable file.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let modules_path = dir.join("modules.json");
        if !modules_path.is_file() {
            let (max_seq_length, do_lower_case) = transformer_settings(dir)?;
            return Ok(Self {
                transformer_dir: dir.to_path_buf(),
                max_seq_length,
                do_lower_case,
                pooling: vec![Pooling::Mean],
                pooling_dimension: None,
                stages: Vec::new(),
            });
        }
        let modules = read_json(&modules_path)?;
        let modules = modules
            .as_array()
            .ok_or_else(|| bad(&modules_path, "expected a list of modules"))?;
        let mut transformer_dir = None;
        let mut pooling = None;
        let mut stages = Vec::new();
        for (index, module) in modules.iter().enumerate() {
            let module = object(&modules_path, module)?;
            let type_name = module
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let sub = dir.join(
                module
                    .get("path")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            );
            let kind = module_kind(type_name).ok_or_else(|| {
                bad(
                    &modules_path,
                    format!(
                        "module {index}: type {type_name:?} is not a sentence-transformers module"
                    ),
                )
            })?;
            let unexpected = |what: &str| {
                bad(
                    &modules_path,
                    format!("module {index} ({type_name}): {what}"),
                )
            };
            match (kind, index) {
                ("Transformer", 0) => transformer_dir = Some(sub),
                ("Transformer", _) => {
                    return Err(unexpected("a Transformer after the first module"));
                }
                (_, 0) => {
                    return Err(unexpected(
                        "ember runs a BERT Transformer as the first module, not this",
                    ));
                }
                ("Pooling", 1) => pooling = Some(read_pooling(&sub.join("config.json"))?),
                ("Pooling", _) => {
                    return Err(unexpected("the pooling must follow the Transformer"));
                }
                (_, 1) => return Err(unexpected("the second module must be the Pooling")),
                ("Dense", _) => stages.push(Stage::Dense(read_dense(&sub)?)),
                ("Normalize", _) => stages.push(Stage::Normalize),
                // Dropout does nothing at inference.
                ("Dropout", _) => {}
                _ => return Err(unexpected("ember does not run this module")),
            }
        }
        let transformer_dir =
            transformer_dir.ok_or_else(|| bad(&modules_path, "no Transformer module"))?;
        let (pooling, pooling_dimension) = pooling.unwrap_or((vec![Pooling::Mean], None));
        let (max_seq_length, do_lower_case) = transformer_settings(&transformer_dir)?;
        Ok(Self {
            transformer_dir,
            max_seq_length,
            do_lower_case,
            pooling,
            pooling_dimension,
            stages,
        })
    }
}

/// The Transformer's `max_seq_length` and `do_lower_case` (`sentence_bert_config.json`), the
/// limit else from `tokenizer_config.json`'s `model_max_length`.
fn transformer_settings(dir: &Path) -> Result<(Option<usize>, bool), ModelError> {
    let path = dir.join("sentence_bert_config.json");
    let (mut max_seq_length, mut do_lower_case) = (None, false);
    if path.is_file() {
        let value = read_json(&path)?;
        let map = object(&path, &value)?;
        check_keys(
            &path,
            map,
            &[
                "max_seq_length",
                "do_lower_case",
                "transformer_task",
                "modality_config",
                "module_output_name",
            ],
        )?;
        max_seq_length = get_usize(&path, map, "max_seq_length")?;
        do_lower_case = get_bool(&path, map, "do_lower_case")?.unwrap_or(false);
        if let Some(task) = map.get("transformer_task").filter(|v| !asks_nothing(v))
            && task != "feature-extraction"
        {
            return Err(bad(
                &path,
                format!(
                    "key \"transformer_task\" = {task}: ember embeds with feature-extraction only"
                ),
            ));
        }
        if let Some(output) = map.get("module_output_name").filter(|v| !asks_nothing(v))
            && output != "token_embeddings"
        {
            return Err(bad(
                &path,
                format!("key \"module_output_name\" = {output}: ember pools the token embeddings"),
            ));
        }
        if let Some(modality) = map.get("modality_config").filter(|v| !asks_nothing(v)) {
            let text = &modality["text"];
            let plain = modality.as_object().is_some_and(|m| m.len() == 1)
                && text["method"] == "forward"
                && text["method_output_name"] == "last_hidden_state";
            if !plain {
                return Err(bad(
                    &path,
                    format!(
                        "key \"modality_config\" = {modality}: ember embeds text through the \
                         model's forward and its last hidden state only"
                    ),
                ));
            }
        }
    }
    if max_seq_length.is_none() {
        let path = dir.join("tokenizer_config.json");
        if path.is_file() {
            let value = read_json(&path)?;
            // transformers' "no limit" is 1e30.
            max_seq_length = value["model_max_length"]
                .as_u64()
                .filter(|&n| n < 1 << 40)
                .map(|n| n as usize);
        }
    }
    Ok((max_seq_length, do_lower_case))
}

/// `1_Pooling/config.json`: the modes, in concatenation order, and the stated dimension.
fn read_pooling(path: &Path) -> Result<(Vec<Pooling>, Option<usize>), ModelError> {
    let value = read_json(path)?;
    let map = object(path, &value)?;
    const LEGACY: [(&str, Pooling); 6] = [
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
        ("pooling_mode_weightedmean_tokens", Pooling::WeightedMean),
        ("pooling_mode_lasttoken", Pooling::LastToken),
    ];
    let mut known: Vec<&str> = LEGACY.iter().map(|(key, _)| *key).collect();
    known.extend([
        "pooling_mode",
        "embedding_dimension",
        "word_embedding_dimension",
        "include_prompt",
        "module_input_name",
        "module_output_name",
    ]);
    check_keys(path, map, &known)?;
    let dimension = match get_usize(path, map, "embedding_dimension")? {
        Some(n) => Some(n),
        None => get_usize(path, map, "word_embedding_dimension")?,
    };
    // ember adds no prompt, so `include_prompt` changes nothing whichever it is.
    get_bool(path, map, "include_prompt")?;
    let modes = match map.get("pooling_mode").filter(|v| !v.is_null()) {
        Some(Value::String(mode)) => vec![parse_mode(path, mode)?],
        Some(Value::Array(modes)) => modes
            .iter()
            .map(|m| {
                m.as_str()
                    .ok_or_else(|| {
                        bad(
                            path,
                            format!("key \"pooling_mode\": {m} is not a mode name"),
                        )
                    })
                    .and_then(|m| parse_mode(path, m))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(bad(
                path,
                format!("key \"pooling_mode\" = {other}: expected a mode or a list of modes"),
            ));
        }
        None => {
            let mut modes = Vec::new();
            for (key, mode) in LEGACY {
                if get_bool(path, map, key)?.unwrap_or(false) {
                    modes.push(mode);
                }
            }
            modes
        }
    };
    if modes.is_empty() {
        // As sentence-transformers: no mode given is mean pooling.
        return Ok((vec![Pooling::Mean], dimension));
    }
    Ok((modes, dimension))
}

fn parse_mode(path: &Path, mode: &str) -> Result<Pooling, ModelError> {
    mode.parse()
        .map_err(|e: String| bad(path, format!("key \"pooling_mode\": {e}")))
}

/// A Dense module's `config.json`.
fn read_dense(dir: &Path) -> Result<DenseSpec, ModelError> {
    let path = dir.join("config.json");
    let value = read_json(&path)?;
    let map = object(&path, &value)?;
    check_keys(
        &path,
        map,
        &[
            "in_features",
            "out_features",
            "bias",
            "activation_function",
            "module_input_name",
            "module_output_name",
        ],
    )?;
    let need = |key: &str| {
        get_usize(&path, map, key)?.ok_or_else(|| bad(&path, format!("key {key:?} is missing")))
    };
    let activation = match map.get("activation_function").and_then(Value::as_str) {
        None | Some("torch.nn.modules.activation.Tanh") => Activation::Tanh,
        Some("torch.nn.modules.linear.Identity") => Activation::Identity,
        Some("torch.nn.modules.activation.ReLU") => Activation::Relu,
        Some("torch.nn.modules.activation.Sigmoid") => Activation::Sigmoid,
        Some("torch.nn.modules.activation.GELU") => Activation::Gelu,
        Some(other) => {
            return Err(bad(
                &path,
                format!(
                    "key \"activation_function\" = {other:?}: ember implements Tanh, Identity, \
                     ReLU, Sigmoid and GELU"
                ),
            ));
        }
    };
    for (key, expected) in [
        ("module_input_name", "sentence_embedding"),
        ("module_output_name", "sentence_embedding"),
    ] {
        if let Some(name) = map.get(key).filter(|v| !asks_nothing(v))
            && name != expected
        {
            return Err(bad(
                &path,
                format!("key {key:?} = {name}: ember's Dense maps the sentence embedding"),
            ));
        }
    }
    Ok(DenseSpec {
        dir: dir.to_path_buf(),
        in_features: need("in_features")?,
        out_features: need("out_features")?,
        bias: get_bool(&path, map, "bias")?.unwrap_or(true),
        activation,
    })
}
