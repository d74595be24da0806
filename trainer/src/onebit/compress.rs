//! 1-bit compression with error feedback, element by element as DeepSpeed's
//! `NcclBackend.compressed_allreduce` (`deepspeed/runtime/comm/nccl.py`) computes it:
//!
//! ```text
//! x ← x + e                       (error feedback: what the last compression lost)
//! s ← ‖x‖₂ / √n                   (one scale for the buffer)
//! c ← s · sign(x)                 (sign(x) = +1 for x ≥ 0, −1 for x < 0)
//! e ← x − c
//! ```
//!
//! Signs travel packed 8 per byte, the first element in the most significant bit (NumPy's and
//! CuPy's `packbits`, which DeepSpeed uses). A zero (and −0, and NaN) is sent as +1: DeepSpeed's
//! `sign().add_(1).bool()` maps 0 to `true`.
//!
//! Eight values at a time go through SSE2 on x86-64 (every x86-64 CPU has it): a compare and a
//! `movemask` for the byte, a select and an add for the error, and back, a bit test per lane.
//! Written element by element the compiler kept the loops scalar (a shift and an or per bit):
//! compression alone took ~30 ms a step per rank of the tiny model's 1-bit LAMB (4.4M
//! momenta, block scales). The lanes run the scalar form's IEEE operations, so the bits are
//! the same (tested against it).

/// Whether `x` is sent as +1 (`true`) or −1.
#[inline]
#[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must give +1, as in DeepSpeed
pub fn sign_bit(x: f32) -> bool {
    // `!(x < 0)`: +0, −0 and NaN are +1, as DeepSpeed's `sign(x) + 1 != 0`.
    !(x < 0.0)
}

/// The scale of a compressed buffer: its root mean square `‖x‖₂ / √n` (accumulated in f64),
/// 0 for an empty buffer.
pub fn rms_scale(values: &[f32]) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    (ember_backend_ext::host_norm::sum_squares(values) / values.len() as f64).sqrt() as f32
}

/// Packs the sign bits of `values` 8 per byte, the first value in the most significant bit.
/// A length that is not a multiple of 8 leaves the last byte's low bits 0.
pub fn pack_signs(values: &[f32]) -> Vec<u8> {
    let byte = |chunk: &[f32]| {
        chunk.iter().enumerate().fold(0u8, |byte, (i, &x)| {
            byte | (u8::from(sign_bit(x)) << (7 - i))
        })
    };
    let chunks = values.chunks_exact(8);
    let tail = chunks.remainder();
    let mut packed: Vec<u8> = chunks.map(byte).collect();
    if !tail.is_empty() {
        packed.push(byte(tail));
    }
    packed
}

/// The ±1 values of the first `n` signs packed by [`pack_signs`], times `scale`, added to `out`
/// (`out[i] += scale · sign[i]`, `out.len() == n`).
///
/// # Panics
/// If `bytes` holds fewer than `n` bits (a bug: the message layout fixes the sizes).
pub fn add_scaled_signs(bytes: &[u8], scale: f32, out: &mut [f32]) {
    assert!(bytes.len() * 8 >= out.len(), "too few packed signs");
    let (whole, tail) = out.as_chunks_mut::<8>();
    let full = whole.len();
    for (chunk, &byte) in whole.iter_mut().zip(bytes) {
        add_8(byte, scale, chunk);
    }
    if !tail.is_empty() {
        add_scalar(bytes[full], scale, tail);
    }
}

/// `out[i] += ±scale` by bit `7 − i` of `byte`, element by element (the tail of a buffer, and
/// what [`add_8`] computes).
fn add_scalar(byte: u8, scale: f32, out: &mut [f32]) {
    for (i, x) in out.iter_mut().enumerate() {
        *x += if (byte >> (7 - i)) & 1 == 1 {
            scale
        } else {
            -scale
        };
    }
}

/// [`add_scalar`] of eight values.
#[inline(always)]
fn add_8(byte: u8, scale: f32, out: &mut [f32; 8]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64's baseline; `out` holds 8 f32 (unaligned loads and
    // stores of two halves).
    unsafe {
        use std::arch::x86_64::*;
        let bits = _mm_set1_epi32(i32::from(byte));
        // Lane i tests bit 7 − i: 128, 64, 32, 16, then 8, 4, 2, 1 (`_mm_set_epi32` lists
        // lanes 3 to 0).
        let lane_bits = [_mm_set_epi32(16, 32, 64, 128), _mm_set_epi32(1, 2, 4, 8)];
        let (plus, minus) = (_mm_set1_ps(scale), _mm_set1_ps(-scale));
        for (half, lane_bit) in lane_bits.into_iter().enumerate() {
            let set = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_and_si128(bits, lane_bit), lane_bit));
            let step = _mm_or_ps(_mm_and_ps(set, plus), _mm_andnot_ps(set, minus));
            let at = out.as_mut_ptr().add(4 * half);
            _mm_storeu_ps(at, _mm_add_ps(_mm_loadu_ps(at), step));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    add_scalar(byte, scale, out);
}

/// Compresses `x` (the value plus the error feedback) and leaves in it what the compression
/// lost: returns the scale and the packed signs, and `x ← x − scale · sign(x)` element by
/// element (two passes, no temporary).
pub fn compress_in_place(x: &mut [f32]) -> (f32, Vec<u8>) {
    let scale = rms_scale(x);
    (scale, compress_with_scale(x, scale))
}

/// As [`compress_in_place`] with a given scale: the packed signs of `x`, and `x ← x − scale ·
/// sign(x)`.
pub fn compress_with_scale(x: &mut [f32], scale: f32) -> Vec<u8> {
    let mut packed = vec![0; x.len().div_ceil(8)];
    compress_with_scale_into(x, scale, &mut packed);
    packed
}

/// As [`compress_with_scale`], the packed signs written to `signs`
/// (`x.len().div_ceil(8)` bytes).
///
/// # Panics
/// If `signs` has another length (a bug: the message layout fixes the sizes).
pub fn compress_with_scale_into(x: &mut [f32], scale: f32, signs: &mut [u8]) {
    assert_eq!(
        signs.len(),
        x.len().div_ceil(8),
        "one sign byte per 8 values"
    );
    let (whole, tail) = x.as_chunks_mut::<8>();
    let full = whole.len();
    for (chunk, byte) in whole.iter_mut().zip(signs.iter_mut()) {
        *byte = compress_8(chunk, scale);
    }
    if !tail.is_empty() {
        signs[full] = compress_scalar(tail, scale);
    }
}

/// The sign byte of up to eight values (the first in the most significant bit, the low bits 0
/// past the end), and `x ← x − scale` where the sign is +1, `x + scale` where it is −1:
/// `v + (−scale)` is `v − scale` exactly in IEEE arithmetic.
fn compress_scalar(x: &mut [f32], scale: f32) -> u8 {
    let mut byte = 0u8;
    for (i, v) in x.iter_mut().enumerate() {
        let bit = sign_bit(*v);
        byte |= u8::from(bit) << (7 - i);
        *v += if bit { -scale } else { scale };
    }
    byte
}

/// [`compress_scalar`] of eight values.
#[inline(always)]
fn compress_8(x: &mut [f32; 8], scale: f32) -> u8 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86-64's baseline; `x` holds 8 f32 (unaligned loads and stores
    // of two halves).
    unsafe {
        use std::arch::x86_64::*;
        let (plus, minus, zero) = (_mm_set1_ps(scale), _mm_set1_ps(-scale), _mm_setzero_ps());
        let mut negative = 0;
        for half in 0..2 {
            let at = x.as_mut_ptr().add(4 * half);
            let v = _mm_loadu_ps(at);
            // `v < 0`: all ones in the lane; false for +0, −0 and NaN (sent as +1).
            let below = _mm_cmplt_ps(v, zero);
            let step = _mm_or_ps(_mm_and_ps(below, plus), _mm_andnot_ps(below, minus));
            _mm_storeu_ps(at, _mm_add_ps(v, step));
            negative |= _mm_movemask_ps(below) << (4 * half);
        }
        // Bit i of `negative`: value i is below 0. The byte has value 0 in its top bit and 1
        // for "not below 0".
        (!(negative as u8)).reverse_bits()
    }
    #[cfg(not(target_arch = "x86_64"))]
    compress_scalar(x, scale)
}

/// Scales a chunk of `len` elements has: one (`block` 0, DeepSpeed's granularity), else one
/// per `block` elements, the last block possibly shorter.
pub fn scales_per_chunk(len: usize, block: usize) -> usize {
    if block == 0 { 1 } else { len.div_ceil(block) }
}

/// Compresses a chunk in place with one scale per `block` elements (`block` a multiple of 8;
/// 0: one scale, `whole` if given, else the chunk's own RMS), writing the scales to `scales`
/// ([`scales_per_chunk`] of them) and the packed signs to `signs` (`x.len().div_ceil(8)`
/// bytes); `x` keeps what the compression lost.
///
/// # Panics
/// If `scales` or `signs` has another length (a bug: the message layout fixes the sizes).
pub fn compress_chunk(
    x: &mut [f32],
    block: usize,
    whole: Option<f32>,
    scales: &mut [f32],
    signs: &mut [u8],
) {
    assert_eq!(
        scales.len(),
        scales_per_chunk(x.len(), block),
        "one scale per block"
    );
    if block == 0 {
        scales[0] = whole.unwrap_or_else(|| rms_scale(x));
        compress_with_scale_into(x, scales[0], signs);
        return;
    }
    assert_eq!(
        signs.len(),
        x.len().div_ceil(8),
        "one sign byte per 8 values"
    );
    for ((part, scale), bits) in x
        .chunks_mut(block)
        .zip(scales)
        .zip(signs.chunks_mut(block / 8))
    {
        *scale = rms_scale(part);
        compress_with_scale_into(part, *scale, bits);
    }
}

/// Adds `factor · scale_b · sign` to `out`, block by block (the inverse of [`compress_chunk`]).
pub fn add_chunk(scales: &[f32], signs: &[u8], block: usize, factor: f32, out: &mut [f32]) {
    let block = if block == 0 { out.len().max(1) } else { block };
    for ((part, bits), &scale) in out
        .chunks_mut(block)
        .zip(signs.chunks(block.div_ceil(8)))
        .zip(scales)
    {
        add_scaled_signs(bits, scale * factor, part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signs_round_trip_through_packing() {
        // 13 values: one full byte, one partial; zeros, −0 and NaN are +1.
        let values = [
            1.5,
            -2.0,
            0.0,
            -0.0,
            f32::NAN,
            -1e-30,
            3.0,
            -4.0,
            5.0,
            -6.0,
            -7.0,
            8.0,
            -9.0,
        ];
        let packed = pack_signs(&values);
        assert_eq!(packed.len(), 2);
        // 1 0 1 1 1 0 1 0 → 0b1011_1010; then 1 0 0 1 0 (000) → 0b1001_0000.
        assert_eq!(packed, vec![0b1011_1010, 0b1001_0000]);
        let mut out = vec![0.0; values.len()];
        add_scaled_signs(&packed, 2.0, &mut out);
        let expected: Vec<f32> = values
            .iter()
            .map(|&x| if sign_bit(x) { 2.0 } else { -2.0 })
            .collect();
        assert_eq!(out, expected);
    }

    #[test]
    fn compressed_plus_error_is_the_input() {
        let buffer: Vec<f32> = (0..37)
            .map(|i| ((i * 7919) % 23) as f32 * 0.1 - 1.1)
            .collect();
        let mut error = buffer.clone();
        let (scale, packed) = compress_in_place(&mut error);
        assert_eq!(packed, pack_signs(&buffer));
        let rms = (buffer.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / buffer.len() as f64)
            .sqrt();
        assert!((f64::from(scale) - rms).abs() < 1e-6, "{scale} vs {rms}");
        let mut decompressed = vec![0.0; buffer.len()];
        add_scaled_signs(&packed, scale, &mut decompressed);
        for ((c, e), x) in decompressed.iter().zip(&error).zip(&buffer) {
            // c + e = x to f32 rounding of the one subtraction that made e.
            assert!(
                (c + e - x).abs() <= f32::EPSILON * x.abs().max(scale),
                "{c} + {e} vs {x}"
            );
            assert_eq!(c.abs(), scale);
            assert_eq!(*c >= 0.0, *x >= 0.0);
        }
    }

    /// The eight-lane forms against the scalar ones, bit for bit: values of both signs, ±0,
    /// NaN, ±∞ and subnormals, buffers with and without a tail, and a zero scale.
    #[test]
    fn eight_lanes_equal_the_scalar_form() {
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-40,
        ];
        for len in [0, 5, 8, 13, 64, 1003] {
            let values: Vec<f32> = (0..len)
                .map(|i| match i % 11 {
                    0 => specials[(i / 11) % specials.len()],
                    k => ((i * 7919) % 97) as f32 * 0.013 - 0.6 + k as f32 * 1e-3,
                })
                .collect();
            for scale in [0.37, 0.0] {
                let mut ours = values.clone();
                let signs = compress_with_scale(&mut ours, scale);
                let mut expected = values.clone();
                let expected_signs: Vec<u8> = expected
                    .chunks_mut(8)
                    .map(|chunk| compress_scalar(chunk, scale))
                    .collect();
                assert_eq!(signs, expected_signs, "len {len} scale {scale}");
                assert_eq!(signs, pack_signs(&values), "len {len}");
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&ours), bits(&expected), "len {len} scale {scale}");

                let mut added = values.clone();
                add_scaled_signs(&signs, 1.5, &mut added);
                let mut expected = values.clone();
                for (chunk, &byte) in expected.chunks_mut(8).zip(&signs) {
                    add_scalar(byte, 1.5, chunk);
                }
                assert_eq!(bits(&added), bits(&expected), "len {len}");
            }
        }
    }

    /// Block scales: each block's RMS, its signs at its own bytes, the same as compressing
    /// the blocks one by one.
    #[test]
    fn chunk_compression_with_blocks_equals_block_by_block() {
        let x: Vec<f32> = (0..200)
            .map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8)
            .collect();
        let mut ours = x.clone();
        let mut scales = vec![0.0; scales_per_chunk(x.len(), 64)];
        let mut signs = vec![0; x.len().div_ceil(8)];
        compress_chunk(&mut ours, 64, None, &mut scales, &mut signs);
        assert_eq!(scales.len(), 4);
        let mut expected = x.clone();
        let mut expected_signs = Vec::new();
        for (k, part) in expected.chunks_mut(64).enumerate() {
            let (scale, bits) = compress_in_place(part);
            assert_eq!(scales[k], scale, "block {k}");
            expected_signs.extend(bits);
        }
        assert_eq!(signs, expected_signs);
        assert_eq!(ours, expected);
    }
}
