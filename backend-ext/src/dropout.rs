//! Counter-based dropout masks keyed by what an element *is*, not where it sits in memory.
//!
//! Element `(sample, row, column)` of a tensor is kept iff a hash of the op's 64-bit key, the
//! sample's index, the row's position within the sample and the column clears a threshold. The
//! kernels, the reference composition and the backward passes compute the same mask from the
//! key alone, so no mask is stored between forward and backward (the idea of Philox-based
//! dropout in cuDNN and apex, with a cheaper hash).
//!
//! Because the hash takes the sample's index within the step and the position within the
//! sample (never the padded length or the batch the sample happens to be in), a sample gets
//! the same mask whether it runs in the whole local batch or in a micro-batch, padded to 128 or
//! to 512: K accumulated micro-batches see the masks of one step on the whole batch.
//!
//! Keys: inside a [`DropoutScope`] (what the trainer opens around each micro-batch's forward),
//! the n-th [`DropoutSpec::draw`] of the forward pass gets the key
//! `mix(seed, rank, step, n)`; BERT's forward draws in a fixed order, so n names the layer and
//! the site (0: embeddings; `1 + 3l`, `2 + 3l`, `3 + 3l`: layer l's attention probabilities,
//! attention output, feed-forward output). Ranks and steps thus draw different masks, and a
//! run is reproducible whatever its threads do. Outside a scope, keys come from a process-wide
//! counter ([`reseed_dropout`]), as Burn's own dropout draws from the backend's generator.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Dropout of one op call: the drop probability, the key of its mask and how the tensor's rows
/// map to samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutSpec {
    /// Probability of dropping an element, in `[0, 1)`; 0 disables dropout.
    pub prob: f64,
    /// Key of the mask (64 bits); the same key gives the same mask.
    pub seed: u64,
    /// Index of the tensor's first sample among the samples the scope keys (the micro-batch's
    /// offset in the step's local batch).
    pub sample_offset: u32,
    /// For a `[R, N]` tensor of `[B·S]` token rows: S, the rows of one sample. 0: one sample
    /// whose rows are the tensor's rows. The tensor-level ops set it from a `[B, S, N]` input;
    /// tensors of three or four dimensions take their layout from their shape.
    pub seq_len: u32,
}

/// Process-wide source of dropout keys outside a [`DropoutScope`].
static NEXT_SEED: AtomicU64 = AtomicU64::new(0x5eed_0f_e3be2);

/// Restarts the sequence of keys [`DropoutSpec::draw`] hands out outside a [`DropoutScope`] (as
/// `B::seed` does for Burn's own RNG): the same seed gives the same masks in the same order.
pub fn reseed_dropout(seed: u64) {
    NEXT_SEED.store(splitmix64(seed), Ordering::Relaxed);
}

/// SplitMix64's finaliser (Steele, Lea & Flood 2014): a bijection on u64.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `splitmix64(key ^ splitmix64(value))`: one more component folded into a 64-bit key.
fn mix(key: u64, value: u64) -> u64 {
    splitmix64(key ^ splitmix64(value))
}

/// PCG's output permutation of a 32-bit state (RXS-M-XS, O'Neill 2014; the `pcg_hash` of
/// Jarzynski & Olano 2020): a bijection on u32. The kernels compute the same function.
pub(crate) fn pcg_hash(v: u32) -> u32 {
    let state = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

/// The key stream of one forward pass (see the module docs).
#[derive(Debug, Clone, Copy)]
struct Stream {
    key: u64,
    next_site: u64,
    sample_offset: u32,
}

thread_local! {
    static STREAM: RefCell<Option<Stream>> = const { RefCell::new(None) };
}

/// While alive, [`DropoutSpec::draw`] on this thread keys its masks by `(seed, rank, step,
/// site)` and offsets their samples by `sample_offset`; dropping it restores the scope it
/// replaced. Open one around each micro-batch's forward pass: the trainer does.
#[derive(Debug)]
#[must_use = "the scope ends when this guard is dropped"]
pub struct DropoutScope {
    previous: Option<Stream>,
}

impl DropoutScope {
    /// Opens the scope of the micro-batch whose first sample is `sample_offset` (in the step's
    /// local batch) of optimizer step `step` on `rank`, in a run seeded with `seed`.
    pub fn enter(seed: u64, rank: usize, step: u64, sample_offset: usize) -> Self {
        let key = mix(mix(mix(0xd5_0e_5eed, seed), rank as u64), step);
        let stream = Stream {
            key,
            next_site: 0,
            sample_offset: sample_offset as u32,
        };
        let previous = STREAM.with(|s| s.borrow_mut().replace(stream));
        Self { previous }
    }
}

impl Drop for DropoutScope {
    fn drop(&mut self) {
        STREAM.with(|s| *s.borrow_mut() = self.previous.take());
    }
}

impl DropoutSpec {
    /// No dropout.
    pub const NONE: DropoutSpec = DropoutSpec {
        prob: 0.0,
        seed: 0,
        sample_offset: 0,
        seq_len: 0,
    };

    /// Dropout with probability `prob` and mask key `seed`, the tensor one sample.
    pub fn new(prob: f64, seed: u64) -> Self {
        Self {
            prob,
            seed,
            ..Self::NONE
        }
    }

    /// Dropout with probability `prob` and the next key: the scope's next site inside a
    /// [`DropoutScope`], else the next of the process-wide sequence ([`reseed_dropout`]).
    /// Inside a scope every call takes a site, whether `prob` is 0 or not, so a site names the
    /// same layer whatever the probabilities.
    pub fn draw(prob: f64) -> Self {
        let scoped = STREAM.with(|s| {
            s.borrow_mut().as_mut().map(|stream| {
                let site = stream.next_site;
                stream.next_site += 1;
                (mix(stream.key, site), stream.sample_offset)
            })
        });
        if prob == 0.0 {
            return Self::NONE;
        }
        let (seed, sample_offset) = scoped.unwrap_or_else(|| {
            let seed = splitmix64(NEXT_SEED.fetch_add(1, Ordering::Relaxed));
            (seed, 0)
        });
        Self {
            prob,
            seed,
            sample_offset,
            seq_len: 0,
        }
    }

    /// This spec for a `[B, S, N]` tensor flattened to `[B·S, N]` rows: `seq_len = S` unless
    /// already set.
    pub fn with_seq_len(self, seq_len: usize) -> Self {
        Self {
            seq_len: if self.seq_len == 0 {
                seq_len as u32
            } else {
                self.seq_len
            },
            ..self
        }
    }

    /// Whether any element can be dropped.
    pub fn enabled(&self) -> bool {
        self.prob > 0.0
    }

    /// The 64-bit key as the kernels take it: (low, high) 32-bit halves, each mixed.
    pub fn key_halves(&self) -> (u32, u32) {
        let lo = self.seed as u32;
        let hi = (self.seed >> 32) as u32;
        (pcg_hash(lo ^ pcg_hash(hi)), pcg_hash(hi ^ 0x2545_f491))
    }

    /// An element is kept iff the top 24 bits of its hash are ≥ this: `round(p · 2²⁴)`.
    pub fn threshold(&self) -> u32 {
        (self.prob * (1u32 << 24) as f64).round() as u32
    }

    /// `1 / (1 − p)`, the scale of kept elements.
    pub fn keep_scale(&self) -> f64 {
        1.0 / (1.0 - self.prob)
    }

    /// The row layout of a tensor of `shape` (see [`MaskLayout`]).
    pub(crate) fn layout(&self, shape: &[usize]) -> MaskLayout {
        let d = shape.len();
        let rows: usize = shape[..d.saturating_sub(1)].iter().product();
        let (rows_per_sample, seq) = if d >= 3 {
            let per_sample: usize = shape[1..d - 1].iter().product();
            (per_sample, shape[d - 2])
        } else if self.seq_len > 0 {
            (self.seq_len as usize, self.seq_len as usize)
        } else {
            (rows.max(1), rows.max(1))
        };
        MaskLayout {
            rows_per_sample: rows_per_sample.max(1) as u32,
            seq: seq.max(1) as u32,
            sample_offset: self.sample_offset,
        }
    }

    /// Whether element `column` of row `row` (row-major rows of a tensor of `shape`) is kept.
    pub fn keeps(&self, shape: &[usize], row: usize, column: usize) -> bool {
        let (lo, hi) = self.key_halves();
        let rk = self.layout(shape).row_key(lo, hi, row as u32);
        keeps(rk, self.threshold(), column as u32)
    }
}

/// How a tensor's rows (all dimensions but the last, row-major) map to samples: row `r` is row
/// `r mod rows_per_sample` of sample `sample_offset + r / rows_per_sample`, and within the
/// sample, position `i mod seq` of block `i / seq` (a head of `[B, nh, S, S]` probabilities).
/// The mask's row key takes `(sample, block · 2¹⁶ + position)`: neither the padded length nor
/// the batch enters it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MaskLayout {
    pub rows_per_sample: u32,
    pub seq: u32,
    pub sample_offset: u32,
}

impl MaskLayout {
    /// The key of row `row`; the kernels' `row_key`.
    pub fn row_key(&self, key_lo: u32, key_hi: u32, row: u32) -> u32 {
        row_key(
            key_lo,
            key_hi,
            self.sample_offset,
            self.rows_per_sample,
            self.seq,
            row,
        )
    }
}

/// `pcg_hash(sample_key ^ pcg_hash(canonical row))` with `sample_key = pcg_hash(key_lo ^
/// pcg_hash(key_hi ^ pcg_hash(sample)))`.
pub(crate) fn row_key(
    key_lo: u32,
    key_hi: u32,
    sample_offset: u32,
    rows_per_sample: u32,
    seq: u32,
    row: u32,
) -> u32 {
    let sample = sample_offset.wrapping_add(row / rows_per_sample);
    let within = row % rows_per_sample;
    let canonical = (within / seq)
        .wrapping_mul(65_536)
        .wrapping_add(within % seq);
    let sample_key = pcg_hash(key_lo ^ pcg_hash(key_hi ^ pcg_hash(sample)));
    pcg_hash(sample_key ^ pcg_hash(canonical.wrapping_add(0x9e37_79b9)))
}

/// The mask test of the kernels: keep iff the top 24 bits of `hash(hash(column ^ rk) + rk)`
/// are at least `threshold`.
pub(crate) fn keeps(row_key: u32, threshold: u32, column: u32) -> bool {
    let bits = pcg_hash(pcg_hash(column ^ row_key).wrapping_add(row_key));
    (bits >> 8) >= threshold
}

/// The scaled keep mask of `spec` for a tensor of `shape` (row-major): `1/(1−p)` where kept, 0
/// where dropped. Computed on the host: the reference path and the tests use it.
///
/// # Panics
/// If a dimension product exceeds 2³² (row and column indices are 32-bit).
pub fn keep_mask<B: Backend, const D: usize>(
    spec: DropoutSpec,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(mask_values(spec, &shape), shape), device)
}

/// The values of [`keep_mask`], row-major.
pub(crate) fn mask_values(spec: DropoutSpec, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    assert!(n <= u32::MAX as usize, "dropout indices are 32-bit");
    let columns = shape.last().copied().unwrap_or(1).max(1);
    let mask = RowMask::of(spec, shape);
    let mut values = Vec::with_capacity(n);
    for row in 0..n / columns {
        let key = mask.row_key(row);
        values.extend((0..columns).map(|c| mask.factor(key, c)));
    }
    values
}

/// The values of the mask of packed rows (see [`crate::PackedRowOps::dropout_rows`]): row `t` of a
/// `[T, columns]` tensor keyed as row `rows[t]` of the padded `[B·S, columns]` rows, S =
/// `spec.seq_len`; row-major.
///
/// # Panics
/// If `spec.seq_len` is 0, or a row is negative.
pub(crate) fn mask_values_of_rows(spec: DropoutSpec, columns: usize, rows: &[i64]) -> Vec<f32> {
    let mask = RowMask::packed(spec);
    let mut values = Vec::with_capacity(rows.len() * columns);
    for &row in rows {
        let key = mask.row_key(usize::try_from(row).expect("a row index"));
        values.extend((0..columns).map(|c| mask.factor(key, c)));
    }
    values
}

/// The keyed mask of a [`DropoutSpec`] for a tensor of one shape, row by row: what
/// [`mask_values`] materialises and NdArray's host loops (`host_layer.rs`) apply in place.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowMask {
    layout: MaskLayout,
    key: (u32, u32),
    threshold: u32,
    scale: f32,
}

impl RowMask {
    /// The mask of `spec` for `shape`, `None` when dropout is off.
    pub(crate) fn new(spec: DropoutSpec, shape: &[usize]) -> Option<Self> {
        spec.enabled().then(|| Self::of(spec, shape))
    }

    /// The mask of packed rows: each row keyed by the padded row it came from, in `[B·S, N]`
    /// rows of `spec.seq_len` per sample ([`crate::PackedRowOps::dropout_rows`]).
    ///
    /// # Panics
    /// If `spec.seq_len` is 0: packed rows need the padded length to find their sample.
    pub(crate) fn packed(spec: DropoutSpec) -> Self {
        assert!(
            spec.seq_len > 0,
            "dropout of packed rows needs the padded length (DropoutSpec::with_seq_len)"
        );
        Self::of(spec, &[spec.seq_len as usize, 1])
    }

    fn of(spec: DropoutSpec, shape: &[usize]) -> Self {
        Self {
            layout: spec.layout(shape),
            key: spec.key_halves(),
            threshold: spec.threshold(),
            scale: spec.keep_scale() as f32,
        }
    }

    /// The key of row `row` (row-major rows of the shape).
    pub(crate) fn row_key(&self, row: usize) -> u32 {
        self.layout.row_key(self.key.0, self.key.1, row as u32)
    }

    /// The factor of element `column` of the row keyed `row_key`: `1/(1−p)` or 0.
    #[inline]
    pub(crate) fn factor(&self, row_key: u32, column: usize) -> f32 {
        if keeps(row_key, self.threshold, column as u32) {
            self.scale
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(spec: DropoutSpec, shape: &[usize]) -> Vec<bool> {
        let columns = *shape.last().unwrap();
        let rows: usize = shape.iter().product::<usize>() / columns;
        (0..rows)
            .flat_map(|r| (0..columns).map(move |c| (r, c)))
            .map(|(r, c)| spec.keeps(shape, r, c))
            .collect()
    }

    #[test]
    fn a_sample_keeps_its_mask_in_any_batch_and_padding() {
        let spec = DropoutSpec::new(0.3, 0x1234_5678_9abc);
        let (h, s_whole, s_micro) = (8, 12, 7);
        // Sample 3 of a whole batch of 4 padded to 12, against the same sample as sample 1
        // of a micro-batch starting at sample 2, padded to 7.
        let whole = mask(spec, &[4, s_whole, h]);
        let micro = mask(
            DropoutSpec {
                sample_offset: 2,
                ..spec
            },
            &[2, s_micro, h],
        );
        for s in 0..s_micro {
            for c in 0..h {
                assert_eq!(
                    whole[(3 * s_whole + s) * h + c],
                    micro[(s_micro + s) * h + c]
                );
            }
        }
        // The same for attention probabilities [B, nh, S, S] over the real keys.
        let whole = mask(spec, &[4, 2, s_whole, s_whole]);
        let micro = mask(
            DropoutSpec {
                sample_offset: 2,
                ..spec
            },
            &[2, 2, s_micro, s_micro],
        );
        for head in 0..2 {
            for i in 0..s_micro {
                for j in 0..s_micro {
                    let w = ((3 * 2 + head) * s_whole + i) * s_whole + j;
                    let m = ((2 + head) * s_micro + i) * s_micro + j;
                    assert_eq!(whole[w], micro[m]);
                }
            }
        }
        // [B·S, N] rows with seq_len S agree with [B, S, N].
        assert_eq!(
            mask(spec.with_seq_len(s_whole), &[4 * s_whole, h]),
            mask(spec, &[4, s_whole, h])
        );
    }

    #[test]
    fn drop_rate_and_independence() {
        let shape = [8, 64, 128];
        let a = mask(DropoutSpec::new(0.1, 1), &shape);
        let b = mask(DropoutSpec::new(0.1, 1 << 32), &shape);
        let n = a.len() as f64;
        let dropped = a.iter().filter(|k| !**k).count() as f64 / n;
        assert!((dropped - 0.1).abs() < 0.005, "drop rate {dropped}");
        // Keys that differ only in their high half give unrelated masks.
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count() as f64 / n;
        assert!(
            (same - (0.9 * 0.9 + 0.1 * 0.1)).abs() < 0.01,
            "agreement {same}"
        );
        // Samples of one mask are unrelated too.
        let per = 64 * 128;
        let same = (0..per).filter(|&i| a[i] == a[per + i]).count() as f64 / per as f64;
        assert!(
            (same - 0.82).abs() < 0.02,
            "agreement between samples {same}"
        );
    }

    #[test]
    fn scopes_key_by_rank_step_and_site_and_restore() {
        let outside = DropoutSpec::draw(0.1);
        let (a0, a1) = {
            let _scope = DropoutScope::enter(7, 0, 3, 0);
            (DropoutSpec::draw(0.1), DropoutSpec::draw(0.1))
        };
        let again = {
            let _scope = DropoutScope::enter(7, 0, 3, 5);
            DropoutSpec::draw(0.1)
        };
        assert_eq!(again.seed, a0.seed);
        assert_eq!(again.sample_offset, 5);
        assert_ne!(a0.seed, a1.seed);
        let other_rank = {
            let _scope = DropoutScope::enter(7, 1, 3, 0);
            DropoutSpec::draw(0.1)
        };
        let other_step = {
            let _scope = DropoutScope::enter(7, 0, 4, 0);
            DropoutSpec::draw(0.1)
        };
        assert_ne!(other_rank.seed, a0.seed);
        assert_ne!(other_step.seed, a0.seed);
        // Outside a scope the process-wide sequence continues.
        assert_ne!(DropoutSpec::draw(0.1).seed, outside.seed);
        assert_eq!(DropoutSpec::draw(0.0), DropoutSpec::NONE);
    }
}
