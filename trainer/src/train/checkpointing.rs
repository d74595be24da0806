//! A rank's part of writing a checkpoint and of resuming from one (Note [Checkpoints] in
//! `checkpoint/mod.rs`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::AutodiffModule;
use ember_model::BertForPreTraining;
use tracing::{info, warn};

use super::data::RankData;
use super::setup::Trainer;
use crate::checkpoint::{
    FileDigest, MANIFEST, Manifest, RankState, RunState, check_resume_compatible,
    check_schedule_kept, newest_complete, prune, rank_file, read_json, read_optimizer_state,
    step_dir, write_file, write_optimizer_state,
};
use crate::onebit::onebit_rank_file;
use crate::optim::PreTrainingOptimizer;
use crate::parallel::{CommThread, GradHookBackend};
use crate::{TrainConfig, TrainError};

/// What a resumed run continues from.
pub(crate) struct Resumed {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Rank 0's saved state of the run (every rank reads it).
    pub run: RunState,
}

fn output_error(path: &Path, e: impl std::fmt::Display) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl<B: GradHookBackend> Trainer<B> {
    /// Writes the checkpoint of step `run.step` to `OUT/checkpoints/step-NNNNNNN/`: this
    /// rank's `rank-NNNNN.json`; on rank 0 the weights, optimizer state, configurations, run
    /// state and metrics so far, then (after every rank has reported its file's digest) the
    /// manifest; then older checkpoints beyond `checkpoint.keep` are deleted. Every rank calls
    /// it at the same step. Returns the folder.
    ///
    /// # Errors
    /// [`TrainError::Checkpoint`] naming a file that cannot be written; [`TrainError::Comm`].
    pub(crate) fn save_checkpoint(
        &self,
        model: &BertForPreTraining<B>,
        config: &TrainConfig,
        rank_data: &RankData,
        run: &RunState,
        comm: &CommThread<B::InnerBackend>,
    ) -> Result<PathBuf, TrainError> {
        let started = Instant::now();
        let out = &config.train.out;
        let dir = step_dir(out, run.step);
        std::fs::create_dir_all(&dir).map_err(|e| output_error(&dir, e))?;
        let rank = comm.rank();
        // A folder of the same step left by an earlier attempt is rewritten: it is incomplete
        // until its new manifest is in place.
        if rank == 0 {
            match std::fs::remove_file(dir.join(MANIFEST)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(output_error(&dir.join(MANIFEST), e));
                }
                _ => {}
            }
        }
        let state = RankState {
            rank,
            seed: self.seed,
            data: rank_data.batches.position(),
        };
        let name = rank_file(rank);
        let path = dir.join(&name);
        write_file(
            &path,
            serde_json::to_string_pretty(&state)
                .expect("a rank state serialises")
                .as_bytes(),
        )?;
        let mut files = vec![(name, FileDigest::of_file(&path)?)];
        // 1-bit Adam/LAMB: this rank's error feedback (Note [Checkpoints]).
        if let Some(onebit) = self.optimizer.onebit() {
            let name = onebit_rank_file(rank);
            let path = dir.join(&name);
            write_file(&path, &onebit.rank_state(model))?;
            files.push((name, FileDigest::of_file(&path)?));
        }
        let report = serde_json::to_vec(&files).expect("a digest serialises");
        let reports = comm.call(move |c| c.allgather(&report))?;
        if rank != 0 {
            return Ok(dir);
        }

        let mut manifest = Manifest {
            format_version: crate::checkpoint::FORMAT_VERSION,
            step: run.step,
            world_size: comm.world_size(),
            files: Default::default(),
        };
        for report in reports {
            let files: Vec<(String, FileDigest)> = serde_json::from_slice(&report)
                .map_err(|e| output_error(&dir, format!("a rank's file report: {e}")))?;
            manifest.files.extend(files);
        }
        let weights = dir.join("model.safetensors");
        model.valid().save_hf_safetensors(&weights)?;
        write_optimizer_state(
            &dir.join("optimizer.safetensors"),
            &self.optimizer.state(model),
        )?;
        write_file(
            &dir.join("config.json"),
            self.bert_config.to_hf_json().as_bytes(),
        )?;
        write_file(&dir.join("train_config.toml"), config.to_toml().as_bytes())?;
        write_file(
            &dir.join("trainer_state.json"),
            serde_json::to_string_pretty(run)
                .expect("a run state serialises")
                .as_bytes(),
        )?;
        let metrics = out.join("metrics.jsonl");
        let metrics = std::fs::read(&metrics).map_err(|e| output_error(&metrics, e))?;
        write_file(&dir.join("metrics.jsonl"), &metrics)?;
        for name in [
            "model.safetensors",
            "optimizer.safetensors",
            "config.json",
            "train_config.toml",
            "trainer_state.json",
            "metrics.jsonl",
        ] {
            manifest
                .files
                .insert(name.into(), FileDigest::of_file(&dir.join(name))?);
        }
        write_file(
            &dir.join(MANIFEST),
            serde_json::to_string_pretty(&manifest)
                .expect("a manifest serialises")
                .as_bytes(),
        )?;
        let bytes: u64 = manifest.files.values().map(|f| f.bytes).sum();
        info!(
            step = run.step,
            dir = %dir.display(),
            mib = format!("{:.1}", bytes as f64 / (1 << 20) as f64),
            seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
            "checkpoint written"
        );
        for deleted in prune(out, config.checkpoint.keep) {
            info!(dir = %deleted.display(), "deleted an older checkpoint (checkpoint.keep)");
        }
        Ok(dir)
    }

    /// Continues the run of `from` (an output folder): rank 0 picks the newest checkpoint
    /// whose manifest verifies (warning about each one skipped), every rank checks that the
    /// configuration may resume it (Note [What a resume may change]) and its own rank file,
    /// then loads the weights, the optimizer state and its data position. Returns the model
    /// and what the loop continues from.
    ///
    /// # Errors
    /// [`TrainError::NoCheckpoint`] (rank 0; the other ranks report that rank 0 found none);
    /// [`TrainError::ResumeMismatch`]; [`TrainError::InvalidSetting`] when `train.steps` is
    /// not above the checkpoint's step; [`TrainError::Checkpoint`] naming a file that does
    /// not load; [`TrainError::Comm`].
    pub(crate) fn resume(
        &mut self,
        model: BertForPreTraining<B>,
        from: &Path,
        config: &TrainConfig,
        rank_data: &mut RankData,
        comm: &CommThread<B::InnerBackend>,
    ) -> Result<(BertForPreTraining<B>, Resumed), TrainError> {
        let started = Instant::now();
        let rank = comm.rank();
        // Rank 0 chooses; every rank learns the choice (or that there is none).
        let chosen = if rank == 0 {
            Some(newest_complete(from))
        } else {
            None
        };
        let message = match &chosen {
            Some(Ok((dir, _, skipped))) => {
                for reason in skipped {
                    warn!("skipped a checkpoint that does not verify: {reason}");
                }
                format!("ok\n{}", dir.display())
            }
            Some(Err(e)) => format!("error\n{e}"),
            None => String::new(),
        };
        let all = comm.call(move |c| c.allgather(message.as_bytes()))?;
        let choice = String::from_utf8_lossy(&all[0]).into_owned();
        let (dir, manifest) = match (chosen, choice.split_once('\n')) {
            (Some(result), _) => {
                let (dir, manifest, _) = result?;
                (dir, manifest)
            }
            (None, Some(("ok", dir))) => {
                let dir = PathBuf::from(dir);
                let manifest = Manifest::read(&dir)?;
                manifest.check_file(&dir, &rank_file(rank))?;
                (dir, manifest)
            }
            (None, _) => {
                return Err(output_error(
                    from,
                    format!(
                        "rank 0 found no checkpoint to resume: {}",
                        choice.split_once('\n').map_or("", |(_, m)| m)
                    ),
                ));
            }
        };

        let saved = TrainConfig::load(&dir.join("train_config.toml"))?;
        check_resume_compatible(&saved, manifest.world_size, config, comm.world_size())?;
        let run: RunState = read_json(&dir.join("trainer_state.json"))?;
        if run.step != manifest.step {
            return Err(output_error(
                &dir.join("trainer_state.json"),
                format!(
                    "step {} differs from the manifest's {}",
                    run.step, manifest.step
                ),
            ));
        }
        check_schedule_kept(&run, &saved, config)?;
        if config.train.steps <= manifest.step {
            return Err(TrainError::InvalidSetting {
                field: "train.steps",
                reason: format!(
                    "the run has {} steps and the checkpoint {} is at step {}: raise train.steps (--steps) to continue it",
                    config.train.steps,
                    dir.display(),
                    manifest.step
                ),
            });
        }
        let model = model.load_hf_safetensors(&dir.join("model.safetensors"))?;
        let optimizer_file = dir.join("optimizer.safetensors");
        self.optimizer
            .load_state(&model, read_optimizer_state(&optimizer_file)?)
            .map_err(|reason| output_error(&optimizer_file, reason))?;
        if self.optimizer.onebit().is_some() {
            let name = onebit_rank_file(rank);
            let path = dir.join(&name);
            if rank != 0 {
                manifest.check_file(&dir, &name)?;
            }
            let bytes = std::fs::read(&path).map_err(|e| output_error(&path, e))?;
            let PreTrainingOptimizer::Onebit(onebit) = &mut self.optimizer else {
                unreachable!("checked above")
            };
            onebit
                .load_rank_state(&model, &bytes)
                .map_err(|reason| output_error(&path, reason))?;
        }
        let rank_path = dir.join(rank_file(rank));
        let state: RankState = read_json(&rank_path)?;
        if state.rank != rank {
            return Err(output_error(
                &rank_path,
                format!("holds rank {}'s state, not rank {rank}'s", state.rank),
            ));
        }
        rank_data.batches.restore(&state.data, &rank_path)?;
        match (self.loss_scaler.as_mut(), run.loss_scaler) {
            (Some(scaler), Some(saved)) => {
                scaler.restore(saved);
                if rank == 0 {
                    info!(
                        loss_scale = scaler.scale(),
                        "the loss scale continues from the checkpoint (loss_scale.init_scale is \
                         for fresh runs)"
                    );
                }
            }
            (None, Some(saved)) if rank == 0 => warn!(
                saved_loss_scale = saved.scale,
                "the checkpoint's run scaled its loss and this one does not (loss_scale.mode, \
                 train.precision)"
            ),
            _ => {}
        }
        if rank == 0 {
            info!(
                step = run.step,
                dir = %dir.display(),
                seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
                "resuming"
            );
        }
        Ok((model, Resumed { dir, run }))
    }
}
