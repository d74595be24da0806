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
    (crate::host_norm::sum_squares(values) / values.len() as f64).sqrt() as f32
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
    let add = |byte: u8, chunk: &mut [f32]| {
        for (i, x) in chunk.iter_mut().enumerate() {
            *x += if (byte >> (7 - i)) & 1 == 1 {
                scale
            } else {
                -scale
            };
        }
    };
    let full = out.len() / 8;
    let mut chunks = out.chunks_exact_mut(8);
    for (chunk, &byte) in (&mut chunks).zip(bytes) {
        add(byte, chunk);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        add(bytes[full], tail);
    }
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
///
/// Branch-free (a select per element, which the compiler vectorizes): `v + (−scale)` is `v −
/// scale` exactly in IEEE arithmetic, so the errors are those of the branching form.
pub fn compress_with_scale(x: &mut [f32], scale: f32) -> Vec<u8> {
    let byte = |chunk: &mut [f32]| {
        let mut byte = 0u8;
        for (i, v) in chunk.iter_mut().enumerate() {
            let bit = sign_bit(*v);
            byte |= u8::from(bit) << (7 - i);
            *v += if bit { -scale } else { scale };
        }
        byte
    };
    let mut packed = Vec::with_capacity(x.len().div_ceil(8));
    let mut chunks = x.chunks_exact_mut(8);
    // Whole bytes: eight lanes of fixed length, which the compiler unrolls and vectorizes.
    packed.extend((&mut chunks).map(|chunk| byte(chunk)));
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        packed.push(byte(tail));
    }
    packed
}

/// Scales a chunk of `len` elements has: one (`block` 0, DeepSpeed's granularity), else one
/// per `block` elements, the last block possibly shorter.
pub fn scales_per_chunk(len: usize, block: usize) -> usize {
    if block == 0 { 1 } else { len.div_ceil(block) }
}

/// Compresses a chunk in place with one scale per `block` elements (`block` a multiple of 8;
/// 0: one scale, `whole` if given, else the chunk's own RMS). Returns the scales and the packed
/// signs; `x` keeps what the compression lost.
pub fn compress_chunk(x: &mut [f32], block: usize, whole: Option<f32>) -> (Vec<f32>, Vec<u8>) {
    if block == 0 {
        let scale = whole.unwrap_or_else(|| rms_scale(x));
        return (vec![scale], compress_with_scale(x, scale));
    }
    let mut scales = Vec::with_capacity(scales_per_chunk(x.len(), block));
    let mut packed = Vec::with_capacity(x.len().div_ceil(8));
    for part in x.chunks_mut(block) {
        let (scale, bits) = compress_in_place(part);
        scales.push(scale);
        packed.extend_from_slice(&bits);
    }
    (scales, packed)
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
}
