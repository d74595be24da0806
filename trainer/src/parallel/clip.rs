//! Gradient clipping in data-parallel training: the modes of MLPerf BERT submissions and the
//! clip coefficient they share (PyTorch's `torch.nn.utils.clip_grad_norm_`).
//!
//! Note [Clip coefficient]: every mode scales a gradient `g` of norm `‖g‖` by
//! `min(1, max_norm / (‖g‖ + 1e-6))`, PyTorch's formula since 1.13 (a clamp rather than a
//! branch, so that it can stay on the device: no host read decides whether to clip). With
//! `max_norm = 0` clipping is off (PyTorch would zero the gradient).

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

/// How gradients are clipped in data-parallel training. `max_norm` is
/// `optimizer.max_grad_norm`; 0 turns every mode off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClipMode {
    /// No clipping.
    None,
    /// Clip by the norm of the averaged gradient, after the allreduce:
    /// `g ← g · min(1, max_norm / (‖mean_r g_r‖ + 1e-6))`. Exact (what one rank with the whole
    /// batch computes, `torch.nn.utils.clip_grad_norm_`); the clip waits for every bucket.
    #[default]
    Global,
    /// Each rank clips its whole local gradient before the allreduce:
    /// `g_r ← g_r · min(1, max_norm / (‖g_r‖ + 1e-6))`, then averages. NVIDIA's MLPerf BERT
    /// default (clipping inside the LAMB/Adam step, before the gradient allreduce); no overlap:
    /// the local norm needs every gradient, so buckets launch after backward.
    LocalGlobal,
    /// Each rank clips each bucket b by that bucket's own local norm, to
    /// `max_norm / sqrt(number of buckets)`:
    /// `g_{r,b} ← g_{r,b} · min(1, (max_norm/√K) / (‖g_{r,b}‖ + 1e-6))`, then that bucket's
    /// allreduce starts at once. The whole gradient's norm stays ≤ max_norm and nothing waits
    /// for a global norm. Samsung's MLPerf Training v1.1 BERT submission
    /// (mlcommons/training_results_v1.1, `Samsung/benchmarks/bert/implementations/pytorch/
    /// run_pretraining.py`: a DDP communication hook clips each bucket to `max_grad_norm/√22`,
    /// 22 being its assumed bucket count; here K is the plan's bucket count).
    Bucket,
}

impl std::fmt::Display for ClipMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ClipMode::None => "none",
            ClipMode::Global => "global",
            ClipMode::LocalGlobal => "local-global",
            ClipMode::Bucket => "bucket",
        })
    }
}

impl std::str::FromStr for ClipMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(ClipMode::None),
            "global" => Ok(ClipMode::Global),
            "local-global" => Ok(ClipMode::LocalGlobal),
            "bucket" => Ok(ClipMode::Bucket),
            other => Err(format!(
                "unknown clip mode {other:?} (expected none, global, local-global or bucket)"
            )),
        }
    }
}

/// The clip coefficient `min(1, max_norm / (norm + 1e-6))` (Note [Clip coefficient]); 1 when
/// `max_norm` is 0.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

/// [`clip_coefficient`] on the device, from a squared norm: `[1]` in, `[1]` out, no host
/// read (`ember_backend_ext::clip_coefficient`, what `BucketOps::clip_multi_tensor`'s kernels
/// compute in one launch with the buckets' scaling).
pub fn clip_coefficient_device<B: Backend>(sq_norm: Tensor<B, 1>, max_norm: f64) -> Tensor<B, 1> {
    if max_norm > 0.0 {
        ember_backend_ext::clip_coefficient(sq_norm, max_norm as f32)
    } else {
        sq_norm.zeros_like().add_scalar(1.0)
    }
}

/// The cap each bucket is clipped to in [`ClipMode::Bucket`]: `max_norm / sqrt(K)` for K
/// buckets, so that K buckets at their cap have a whole norm of `max_norm`.
pub fn bucket_clip_cap(max_norm: f64, buckets: usize) -> f64 {
    max_norm / (buckets.max(1) as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn the_device_coefficient_equals_the_host_one() {
        let device = Default::default();
        for (norm, max_norm) in [(3.0, 1.0), (0.5, 1.0), (1.0, 1.0), (2.0, 0.0), (0.0, 1.0)] {
            let sq = Tensor::<NdArray, 1>::from_data(TensorData::from([norm * norm]), &device);
            let device_value: f32 = clip_coefficient_device(sq, f64::from(max_norm)).into_scalar();
            let host = clip_coefficient(f64::from(norm), f64::from(max_norm));
            assert!(
                (f64::from(device_value) - host).abs() < 1e-6,
                "{norm}, {max_norm}: {device_value} vs {host}"
            );
        }
        assert!((clip_coefficient(3.0, 1.0) - 1.0 / (3.0 + 1e-6)).abs() < 1e-12);
        assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
        assert_eq!(clip_coefficient(9.0, 0.0), 1.0);
        assert!((bucket_clip_cap(1.0, 4) - 0.5).abs() < 1e-12);
    }
}
