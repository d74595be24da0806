//! The types of the multi-tensor Adam-family steps
//! ([`FusedOps::adam_multi_tensor`](crate::FusedOps::adam_multi_tensor),
//! [`FusedOps::lamb_apply_multi_tensor`](crate::FusedOps::lamb_apply_multi_tensor)):
//! hyper-parameters, which step, and one tensor's inputs and outputs.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// Hyper-parameters of one Adam-family step (Kingma & Ba 2015; Loshchilov & Hutter 2019;
/// You et al. 2020), PyTorch's names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// Learning rate of this step.
    pub lr: f64,
    pub beta_1: f64,
    pub beta_2: f64,
    /// Added to `sqrt(v̂)`.
    pub epsilon: f64,
    /// Decoupled weight decay λ.
    pub weight_decay: f64,
    /// Step number t, from 1 (bias corrections `1 − βᵗ`).
    pub step: u32,
}

impl AdamHyper {
    pub(crate) fn corrections(&self) -> (f64, f64) {
        (
            1.0 - self.beta_1.powi(self.step as i32),
            1.0 - self.beta_2.powi(self.step as i32),
        )
    }
}

/// Which Adam-family step [`FusedOps::adam_multi_tensor`](crate::FusedOps::adam_multi_tensor)
/// takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdamKind {
    /// Burn's `AdamW` (PyTorch's formula): the new parameter
    /// `w·(1 − lr·λ) − lr · m̂ / (sqrt(v̂) + ε)`.
    AdamW,
    /// The first half of a LAMB step (You et al. 2020, Algorithm 2; MLPerf's reference): the
    /// update `u = m̂ / (sqrt(v̂) + ε) + λ·w`; [`FusedOps::lamb_apply_multi_tensor`](crate::FusedOps::lamb_apply_multi_tensor)
    /// applies it.
    LambUpdate,
}

/// One tensor of a multi-tensor Adam-family step, all flat `[n]` (`n ≥ 1`).
#[derive(Debug, Clone)]
pub struct AdamTensors<B: Backend> {
    pub param: FloatTensor<B>,
    pub grad: FloatTensor<B>,
    pub moment_1: FloatTensor<B>,
    pub moment_2: FloatTensor<B>,
}

/// What an Adam-family step returns for one tensor, all flat `[n]`: the new parameter (for
/// [`AdamKind::LambUpdate`]: the update direction) and both moments.
#[derive(Debug, Clone)]
pub struct AdamOutput<B: Backend> {
    pub param: FloatTensor<B>,
    pub moment_1: FloatTensor<B>,
    pub moment_2: FloatTensor<B>,
}
