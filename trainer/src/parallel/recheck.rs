//! Note [Re-checking late gradients]: the start-up probe ([`super::ready_order`]) decides once
//! which gradients a hook may hand over during backward (Note [Late gradients] in
//! `hooks.rs`). If that stops being true later (a parameter used a second time after its
//! hook, a graph that changed with the kernels or a cast), a hook hands over a partial
//! gradient, its bucket is reduced, and the rest of the gradient is silently dropped. Missing
//! and duplicate deliveries are caught every step by the reducer's bookkeeping (no device
//! work); a *changed* gradient needs its values: every `parallel.check_gradients_every`
//! steps the trainer records what the hooks delivered ([`DeliveryCheck::wrap`]), after each
//! micro-batch's backward starts comparing each with the parameter's final gradient on the
//! device ([`DeliveryCheck::compare`]: one fused squared-norm launch over the differences),
//! and reads the results after the step's wait for its buckets, before the optimizer
//! ([`PendingCheck::result`]: one read of a `[n]` vector; backward itself still never waits
//! for the device). A difference that is not exactly 0 stops the step with an error naming
//! the parameter
//! (a delivered gradient that nothing touched afterwards is the same tensor: the difference is
//! exactly 0).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};
use ember_backend_ext::FusedOps;

use super::hooks::{GradCallback, HookGradients};

/// What the hooks delivered during one backward, for [`DeliveryCheck::verify`].
pub struct DeliveryCheck<B: FusedOps> {
    delivered: Arc<Mutex<HookGradients<B>>>,
}

impl<B: FusedOps> Default for DeliveryCheck<B> {
    fn default() -> Self {
        Self {
            delivered: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl<B: FusedOps> DeliveryCheck<B> {
    /// `callback`, also recording every `(parameter, gradient)` it is handed (the tensors, not
    /// their values: nothing is read).
    pub fn wrap(&self, callback: GradCallback<B>) -> GradCallback<B> {
        let delivered = self.delivered.clone();
        GradCallback(Arc::new(move |group, grads: HookGradients<B>| {
            delivered
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(grads.iter().map(|(id, g)| (*id, g.clone())));
            (callback.0)(group, grads)
        }))
    }

    /// Starts comparing every recorded gradient of a parameter in `finals` (each parameter's
    /// gradient when backward returned) with its final value, on the device: one fused
    /// squared-norm launch over the differences, nothing read yet ([`PendingCheck::result`]
    /// reads). Recorded ids without a final gradient (the decoder's share of a split tied
    /// embedding) are not compared. Clears the record.
    pub fn compare(&self, finals: &HashMap<ParamId, FloatTensor<B>>) -> PendingCheck<B> {
        let delivered =
            std::mem::take(&mut *self.delivered.lock().unwrap_or_else(|e| e.into_inner()));
        let (ids, diffs): (Vec<ParamId>, Vec<FloatTensor<B>>) = delivered
            .into_iter()
            .filter_map(|(id, g)| {
                let last = finals.get(&id)?.clone();
                let n = g.shape().num_elements();
                let diff = B::float_sub(
                    B::float_reshape(last, [n].into()),
                    B::float_reshape(g, [n].into()),
                );
                Some((id, diff))
            })
            .unzip();
        let sums = (!diffs.is_empty()).then(|| {
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::sum_squares_multi_tensor(
                diffs,
            )))
        });
        PendingCheck { ids, sums }
    }

    /// [`DeliveryCheck::compare`], then [`PendingCheck::result`].
    ///
    /// # Errors
    /// As [`PendingCheck::result`].
    pub fn verify(
        &self,
        finals: &HashMap<ParamId, FloatTensor<B>>,
        name: impl Fn(ParamId) -> String,
    ) -> Result<(), String> {
        self.compare(finals).result(name)
    }
}

/// A comparison started by [`DeliveryCheck::compare`]: the squared size of each change, on the
/// device.
pub struct PendingCheck<B: FusedOps> {
    ids: Vec<ParamId>,
    sums: Option<Tensor<B, 1>>,
}

impl<B: FusedOps> PendingCheck<B> {
    /// Reads the comparison (one read of a `[n]` vector; none when nothing was compared).
    ///
    /// # Errors
    /// The names (from `name`) of the parameters whose gradient changed after a hook handed
    /// it over, with the size of the change, comma-separated; or why the comparison could not
    /// be read (a check that cannot check fails).
    pub fn result(self, name: impl Fn(ParamId) -> String) -> Result<(), String> {
        let Some(sums) = self.sums else {
            return Ok(());
        };
        let values = sums
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| format!("the re-check's result could not be read: {e:?}"))?;
        if values.len() != self.ids.len() {
            return Err(format!(
                "the re-check compared {} gradients but read {} results",
                self.ids.len(),
                values.len()
            ));
        }
        let changed: Vec<String> = self
            .ids
            .iter()
            .zip(&values)
            .filter(|(_, sq)| **sq != 0.0)
            .map(|(id, sq)| format!("{} (changed by {:.3e})", name(*id), sq.sqrt()))
            .collect();
        if changed.is_empty() {
            Ok(())
        } else {
            Err(changed.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::module::Param;

    use super::*;
    use crate::parallel::GradHookBackend;

    type A = Autodiff<NdArray>;
    type I = NdArray;

    /// A test model that uses its weight twice, the second use after the hook that hands the
    /// weight's gradient over: `y = hook(x · w) · w`. In backward the outer use's contribution
    /// exists when the hook fires; the inner one arrives after it, and the check names the
    /// weight. Used once behind the hook, `y = hook(x) · w`, the hook hands over the final
    /// gradient and the check passes.
    #[test]
    fn a_gradient_that_changes_after_its_hook_is_named() {
        let device = Default::default();
        for used_twice in [true, false] {
            let w = Param::from_tensor(Tensor::<A, 1>::from_floats([0.5, -2.0, 3.0], &device));
            let x = Tensor::<A, 1>::from_floats([1.0, 2.0, -1.0], &device).require_grad();
            let check = DeliveryCheck::<I>::default();
            let seen = Arc::new(Mutex::new(0usize));
            let counter = seen.clone();
            let callback = check.wrap(GradCallback(Arc::new(move |_, grads: HookGradients<I>| {
                *counter.lock().unwrap() += grads.len();
            })));
            let before = if used_twice { x * w.val() } else { x };
            let hooked = Tensor::<A, 1>::from_primitive(TensorPrimitive::Float(A::grad_hook(
                before.into_primitive().tensor(),
                0,
                vec![(w.id, w.val().into_primitive().tensor())],
                callback,
            )));
            let grads = (hooked * w.val()).sum().backward();
            let last = w.val().grad(&grads).expect("w has a gradient");
            let finals = HashMap::from([(w.id, last.into_primitive().tensor())]);
            let result = check.verify(&finals, |_| "test.weight".to_string());
            assert_eq!(*seen.lock().unwrap(), 1, "the hook delivered w's gradient");
            if used_twice {
                let error = result.expect_err("a changed gradient must be reported");
                assert!(error.starts_with("test.weight (changed by"), "{error}");
            } else {
                assert_eq!(result, Ok(()));
            }
        }
    }
}
