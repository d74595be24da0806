//! Sums of squares of host f32 buffers, accumulated in f64: the gradient norms of ember-trainer's
//! host buckets (`parallel/buckets.rs`), 1-bit compression's scales (`onebit/compress.rs`),
//! 1-bit LAMB's norms (`onebit/step.rs`), and NdArray's
//! [`FusedOps::sum_squares_multi_tensor`](crate::FusedOps::sum_squares_multi_tensor) (LAMB's
//! trust ratios, the gradient norm of clipping).
//!
//! A plain `iter().map(..).sum::<f64>()` is one chain of dependent additions: the compiler may
//! not reorder floating-point sums, so it runs at one addition per FP-add latency (~4 cycles)
//! and took 12% of a 1-bit LAMB step of the tiny model (4.4M parameters, four norms a step).
//! Here [`LANES`] independent partial sums run side by side (vector registers of f64) and are
//! added pairwise at the end: a fixed order, so the result is the same on every run and
//! machine, within f64 rounding (≤ n·2⁻⁵³ relative, as any order) of the sequential sum. The
//! loop is compiled for AVX-512, for AVX2 and for the baseline (`host_math.rs`'s
//! `multiversion!`); each squares and adds in the same lanes without fused multiply-adds, so
//! every variant gives the same bits.

/// Partial sums: one AVX-512 register of f64, two AVX2 ones, four SSE2 ones.
const LANES: usize = 8;

multiversion! {
/// `Σ xᵢ²` of `x`, each square and the sum in f64; 0 for an empty buffer.
pub fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; LANES];
    // Fixed-size chunks: the lanes' loop unrolls into vector operations.
    let (chunks, tail) = x.as_chunks::<LANES>();
    for chunk in chunks {
        for lane in 0..LANES {
            let v = f64::from(chunk[lane]);
            acc[lane] += v * v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(tail) {
        let v = f64::from(v);
        *a += v * v;
    }
    // Pairwise: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1.
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}
}

/// `‖x‖₂`, accumulated in f64 ([`sum_squares`]).
pub fn norm(x: &[f32]) -> f64 {
    sum_squares(x).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sequential(x: &[f32]) -> f64 {
        x.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
    }

    #[test]
    fn sums_every_element_whatever_the_length() {
        // Integers: every partial sum is exact, so any order gives the same value.
        for n in [0, 1, 7, 8, 9, 16, 17, 1001] {
            let x: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            assert_eq!(sum_squares(&x), sequential(&x), "n = {n}");
        }
        assert_eq!(norm(&[3.0, 4.0]), 5.0);
    }

    #[test]
    fn agrees_with_the_sequential_sum_to_f64_rounding() {
        let x: Vec<f32> = (0..100_003u64)
            .map(|i| ((i.wrapping_mul(2_654_435_761) % 10_007) as f32 - 5_003.0) * 1.37e-3)
            .collect();
        let (a, b) = (sum_squares(&x), sequential(&x));
        assert!((a - b).abs() <= 1e-12 * b, "{a} vs {b}");
    }
}
