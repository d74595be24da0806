//! The compressed allreduce of 1-bit Adam (Tang et al. 2021, Algorithm 1) and 1-bit LAMB (Li
//! et al. 2022), as DeepSpeed's `NcclBackend.compressed_allreduce`
//! (`deepspeed/runtime/comm/nccl.py`) runs it:
//!
//! 1. **worker**: each rank adds its worker error to its buffer, compresses it to one scale
//!    and a sign per element (`compress.rs`) and keeps what that lost as the new worker error;
//! 2. **all-to-all**: the buffer is cut into `world_size` equal chunks; rank j receives every
//!    rank's signs of chunk j, and every rank's scale;
//! 3. **server**: rank j averages its chunk (`Σᵢ sᵢ/W · signᵢ`), adds its server error,
//!    compresses again and keeps the new server error;
//! 4. **allgather**: every rank receives every server chunk's scale and signs and rebuilds the
//!    whole averaged buffer, identical on every rank.
//!
//! A buffer is padded with zeros to a multiple of `W · lcm(W, 8)` elements (DeepSpeed's
//! `corrected_tensor_size`), so that each chunk packs into whole bytes.
//!
//! ember sends several buffers (segments) per call, each with its own scales and errors: the
//! scales ride in front of the signs in the all-to-all's blocks and in the allgather's message,
//! so a call is one all-to-all and one allgather whatever the number of segments (DeepSpeed
//! issues an all-to-all and two allgathers per tensor). With one rank nothing is compressed:
//! the buffers are already the average (DeepSpeed likewise skips the call when `size == 1`).

use super::compress::{add_chunk, compress_chunk, rms_scale, scales_per_chunk};
use crate::parallel::{Collective, CommError};

/// `scales` as little-endian bytes into `out` (4 per scale), where a message carries them.
fn write_scales(scales: &[f32], out: &mut [u8]) {
    for (scale, bytes) in scales.iter().zip(out.chunks_exact_mut(4)) {
        bytes.copy_from_slice(&scale.to_le_bytes());
    }
}

/// The length DeepSpeed pads a buffer of `len` elements to for `world_size` ranks: the next
/// multiple of `world_size · lcm(world_size, 8)`.
pub fn padded_len(len: usize, world_size: usize) -> usize {
    let w = world_size.max(1);
    let lcm = w * 8 / gcd(w, 8);
    len.div_ceil(w * lcm) * (w * lcm)
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Bytes one rank sent in one compressed allreduce, by phase. The all-to-all counts the
/// W−1 blocks that leave the rank; the allgather counts W−1 copies of the rank's message (a
/// ring allgather forwards W−1 messages of that size).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BytesSent {
    /// Worker phase (all-to-all of signs and scales).
    pub alltoall: u64,
    /// Server phase (allgather of the averaged chunks' signs and scales).
    pub allgather: u64,
}

impl BytesSent {
    /// Both phases.
    pub fn total(&self) -> u64 {
        self.alltoall + self.allgather
    }
}

/// Bytes one rank sends in a ring allreduce of `elements` f32 values over `world_size` ranks:
/// `2(W−1)/W · 4n` (Patarasuk & Yuan 2009), what the exact stage's buckets cost.
pub fn ring_allreduce_bytes(elements: usize, world_size: usize) -> u64 {
    let w = world_size as u64;
    if w < 2 {
        return 0;
    }
    2 * (w - 1) * 4 * elements as u64 / w
}

/// One rank's compressed allreduce over a fixed list of segments, with the error-feedback
/// buffers that persist from call to call (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct CompressedAllreduce {
    world_size: usize,
    rank: usize,
    /// Each segment's length before padding.
    lengths: Vec<usize>,
    /// Each segment's worker error, `padded_len` long.
    pub worker_errors: Vec<Vec<f32>>,
    /// Each segment's server error: this rank's chunk, `padded_len / world_size` long.
    pub server_errors: Vec<Vec<f32>>,
    /// Elements per scale within a chunk (a multiple of 8); 0: one scale per buffer on the
    /// worker and one per chunk on the server, DeepSpeed's.
    block: usize,
}

impl CompressedAllreduce {
    /// Zero errors for segments of `lengths` elements, for `rank` of `world_size`, with one
    /// scale per `block` elements of a chunk (a multiple of 8; 0: DeepSpeed's one scale per
    /// buffer).
    ///
    /// # Panics
    /// If `block` is not a multiple of 8 (the settings are validated before).
    pub fn new(lengths: Vec<usize>, world_size: usize, rank: usize, block: usize) -> Self {
        assert!(block.is_multiple_of(8), "scale blocks pack whole bytes");
        let padded: Vec<usize> = lengths.iter().map(|&n| padded_len(n, world_size)).collect();
        Self {
            world_size,
            rank,
            worker_errors: padded.iter().map(|&p| vec![0.0; p]).collect(),
            server_errors: padded.iter().map(|&p| vec![0.0; p / world_size]).collect(),
            lengths,
            block,
        }
    }

    /// The segments' lengths before padding.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Elements of one chunk of segment `s` (its padded length over the ranks).
    fn chunk_len(&self, s: usize) -> usize {
        self.worker_errors[s].len() / self.world_size
    }

    /// Where segment `s`'s scales and signs start in a message, and how many of each (scales,
    /// sign bytes). A message (one all-to-all block, or the allgather's) is every segment's
    /// scales of one chunk, then every segment's packed signs of that chunk.
    fn layout(&self) -> (Vec<(usize, usize, usize, usize)>, usize) {
        let segments = self.lengths.len();
        let scales: Vec<usize> = (0..segments)
            .map(|s| scales_per_chunk(self.chunk_len(s), self.block))
            .collect();
        let mut scale_offset = 0;
        let mut sign_offset = 4 * scales.iter().sum::<usize>();
        let mut layout = Vec::with_capacity(segments);
        for (s, &n) in scales.iter().enumerate() {
            let bytes = self.chunk_len(s) / 8;
            layout.push((scale_offset, n, sign_offset, bytes));
            scale_offset += 4 * n;
            sign_offset += bytes;
        }
        (layout, sign_offset)
    }

    /// Replaces each of `values` (one per segment, of the lengths given to
    /// [`CompressedAllreduce::new`]) by its compressed average over the ranks, the same on
    /// every rank, and updates the error feedback. Returns the bytes this rank sent.
    ///
    /// # Errors
    /// [`CommError`] from the all-to-all or the allgather; [`CommError::Mismatch`] when a
    /// rank's message has another size.
    ///
    /// # Panics
    /// If `values` does not match the segments (a bug of the caller).
    pub fn run(
        &mut self,
        comm: &mut dyn Collective,
        values: &mut [Vec<f32>],
    ) -> Result<BytesSent, CommError> {
        assert_eq!(values.len(), self.lengths.len(), "one buffer per segment");
        let w = self.world_size;
        if w == 1 {
            return Ok(BytesSent::default());
        }
        let (layout, message_len) = self.layout();
        let scales_of = |message: &[u8], (offset, n, _, _): (usize, usize, usize, usize)| {
            message[offset..offset + 4 * n]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect::<Vec<f32>>()
        };

        // 1. Worker: x = v + e, compressed chunk by chunk (one scale for the whole buffer, or
        // one per block); e = what that lost.
        let mut send = vec![0u8; message_len * w];
        for (s, v) in values.iter().enumerate() {
            assert_eq!(v.len(), self.lengths[s], "segment {s}'s length");
            let c = self.chunk_len(s);
            let error = &mut self.worker_errors[s];
            for (e, &y) in error.iter_mut().zip(v) {
                *e += y;
            }
            let whole = (self.block == 0).then(|| rms_scale(error));
            let (scale_offset, n, sign_offset, bytes) = layout[s];
            let mut scales = vec![0.0; n];
            for (j, chunk) in error.chunks_mut(c).enumerate() {
                let message = &mut send[j * message_len..(j + 1) * message_len];
                let signs = &mut message[sign_offset..sign_offset + bytes];
                compress_chunk(chunk, self.block, whole, &mut scales, signs);
                write_scales(&scales, &mut message[scale_offset..scale_offset + 4 * n]);
            }
        }

        // 2. All-to-all: rank j receives every rank's chunk j.
        let received = comm.alltoall(&send)?;

        // 3. Server: this rank's chunk averaged over the ranks (Σᵢ sᵢ/W · signᵢ), plus the
        // server error, compressed again.
        let mut message = vec![0u8; message_len];
        for (s, &place) in layout.iter().enumerate() {
            let (scale_offset, n, sign_offset, bytes) = place;
            let mut chunk = vec![0.0f32; self.chunk_len(s)];
            for from in received.chunks(message_len) {
                let scales = scales_of(from, place);
                let signs = &from[sign_offset..sign_offset + bytes];
                add_chunk(&scales, signs, self.block, 1.0 / w as f32, &mut chunk);
            }
            let error = &mut self.server_errors[s];
            for (e, &x) in error.iter_mut().zip(&chunk) {
                *e += x;
            }
            let mut scales = vec![0.0; n];
            let signs = &mut message[sign_offset..sign_offset + bytes];
            compress_chunk(error, self.block, None, &mut scales, signs);
            write_scales(&scales, &mut message[scale_offset..scale_offset + 4 * n]);
        }

        // 4. Allgather: every server chunk, rebuilt as scale · sign.
        let all = comm.allgather(&message)?;
        if let Some((j, from)) = all.iter().enumerate().find(|(_, m)| m.len() != message_len) {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: format!(
                    "compressed allreduce: rank {j} sent {} bytes, rank {} expected {message_len}",
                    from.len(),
                    self.rank
                ),
            });
        }
        for (s, v) in values.iter_mut().enumerate() {
            let c = self.chunk_len(s);
            let place = layout[s];
            let (_, _, sign_offset, bytes) = place;
            let mut rebuilt = vec![0.0f32; c * w];
            for (from, out) in all.iter().zip(rebuilt.chunks_mut(c)) {
                let scales = scales_of(from, place);
                add_chunk(
                    &scales,
                    &from[sign_offset..sign_offset + bytes],
                    self.block,
                    1.0,
                    out,
                );
            }
            rebuilt.truncate(v.len());
            *v = rebuilt;
        }
        Ok(BytesSent {
            alltoall: ((w - 1) * message_len) as u64,
            allgather: ((w - 1) * message_len) as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::parallel::InProcess;
    use crate::parallel::in_process::tests::run_group;

    fn on_ranks<T: Send + 'static>(
        world_size: usize,
        body: impl Fn(InProcess) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        run_group(world_size, Duration::from_secs(30), body)
    }

    /// Deterministic values in [-1, 1) for (rank, call, segment, element).
    fn input(rank: usize, call: usize, segment: usize, len: usize) -> Vec<f32> {
        let mut state = (rank * 1_000_003 + call * 7_919 + segment * 104_729 + 1) as u64;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0 + 0.1 * segment as f32
            })
            .collect()
    }

    /// The papers' formula, serially over all ranks at once (written here, not a call of the
    /// code under test): per segment, each rank's `x = pad(v) + e`, scales `s` (the RMS of the
    /// whole buffer, or of each block of a chunk), `e ← x − s·sgn(x)`; per chunk j,
    /// `c = Σᵢ sᵢ/W · sgn(xᵢ)[j] + E_j`, scales `S` (of the chunk, or of each block),
    /// `E_j ← c − S·sgn(c)`; the result is `S · sgn(c)`, chunk by chunk.
    struct Serial {
        block: usize,
        worker: Vec<Vec<Vec<f32>>>, // [rank][segment][padded]
        server: Vec<Vec<Vec<f32>>>, // [chunk j][segment][chunk]
    }

    fn sgn(x: f32) -> f32 {
        if x < 0.0 { -1.0 } else { 1.0 }
    }

    fn rms(x: &[f32]) -> f32 {
        (x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / x.len() as f64).sqrt() as f32
    }

    /// Each element's scale: blocks of `block` within chunks of `chunk`; `block` 0: the RMS of
    /// all of `x`.
    fn element_scales(x: &[f32], chunk: usize, block: usize) -> Vec<f32> {
        if block == 0 {
            return vec![rms(x); x.len()];
        }
        x.chunks(chunk)
            .flat_map(|c| c.chunks(block).flat_map(|b| vec![rms(b); b.len()]))
            .collect()
    }

    impl Serial {
        fn new(lengths: &[usize], w: usize, block: usize) -> Self {
            let padded: Vec<usize> = lengths.iter().map(|&n| padded_len(n, w)).collect();
            Self {
                block,
                worker: (0..w)
                    .map(|_| padded.iter().map(|&p| vec![0.0; p]).collect())
                    .collect(),
                server: (0..w)
                    .map(|_| padded.iter().map(|&p| vec![0.0; p / w]).collect())
                    .collect(),
            }
        }

        fn call(&mut self, inputs: &[Vec<Vec<f32>>]) -> Vec<Vec<f32>> {
            let w = inputs.len();
            (0..inputs[0].len())
                .map(|s| {
                    let padded = self.worker[0][s].len();
                    let chunk = padded / w;
                    let mut xs = Vec::new();
                    let mut scales = Vec::new();
                    for (i, input) in inputs.iter().enumerate() {
                        let x: Vec<f32> = (0..padded)
                            .map(|k| input[s].get(k).copied().unwrap_or(0.0) + self.worker[i][s][k])
                            .collect();
                        let scale = element_scales(&x, chunk, self.block);
                        for k in 0..padded {
                            self.worker[i][s][k] = x[k] - scale[k] * sgn(x[k]);
                        }
                        xs.push(x);
                        scales.push(scale);
                    }
                    let mut out = Vec::with_capacity(padded);
                    for j in 0..w {
                        let mut c = vec![0.0f32; chunk];
                        for i in 0..w {
                            for k in 0..chunk {
                                let at = j * chunk + k;
                                c[k] += scales[i][at] * (1.0 / w as f32) * sgn(xs[i][at]);
                            }
                        }
                        for k in 0..chunk {
                            c[k] += self.server[j][s][k];
                        }
                        let scale = element_scales(&c, chunk, self.block);
                        for k in 0..chunk {
                            self.server[j][s][k] = c[k] - scale[k] * sgn(c[k]);
                            out.push(scale[k] * sgn(c[k]));
                        }
                    }
                    out.truncate(inputs[0][s].len());
                    out
                })
                .collect()
        }
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (k, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{k}]: {x} vs {y}"
            );
        }
    }

    #[test]
    fn padding_follows_deepspeed() {
        // W·lcm(W, 8): 16 for 2 ranks, 72 for 3, 32 for 4, 8 for 1.
        assert_eq!(padded_len(1, 2), 16);
        assert_eq!(padded_len(16, 2), 16);
        assert_eq!(padded_len(17, 3), 72);
        assert_eq!(padded_len(100, 4), 128);
        assert_eq!(padded_len(9, 1), 16);
        assert_eq!(padded_len(0, 4), 0);
    }

    #[test]
    fn compressed_allreduce_equals_the_serial_formula_on_2_and_4_ranks() {
        let lengths = vec![1usize, 13, 100, 257];
        // One scale per buffer (DeepSpeed's), and per 16 elements (chunks of 8 to 72
        // elements: whole and partial blocks).
        for (w, block) in [(2usize, 0usize), (4, 0), (2, 16), (4, 16)] {
            let calls = 3;
            let lengths_for_ranks = lengths.clone();
            let results = on_ranks(w, move |mut comm| {
                let rank = comm.rank();
                let mut reducer =
                    CompressedAllreduce::new(lengths_for_ranks.clone(), w, rank, block);
                let mut outputs = Vec::new();
                for call in 0..calls {
                    let mut values: Vec<Vec<f32>> = lengths_for_ranks
                        .iter()
                        .enumerate()
                        .map(|(s, &n)| input(rank, call, s, n))
                        .collect();
                    let sent = reducer.run(&mut comm, &mut values).unwrap();
                    outputs.push((values, sent));
                }
                (outputs, reducer)
            });
            let mut serial = Serial::new(&lengths, w, block);
            for call in 0..calls {
                let inputs: Vec<Vec<Vec<f32>>> = (0..w)
                    .map(|r| {
                        lengths
                            .iter()
                            .enumerate()
                            .map(|(s, &n)| input(r, call, s, n))
                            .collect()
                    })
                    .collect();
                let expected = serial.call(&inputs);
                for (rank, (outputs, _)) in results.iter().enumerate() {
                    for (s, e) in expected.iter().enumerate() {
                        close(
                            &outputs[call].0[s],
                            e,
                            &format!("W={w} call {call} rank {rank} segment {s}"),
                        );
                    }
                }
            }
            for (rank, (outputs, reducer)) in results.iter().enumerate() {
                for s in 0..lengths.len() {
                    close(
                        &reducer.worker_errors[s],
                        &serial.worker[rank][s],
                        "worker error",
                    );
                    close(
                        &reducer.server_errors[s],
                        &serial.server[rank][s],
                        "server error",
                    );
                }
                // Bytes: (W−1) messages of [each segment's chunk scales][its chunk's signs]
                // out in the all-to-all, and (W−1) in the allgather.
                let message: usize = lengths
                    .iter()
                    .map(|&n| {
                        let chunk = padded_len(n, w) / w;
                        let scales = if block == 0 { 1 } else { chunk.div_ceil(block) };
                        4 * scales + chunk / 8
                    })
                    .sum();
                let sent = outputs[0].1;
                assert_eq!(sent.alltoall, (w - 1) as u64 * message as u64);
                assert_eq!(sent.allgather, (w - 1) as u64 * message as u64);
            }
        }
    }

    /// At a layer's size the bytes are about 1/32 of the f32 ring allreduce's (signs, one bit
    /// instead of 32; scales and padding are the rest: with a scale per 128 elements, 1/25.6).
    #[test]
    fn the_compressed_allreduce_sends_over_16_times_fewer_bytes() {
        for (w, block) in [(2usize, 0usize), (4, 0), (2, 128), (4, 128)] {
            let lengths = vec![768 * 768, 768, 3 * 768];
            let total: usize = lengths.iter().sum();
            let sent = on_ranks(w, move |mut comm| {
                let mut reducer = CompressedAllreduce::new(lengths.clone(), w, comm.rank(), block);
                let mut values: Vec<Vec<f32>> = lengths
                    .iter()
                    .enumerate()
                    .map(|(s, &n)| input(comm.rank(), 0, s, n))
                    .collect();
                reducer.run(&mut comm, &mut values).unwrap()
            });
            let ratio = ring_allreduce_bytes(total, w) as f64 / sent[0].total() as f64;
            assert!(
                ratio > 16.0 && ratio <= 32.0,
                "W={w}, block {block}: {ratio}"
            );
        }
    }

    /// Error feedback: compressing the same inputs again and again, the running mean of the
    /// results approaches the exact average (the errors stay bounded), while one call alone is
    /// far from it.
    #[test]
    fn error_feedback_makes_the_running_mean_exact() {
        let n = 200;
        let results = on_ranks(2, move |mut comm| {
            let rank = comm.rank();
            let mut reducer = CompressedAllreduce::new(vec![n], 2, rank, 0);
            let fixed = input(rank, 0, 0, n);
            let mut sum = vec![0.0f64; n];
            let mut first = Vec::new();
            let calls = 400;
            for call in 0..calls {
                let mut values = vec![fixed.clone()];
                reducer.run(&mut comm, &mut values).unwrap();
                if call == 0 {
                    first = values[0].clone();
                }
                for (s, v) in sum.iter_mut().zip(&values[0]) {
                    *s += f64::from(*v) / calls as f64;
                }
            }
            (sum, first)
        });
        let exact: Vec<f64> = (0..n)
            .map(|k| (f64::from(input(0, 0, 0, n)[k]) + f64::from(input(1, 0, 0, n)[k])) / 2.0)
            .collect();
        let rms_exact = (exact.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
        let deviation = |got: &[f64]| {
            (got.iter()
                .zip(&exact)
                .map(|(g, e)| (g - e).powi(2))
                .sum::<f64>()
                / n as f64)
                .sqrt()
        };
        let (mean, first) = &results[0];
        let first: Vec<f64> = first.iter().map(|&x| f64::from(x)).collect();
        assert!(
            deviation(&first) > 0.3 * rms_exact,
            "one call: {}",
            deviation(&first)
        );
        assert!(
            deviation(mean) < 0.02 * rms_exact,
            "running mean off by {} (rms {rms_exact})",
            deviation(mean)
        );
    }
}
