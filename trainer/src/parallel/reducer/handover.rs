//! The reducer's hand-over to the optimizer: each parameter's averaged gradient out of the
//! buckets ([`Reducer::gradients`]), and a bucket's values for tests.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;

use super::super::plan::BucketPlan;
use super::super::tied::TiedRows;
use super::Reducer;

impl<B: FusedOps> Reducer<B> {
    /// The averaged (and clipped) gradients of the last [`Reducer::finalize_backward`], as
    /// Burn gradients of `module`'s parameters on `device`: parts of the device buckets (each
    /// bucket taken apart at once, Note [Unflattened by views] in ember-backend-ext), or
    /// uploads of the host ones.
    pub fn gradients<AB: AutodiffBackend<InnerBackend = B>, M: AutodiffModule<AB>>(
        &self,
        module: &M,
        device: &B::Device,
    ) -> GradientsParams {
        struct WriteBack<'a, B: FusedOps> {
            plan: &'a BucketPlan,
            index: &'a HashMap<ParamId, (usize, usize)>,
            /// Each planned parameter's flat gradient, by `(bucket, index in bucket)`.
            parts: HashMap<(usize, usize), Tensor<B, 1>>,
            tied: Option<&'a TiedRows<B>>,
            device: &'a B::Device,
            grads: GradientsParams,
        }
        impl<B: FusedOps> WriteBack<'_, B> {
            fn part<const D: usize>(
                &mut self,
                place: (usize, usize),
                shape: [usize; D],
            ) -> Tensor<B, D> {
                // Without NdArray's copy of the part (`reshape_contiguous`).
                ember_backend_ext::reshape(
                    self.parts
                        .remove(&place)
                        .expect("every planned parameter has its part"),
                    shape,
                )
            }
        }
        impl<AB: AutodiffBackend<InnerBackend = B>, B: FusedOps> ModuleVisitor<AB> for WriteBack<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
                if let Some(tied) = self.tied.filter(|t| t.table == param.id) {
                    // The decoder's share, the rows added (Note [Tied embedding split]).
                    let decoder = self.plan.tied.as_ref().expect("a split plan").decoder;
                    let place = self.index[&decoder];
                    let shape: [usize; D] = param.shape().dims();
                    let decoder = self.part(place, shape);
                    self.grads
                        .register(param.id, tied.gradient(decoder, self.device));
                    return;
                }
                let Some(&(k, i)) = self.index.get(&param.id) else {
                    return;
                };
                let p = &self.plan.buckets[k].params[i];
                let shape: [usize; D] = p.shape.clone().try_into().expect("the plan's shape");
                let gradient = self.part((k, i), shape);
                self.grads.register(param.id, gradient);
            }
        }
        let state = self.lock();
        let mut parts = HashMap::new();
        for (k, bucket) in self.plan.buckets.iter().enumerate() {
            let buffer = state.buffers[k]
                .as_ref()
                .expect("every bucket was averaged");
            let ranges: Vec<_> = bucket
                .params
                .iter()
                .map(|p| p.offset..p.offset + p.numel())
                .collect();
            for (i, part) in buffer.parts(&ranges, device).into_iter().enumerate() {
                parts.insert((k, i), part);
            }
        }
        let mut write = WriteBack::<B> {
            plan: &self.plan,
            index: &self.index,
            parts,
            tied: state.tied.as_ref(),
            device,
            grads: GradientsParams::new(),
        };
        module.visit(&mut write);
        write.grads
    }

    /// The flat buffer of bucket `k` as it stands (after [`Reducer::finalize_backward`]:
    /// averaged), on the host: for tests.
    ///
    /// # Panics
    /// If bucket `k` has no buffer (not complete, or in flight).
    pub fn bucket_values(&self, k: usize) -> Vec<f32> {
        self.lock().buffers[k]
            .as_ref()
            .expect("bucket k holds a buffer")
            .to_vec()
    }
}
