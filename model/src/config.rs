//! [`BertConfig`]: the model's hyper-parameters, with Hugging Face's field names so a
//! `config.json` from the Hub reads as is, and the presets ember trains.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ModelError;
use ember_backend_ext::Gelu;

/// Hyper-parameters of a BERT model, field for field Hugging Face's `BertConfig`
/// (`transformers/models/bert/configuration_bert.py`). Fields missing from a `config.json` take
/// the Hugging Face defaults (BERT-base), and unknown fields (`architectures`, `model_type`, ...)
/// are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BertConfig {
    /// Number of WordPiece tokens. Default: 30522, as bert-base-uncased.
    pub vocab_size: usize,
    /// Width H of every hidden state. Default: 768.
    pub hidden_size: usize,
    /// Number of encoder layers. Default: 12.
    pub num_hidden_layers: usize,
    /// Number of attention heads nh; `hidden_size` must be a multiple of it. Default: 12.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer. Default: 3072.
    pub intermediate_size: usize,
    /// Activation of the feed-forward layer and the MLM transform, by Hugging Face's names:
    /// `"gelu"` (the exact erf form) or `"gelu_new"` (the tanh approximation of Google's and
    /// NVIDIA's MLPerf BERT; also `"gelu_pytorch_tanh"`, `"gelu_fast"`). Note [Two GELUs] in
    /// `ember-backend-ext`'s `gelu.rs`. Default: `"gelu"`.
    pub hidden_act: String,
    /// Dropout on embeddings and on each sub-layer's output. Default: 0.1.
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities. Default: 0.1.
    pub attention_probs_dropout_prob: f64,
    /// Number of learned positions, the longest sequence the model accepts. Default: 512.
    pub max_position_embeddings: usize,
    /// Number of segment (token type) ids. Default: 2 (sentence A and B).
    pub type_vocab_size: usize,
    /// Standard deviation of the normal initialiser of every weight matrix. Default: 0.02.
    pub initializer_range: f64,
    /// LayerNorm epsilon. Default: 1e-12, as BERT.
    pub layer_norm_eps: f64,
    /// Id of `[PAD]`; its word-embedding row starts at zero, as Hugging Face. Default: 0.
    pub pad_token_id: usize,
}

impl Default for BertConfig {
    fn default() -> Self {
        Self {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            hidden_act: "gelu".to_string(),
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
            pad_token_id: 0,
        }
    }
}

/// Named model sizes. tiny/mini/small are the BERT miniatures of Turc et al. 2019 ("Well-Read
/// Students Learn Better"); base and large are the paper's; large is MLPerf's BERT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// 2 layers, H 128, 2 heads, FFN 512 (4.4 M parameters, 3.9 M of them word embeddings).
    Tiny,
    /// 4 layers, H 256, 4 heads, FFN 1024.
    Mini,
    /// 4 layers, H 512, 8 heads, FFN 2048.
    Small,
    /// 12 layers, H 768, 12 heads, FFN 3072 (BERT-base, 110 M parameters).
    Base,
    /// 24 layers, H 1024, 16 heads, FFN 4096 (BERT-large, 340 M parameters; MLPerf's model).
    Large,
}

impl Preset {
    /// Every preset, smallest first.
    pub const ALL: [Preset; 5] = [
        Preset::Tiny,
        Preset::Mini,
        Preset::Small,
        Preset::Base,
        Preset::Large,
    ];

    /// The preset's lower-case name, as configs and flags spell it.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Mini => "mini",
            Preset::Small => "small",
            Preset::Base => "base",
            Preset::Large => "large",
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL
            .into_iter()
            .find(|p| p.name() == s.to_ascii_lowercase())
            .ok_or_else(|| ModelError::UnknownPreset(s.to_string()))
    }
}

impl BertConfig {
    /// The configuration of a named size, with the bert-base-uncased vocabulary (30522) and 512
    /// positions.
    pub fn preset(preset: Preset) -> Self {
        let (layers, hidden, heads) = match preset {
            Preset::Tiny => (2, 128, 2),
            Preset::Mini => (4, 256, 4),
            Preset::Small => (4, 512, 8),
            Preset::Base => (12, 768, 12),
            Preset::Large => (24, 1024, 16),
        };
        Self {
            num_hidden_layers: layers,
            hidden_size: hidden,
            num_attention_heads: heads,
            intermediate_size: 4 * hidden,
            ..Self::default()
        }
    }

    /// Reads a Hugging Face `config.json`.
    ///
    /// # Errors
    /// [`ModelError::Io`] if the file cannot be read, [`ModelError::ConfigJson`] if it is not
    /// valid JSON of this shape, and any error of [`BertConfig::validate`].
    pub fn load_json(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|error| ModelError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        let config: Self = serde_json::from_str(&text).map_err(|error| ModelError::ConfigJson {
            path: path.to_path_buf(),
            error,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// The configuration as Hugging Face `config.json` text (with `architectures` and
    /// `model_type`, so `BertForPreTraining.from_pretrained` reads it).
    pub fn to_hf_json(&self) -> String {
        self.to_hf_json_as("BertForPreTraining")
    }

    /// [`BertConfig::to_hf_json`] naming another transformers class in `architectures`
    /// (`"BertModel"` for an encoder without the pre-training heads).
    pub fn to_hf_json_as(&self, architecture: &str) -> String {
        let mut value = serde_json::to_value(self).expect("BertConfig always serialises");
        let object = value
            .as_object_mut()
            .expect("a struct serialises to an object");
        object.insert("architectures".into(), serde_json::json!([architecture]));
        object.insert("model_type".into(), serde_json::json!("bert"));
        serde_json::to_string_pretty(&value).expect("a JSON value always serialises")
    }

    /// The GELU form `hidden_act` names ([`Gelu::from_hidden_act`]).
    ///
    /// # Panics
    /// Where `hidden_act` names an activation ember does not implement:
    /// [`BertConfig::validate`] reports it as an error (call it first on configurations from
    /// users, as [`BertConfig::load_json`] does).
    pub fn gelu(&self) -> Gelu {
        Gelu::from_hidden_act(&self.hidden_act).unwrap_or_else(|| {
            panic!(
                "hidden_act {:?} is not a GELU ember implements (BertConfig::validate)",
                self.hidden_act
            )
        })
    }

    /// Width of one attention head, `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks what the modules assume.
    ///
    /// # Errors
    /// [`ModelError::InvalidConfig`] naming the field: a zero size, `hidden_size` not a multiple
    /// of `num_attention_heads`, an activation other than the GELUs ([`Gelu::from_hidden_act`]), a dropout outside [0, 1).
    pub fn validate(&self) -> Result<(), ModelError> {
        let invalid =
            |field: &'static str, reason: String| Err(ModelError::InvalidConfig { field, reason });
        for (field, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if value == 0 {
                return invalid(field, "must be at least 1".into());
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return invalid(
                "hidden_size",
                format!(
                    "{} is not a multiple of num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                ),
            );
        }
        if let Err(reason) = self.hidden_act.parse::<Gelu>() {
            return invalid("hidden_act", reason);
        }
        for (field, p) in [
            ("hidden_dropout_prob", self.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                self.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                return invalid(field, format!("{p} is outside [0, 1)"));
            }
        }
        if self.pad_token_id >= self.vocab_size {
            return invalid(
                "pad_token_id",
                format!(
                    "{} is not below vocab_size {}",
                    self.pad_token_id, self.vocab_size
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_preset_is_mlperf_bert_large() {
        let c = BertConfig::preset(Preset::Large);
        assert_eq!(
            (
                c.num_hidden_layers,
                c.hidden_size,
                c.num_attention_heads,
                c.intermediate_size
            ),
            (24, 1024, 16, 4096)
        );
        assert_eq!((c.vocab_size, c.max_position_embeddings), (30522, 512));
    }

    #[test]
    fn hf_config_json_round_trips_and_ignores_unknown_fields() {
        let c = BertConfig::preset(Preset::Mini);
        let back: BertConfig = serde_json::from_str(&c.to_hf_json()).unwrap();
        assert_eq!(back, c);
        let partial: BertConfig =
            serde_json::from_str(r#"{"hidden_size": 64, "num_attention_heads": 4, "x": 1}"#)
                .unwrap();
        assert_eq!(partial.hidden_size, 64);
        assert_eq!(partial.vocab_size, 30522);
    }

    #[test]
    fn validate_names_the_bad_field() {
        let c = BertConfig {
            hidden_size: 100,
            num_attention_heads: 3,
            ..BertConfig::default()
        };
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
        let relu = BertConfig {
            hidden_act: "relu".into(),
            ..BertConfig::default()
        };
        let err = relu.validate().unwrap_err().to_string();
        assert!(
            err.contains("hidden_act") && err.contains("gelu_new"),
            "{err}"
        );
        for (name, form) in [("gelu", Gelu::Erf), ("gelu_new", Gelu::Tanh)] {
            let c = BertConfig {
                hidden_act: name.into(),
                ..BertConfig::default()
            };
            c.validate().unwrap();
            assert_eq!(c.gelu(), form);
        }
        assert!("huge".parse::<Preset>().is_err());
        assert_eq!("Tiny".parse::<Preset>().unwrap(), Preset::Tiny);
    }
}
