//! `train.init_passes`: forward and backward passes on a dummy batch before the timed run,
//! as Samsung's MLPerf BERT runs them (Note [Init passes]).

use std::time::Instant;

use ember_data::HostBatch;
use ember_model::BertForPreTraining;
use serde_json::json;
use tracing::info;

use super::output::RunLog;
use super::setup::Trainer;
use super::step::Update;
use crate::parallel::GradHookBackend;
use crate::{RunOptions, TrainConfig, TrainError};

// Note [Init passes]
// ~~~~~~~~~~~~~~~~~~
// Samsung's MLPerf v1.1 BERT (`run_pretraining.py`, "Dummy Batch First from MLPerf v1.0
// code": `for i in range(10):  # 10 Times need to initialize NCCL`) runs ten passes between
// loading the model and `init_stop`/`run_start`, each on a batch of ones of the run's shape:
// its group exchange padding (an all-gather), forward, backward through the DDP
// communication hook (each bucket clipped and allreduced), the optimizer's lazy
// initialisation, then `optimizer.zero_grad()`; no optimizer step. The first kernels, the
// communicator's first collectives and the allocations of a step happen there, outside the
// timed run: an MLPerf result is timed from `run_start` (Samsung's run took 26.7 s in all,
// ../shared/REFERENCES.md), and ember's first step compiles its kernels
// (docs/gpu.md, the time to the first step). NVIDIA's MLPerf BERT builds the same batch of
// ones (`batch_gpu_placeholder`) for its CUDA graphs.
//
// ember's passes are `Trainer::pass` with `Update::None`: the step's own code, its gradient
// hooks, buckets, clipping and allreduces included, on a dummy batch of the run's largest
// shape (`train.batch_size` samples of `instances.max_seq_length` tokens; one micro-batch, or
// two with `parallel.grad_accum` > 1, so that a later micro-batch's accumulation runs too);
// then nothing is updated: the weights, the optimizer's state, the loss scale and the
// schedule stay, and no training or evaluation batch is drawn, so a run with passes trains
// bit for bit as the same run without them (tested). Where ember differs from Samsung's:
// - its masked-LM labels cover every position of every sample (the `[B, S]` labels of
//   NVIDIA's model); ember's batch masks the first `instances.max_predictions_per_seq`
//   positions after `[CLS]` of each sample, the most a training sample has (`dense_seq_output`);
// - its optimizer initialises its buffers in the passes (apex's `_lazy_init_stage1/2`);
//   ember's optimizer creates its moments, and compiles its kernels, at the first step,
//   which the passes do not take;
// - the exchange padding's all-gather is not repeated (ember's presorting exchanges
//   lengths on the host, `ember_data::sampler`).
// So the first step still holds the optimizer's first update, and the kernels of shapes the
// dummy batch does not have (shorter micro-batches under `--padding grouped` where a kernel
// depends on the shape, as autotuned GEMMs do).

/// The dummy batch of the init passes (Note [Init passes]): `batch_size` samples of
/// `seq_len` tokens, every token id, segment id and mask 1, the first `predictions` positions
/// after `[CLS]` masked with label 1 (at most `seq_len − 1` of them), next-sentence label 1.
pub(crate) fn dummy_batch(batch_size: usize, seq_len: usize, predictions: usize) -> HostBatch {
    let predictions = predictions.clamp(1, seq_len.saturating_sub(1).max(1));
    let positions: Vec<i64> = (1..=predictions as i64).collect();
    HostBatch {
        batch_size,
        seq_len,
        num_predictions: predictions,
        input_ids: vec![1; batch_size * seq_len],
        segment_ids: vec![1; batch_size * seq_len],
        input_mask: vec![1; batch_size * seq_len],
        masked_lm_positions: positions.repeat(batch_size),
        masked_lm_ids: vec![1; batch_size * predictions],
        masked_lm_weights: vec![1.0; batch_size * predictions],
        next_sentence_labels: vec![1; batch_size],
    }
}

impl<B: GradHookBackend> Trainer<B> {
    /// Runs `config.train.init_passes` passes (Note [Init passes]) before step `step` (the
    /// dropout masks are that step's), each of one micro-batch, or two with
    /// `parallel.grad_accum` > 1, and returns `model`, unchanged, with this rank's loss (MLM +
    /// NSP, the micro-batches' as a step weighs them) of each pass. Rank 0 logs them and
    /// writes an `init_passes` record to the metrics (with the bytes each pass allreduced);
    /// the loop's clock (`train_seconds`) starts after them.
    ///
    /// # Errors
    /// As [`Trainer::step`].
    pub(crate) fn init_passes(
        &mut self,
        mut model: BertForPreTraining<B>,
        config: &TrainConfig,
        step: u64,
        device: &B::Device,
        options: &RunOptions,
        log: &mut RunLog<B::InnerBackend>,
    ) -> Result<(BertForPreTraining<B>, Vec<f64>), TrainError> {
        let passes = config.train.init_passes;
        if passes == 0 {
            return Ok((model, Vec::new()));
        }
        let started = Instant::now();
        let batch = dummy_batch(
            config.train.batch_size,
            config.instances.max_seq_length,
            config.instances.max_predictions_per_seq,
        );
        // With accumulation, a first and a later micro-batch: both paths of the buckets.
        let micro_batches = config.parallel.grad_accum.clamp(1, 2);
        let mut losses = Vec::with_capacity(passes as usize);
        let mut comm_bytes = Vec::with_capacity(passes as usize);
        for _ in 0..passes {
            let record;
            (model, record) = self.pass(
                model,
                step,
                vec![batch.clone(); micro_batches],
                device,
                options,
                Update::None,
            )?;
            comm_bytes.push(record.comm_bytes);
            // `[total, mlm, nsp]`: one read a pass, outside the timed run.
            let total = record.losses.into_data().convert::<f64>().to_vec::<f64>();
            losses.push(total.map_or(f64::NAN, |v| v[0]));
        }
        let seconds = started.elapsed().as_secs_f64();
        if self.rank == 0 {
            info!(
                passes,
                seconds = format!("{seconds:.1}"),
                losses = ?losses,
                "init passes done (forward and backward on a dummy batch, nothing updated)"
            );
        }
        log.write(json!({
            "event": "init_passes", "passes": passes, "micro_batches": micro_batches,
            "seconds": seconds, "losses": losses, "comm_bytes": comm_bytes,
        }))?;
        log.started = Instant::now();
        Ok((model, losses))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dummy_batch_has_the_runs_shape_and_masks_after_cls() {
        let b = dummy_batch(2, 8, 3);
        assert_eq!((b.batch_size, b.seq_len, b.num_predictions), (2, 8, 3));
        assert_eq!(b.input_ids, vec![1; 16]);
        assert_eq!(b.input_mask, vec![1; 16]);
        assert_eq!(b.segment_ids, vec![1; 16]);
        assert_eq!(b.masked_lm_positions, vec![1, 2, 3, 1, 2, 3]);
        assert_eq!(b.masked_lm_ids, vec![1; 6]);
        assert_eq!(b.masked_lm_weights, vec![1.0; 6]);
        assert_eq!(b.next_sentence_labels, vec![1, 1]);
        assert_eq!(b.num_tokens(), 16);
        // No more predictions than positions after [CLS].
        let b = dummy_batch(1, 4, 20);
        assert_eq!(b.num_predictions, 3);
        assert_eq!(b.masked_lm_positions, vec![1, 2, 3]);
    }
}
