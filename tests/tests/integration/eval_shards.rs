//! Evaluation on an eval shard, as MLPerf scores it: masked-LM accuracy over every masked
//! position of the set (not a mean over batches). A hand-made shard of samples with 1 to 4
//! masked positions, whose labels are set, position by position, to what the model predicts
//! or to another token, so the accuracy is known by construction (hits / positions); the
//! trainer's `evaluate` over the shard read by `read_eval_set`, in batches of several sizes,
//! must give exactly that, and its loss the mean over positions computed here by hand.

use burn::backend::NdArray;
use ember_data::shard::{Compression, write_shard};
use ember_data::{InstanceLoader, TrainingInstance, collate, read_eval_set};
use ember_model::{BertConfig, BertForPreTraining};
use ember_tests::fixture;
use ember_trainer::eval::evaluate;

type B = NdArray;

/// Sample `i`: 10 + 3i real tokens below the fixture's vocabulary of 97, `1 + i % 4` masked.
fn sample(i: usize) -> TrainingInstance {
    let len = 10 + 3 * i;
    let input_ids: Vec<u32> = (0..len)
        .map(|t| match t {
            0 => 2,
            t if t + 1 == len => 3,
            t => 5 + ((t * 7 + i * 13) % 90) as u32,
        })
        .collect();
    let masked = 1 + i % 4;
    let positions: Vec<u32> = (0..masked).map(|k| (1 + 2 * k + i % 2) as u32).collect();
    TrainingInstance {
        segment_ids: (0..len).map(|t| u8::from(t >= len / 2)).collect(),
        masked_lm_ids: vec![0; masked],
        masked_lm_positions: positions,
        input_ids,
        next_sentence_label: (i % 2) as u8,
    }
}

/// The model's prediction and log-softmax row at each masked position of one sample, by
/// hand from its logits.
fn by_hand(model: &BertForPreTraining<B>, instance: &TrainingInstance) -> Vec<(u32, Vec<f64>)> {
    let device = Default::default();
    let batch = collate(&[instance], 32).to_device::<B>(&device);
    let output = model.forward(
        batch.input_ids,
        batch.segment_ids,
        batch.input_mask,
        batch.masked_lm_flat_positions,
    );
    let [n, vocab] = output.mlm_logits.dims();
    let logits: Vec<f32> = output.mlm_logits.into_data().to_vec().unwrap();
    (0..n)
        .map(|row| {
            let row = &logits[row * vocab..(row + 1) * vocab];
            let (best, _) =
                row.iter().enumerate().fold(
                    (0, f32::MIN),
                    |(bi, bv), (i, &v)| {
                        if v > bv { (i, v) } else { (bi, bv) }
                    },
                );
            let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            let log_softmax = row.iter().map(|&v| v as f64 - max - sum.ln()).collect();
            (best as u32, log_softmax)
        })
        .collect()
}

#[test]
fn eval_shard_accuracy_is_over_every_masked_position() {
    let device = Default::default();
    let dir = fixture("hf_tiny_bert");
    let config = BertConfig::load_json(&dir.join("config.json")).unwrap();
    let model: BertForPreTraining<B> = config
        .init_for_pretraining(&device)
        .load_hf_safetensors(&dir.join("model.safetensors"))
        .unwrap();
    let mut instances: Vec<TrainingInstance> = (0..7).map(sample).collect();
    let (mut hits, mut positions, mut loss) = (0usize, 0usize, 0.0f64);
    for (i, instance) in instances.iter_mut().enumerate() {
        for (k, (predicted, log_softmax)) in by_hand(&model, instance).into_iter().enumerate() {
            // Every other position (by sample and position) gets the predicted token.
            let label = if (i + k) % 2 == 0 {
                hits += 1;
                predicted
            } else {
                (predicted + 1) % 97
            };
            instance.masked_lm_ids[k] = label;
            loss -= log_softmax[label as usize];
            positions += 1;
        }
    }
    assert_eq!(positions, 1 + 2 + 3 + 4 + 1 + 2 + 3);
    assert_eq!(hits, 10);
    let tmp = tempfile::tempdir().unwrap();
    let shard = tmp.path().join("eval.hdf5");
    write_shard(&shard, &instances, 32, 4, Compression::Gzip(1)).unwrap();
    // The first 6 samples only: the limit is MLPerf's "first N samples of the eval shard".
    let read = read_eval_set(&shard, 97, 32, 6).unwrap();
    assert_eq!(read, instances[..6]);
    let read = read_eval_set(tmp.path(), 97, 32, 100).unwrap();
    assert_eq!(read, instances);
    // Samples 0..6: 1, 2, 3, 4, 1, 2 positions, of which 1, 1, 2, 2, 1, 1 predicted.
    let (hits_6, positions_6) = (8, 13);
    let expected = [(6, hits_6, positions_6), (7, hits, positions)];
    for (n, hits, positions) in expected {
        for batch_size in [1, 2, 3, 7] {
            let loader =
                InstanceLoader::new(read[..n].to_vec(), batch_size.min(n), 32, 0, "eval").unwrap();
            let result = evaluate(&model, loader.sequential_batches(), &device);
            assert_eq!(result.num_predictions, positions, "batch {batch_size}");
            assert_eq!(
                result.mlm_accuracy,
                hits as f64 / positions as f64,
                "{n} samples in batches of {batch_size}"
            );
            if n == 7 {
                let mean = loss / positions as f64;
                assert!(
                    (result.mlm_loss - mean).abs() < 1e-4 * mean,
                    "loss {} vs {mean} by hand",
                    result.mlm_loss
                );
            }
        }
    }
}
