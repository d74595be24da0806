//! Ranks stay one model.
//!
//! Note [Ranks stay one model]: data parallelism is only correct while every rank holds the
//! same parameters. Ranks start equal (rank 0's parameters are broadcast, as PyTorch DDP's
//! `_sync_module_states`) and stay equal only if every step changes them by the same amount
//! on every rank: the averaged gradient is one collective's result, the same bits everywhere,
//! so what must be the same too is every number a rank computes from it. Two of those are
//! reductions: the global clip mode's norm of the averaged gradient (`reducer.rs`) and LAMB's
//! per-tensor norms (its trust ratios). On the CPU they are sums in a fixed order; on CubeCL
//! backends the multi-tensor norm kernel writes per-block partial sums and adds them in a
//! fixed order too (`FusedOps::sum_squares_multi_tensor`), never through an autotuned or
//! atomic reduction whose order could differ between processes. Last, what no design
//! argument covers is checked: a digest of every parameter is compared across ranks at start
//! and every `parallel.check_every` steps (default: before every checkpoint), and the first
//! tensor that differs stops the run, named, rather than training on as several models.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::CommThread;
use crate::TrainError;
use crate::grads::named_params;

/// A 64-bit digest of `values`' bits (not cryptographic: it detects drift, not tampering).
fn digest(values: &[f32]) -> u64 {
    let mut h = values.len() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for v in values {
        h = (h.rotate_left(5) ^ u64::from(v.to_bits())).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    h
}

/// Every float parameter's dotted path and [`digest`], in module order (a read of every
/// parameter to the host).
pub fn parameter_digests<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
) -> Vec<(String, u64)> {
    struct Digests(HashMap<ParamId, u64>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Digests {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            let values = data.as_slice::<f32>().expect("f32 after convert");
            self.0.insert(param.id, digest(values));
        }
    }
    let mut digests = Digests(HashMap::new());
    module.visit(&mut digests);
    named_params::<B, M>(module)
        .into_iter()
        .map(|(name, id)| (name, digests.0[&id]))
        .collect()
}

/// Compares `module`'s parameters with every other rank's (Note [Ranks stay one model]);
/// `when` says at which point of the run, for the error ("at start", "after step 300").
///
/// # Errors
/// [`TrainError::ParametersDiverged`] naming the first differing tensor (in module order)
/// and the first rank holding another value than rank 0; [`TrainError::Comm`].
pub fn check_parameters_agree<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    comm: &CommThread<B::InnerBackend>,
    when: String,
) -> Result<(), TrainError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let digests = parameter_digests::<B, M>(module);
    let bytes: Vec<u8> = digests.iter().flat_map(|(_, d)| d.to_le_bytes()).collect();
    let all = comm.call(move |c| c.allgather(&bytes))?;
    let decode = |bytes: &[u8]| -> Vec<u64> {
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()
    };
    let reference = decode(&all[0]);
    for (index, (name, _)) in digests.iter().enumerate() {
        for (rank, theirs) in all.iter().enumerate().skip(1) {
            if decode(theirs).get(index) != reference.get(index) {
                return Err(TrainError::ParametersDiverged {
                    when,
                    rank,
                    name: name.clone(),
                });
            }
        }
    }
    Ok(())
}

/// Whether the parameters are compared after `step` (counted from 1): every `check_every`
/// steps when set (0: never after the start), else when a checkpoint is written
/// (`checkpointing`).
pub fn check_due(check_every: Option<u64>, step: u64, checkpointing: bool) -> bool {
    match check_every {
        Some(0) => false,
        Some(n) => step % n == 0,
        None => checkpointing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_sees_every_bit_and_every_position() {
        let a = [1.0f32, 2.0, 3.0];
        assert_eq!(digest(&a), digest(&[1.0, 2.0, 3.0]));
        assert_ne!(
            digest(&a),
            digest(&[1.0, 2.0, f32::from_bits(3.0f32.to_bits() + 1)])
        );
        assert_ne!(digest(&a), digest(&[2.0, 1.0, 3.0]));
        assert_ne!(digest(&[0.0]), digest(&[-0.0]));
        assert_ne!(digest(&[]), digest(&[0.0]));
    }

    #[test]
    fn checks_fall_due_as_configured() {
        assert!(check_due(None, 7, true) && !check_due(None, 8, false));
        assert!(check_due(Some(4), 8, false) && !check_due(Some(4), 9, true));
        assert!(!check_due(Some(0), 10, true));
    }
}
