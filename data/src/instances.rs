//! Pre-training instances with the semantics of Google's `create_pretraining_data.py`
//! (github.com/google-research/bert): sentence pairs packed up to a target length (shorter with
//! probability `short_seq_prob`), a random second segment half of the time (next-sentence
//! label 1), and `masked_lm_prob` of the tokens selected for prediction, of which 80% become
//! `[MASK]`, 10% stay and 10% become a random vocabulary token.
//!
//! The control flow follows the reference line for line; the random number generator is Rust's
//! `StdRng`, not Python's `random`, so the same seed gives the same instances in ember on every
//! platform, but not the instances Python would give. Whole-word masking (the reference's
//! `--do_whole_word_mask`, off by default) is not implemented.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::{DataError, Document, SpecialTokens};

/// Settings of instance creation; names and defaults as the reference's flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default, deny_unknown_fields)]
pub struct PretrainingConfig {
    /// Longest instance, in tokens, `[CLS]` and both `[SEP]` included. Default: 128.
    #[arg(long = "seq-len", visible_alias = "max-seq-length")]
    pub max_seq_length: usize,
    /// Most masked positions per instance. Default: 20 (the reference's value for 128).
    #[arg(long = "max-predictions", visible_alias = "max-predictions-per-seq")]
    pub max_predictions_per_seq: usize,
    /// Fraction of tokens selected for prediction. Default: 0.15.
    #[arg(long)]
    pub masked_lm_prob: f64,
    /// Probability of a shorter target length, drawn uniformly in [2, max_seq_length − 3].
    /// Default: 0.1.
    #[arg(long)]
    pub short_seq_prob: f64,
    /// Number of passes over the documents, each with fresh masks and pairings. Default: 10.
    #[arg(long)]
    pub dupe_factor: usize,
    /// Seed of the instance generator. Default: 12345, the reference's `random_seed`.
    #[arg(long = "instances-seed", id = "instances.seed", value_name = "SEED")]
    pub seed: u64,
}

impl Default for PretrainingConfig {
    fn default() -> Self {
        Self {
            max_seq_length: 128,
            max_predictions_per_seq: 20,
            masked_lm_prob: 0.15,
            short_seq_prob: 0.1,
            dupe_factor: 10,
            seed: 12345,
        }
    }
}

impl PretrainingConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`DataError::InvalidSetting`] naming the setting: `max_seq_length` below 8,
    /// `max_predictions_per_seq` 0, a probability outside [0, 1], `dupe_factor` 0.
    pub fn validate(&self) -> Result<(), DataError> {
        let invalid = |field, reason: String| Err(DataError::InvalidSetting { field, reason });
        if self.max_seq_length < 8 {
            return invalid(
                "max_seq_length",
                format!("{} is below 8", self.max_seq_length),
            );
        }
        if self.max_predictions_per_seq == 0 {
            return invalid("max_predictions_per_seq", "must be at least 1".into());
        }
        for (field, p) in [
            ("masked_lm_prob", self.masked_lm_prob),
            ("short_seq_prob", self.short_seq_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return invalid(field, format!("{p} is outside [0, 1]"));
            }
        }
        if self.dupe_factor == 0 {
            return invalid("dupe_factor", "must be at least 1".into());
        }
        Ok(())
    }
}

/// One pre-training example, unpadded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingInstance {
    /// `[CLS] A [SEP] B [SEP]` with masked tokens replaced, length ≤ `max_seq_length`.
    pub input_ids: Vec<u32>,
    /// 0 for `[CLS]`, A and the first `[SEP]`; 1 for B and the last `[SEP]`.
    pub segment_ids: Vec<u8>,
    /// Positions selected for prediction, ascending, never a special token's position.
    pub masked_lm_positions: Vec<u32>,
    /// The original token at each masked position.
    pub masked_lm_ids: Vec<u32>,
    /// 1 if B is a random segment from another document, 0 if it follows A.
    pub next_sentence_label: u8,
}

impl TrainingInstance {
    /// Number of real tokens (the sum of the input mask).
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the instance has no token (never true for created instances).
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}

/// Creates the instances of a corpus: `dupe_factor` passes over the (shuffled) documents, then
/// one shuffle of all instances. Token ids of random replacements are drawn from
/// `0..vocab_size`, as the reference draws from the whole vocabulary.
///
/// # Errors
/// [`DataError::InvalidSetting`] from [`PretrainingConfig::validate`].
pub fn create_training_instances(
    documents: &[Document],
    config: &PretrainingConfig,
    special: SpecialTokens,
    vocab_size: usize,
) -> Result<Vec<TrainingInstance>, DataError> {
    config.validate()?;
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut documents: Vec<&Document> = documents.iter().filter(|d| !d.is_empty()).collect();
    documents.shuffle(&mut rng);

    let mut instances = Vec::new();
    for _ in 0..config.dupe_factor {
        for document_index in 0..documents.len() {
            instances.extend(create_instances_from_document(
                &documents,
                document_index,
                config,
                special,
                vocab_size,
                &mut rng,
            ));
        }
    }
    instances.shuffle(&mut rng);
    Ok(instances)
}

/// The reference's `create_instances_from_document`.
fn create_instances_from_document(
    documents: &[&Document],
    document_index: usize,
    config: &PretrainingConfig,
    special: SpecialTokens,
    vocab_size: usize,
    rng: &mut StdRng,
) -> Vec<TrainingInstance> {
    let document = documents[document_index];
    // Room for [CLS], [SEP], [SEP].
    let max_num_tokens = config.max_seq_length - 3;
    // Mostly fill the sequence, but sometimes train on shorter ones so that the model sees
    // the short sequences of fine-tuning too (the reference's comment).
    let target_seq_length = if rng.random::<f64>() < config.short_seq_prob {
        rng.random_range(2..=max_num_tokens)
    } else {
        max_num_tokens
    };

    let mut instances = Vec::new();
    let mut current_chunk: Vec<&[u32]> = Vec::new();
    let mut current_length = 0;
    let mut i = 0;
    while i < document.len() {
        let segment = &document[i];
        current_chunk.push(segment);
        current_length += segment.len();
        if i == document.len() - 1 || current_length >= target_seq_length {
            // `a_end` is how many chunk segments go into sentence A.
            let a_end = if current_chunk.len() >= 2 {
                rng.random_range(1..current_chunk.len())
            } else {
                1
            };
            let mut tokens_a: Vec<u32> = current_chunk[..a_end].concat();
            let mut tokens_b: Vec<u32> = Vec::new();
            let is_random_next = current_chunk.len() == 1 || rng.random::<f64>() < 0.5;
            if is_random_next {
                let target_b_length = target_seq_length.saturating_sub(tokens_a.len());
                // Ten tries at another document; a one-document corpus pairs with itself.
                let mut random_document_index = 0;
                for _ in 0..10 {
                    random_document_index = rng.random_range(0..documents.len());
                    if random_document_index != document_index {
                        break;
                    }
                }
                let random_document = documents[random_document_index];
                let random_start = rng.random_range(0..random_document.len());
                for sentence in &random_document[random_start..] {
                    tokens_b.extend_from_slice(sentence);
                    if tokens_b.len() >= target_b_length {
                        break;
                    }
                }
                // The segments of the chunk that B did not use are put back for the next chunk.
                let num_unused_segments = current_chunk.len() - a_end;
                i -= num_unused_segments;
            } else {
                tokens_b = current_chunk[a_end..].concat();
            }
            truncate_seq_pair(&mut tokens_a, &mut tokens_b, max_num_tokens, rng);
            debug_assert!(!tokens_a.is_empty() && !tokens_b.is_empty());

            let mut input_ids = Vec::with_capacity(tokens_a.len() + tokens_b.len() + 3);
            input_ids.push(special.cls);
            input_ids.extend_from_slice(&tokens_a);
            input_ids.push(special.sep);
            let segment_a_len = input_ids.len();
            input_ids.extend_from_slice(&tokens_b);
            input_ids.push(special.sep);
            let mut segment_ids = vec![0u8; segment_a_len];
            segment_ids.resize(input_ids.len(), 1);

            let (masked_lm_positions, masked_lm_ids) =
                create_masked_lm_predictions(&mut input_ids, config, special, vocab_size, rng);
            instances.push(TrainingInstance {
                input_ids,
                segment_ids,
                masked_lm_positions,
                masked_lm_ids,
                next_sentence_label: u8::from(is_random_next),
            });
            current_chunk.clear();
            current_length = 0;
        }
        i += 1;
    }
    instances
}

/// Number of positions to predict in a sequence of `num_tokens` real tokens:
/// `min(max_predictions_per_seq, max(1, round(num_tokens · masked_lm_prob)))`, with Python's
/// round-half-to-even as the reference's `int(round(...))`.
pub fn num_predictions(num_tokens: usize, config: &PretrainingConfig) -> usize {
    let expected = (num_tokens as f64 * config.masked_lm_prob).round_ties_even() as usize;
    config.max_predictions_per_seq.min(expected.max(1))
}

/// The reference's `create_masked_lm_predictions`: replaces the selected tokens of `tokens` in
/// place and returns (positions ascending, original ids).
fn create_masked_lm_predictions(
    tokens: &mut [u32],
    config: &PretrainingConfig,
    special: SpecialTokens,
    vocab_size: usize,
    rng: &mut StdRng,
) -> (Vec<u32>, Vec<u32>) {
    let mut candidates: Vec<usize> = (0..tokens.len())
        .filter(|&i| tokens[i] != special.cls && tokens[i] != special.sep)
        .collect();
    candidates.shuffle(rng);
    let n = num_predictions(tokens.len(), config);

    let mut masked: Vec<(u32, u32)> = Vec::with_capacity(n);
    for &index in candidates.iter().take(n) {
        let original = tokens[index];
        // 80% of the time, replace with [MASK]; 10% keep the original; 10% a random token.
        tokens[index] = if rng.random::<f64>() < 0.8 {
            special.mask
        } else if rng.random::<f64>() < 0.5 {
            original
        } else {
            rng.random_range(0..vocab_size as u32)
        };
        masked.push((index as u32, original));
    }
    masked.sort_unstable_by_key(|&(position, _)| position);
    masked.into_iter().unzip()
}

/// The reference's `truncate_seq_pair`: removes tokens from the longer segment, at the front
/// or the back with equal probability, until the pair fits.
fn truncate_seq_pair(
    tokens_a: &mut Vec<u32>,
    tokens_b: &mut Vec<u32>,
    max_num_tokens: usize,
    rng: &mut StdRng,
) {
    while tokens_a.len() + tokens_b.len() > max_num_tokens {
        let longer = if tokens_a.len() > tokens_b.len() {
            &mut *tokens_a
        } else {
            &mut *tokens_b
        };
        // Truncating at both ends avoids a bias towards the start of documents.
        if rng.random::<f64>() < 0.5 {
            longer.remove(0);
        } else {
            longer.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn num_predictions_rounds_half_to_even_as_python() {
        let config = PretrainingConfig {
            masked_lm_prob: 0.5,
            max_predictions_per_seq: 100,
            ..PretrainingConfig::default()
        };
        // Python: round(2.5) == 2, round(3.5) == 4.
        assert_eq!(num_predictions(5, &config), 2);
        assert_eq!(num_predictions(7, &config), 4);
        assert_eq!(num_predictions(1, &config), 1); // round(0.5) == 0, then max(1, ..)
        let capped = PretrainingConfig {
            max_predictions_per_seq: 3,
            ..config
        };
        assert_eq!(num_predictions(100, &capped), 3);
    }

    #[test]
    fn truncation_keeps_both_segments_within_budget() {
        let mut rng = StdRng::seed_from_u64(0);
        let mut a: Vec<u32> = (0..50).collect();
        let mut b: Vec<u32> = (100..110).collect();
        truncate_seq_pair(&mut a, &mut b, 30, &mut rng);
        assert_eq!(a.len() + b.len(), 30);
        assert_eq!(
            b.len(),
            10,
            "only the longer segment is cut while it stays longer"
        );
        // What remains of A is a contiguous run of the original.
        assert!(a.windows(2).all(|w| w[1] == w[0] + 1));
    }
}
