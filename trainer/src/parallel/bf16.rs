//! Buckets allreduced in bf16 (`parallel.allreduce_dtype = "bf16"`): half the bytes of f32 on
//! the wire, the sum accumulated in f32.
//!
//! The exchange is a reduce-scatter and an allgather built from the byte collectives every
//! communicator has (in-process, MPI, NCCL's host path), the structure of a ring allreduce:
//! each rank rounds its buffer to bf16 (round to nearest even) and sends the ranks their
//! chunks ([`Collective::alltoall`]); each rank sums the chunk it owns **in f32**, in rank
//! order (the same order on every rank: deterministic), averages it, rounds the result to bf16
//! and the chunks are gathered ([`Collective::allgather`]). Bytes each rank sends:
//! `2 · (W−1)/W · N · 2`, half of the f32 ring's `2 · (W−1)/W · N · 4`. The result differs from
//! the f32 average by the rounding of the inputs (relative 2⁻⁸ each: bf16 keeps 8 significant
//! bits) and one rounding of the output; NCCL's own bf16 allreduce (`ncclBfloat16`) adds in bf16 at every hop of the ring,
//! which this avoids. PyTorch DDP offers the same trade as a communication hook
//! (`torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook`, which
//! casts the bucket, allreduces it in bf16 and casts back); DeepSpeed as
//! `communication_data_type`.
//!
//! One rank: nothing travels, the buffer stays f32.
//!
//! Note [bf16 device buckets]: device buckets take another road
//! (`Reducer::with_allreduce_dtype`): cast to bf16 on the GPU and reduced by NCCL's
//! `ncclBfloat16` allreduce, which is what PyTorch DDP's `bf16_compress_hook` does. NCCL's ring
//! adds in bf16 at every hop (`FuncSum` on `__nv_bfloat16`, one rounding per addition) and
//! averages by pre-multiplying each input by 1/W (`ncclAvg` as `ncclPreMulSum`): W − 1
//! roundings of the running sum instead of one. Measured against the f32 average
//! (`nccl_style_bf16_rounds_at_every_hop`: that order emulated on the host beside this
//! module's path on in-process ranks, each element's error relative to its ranks' mean
//! magnitude): 2 ranks, both max 5.9e-3 and RMS 1.9e-3 (halving is exact); 8 ranks, NCCL's
//! order max 4.1e-3 and RMS 1.2e-3, the f32 sum 2.5e-3 and 8.2e-4. Both stay within a few of
//! bf16's roundings (2⁻⁸ = 3.9e-3 each), and a bucket stays one NCCL call on the device; an f32
//! sum of device buckets would take an all-to-all, a sum kernel and an allgather per bucket.

use burn::tensor::bf16;
use serde::{Deserialize, Serialize};

use super::collective::{Collective, CommError, ReduceOp};

/// The element type gradient buckets travel in (`parallel.allreduce_dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllreduceDtype {
    /// f32, exact up to the order of the sum.
    #[default]
    F32,
    /// bf16 on the wire, the sum in f32 (see the module docs).
    Bf16,
}

impl AllreduceDtype {
    /// Bytes of one element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            AllreduceDtype::F32 => 4,
            AllreduceDtype::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for AllreduceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AllreduceDtype::F32 => "f32",
            AllreduceDtype::Bf16 => "bf16",
        })
    }
}

impl std::str::FromStr for AllreduceDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(AllreduceDtype::F32),
            "bf16" => Ok(AllreduceDtype::Bf16),
            other => Err(format!(
                "unknown allreduce dtype {other:?}: expected f32 or bf16"
            )),
        }
    }
}

/// Allreduces `data` with bf16 on the wire and the sum in f32 (see the module docs). Every
/// rank ends with the same values: the f32 sum (or average) of the ranks' bf16-rounded
/// buffers, rounded to bf16.
///
/// # Errors
/// [`CommError`] from the all-to-all or the allgather (a rank gone, a timeout, buffers of
/// different lengths).
pub fn allreduce_bf16(
    comm: &mut dyn Collective,
    data: &mut [f32],
    op: ReduceOp,
) -> Result<(), CommError> {
    let (world_size, rank) = (comm.world_size(), comm.rank());
    if world_size < 2 {
        return Ok(());
    }
    let chunk = data.len().div_ceil(world_size);
    // World-size blocks of `chunk` bf16 each, the last one padded with zeros.
    let mut send = vec![0u8; world_size * chunk * 2];
    for (bytes, x) in send.chunks_exact_mut(2).zip(data.iter()) {
        bytes.copy_from_slice(&bf16::from_f32(*x).to_bits().to_le_bytes());
    }
    let received = comm.alltoall(&send)?;
    let mut sum = vec![0f32; chunk];
    for block in received.chunks_exact(chunk * 2) {
        for (s, bytes) in sum.iter_mut().zip(block.chunks_exact(2)) {
            *s += bf16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32();
        }
    }
    if op == ReduceOp::Average {
        let inv = 1.0 / world_size as f32;
        sum.iter_mut().for_each(|s| *s *= inv);
    }
    let mine: Vec<u8> = sum
        .iter()
        .flat_map(|s| bf16::from_f32(*s).to_bits().to_le_bytes())
        .collect();
    let gathered = comm.allgather(&mine)?;
    for (from, block) in gathered.iter().enumerate() {
        if block.len() != chunk * 2 {
            return Err(CommError::Mismatch {
                seq: 0,
                detail: format!(
                    "bf16 allreduce on rank {rank}: rank {from} sent {} bytes, expected {}",
                    block.len(),
                    chunk * 2
                ),
            });
        }
        let start = (from * chunk).min(data.len());
        for (x, bytes) in data[start..].iter_mut().zip(block.chunks_exact(2)) {
            *x = bf16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32();
        }
    }
    Ok(())
}

/// Bytes one rank sends in an allreduce of `elements` elements of `dtype` over `world_size`
/// ranks, as a ring allreduce (or the reduce-scatter + allgather above) sends them:
/// `2 · (W−1)/W · N · bytes`; 0 for one rank.
pub fn allreduce_bytes(elements: usize, world_size: usize, dtype: AllreduceDtype) -> u64 {
    let w = world_size as u64;
    if w < 2 {
        return 0;
    }
    2 * (w - 1) * dtype.bytes() as u64 * elements as u64 / w
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::parallel::in_process::tests::run_group;

    /// A deterministic value of rank `r` at `i`, spread over magnitudes 1e-6 to 1e3.
    fn value(r: usize, i: usize) -> f32 {
        let x = ((i * 7919 + r * 104_729) % 1000) as f32 / 1000.0 - 0.5;
        x * 10f32.powi((i % 10) as i32 - 6)
    }

    /// 2 and 3 ranks, odd lengths (padded chunks, a length below the world size): every rank
    /// gets the same values, within bf16 rounding of the f32 average (bf16 keeps 8 significant
    /// bits: each rounding is within 2⁻⁸ relative, the inputs' of their magnitudes and the
    /// output's of the result, so 2⁻⁷ of the larger), and exactly the f32 sum of the
    /// bf16-rounded inputs, rounded once.
    #[test]
    fn bf16_allreduce_equals_the_f32_average_within_bf16_rounding() {
        for (world_size, n) in [(2, 1001), (3, 1000), (3, 2)] {
            let results = run_group(world_size, Duration::from_secs(10), move |mut comm| {
                let r = comm.rank();
                let mut exact: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                let mut half = exact.clone();
                comm.allreduce(&mut exact, ReduceOp::Average).unwrap();
                allreduce_bf16(&mut comm, &mut half, ReduceOp::Average).unwrap();
                (exact, half)
            });
            for (exact, half) in &results {
                assert_eq!(half, &results[0].1, "every rank holds the same result");
                for (i, (e, h)) in exact.iter().zip(half).enumerate() {
                    // Rounding each input by up to 2⁻⁸ of its magnitude bounds the sum's error
                    // by the mean magnitude, not by the (possibly cancelled) result.
                    let scale: f32 =
                        (0..world_size).map(|r| value(r, i).abs()).sum::<f32>() / world_size as f32;
                    assert!(
                        (e - h).abs() <= 2f32.powi(-7) * scale.max(e.abs()) + 1e-30,
                        "{world_size} ranks, element {i}: f32 {e}, bf16 {h}"
                    );
                    // Written out: the f32 average of the rounded inputs, rounded once.
                    let rounded: f32 = (0..world_size)
                        .map(|r| bf16::from_f32(value(r, i)).to_f32())
                        .sum::<f32>()
                        * (1.0 / world_size as f32);
                    assert_eq!(*h, bf16::from_f32(rounded).to_f32(), "element {i}");
                }
            }
        }
    }

    /// NCCL's `ncclBfloat16` average as a ring computes it (Note [bf16 device buckets]): the
    /// bucket cast to bf16, each input pre-multiplied by 1/W and rounded, then added around
    /// the ring, rounded to bf16 after every addition.
    fn nccl_style_average(inputs: &[f32]) -> f32 {
        let round = |x: f32| bf16::from_f32(x).to_f32();
        let inv = 1.0 / inputs.len() as f32;
        let mut sum = round(round(inputs[0]) * inv);
        for &x in &inputs[1..] {
            sum = round(sum + round(round(x) * inv));
        }
        sum
    }

    /// Note [bf16 device buckets], measured: on 2 and 8 in-process ranks, this module's f32
    /// sum against the f32 average, beside NCCL's order emulated; each element's error
    /// relative to its ranks' mean magnitude (the scale rounding works at). Bounds: the f32
    /// sum rounds each input and the output once (2 · 2⁻⁸), the ring each input, its scaled
    /// copy and W − 1 running sums ((W + 1) · 2⁻⁸); at 8 ranks the ring's RMS error is the
    /// larger.
    #[test]
    fn nccl_style_bf16_rounds_at_every_hop() {
        let n = 20_000;
        for world_size in [2usize, 8] {
            let results = run_group(world_size, Duration::from_secs(20), move |mut comm| {
                let r = comm.rank();
                let mut half: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
                allreduce_bf16(&mut comm, &mut half, ReduceOp::Average).unwrap();
                half
            });
            let (mut ours, mut ring) = (Vec::new(), Vec::new());
            for i in 0..n {
                let inputs: Vec<f32> = (0..world_size).map(|r| value(r, i)).collect();
                let exact = inputs.iter().map(|&x| f64::from(x)).sum::<f64>() / world_size as f64;
                let scale =
                    inputs.iter().map(|&x| f64::from(x).abs()).sum::<f64>() / world_size as f64;
                if scale == 0.0 {
                    continue;
                }
                ours.push((f64::from(results[0][i]) - exact).abs() / scale);
                ring.push((f64::from(nccl_style_average(&inputs)) - exact).abs() / scale);
            }
            let max = |e: &[f64]| e.iter().copied().fold(0.0, f64::max);
            let rms = |e: &[f64]| (e.iter().map(|x| x * x).sum::<f64>() / e.len() as f64).sqrt();
            println!(
                "{world_size} ranks: f32 sum max {:.1e} RMS {:.1e}; NCCL's bf16 ring max {:.1e} \
                 RMS {:.1e}",
                max(&ours),
                rms(&ours),
                max(&ring),
                rms(&ring)
            );
            let unit = 2f64.powi(-8);
            assert!(max(&ours) <= 2.0 * unit, "{}", max(&ours));
            assert!(
                max(&ring) <= (world_size as f64 + 1.0) * unit,
                "{}",
                max(&ring)
            );
            if world_size == 8 {
                assert!(rms(&ring) > rms(&ours), "{} vs {}", rms(&ring), rms(&ours));
            }
        }
    }

    #[test]
    fn bf16_sends_half_the_bytes_of_f32() {
        assert_eq!(allreduce_bytes(1000, 4, AllreduceDtype::F32), 6000);
        assert_eq!(allreduce_bytes(1000, 4, AllreduceDtype::Bf16), 3000);
        assert_eq!(allreduce_bytes(1000, 1, AllreduceDtype::Bf16), 0);
        assert_eq!("bf16".parse::<AllreduceDtype>(), Ok(AllreduceDtype::Bf16));
        assert!(
            "fp8"
                .parse::<AllreduceDtype>()
                .unwrap_err()
                .contains("f32 or bf16")
        );
    }
}
