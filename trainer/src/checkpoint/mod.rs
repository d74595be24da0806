//! Checkpoints that survive a kill, and resuming from them (Note [Checkpoints]).
//!
//! Note [Checkpoints]: a checkpoint is the folder `OUT/checkpoints/step-NNNNNNN/` holding
//!
//! | file | written by | holds |
//! |---|---|---|
//! | `model.safetensors` | rank 0 | the weights, Hugging Face names (`transformers` opens it) |
//! | `config.json` | rank 0 | the Hugging Face model configuration |
//! | `optimizer.safetensors` | rank 0 | both moments and the step of each parameter ([`optimizer_file`]) |
//! | `train_config.toml` | rank 0 | the run's whole configuration |
//! | `trainer_state.json` | rank 0 | step, every step's loss, tokens, the last evaluation ([`RunState`]) |
//! | `metrics.jsonl` | rank 0 | the run's metrics up to this step |
//! | `rank-NNNNN.json` | each rank | its data position and seed ([`RankState`]) |
//! | `manifest.json` | rank 0, last | format version, step, world size, size and SHA-256 of every file ([`Manifest`]) |
//!
//! Every file goes to a temporary name, is flushed to disk and renamed; rank 0 writes the
//! manifest after every rank has reported its file's digest, so a folder without a manifest
//! that verifies is incomplete, whenever the job was killed. `--resume` takes the newest
//! folder that verifies and skips the others with a warning naming the file at fault; only a
//! newer complete checkpoint lets `--keep-checkpoints` delete an older one.
//!
//! What a resumed run restores makes it continue bit for bit: the weights and moments are f32
//! as trained, the schedule is a function of the step, the dropout masks are keyed by (seed,
//! rank, step, layer, sample, position) and hold no counter (`ember_backend_ext::DropoutScope`),
//! and each rank's data loader continues from its saved position.
//! [`compat::check_resume_compatible`] refuses a resume under settings that would make it
//! another run (Note [What a resume may change]).

pub mod compat;
pub mod manifest;
pub mod optimizer_file;
pub mod signals;

use std::io::Write;
use std::path::{Path, PathBuf};

use ember_data::SamplerState;
use serde::{Deserialize, Serialize};

pub use compat::{check_resume_compatible, check_schedule_kept};
pub use manifest::{
    FORMAT_VERSION, FileDigest, MANIFEST, Manifest, checkpoints_dir, list_step_dirs,
    newest_complete, step_dir,
};
pub use optimizer_file::{read_optimizer_state, write_optimizer_state};

use crate::{EvalResult, TrainError};
use manifest::checkpoint_error;

/// `[checkpoint]`: when to write checkpoints and where to resume from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many optimizer steps; 0: only at the end and on SIGTERM or
    /// SIGINT. Default: 0.
    #[arg(long = "checkpoint-every")]
    pub every: u64,
    /// Keep the newest this many complete checkpoints (older ones are deleted once a newer one
    /// is complete); 0 keeps all. Default: 0.
    #[arg(long = "keep-checkpoints")]
    pub keep: usize,
    /// Continue the run whose output folder this is, from its newest complete checkpoint.
    /// Default: none.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Start from these weights with a fresh optimizer and schedule (MLPerf's phase 2 from the
    /// phase-1 checkpoint, or continued pre-training of a published BERT): a Hugging Face
    /// folder, a `.safetensors` or PyTorch `.bin` file, with or without the pre-training
    /// heads, or an ember run or checkpoint folder. The

    /// parameters it lacks keep their initialisation and are listed in the log. Not used when
    /// resuming: the checkpoint holds the weights. Default: none.
    #[arg(long, value_name = "PATH")]
    pub init_from: Option<PathBuf>,
}

/// What rank 0 saves about the run (`trainer_state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Optimizer steps done.
    pub step: u64,
    /// Ranks of the run.
    pub world_size: usize,
    /// Samples per optimizer step over all ranks.
    pub global_batch_size: usize,
    /// Every step's training loss so far, averaged over ranks.
    pub losses: Vec<f64>,
    /// Real tokens processed by all ranks so far.
    pub tokens: usize,
    /// The last evaluation, if any.
    pub last_eval: Option<EvalResult>,
    /// The dynamic loss scaler's state (`loss_scale.mode = "dynamic"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<crate::loss_scale::LossScalerState>,
    /// The run's warmup in steps, as resolved (`TrainConfig::warmup_steps`: a fraction of
    /// `train.steps` when unset), so that a resume with more steps cannot move it silently
    /// (Note [What a resume may change]). Unset in checkpoints of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<u64>,
    /// A 1-bit optimizer's last warm-up step, as resolved (`TrainConfig::freeze_step`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze_step: Option<u64>,
}

/// Where one rank's training data stands (`rank-NNNNN.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum DataPosition {
    /// Instances from the corpus: the epoch (its permutation) and the position in it.
    Instances { epoch: u64, position: usize },
    /// Shards: the sampler's state (`ember_data::RankSampler::restore`).
    Shards { sampler: SamplerState },
}

/// One rank's state (`rank-NNNNN.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankState {
    /// The rank.
    pub rank: usize,
    /// The run's seed (the dropout keys are (seed, rank, step, …)).
    pub seed: u64,
    /// Its data loader's position.
    pub data: DataPosition,
}

/// `rank-NNNNN.json`.
pub fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.json")
}

/// Flushes `tmp` to disk and renames it to `path`.
pub(crate) fn sync_and_rename(tmp: &Path, path: &Path) -> Result<(), TrainError> {
    std::fs::File::open(tmp)
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(tmp, path))
        .map_err(|e| checkpoint_error(path, e))
}

/// Writes `bytes` to `path` through a temporary file, flushed to disk, and a rename.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the file.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    let tmp = ember_model::checkpoint::temp_path(path);
    std::fs::File::create(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .map_err(|e| checkpoint_error(path, e))
        .and_then(|()| sync_and_rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Reads and parses a JSON file of a checkpoint.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the file.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|e| checkpoint_error(path, e))?;
    serde_json::from_str(&text).map_err(|e| checkpoint_error(path, e))
}

/// Deletes the complete checkpoints of `out` older than the newest `keep` complete ones, and
/// incomplete folders older than the newest complete one (0 keeps all). A folder counts as
/// complete when its manifest parses (its files were verified when it was written). Returns
/// the folders deleted.
pub fn prune(out: &Path, keep: usize) -> Vec<PathBuf> {
    if keep == 0 {
        return Vec::new();
    }
    let mut complete = 0;
    let mut deleted = Vec::new();
    for (_, dir) in list_step_dirs(out) {
        let is_complete = Manifest::read(&dir).is_ok();
        if is_complete && complete < keep {
            complete += 1;
            continue;
        }
        if complete == 0 {
            // Nothing newer is complete: an incomplete folder is kept (it may be written now).
            continue;
        }
        if std::fs::remove_dir_all(&dir).is_ok() {
            deleted.push(dir);
        }
    }
    deleted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pruning_keeps_the_newest_complete_checkpoints() {
        let out = tempfile::tempdir().unwrap();
        let out = out.path();
        let complete = |step: u64| {
            let dir = step_dir(out, step);
            std::fs::create_dir_all(&dir).unwrap();
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                step,
                world_size: 1,
                files: Default::default(),
            };
            std::fs::write(
                dir.join(MANIFEST),
                serde_json::to_string(&manifest).unwrap(),
            )
            .unwrap();
        };
        let incomplete = |step: u64| std::fs::create_dir_all(step_dir(out, step)).unwrap();
        complete(10);
        incomplete(15);
        complete(20);
        complete(30);
        incomplete(40);
        assert!(prune(out, 0).is_empty(), "keep 0 keeps all");
        let deleted = prune(out, 2);
        assert_eq!(deleted, vec![step_dir(out, 15), step_dir(out, 10)]);
        let left: Vec<u64> = list_step_dirs(out).into_iter().map(|(s, _)| s).collect();
        assert_eq!(left, vec![40, 30, 20]);
    }
}
