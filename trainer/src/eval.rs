//! Evaluation on held-out instances: masked-LM and next-sentence accuracy and loss, and the
//! unigram baseline that masked-LM accuracy has to beat.

use ember_backend_ext::FusedOps;
use std::collections::HashMap;

use burn::tensor::ElementConversion;
use ember_data::{Batch, HostBatch, TrainingInstance};
use ember_model::{BertForPreTraining, ForwardHook, NoHook, PreTrainingLoss, PreTrainingOutput};
use serde::Serialize;

/// Accuracy and loss over an evaluation set.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct EvalResult {
    /// Fraction of masked tokens whose arg-max prediction is the original token.
    pub mlm_accuracy: f64,
    /// Fraction of samples whose next-sentence label is predicted.
    pub nsp_accuracy: f64,
    /// Masked-LM cross-entropy per masked token.
    pub mlm_loss: f64,
    /// Next-sentence cross-entropy per sample.
    pub nsp_loss: f64,
    /// Masked tokens evaluated.
    pub num_predictions: usize,
    /// Samples evaluated.
    pub num_samples: usize,
}

/// Runs the model on a batch and computes its pre-training loss.
pub fn forward_loss<B: FusedOps>(
    model: &BertForPreTraining<B>,
    batch: Batch<B>,
) -> (PreTrainingOutput<B>, PreTrainingLoss<B>) {
    forward_loss_hooked(model, batch, &NoHook)
}

/// [`forward_loss`] with `hook` at the model's layer boundaries (see [`ForwardHook`]).
pub fn forward_loss_hooked<B: FusedOps>(
    model: &BertForPreTraining<B>,
    batch: Batch<B>,
    hook: &dyn ForwardHook<B>,
) -> (PreTrainingOutput<B>, PreTrainingLoss<B>) {
    // The real tokens' rows built on the host: an unpadded encoder reads no mask back.
    let output = model.forward_hooked_with_rows(
        batch.input_ids,
        batch.segment_ids,
        batch.input_mask,
        batch.masked_lm_flat_positions,
        Some(batch.real_rows),
        hook,
    );
    let loss = model.loss(&output, batch.masked_lm_labels, batch.next_sentence_labels);
    (output, loss)
}

/// Evaluates `model` (use `model.valid()`: the inner backend has no dropout) on `batches`.
pub fn evaluate<B: FusedOps>(
    model: &BertForPreTraining<B>,
    batches: impl IntoIterator<Item = HostBatch>,
    device: &B::Device,
) -> EvalResult {
    let (mut mlm_correct, mut mlm_loss, mut predictions) = (0.0f64, 0.0f64, 0.0f64);
    let (mut nsp_correct, mut nsp_loss, mut samples) = (0.0f64, 0.0f64, 0usize);
    for host in batches {
        let batch = host.to_device::<B>(device);
        let (output, loss) = forward_loss(model, batch.clone());
        let [n, _] = output.mlm_logits.dims();
        let b = host.batch_size;
        let n_pred = n as f64;
        let predicted = output.mlm_logits.argmax(1).reshape([n]);
        let hits = predicted.equal(batch.masked_lm_labels).int().sum();
        mlm_correct += f64::from(hits.into_scalar().elem::<i32>());
        mlm_loss += f64::from(loss.mlm.into_scalar().elem::<f32>()) * n_pred;
        predictions += n_pred;

        let nsp_predicted = output.nsp_logits.argmax(1).reshape([b]);
        let nsp_hits = nsp_predicted.equal(batch.next_sentence_labels).int().sum();
        nsp_correct += f64::from(nsp_hits.into_scalar().elem::<i32>());
        nsp_loss += f64::from(loss.nsp.into_scalar().elem::<f32>()) * b as f64;
        samples += b;
    }
    let per = |x: f64, n: f64| if n > 0.0 { x / n } else { 0.0 };
    EvalResult {
        mlm_accuracy: per(mlm_correct, predictions),
        nsp_accuracy: per(nsp_correct, samples as f64),
        mlm_loss: per(mlm_loss, predictions),
        nsp_loss: per(nsp_loss, samples as f64),
        num_predictions: predictions as usize,
        num_samples: samples,
    }
}

/// The masked-LM accuracy of always predicting the most frequent masked token of `train`,
/// measured on `eval`: what a model that ignores the context scores. Returns (token id,
/// accuracy).
pub fn unigram_baseline<'a>(
    train: impl IntoIterator<Item = &'a TrainingInstance>,
    eval: &[TrainingInstance],
) -> (u32, f64) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for id in train.into_iter().flat_map(|i| &i.masked_lm_ids) {
        *counts.entry(*id).or_default() += 1;
    }
    // Ties go to the smaller id, so the baseline does not depend on hash order.
    let top = counts
        .into_iter()
        .max_by_key(|&(id, n)| (n, std::cmp::Reverse(id)))
        .map_or(0, |(id, _)| id);
    let labels: Vec<u32> = eval
        .iter()
        .flat_map(|i| i.masked_lm_ids.iter().copied())
        .collect();
    let hits = labels.iter().filter(|&&id| id == top).count();
    (
        top,
        if labels.is_empty() {
            0.0
        } else {
            hits as f64 / labels.len() as f64
        },
    )
}

/// Evaluates the held-out set split over the ranks (batch i on rank i mod W) and sums the
/// counts over ranks, so every rank gets the whole set's result.
pub(crate) fn evaluate_sharded<B: crate::parallel::GradHookBackend>(
    model: &ember_model::BertForPreTraining<B>,
    eval_loader: &ember_data::InstanceLoader,
    device: &B::Device,
    comm: &crate::parallel::CommThread<B::InnerBackend>,
) -> Result<EvalResult, crate::TrainError> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let mine = eval_loader
        .sequential_batches()
        .enumerate()
        .filter(|(i, _)| i % world_size == rank)
        .map(|(_, b)| b);
    let local = evaluate(&burn::module::AutodiffModule::valid(model), mine, device);
    if world_size == 1 {
        return Ok(local);
    }
    // Counts are integers (exact in f32 below 2^24); loss sums lose only f32 rounding.
    let (n, s) = (local.num_predictions as f64, local.num_samples as f64);
    let sums = [
        (local.mlm_accuracy * n).round(),
        local.mlm_loss * n,
        n,
        (local.nsp_accuracy * s).round(),
        local.nsp_loss * s,
        s,
    ]
    .map(|x| x as f32);
    let sums = comm.call(move |c| {
        let mut sums = sums;
        c.allreduce(&mut sums, crate::parallel::ReduceOp::Sum)
            .map(|()| sums)
    })?;
    let per = |x: f32, n: f32| if n > 0.0 { f64::from(x / n) } else { 0.0 };
    Ok(EvalResult {
        mlm_accuracy: per(sums[0], sums[2]),
        mlm_loss: per(sums[1], sums[2]),
        nsp_accuracy: per(sums[3], sums[5]),
        nsp_loss: per(sums[4], sums[5]),
        num_predictions: sums[2].round() as usize,
        num_samples: sums[5].round() as usize,
    })
}
