use std::path::PathBuf;

/// Errors of the model crate: configurations and checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration field has a value the modules cannot build.
    #[error("invalid model config: {field}: {reason}")]
    InvalidConfig {
        /// The `BertConfig` field at fault.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// A preset name that is not one of tiny, mini, small, base, large.
    #[error("unknown model preset {0:?} (expected one of: tiny, mini, small, base, large)")]
    UnknownPreset(String),
    /// A file could not be read or written.
    #[error("{}: {error}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error (in the message, not chained, so it prints once).
        error: std::io::Error,
    },
    /// A `config.json` that is not a BERT configuration.
    #[error("{}: not a BERT config.json: {error}", path.display())]
    ConfigJson {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        error: serde_json::Error,
    },
    /// A safetensors checkpoint that does not fit the model.
    #[error("{}: {reason}", path.display())]
    Checkpoint {
        /// The checkpoint file.
        path: PathBuf,
        /// What did not fit: missing or misshaped tensors, or an unreadable file.
        reason: String,
    },
}
