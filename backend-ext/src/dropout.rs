//! Counter-based dropout masks: element `i` of a tensor is kept iff a hash of `(seed, i)` clears
//! a threshold. The kernels, the reference composition and the backward passes compute the same
//! mask from the seed alone, so no mask is stored between forward and backward (the idea of
//! Philox-based dropout in cuDNN and apex, with a cheaper hash).

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Dropout of one op call: the drop probability and the seed of its mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutSpec {
    /// Probability of dropping an element, in `[0, 1)`; 0 disables dropout.
    pub prob: f64,
    /// Seed of the mask; the same seed gives the same mask.
    pub seed: u64,
}

/// Process-wide source of dropout seeds for [`DropoutSpec::draw`].
static NEXT_SEED: AtomicU64 = AtomicU64::new(0x5eed_0f_e3be2);

/// Restarts the sequence of seeds [`DropoutSpec::draw`] hands out (as `B::seed` does for
/// Burn's own RNG): the same seed gives the same masks in the same order.
pub fn reseed_dropout(seed: u64) {
    NEXT_SEED.store(splitmix64(seed), Ordering::Relaxed);
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// PCG's output permutation of a 32-bit state (RXS-M-XS, O'Neill 2014; the `pcg_hash` of
/// Jarzynski & Olano 2020): a bijection on u32. The kernels compute the same function.
pub(crate) fn pcg_hash(v: u32) -> u32 {
    let state = v.wrapping_mul(747_796_405).wrapping_add(2_891_336_453);
    let word = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277_803_737);
    (word >> 22) ^ word
}

impl DropoutSpec {
    /// No dropout.
    pub const NONE: DropoutSpec = DropoutSpec { prob: 0.0, seed: 0 };

    /// Dropout with probability `prob` and a fresh seed from the process-wide sequence
    /// ([`reseed_dropout`]).
    pub fn draw(prob: f64) -> Self {
        if prob == 0.0 {
            return Self::NONE;
        }
        let seed = splitmix64(NEXT_SEED.fetch_add(1, Ordering::Relaxed));
        Self { prob, seed }
    }

    /// Whether any element can be dropped.
    pub fn enabled(&self) -> bool {
        self.prob > 0.0
    }

    /// The 32-bit key mixed into every element's hash.
    pub fn key(&self) -> u32 {
        pcg_hash(self.seed as u32 ^ pcg_hash((self.seed >> 32) as u32))
    }

    /// An element is kept iff the top 24 bits of its hash are ≥ this: `round(p · 2²⁴)`.
    pub fn threshold(&self) -> u32 {
        (self.prob * (1u32 << 24) as f64).round() as u32
    }

    /// `1 / (1 − p)`, the scale of kept elements.
    pub fn keep_scale(&self) -> f64 {
        1.0 / (1.0 - self.prob)
    }

    /// Whether element `index` (row-major position in the op's output) is kept.
    pub fn keeps(&self, index: u32) -> bool {
        keeps(self.key(), self.threshold(), index)
    }
}

/// The mask test of the kernels: keep iff the top 24 bits of `hash(hash(i ^ key) + key)` are
/// at least `threshold`.
pub(crate) fn keeps(key: u32, threshold: u32, index: u32) -> bool {
    let bits = pcg_hash(pcg_hash(index ^ key).wrapping_add(key));
    (bits >> 8) >= threshold
}

/// The scaled keep mask of `spec` for a tensor of `shape` (row-major element order): `1/(1−p)`
/// where kept, 0 where dropped. Computed on the host: the reference path and the tests use it.
///
/// # Panics
/// If the tensor has more than 2³² elements (indices are 32-bit).
pub fn keep_mask<B: Backend, const D: usize>(
    spec: DropoutSpec,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    let n: usize = shape.iter().product();
    assert!(n <= u32::MAX as usize, "dropout indices are 32-bit");
    let (key, threshold, scale) = (spec.key(), spec.threshold(), spec.keep_scale() as f32);
    let values: Vec<f32> = (0..n as u32)
        .map(|i| if keeps(key, threshold, i) { scale } else { 0.0 })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}
