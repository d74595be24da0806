use std::path::PathBuf;

use ember_data::DataError;
use ember_model::ModelError;

/// Errors of a training run; each names the file or setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration file that cannot be read or parsed.
    #[error("{}: {reason}", path.display())]
    Config {
        /// The TOML file.
        path: PathBuf,
        /// The parser's or file system's message.
        reason: String,
    },
    /// A setting with a value the run cannot use.
    #[error("invalid setting {field}: {reason}")]
    InvalidSetting {
        /// The setting, as `section.field`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A sequence length the model has no positions for.
    #[error(
        "max_seq_length {seq_len} is above the model's max_position_embeddings {max_positions}"
    )]
    SeqLenTooLong {
        /// The requested sequence length.
        seq_len: usize,
        /// The model's number of positions.
        max_positions: usize,
    },
    /// The output folder cannot be created or written.
    #[error("output folder {}: {reason}", path.display())]
    Output {
        /// The folder or file.
        path: PathBuf,
        /// The file system's message.
        reason: String,
    },
    /// The loss became NaN or infinite.
    #[error(
        "the loss is {loss} at step {step}: training diverged (lower optimizer.lr or keep gradient clipping on)"
    )]
    Diverged {
        /// The step.
        step: u64,
        /// The loss value.
        loss: f64,
    },
    /// The gradients overflowed in `loss_scale.max_skipped_steps` steps in a row.
    #[error(
        "step {step}: the gradients overflowed (inf or NaN) in {skipped} steps in a row, the last at loss scale {scale}: the run stops instead of training on a collapsed scale (lower optimizer.lr, keep gradient clipping on, raise loss_scale.min_scale, lower a high loss_scale.init_scale, or train in bf16)"
    )]
    LossScaleCollapsed {
        /// The optimizer step the last skipped batch was for (1-based).
        step: u64,
        /// The scale of that step, as printed.
        scale: String,
        /// Consecutive skipped steps.
        skipped: u64,
    },
    /// A gradient changed after a hook handed it to the reducer: its bucket was reduced
    /// without the rest of it (Note [Re-checking late gradients]).
    #[error(
        "step {step}: the gradient of {params} changed after its hook handed it to the reducer, so its bucket was reduced without the rest; the start-up probe of gradient order no longer holds for this model (a parameter used again after its layer?)"
    )]
    GradientAfterHook {
        /// The step (1-based).
        step: u64,
        /// The parameters, with the size of each change.
        params: String,
    },
    /// A checkpoint file that cannot be written, read or trusted.
    #[error("checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `--resume` found no checkpoint whose manifest verifies.
    #[error(
        "no complete checkpoint in {} to resume from{}",
        dir.display(),
        if skipped.is_empty() { " (none written yet)".to_string() } else { format!("; skipped: {}", skipped.join("; ")) }
    )]
    NoCheckpoint {
        /// `OUT/checkpoints`.
        dir: PathBuf,
        /// Why each checkpoint folder was skipped, newest first.
        skipped: Vec<String>,
    },
    /// A resumed run changed a setting that the checkpoint depends on (Note [What a resume
    /// may change]).
    #[error(
        "cannot resume: {setting} was {saved} in the checkpoint's run and is {given} now (a resumed run must keep it; start a new run to change it)"
    )]
    ResumeMismatch {
        /// The setting, as `section.field` (or `world size`, `global batch size`).
        setting: String,
        /// Its value in the checkpoint's configuration.
        saved: String,
        /// Its value now.
        given: String,
    },
    /// A collective failed: another rank left or stalled, or the ranks disagree.
    #[error("data-parallel communication failed: {0}")]
    Comm(#[from] crate::parallel::CommError),
    /// Ranks started with different configurations or bucket plans.
    #[error(
        "rank {rank} disagrees with rank 0 on the {what}, line {line}: rank 0 has {theirs:?}, rank {rank} has {ours:?}"
    )]
    RankMismatch {
        /// `configuration` or `bucket plan`.
        what: &'static str,
        /// The rank that differs.
        rank: usize,
        /// First differing line.
        line: usize,
        /// That line on rank 0.
        theirs: String,
        /// That line on `rank`.
        ours: String,
    },
    /// A rank's parameters differ from rank 0's (Note [Ranks stay one model]).
    #[error(
        "{when}, rank {rank}'s {name} differs from rank 0's: the ranks no longer train one \
         model (a rank computed its update differently); the run stops rather than train on \
         as several"
    )]
    ParametersDiverged {
        /// The point of the run ("at start", "after step 300").
        when: String,
        /// The first rank whose parameters differ.
        rank: usize,
        /// The first differing parameter, in module order.
        name: String,
    },
    /// Launch variables that cannot be used.
    #[error(transparent)]
    Launch(#[from] crate::parallel::LaunchError),
    /// An error of the data pipeline.
    #[error(transparent)]
    Data(#[from] DataError),
    /// An error of the model crate.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The device reported a failure while waiting for its kernels (Burn's `ExecutionError`).
    #[error("the device failed running the step's kernels: {0}")]
    Device(String),
}
