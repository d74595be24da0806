//! Token vectors to one sentence vector, as sentence-transformers' `Pooling` module computes
//! them (`sentence_transformers/sentence_transformer/modules/pooling.py`, `_forward_padded`),
//! for right-padded batches.
//!
//! # Shapes
//! n texts, S the batch's padded length, H the hidden size.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use crate::mean_pool;

/// How token vectors become one sentence vector (sentence-transformers' pooling modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooling {
    /// Mean over the real (unpadded) tokens, `[CLS]` and `[SEP]` included: `mean`
    /// (all-MiniLM-L6-v2's).
    #[default]
    Mean,
    /// The last layer's `[CLS]` vector: `cls`.
    Cls,
    /// The element-wise maximum over the real tokens: `max`.
    Max,
    /// The sum over the real tokens divided by the square root of their number:
    /// `mean_sqrt_len_tokens`.
    MeanSqrtLen,
    /// The mean weighted by position, 1 for the first token: `weightedmean`.
    WeightedMean,
    /// The last real token's vector (`[SEP]` for BERT): `lasttoken`.
    LastToken,
}

impl Pooling {
    /// sentence-transformers' name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len_tokens",
            Pooling::WeightedMean => "weightedmean",
            Pooling::LastToken => "lasttoken",
        }
    }
}

impl std::fmt::Display for Pooling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Pooling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mean" => Ok(Self::Mean),
            "cls" => Ok(Self::Cls),
            "max" => Ok(Self::Max),
            "mean_sqrt_len_tokens" | "mean-sqrt-len" => Ok(Self::MeanSqrtLen),
            "weightedmean" | "weighted-mean" => Ok(Self::WeightedMean),
            "lasttoken" | "last-token" => Ok(Self::LastToken),
            other => Err(format!(
                "unknown pooling mode `{other}` (expected mean, cls, max, mean_sqrt_len_tokens, \
                 weightedmean or lasttoken)"
            )),
        }
    }
}

/// The modes' vectors concatenated in order: `[n, H · modes.len()]`.
///
/// # Shapes
/// `tokens` `[n, S, H]`, `mask` `[n, S]` (1 for a real token, right-padded), `lengths` the n
/// real lengths (each ≥ 1) → `[n, H · modes.len()]`
pub(crate) fn pool<B: Backend>(
    modes: &[Pooling],
    tokens: Tensor<B, 3>,
    mask: Tensor<B, 2, Int>,
    lengths: &[usize],
) -> Tensor<B, 2> {
    let [n, s, h] = tokens.dims();
    let device = tokens.device();
    let maskf = || mask.clone().float().unsqueeze_dim::<3>(2); // [n, S, 1]
    let vectors = modes
        .iter()
        .map(|mode| match mode {
            Pooling::Mean => mean_pool(tokens.clone(), mask.clone()),
            Pooling::Cls => tokens.clone().slice([0..n, 0..1, 0..h]).reshape([n, h]),
            Pooling::Max => {
                // Padding never wins: −∞ where the mask is 0.
                let padding = maskf().equal_elem(0.0).expand([n, s, h]);
                tokens
                    .clone()
                    .mask_fill(padding, f32::NEG_INFINITY)
                    .max_dim(1)
                    .reshape([n, h])
            }
            Pooling::MeanSqrtLen => {
                let summed = (tokens.clone() * maskf()).sum_dim(1).reshape([n, h]);
                let counts = maskf().sum_dim(1).reshape([n, 1]).clamp_min(1e-9);
                summed / counts.sqrt()
            }
            Pooling::WeightedMean => {
                // Position weights 1..S, zero on padding.
                let positions: Vec<f32> = (1..=s).map(|p| p as f32).collect();
                let weights = Tensor::<B, 1>::from_data(TensorData::new(positions, [s]), &device)
                    .reshape([1, s, 1])
                    * maskf();
                let summed = (tokens.clone() * weights.clone())
                    .sum_dim(1)
                    .reshape([n, h]);
                summed / weights.sum_dim(1).reshape([n, 1]).clamp_min(1e-9)
            }
            Pooling::LastToken => {
                // Row i · S + (length − 1) of the flattened tokens.
                let rows: Vec<i64> = lengths
                    .iter()
                    .enumerate()
                    .map(|(i, &len)| (i * s + len.max(1) - 1) as i64)
                    .collect();
                let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), &device);
                tokens.clone().reshape([n * s, h]).select(0, rows)
            }
        })
        .collect::<Vec<_>>();
    if vectors.len() == 1 {
        vectors.into_iter().next().expect("one mode")
    } else {
        Tensor::cat(vectors, 1)
    }
}
