//! Load-balance simulation of the samplers: what `balance-report` prints.
//!
//! Every rank of a world of W draws S steps of B samples with the real samplers (seeded as in
//! training), each local batch is cut into micro-batches and padded as in training, and each
//! rank's per-step compute is modelled for padded attention as
//!
//! ```text
//! compute(sample) = a·s + b·s²,   s = the padded length of its micro-batch,
//! a = 24·H² (QKV, output and FFN GEMMs), b = 4·H (QKᵀ and attention·V), per layer,
//! ```
//!
//! i.e. `s + s²/(6H)` in units of `a`. Reported per sampler × padding:
//! - padding efficiency: real tokens / computed (padded) tokens, over all ranks and steps;
//! - rank imbalance: the mean over steps of max over ranks / mean over ranks of compute;
//! - step-time ratio: Σ over steps of the slowest rank's compute, against the same for the
//!   random sampler padded to the maximum length (synchronous data parallelism waits for the
//!   slowest rank every step).

use crate::DataError;
use crate::dataset::ShardedDataset;
use crate::sampler::{Padding, RankSampler, SamplerConfig, SamplerKind};
use crate::shard_loader::micro_batches;

/// Settings of a simulation.
#[derive(Debug, Clone)]
pub struct BalanceSettings {
    /// W, the simulated ranks.
    pub world_size: usize,
    /// B, samples per rank per step.
    pub local_batch: usize,
    /// S, simulated steps.
    pub steps: usize,
    /// The model's maximum sequence length (padding `max`).
    pub max_seq_length: usize,
    /// H, the hidden size of the cost model (BERT-large: 1024).
    pub hidden: usize,
    /// G, the presort group.
    pub presort_group: usize,
    /// Per-bin quotas (stratified, presort); `None`: proportional.
    pub bin_quota: Option<Vec<usize>>,
    /// Sampler seed.
    pub seed: u64,
}

/// One sampler × padding mode.
#[derive(Debug, Clone, PartialEq)]
pub struct BalanceRow {
    /// The sampler.
    pub sampler: SamplerKind,
    /// The padding mode.
    pub padding: Padding,
    /// Micro-batches per local batch (1 but for grouped).
    pub micro_batches: usize,
    /// Real tokens / computed tokens.
    pub padding_efficiency: f64,
    /// Mean over steps of max / mean per-rank compute.
    pub imbalance: f64,
    /// Σ slowest-rank compute / the same for random + max padding.
    pub step_time_ratio: f64,
}

impl BalanceRow {
    /// `max`, `dynamic`, `grouped k=4`.
    pub fn padding_label(&self) -> String {
        match self.padding {
            Padding::Max => "max".into(),
            Padding::Dynamic => "dynamic".into(),
            Padding::Grouped => format!("grouped k={}", self.micro_batches),
        }
    }
}

/// The modelled compute of one sample padded to `s` tokens, in units of `24·H²` per layer.
pub fn sample_compute(s: usize, hidden: usize) -> f64 {
    let s = s as f64;
    s + s * s / (6.0 * hidden as f64)
}

struct Measure {
    real: f64,
    computed: f64,
    sum_max: f64,
    imbalance_sum: f64,
}

fn measure(
    dataset: &ShardedDataset,
    settings: &BalanceSettings,
    kind: SamplerKind,
    padding: Padding,
    k: usize,
) -> Result<Measure, DataError> {
    let w = settings.world_size;
    let config = SamplerConfig {
        kind,
        local_batch: settings.local_batch,
        presort_group: settings.presort_group,
        bin_quota: settings.bin_quota.clone(),
        seed: settings.seed,
        exchange: false,
    };
    let group = if kind == SamplerKind::Presort {
        settings.presort_group.max(1)
    } else {
        1
    };
    let mut samplers = (0..w)
        .step_by(group)
        .map(|r| RankSampler::new(&config, &dataset.shard_sizes, dataset.lengths.clone(), r, w))
        .collect::<Result<Vec<_>, _>>()?;
    let mut m = Measure {
        real: 0.0,
        computed: 0.0,
        sum_max: 0.0,
        imbalance_sum: 0.0,
    };
    let mut per_rank = Vec::with_capacity(w);
    for _ in 0..settings.steps {
        per_rank.clear();
        for sampler in &mut samplers {
            for batch in sampler.next_group_batches() {
                let lengths: Vec<u16> = batch
                    .iter()
                    .map(|s| dataset.lengths[s.bin as usize][s.index as usize])
                    .collect();
                let mut compute = 0.0;
                for (part, padded) in micro_batches(&lengths, k, padding, settings.max_seq_length) {
                    m.computed += (part.len() * padded) as f64;
                    m.real += part.iter().map(|&i| lengths[i] as f64).sum::<f64>();
                    compute += part.len() as f64 * sample_compute(padded, settings.hidden);
                }
                per_rank.push(compute);
            }
        }
        let max = per_rank.iter().copied().fold(0.0, f64::max);
        let mean = per_rank.iter().sum::<f64>() / per_rank.len() as f64;
        m.sum_max += max;
        m.imbalance_sum += max / mean;
    }
    Ok(m)
}

/// Simulates every sampler × padding (max, dynamic, grouped with each of `grouped_k`) and
/// returns the rows in that order, random first.
///
/// # Errors
/// [`DataError::InvalidSetting`] for settings a sampler refuses (e.g. too little data per
/// rank for the batch), naming the setting; `steps` 0.
pub fn balance_report(
    dataset: &ShardedDataset,
    settings: &BalanceSettings,
    grouped_k: &[usize],
) -> Result<Vec<BalanceRow>, DataError> {
    if settings.steps == 0 || settings.world_size == 0 {
        return Err(DataError::InvalidSetting {
            field: "steps",
            reason: "simulate at least one step of at least one rank".into(),
        });
    }
    let mut modes = vec![(Padding::Max, 1), (Padding::Dynamic, 1)];
    modes.extend(grouped_k.iter().map(|&k| (Padding::Grouped, k)));
    let baseline = measure(dataset, settings, SamplerKind::Random, Padding::Max, 1)?.sum_max;
    let mut rows = Vec::new();
    for kind in [
        SamplerKind::Random,
        SamplerKind::Stratified,
        SamplerKind::Presort,
    ] {
        for &(padding, k) in &modes {
            let m = measure(dataset, settings, kind, padding, k)?;
            rows.push(BalanceRow {
                sampler: kind,
                padding,
                micro_batches: k,
                padding_efficiency: m.real / m.computed,
                imbalance: m.imbalance_sum / settings.steps as f64,
                step_time_ratio: m.sum_max / baseline,
            });
        }
    }
    Ok(rows)
}
