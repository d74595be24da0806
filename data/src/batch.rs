//! Batches with dynamic padding: each batch is padded to its own longest sample, rounded up to
//! a multiple of 8 (tensor-core friendly, as NVIDIA's MLPerf BERT and Hugging Face's
//! `pad_to_multiple_of=8`), never beyond `max_seq_length`.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::TrainingInstance;

/// Padded sequence lengths are multiples of this.
pub const PAD_TO_MULTIPLE_OF: usize = 8;

/// A padded batch in host memory, row-major, ready to become tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct HostBatch {
    /// B, the number of samples.
    pub batch_size: usize,
    /// S, the padded sequence length.
    pub seq_len: usize,
    /// P, the padded number of predictions (the most of any sample of the batch, at least 1).
    pub num_predictions: usize,
    /// `[B·S]` token ids, `[PAD]` (0) after each sample's end.
    pub input_ids: Vec<i64>,
    /// `[B·S]` segment ids, 0 in padding.
    pub segment_ids: Vec<i64>,
    /// `[B·S]` 1 for real tokens, 0 for padding.
    pub input_mask: Vec<i64>,
    /// `[B·P]` masked positions, 0 in padding (position 0 is `[CLS]`, never masked).
    pub masked_lm_positions: Vec<i64>,
    /// `[B·P]` original ids at the masked positions, 0 in padding.
    pub masked_lm_ids: Vec<i64>,
    /// `[B·P]` 1.0 for real predictions, 0.0 for padding.
    pub masked_lm_weights: Vec<f32>,
    /// `[B]` 1 if segment B is random, 0 if it follows A.
    pub next_sentence_labels: Vec<i64>,
}

/// A batch as tensors on a device, the masked-LM targets packed: only the N real predictions
/// of the batch, in row-major order of the `[B, P]` layout (MLPerf's `dense_seq_output`).
#[derive(Debug, Clone)]
pub struct Batch<B: Backend> {
    /// `[B, S]`
    pub input_ids: Tensor<B, 2, Int>,
    /// `[B, S]`
    pub segment_ids: Tensor<B, 2, Int>,
    /// `[B, S]`
    pub input_mask: Tensor<B, 2, Int>,
    /// `[N]`, `b·S + masked_lm_positions[b, p]` for each real prediction: a row of the
    /// flattened `[B·S, H]` hidden states.
    pub masked_lm_flat_positions: Tensor<B, 1, Int>,
    /// `[N]`, `masked_lm_ids[b, p]` of each real prediction.
    pub masked_lm_labels: Tensor<B, 1, Int>,
    /// `[B]`
    pub next_sentence_labels: Tensor<B, 1, Int>,
    /// `[T]`, `b·S + s` for each real token (`input_mask` 1), ascending: the rows of the
    /// flattened `[B·S, H]` hidden states an unpadded encoder keeps (`model.unpad`), built on
    /// the host so that the model need not read the mask back.
    pub real_rows: Tensor<B, 1, Int>,
}

/// The flattened rows `b·S + s` (indices into the row-major mask) where a `[B, S]`
/// `input_mask` is not 0, ascending: [`Batch::real_rows`].
pub fn real_rows(input_mask: &[i64]) -> Vec<i64> {
    (0..input_mask.len())
        .filter(|&i| input_mask[i] != 0)
        .map(|i| i as i64)
        .collect()
}

/// The padded length of a batch whose longest sample has `longest` tokens.
pub fn padded_length(longest: usize, max_seq_length: usize) -> usize {
    longest
        .div_ceil(PAD_TO_MULTIPLE_OF)
        .saturating_mul(PAD_TO_MULTIPLE_OF)
        .min(max_seq_length)
}

/// Pads `instances` into one batch: S = the longest sample rounded up to a multiple of 8
/// (capped at `max_seq_length`), P = the most predictions of any sample (at least 1).
///
/// # Panics
/// If `instances` is empty or a sample is longer than `max_seq_length` (instances are created
/// no longer than that).
pub fn collate(instances: &[&TrainingInstance], max_seq_length: usize) -> HostBatch {
    let longest = instances.iter().map(|i| i.len()).max().unwrap_or(0);
    collate_padded(instances, padded_length(longest, max_seq_length))
}

/// Pads `instances` into one batch of exactly `seq_len` tokens per sample (P as
/// [`collate`]): `max_seq_length` for padding to the maximum.
///
/// # Panics
/// If `instances` is empty or a sample is longer than `seq_len`.
pub fn collate_padded(instances: &[&TrainingInstance], seq_len: usize) -> HostBatch {
    assert!(!instances.is_empty(), "a batch needs at least one instance");
    let longest = instances.iter().map(|i| i.len()).max().unwrap_or(0);
    assert!(
        longest <= seq_len,
        "instance of {longest} tokens exceeds {seq_len}"
    );
    let num_predictions = instances
        .iter()
        .map(|i| i.masked_lm_positions.len())
        .max()
        .unwrap_or(0)
        .max(1);

    let b = instances.len();
    let mut batch = HostBatch {
        batch_size: b,
        seq_len,
        num_predictions,
        input_ids: vec![0; b * seq_len],
        segment_ids: vec![0; b * seq_len],
        input_mask: vec![0; b * seq_len],
        masked_lm_positions: vec![0; b * num_predictions],
        masked_lm_ids: vec![0; b * num_predictions],
        masked_lm_weights: vec![0.0; b * num_predictions],
        next_sentence_labels: Vec::with_capacity(b),
    };
    for (row, instance) in instances.iter().enumerate() {
        let tokens = row * seq_len..row * seq_len + instance.len();
        for (dst, &id) in batch.input_ids[tokens.clone()]
            .iter_mut()
            .zip(&instance.input_ids)
        {
            *dst = i64::from(id);
        }
        for (dst, &s) in batch.segment_ids[tokens.clone()]
            .iter_mut()
            .zip(&instance.segment_ids)
        {
            *dst = i64::from(s);
        }
        batch.input_mask[tokens].fill(1);
        let preds =
            row * num_predictions..row * num_predictions + instance.masked_lm_positions.len();
        for (k, idx) in preds.enumerate() {
            batch.masked_lm_positions[idx] = i64::from(instance.masked_lm_positions[k]);
            batch.masked_lm_ids[idx] = i64::from(instance.masked_lm_ids[k]);
            batch.masked_lm_weights[idx] = 1.0;
        }
        batch
            .next_sentence_labels
            .push(i64::from(instance.next_sentence_label));
    }
    batch
}

impl HostBatch {
    /// Number of real tokens in the batch (the sum of `input_mask`).
    pub fn num_tokens(&self) -> usize {
        self.input_mask.iter().filter(|&&m| m == 1).count()
    }

    /// The flattened rows `b·S + s` of the real tokens, ascending (see [`Batch::real_rows`]).
    pub fn real_rows(&self) -> Vec<i64> {
        real_rows(&self.input_mask)
    }

    /// Number of real predictions (masked tokens): the N of the packed targets.
    pub fn num_masked_tokens(&self) -> usize {
        self.masked_lm_weights.iter().filter(|&&w| w > 0.0).count()
    }

    /// The real predictions, packed: (`b·S + position`, original id) for each prediction
    /// with weight 1, in row-major order.
    pub fn packed_predictions(&self) -> (Vec<i64>, Vec<i64>) {
        let p = self.num_predictions;
        (0..self.batch_size * p)
            .filter(|&k| self.masked_lm_weights[k] > 0.0)
            .map(|k| {
                (
                    (k / p * self.seq_len) as i64 + self.masked_lm_positions[k],
                    self.masked_lm_ids[k],
                )
            })
            .unzip()
    }

    /// Copies the batch to `device` as tensors, the predictions packed.
    pub fn to_device<B: Backend>(&self, device: &B::Device) -> Batch<B> {
        let (b, s) = (self.batch_size, self.seq_len);
        let tokens = |values: &[i64]| {
            Tensor::<B, 2, Int>::from_data(TensorData::new(values.to_vec(), [b, s]), device)
        };
        let vector = |values: Vec<i64>| {
            let n = values.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(values, [n]), device)
        };
        let (flat_positions, labels) = self.packed_predictions();
        Batch {
            input_ids: tokens(&self.input_ids),
            segment_ids: tokens(&self.segment_ids),
            input_mask: tokens(&self.input_mask),
            masked_lm_flat_positions: vector(flat_positions),
            masked_lm_labels: vector(labels),
            next_sentence_labels: vector(self.next_sentence_labels.clone()),
            real_rows: vector(self.real_rows()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(len: usize, predictions: usize) -> TrainingInstance {
        TrainingInstance {
            input_ids: (0..len as u32).map(|i| i + 1000).collect(),
            segment_ids: vec![0; len],
            masked_lm_positions: (1..=predictions as u32).collect(),
            masked_lm_ids: vec![7; predictions],
            next_sentence_label: 1,
        }
    }

    #[test]
    fn pads_to_longest_rounded_to_eight() {
        let (a, b) = (instance(11, 2), instance(5, 3));
        let batch = collate(&[&a, &b], 128);
        assert_eq!((batch.seq_len, batch.num_predictions), (16, 3));
        assert_eq!(batch.num_tokens(), 16);
        assert_eq!(&batch.input_mask[16..24], &[1, 1, 1, 1, 1, 0, 0, 0]);
        assert_eq!(&batch.input_ids[16 + 4..16 + 6], &[1004, 0]);
        assert_eq!(&batch.masked_lm_weights, &[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(&batch.masked_lm_positions[..3], &[1, 2, 0]);
        // Packed: row 0's two predictions, then row 1's three, at b·16 + position.
        let (flat, labels) = batch.packed_predictions();
        assert_eq!(flat, vec![1, 2, 17, 18, 19]);
        assert_eq!(labels, vec![7; 5]);
        // The real tokens' rows: row 0's 11, then row 1's 5 from 16.
        let rows: Vec<i64> = (0..11).chain(16..21).collect();
        assert_eq!(batch.real_rows(), rows);
        // Never padded beyond the model's maximum, even when that is not a multiple of 8.
        assert_eq!(collate(&[&instance(60, 1)], 60).seq_len, 60);
        assert_eq!(padded_length(64, 128), 64);
    }
}
