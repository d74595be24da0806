//! ember's side of `bench train-step`: one configuration's model, optimizer and batch, and the
//! training step it times (`crate::bench_train_step`) or tries (`crate::bench_largest_batch`).

use std::time::Instant;

use anyhow::{Result, bail};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;
use ember_data::Batch;
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_trainer::config::OptimizerConfig;
use ember_trainer::eval::forward_loss;
use ember_trainer::optim::PreTrainingOptimizer;

use crate::bench_reference::HostInputs;

/// The model both sides of `bench train-step` (and `--largest-batch`'s tries) run: `preset`
/// with dropout 0, so that the two steps compute the same function, its vocabulary padded to
/// a multiple of `vocab_multiple` (`--make-vocab-size-divisible-by`, Note [Padded vocabulary]
/// in `model/src/vocab_padding.rs`; PyTorch's side gets the same `config.json`, as NVIDIA's
/// code pads its Hugging Face-style model).
pub(crate) fn bench_config(preset: Preset, vocab_multiple: usize) -> BertConfig {
    let config = BertConfig::preset(preset);
    BertConfig {
        hidden_dropout_prob: 0.0,
        attention_probs_dropout_prob: 0.0,
        vocab_size: ember_model::padded_vocab_size(config.vocab_size, vocab_multiple),
        ..config
    }
}

/// The ids the benchmark's batches draw from: the preset's own vocabulary, so that no id
/// reaches a padding row.
pub(crate) fn token_vocab(preset: Preset) -> usize {
    BertConfig::preset(preset).vocab_size
}

/// The host batch of one configuration: `batch_size` samples padded to `seq_len`, drawn
/// from `preset`'s vocabulary with `--max-predictions` masked positions and `--lengths`.
pub(crate) fn bench_inputs(
    args: &crate::bench_train_step::TrainStepArgs,
    preset: Preset,
    batch_size: usize,
    seq_len: usize,
) -> crate::bench_reference::HostInputs {
    crate::bench_reference::HostInputs::random(
        token_vocab(preset),
        batch_size,
        seq_len,
        args.max_predictions,
        args.lengths,
    )
}

/// Refuses a sequence length `config` has no positions for, and `max_predictions` outside
/// `1..seq_len`, naming the flag.
pub(crate) fn check_shape(
    config: &BertConfig,
    seq_len: usize,
    max_predictions: usize,
) -> Result<()> {
    if max_predictions == 0 || max_predictions >= seq_len {
        bail!("--max-predictions {max_predictions} must be in 1..{seq_len} (the sequence length)");
    }
    if seq_len > config.max_position_embeddings {
        bail!(
            "--seq-len {seq_len} exceeds the model's {} positions",
            config.max_position_embeddings
        );
    }
    Ok(())
}

/// ember's side of one configuration: the model, its optimizer and the batch.
pub(crate) struct EmberStep<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps> {
    pub(crate) model: Option<BertForPreTraining<B>>,
    pub(crate) optimizer: PreTrainingOptimizer<BertForPreTraining<B>, B>,
    pub(crate) inputs: Batch<B>,
    pub(crate) lr: f64,
    pub(crate) device: B::Device,
    /// The calling thread's kernel launches so far (the counting runtime's), if counted.
    pub(crate) launches: Option<fn() -> u64>,
    /// The most device memory the allocator held at a phase's end, bytes.
    pub(crate) reserved: Option<u64>,
}

impl<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps> EmberStep<B> {
    /// `model` with its AdamW (learning rate `lr`, the multi-tensor path where the backend
    /// has it) and `inputs` on `device`; `launches` counts the kernel launches, if given.
    pub(crate) fn new(
        model: BertForPreTraining<B>,
        inputs: &HostInputs,
        lr: f64,
        device: &B::Device,
        launches: Option<fn() -> u64>,
    ) -> Self {
        let optimizer = OptimizerConfig {
            lr,
            ..OptimizerConfig::default()
        };
        EmberStep {
            optimizer: PreTrainingOptimizer::new(
                &optimizer,
                &model,
                ember_model::Kernels::Auto.multi_tensor::<B>(),
            ),
            model: Some(model),
            inputs: inputs.batch(device),
            lr,
            device: device.clone(),
            launches,
            reserved: None,
        }
    }

    /// Runs the encoder on the real tokens alone from the next step on, or not
    /// ([`BertForPreTraining::set_unpad`]).
    pub(crate) fn set_unpad(&mut self, unpad: bool) {
        self.model
            .as_mut()
            .expect("the model is held between steps")
            .set_unpad(unpad);
    }

    pub(crate) fn loss(&self) -> f64 {
        let model = self
            .model
            .as_ref()
            .expect("the model is held between steps");
        let (_, loss) = forward_loss(&model.valid(), self.inputs_valid());
        loss.total.into_scalar().elem()
    }

    fn inputs_valid(&self) -> Batch<B::InnerBackend> {
        let i = &self.inputs;
        Batch {
            input_ids: i.input_ids.clone().inner(),
            segment_ids: i.segment_ids.clone().inner(),
            input_mask: i.input_mask.clone().inner(),
            masked_lm_flat_positions: i.masked_lm_flat_positions.clone().inner(),
            masked_lm_labels: i.masked_lm_labels.clone().inner(),
            next_sentence_labels: i.next_sentence_labels.clone().inner(),
            real_rows: i.real_rows.clone().inner(),
        }
    }

    /// One training step: its phases' seconds [forward and losses, backward, optimizer], each
    /// ended by a read to the host (the loss; a parameter's first value), which also waits for
    /// the device; and its kernel launches where counted (the reads launch nothing).
    pub(crate) fn step(&mut self) -> ([f64; 3], Option<u64>) {
        let model = self.model.take().expect("the model is held between steps");
        let launches_before = self.launches.map(|count| count());
        let start = Instant::now();
        let (_, loss) = forward_loss(&model, self.inputs.clone());
        let _: f64 = loss.total.clone().into_scalar().elem();
        let forward = start.elapsed().as_secs_f64();
        // The memory reads between phases are not the step's: their time is taken out.
        let mut reading = self.note_memory();
        let grads = GradientsParams::from_grads(loss.total.backward(), &model);
        wait_for(&model);
        let backward = start.elapsed().as_secs_f64() - reading - forward;
        reading += self.note_memory();
        let model = self.optimizer.step(self.lr, model, grads);
        wait_for(&model);
        let total = start.elapsed().as_secs_f64() - reading;
        self.note_memory();
        self.model = Some(model);
        let launches = self
            .launches
            .zip(launches_before)
            .map(|(count, before)| count() - before);
        ([forward, backward, total - forward - backward], launches)
    }

    /// Keeps the most device memory the allocator has held (read between phases); returns
    /// the seconds the read took, which the caller takes out of the phases' times.
    fn note_memory(&mut self) -> f64 {
        let start = Instant::now();
        if let Some(now) = B::memory_reserved(&self.device) {
            self.reserved = Some(self.reserved.map_or(now, |most| most.max(now)));
        }
        start.elapsed().as_secs_f64()
    }

    pub(crate) fn timed_steps(&mut self, n: usize) -> Vec<([f64; 3], Option<u64>)> {
        (0..n).map(|_| self.step()).collect()
    }
}

/// Waits for the device's queued work by reading one value of `model` to the host.
fn wait_for<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(model: &BertForPreTraining<B>) {
    let bias = model.cls.predictions.bias.val().slice([0..1]);
    let _: f64 = bias.into_scalar().elem();
}
