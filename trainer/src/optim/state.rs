//! The optimizer's state out of and back into [`PreTrainingOptimizer`], for checkpoints: each
//! parameter's two moments and step count, keyed by the parameter's ember path, whichever of
//! the three optimizers (Burn's `AdamW`, [`Lamb`], [`MultiTensorOptimizer`]) holds them.
//! Moments keep the parameter's shape in ember's layout (a `Linear` weight is `[in, out]`).

use std::collections::{BTreeMap, HashMap};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWState, AdaptiveMomentumState, Optimizer, SimpleOptimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use ember_backend_ext::FusedOps;
use ember_model::checkpoint::read_unshared;

use super::{GroupedOptimizer, Lamb, LambState, MultiTensorOptimizer, PreTrainingOptimizer};
use crate::grads::named_params;

/// One parameter's optimizer state: Adam's (and LAMB's) moments m and v, in the parameter's
/// shape, and the steps t it has taken.
#[derive(Debug, Clone)]
pub struct ParamMoments {
    /// First moment m (PyTorch's `exp_avg`).
    pub moment_1: TensorData,
    /// Second moment v (PyTorch's `exp_avg_sq`).
    pub moment_2: TensorData,
    /// Steps taken, t.
    pub time: usize,
}

/// A parameter's moments m and v on the device, flat `[n]`, and its step count t.
pub type DeviceMoments<B> = (Tensor<B, 1>, Tensor<B, 1>, usize);

/// The whole optimizer's state, by ember parameter path. A parameter that has never been
/// stepped has no entry.
pub type OptimizerState = BTreeMap<String, ParamMoments>;

/// Moments in and out of a Burn optimizer's per-tensor state (Burn's `AdamW`, [`Lamb`]).
pub trait Moments<B: Backend>: SimpleOptimizer<B> + Clone {
    /// The moments m and v and the step t held in `state`.
    fn moments<const D: usize>(state: Self::State<D>) -> (Tensor<B, D>, Tensor<B, D>, usize);
    /// The state holding moments `m`, `v` and step `t`.
    fn from_moments<const D: usize>(m: Tensor<B, D>, v: Tensor<B, D>, t: usize) -> Self::State<D>;
}

impl<B: Backend> Moments<B> for AdamW {
    fn moments<const D: usize>(state: AdamWState<B, D>) -> (Tensor<B, D>, Tensor<B, D>, usize) {
        let m = state.momentum;
        (m.moment_1, m.moment_2, m.time)
    }
    fn from_moments<const D: usize>(
        m: Tensor<B, D>,
        v: Tensor<B, D>,
        t: usize,
    ) -> AdamWState<B, D> {
        AdamWState::new(AdaptiveMomentumState::new(t, m, v))
    }
}

impl<B: ember_backend_ext::FusedOps> Moments<B> for Lamb {
    fn moments<const D: usize>(state: LambState<B, D>) -> (Tensor<B, D>, Tensor<B, D>, usize) {
        (state.moment_1, state.moment_2, state.time)
    }
    fn from_moments<const D: usize>(m: Tensor<B, D>, v: Tensor<B, D>, t: usize) -> LambState<B, D> {
        LambState {
            moment_1: m,
            moment_2: v,
            time: t,
        }
    }
}

/// Paths of the module's parameters by id.
fn paths<B: Backend, M: burn::module::Module<B>>(module: &M) -> HashMap<ParamId, String> {
    named_params::<B, M>(module)
        .into_iter()
        .map(|(path, id)| (id, path))
        .collect()
}

/// The state of one Burn adaptor, read with the parameters' dimensions from `module`.
fn adaptor_state<O, M, B>(adaptor: &OptimizerAdaptor<O, M, B>, module: &M, out: &mut OptimizerState)
where
    O: Moments<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    struct Read<'a, O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        records: HashMap<ParamId, AdaptorRecord<O, B>>,
        paths: HashMap<ParamId, String>,
        out: &'a mut OptimizerState,
    }
    impl<O: Moments<B::InnerBackend>, B: AutodiffBackend> ModuleVisitor<B> for Read<'_, O, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(record) = self.records.remove(&param.id) {
                let (m, v, time) = O::moments(record.into_state::<D>());
                self.out.insert(
                    self.paths[&param.id].clone(),
                    ParamMoments {
                        moment_1: read_unshared(m),
                        moment_2: read_unshared(v),
                        time,
                    },
                );
            }
        }
    }
    module.visit(&mut Read::<O, B> {
        records: adaptor.to_record().into_iter().collect(),
        paths: paths::<B, M>(module),
        out,
    });
}

/// `adaptor` with the state of its parameters (those in `ids`) taken from `state`.
fn load_adaptor<O, M, B>(
    adaptor: &mut OptimizerAdaptor<O, M, B>,
    module: &M,
    state: &mut OptimizerState,
    ids: &dyn Fn(ParamId) -> bool,
) -> Result<(), String>
where
    O: Moments<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    struct Build<'a, O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
        records: HashMap<ParamId, AdaptorRecord<O, B>>,
        paths: HashMap<ParamId, String>,
        state: &'a mut OptimizerState,
        ids: &'a dyn Fn(ParamId) -> bool,
        error: Option<String>,
    }
    impl<O: Moments<B::InnerBackend>, B: AutodiffBackend> ModuleVisitor<B> for Build<'_, O, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !(self.ids)(param.id) || self.error.is_some() {
                return;
            }
            let path = &self.paths[&param.id];
            let Some(saved) = self.state.remove(path) else {
                return;
            };
            let value = param.val();
            match moments_as::<B::InnerBackend, D>(path, saved, &value.dims(), &value.device()) {
                Ok((m, v, t)) => {
                    self.records.insert(
                        param.id,
                        AdaptorRecord::from_state::<D>(O::from_moments(m, v, t)),
                    );
                }
                Err(e) => self.error = Some(e),
            }
        }
    }
    let mut build = Build::<O, B> {
        records: HashMap::new(),
        paths: paths::<B, M>(module),
        state,
        ids,
        error: None,
    };
    module.visit(&mut build);
    if let Some(e) = build.error {
        return Err(e);
    }
    let fresh = OptimizerAdaptor::from(adaptor.optim().clone());
    *adaptor = std::mem::replace(adaptor, fresh).load_record(build.records.into_iter().collect());
    Ok(())
}

/// A saved parameter's moments as tensors of `dims` on `device`, or an error naming the
/// parameter and both shapes.
fn moments_as<B: Backend, const D: usize>(
    path: &str,
    saved: ParamMoments,
    dims: &[usize],
    device: &B::Device,
) -> Result<(Tensor<B, D>, Tensor<B, D>, usize), String> {
    for data in [&saved.moment_1, &saved.moment_2] {
        if data.shape.as_slice() != dims {
            return Err(format!(
                "{path}: the saved moments have shape {:?}, the parameter {dims:?}",
                data.shape.as_slice()
            ));
        }
    }
    Ok((
        Tensor::from_data(saved.moment_1, device),
        Tensor::from_data(saved.moment_2, device),
        saved.time,
    ))
}

impl<O, M, B> GroupedOptimizer<O, M, B>
where
    O: Moments<B::InnerBackend>,
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    fn state(&self, module: &M) -> OptimizerState {
        let mut out = OptimizerState::new();
        adaptor_state(&self.decay, module, &mut out);
        adaptor_state(&self.no_decay, module, &mut out);
        out
    }

    fn device_moments(&self, module: &M) -> HashMap<ParamId, DeviceMoments<B::InnerBackend>> {
        struct Read<O: SimpleOptimizer<B::InnerBackend>, B: AutodiffBackend> {
            records: HashMap<ParamId, AdaptorRecord<O, B>>,
            out: HashMap<ParamId, DeviceMoments<B::InnerBackend>>,
        }
        impl<O: Moments<B::InnerBackend>, B: AutodiffBackend> ModuleVisitor<B> for Read<O, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(record) = self.records.remove(&param.id) {
                    let (m, v, time) = O::moments(record.into_state::<D>());
                    let n = m.shape().num_elements();
                    self.out
                        .insert(param.id, (m.reshape([n]), v.reshape([n]), time));
                }
            }
        }
        let mut read = Read::<O, B> {
            records: self.decay.to_record().into_iter().collect(),
            out: HashMap::new(),
        };
        read.records.extend(self.no_decay.to_record());
        module.visit(&mut read);
        read.out
    }

    fn load_state(&mut self, module: &M, state: &mut OptimizerState) -> Result<(), String> {
        let no_decay = self.no_decay_ids.clone();
        load_adaptor(&mut self.decay, module, state, &|id| {
            !no_decay.contains(&id)
        })?;
        load_adaptor(&mut self.no_decay, module, state, &|id| {
            no_decay.contains(&id)
        })
    }
}

impl<B: AutodiffBackend<InnerBackend: FusedOps>> MultiTensorOptimizer<B> {
    fn state<M: AutodiffModule<B>>(&self, module: &M) -> OptimizerState {
        let mut out = OptimizerState::new();
        let shapes = shapes::<B, M>(module);
        for (path, id) in named_params::<B, M>(module) {
            if let Some((m, v, time)) = self.state.get(&id) {
                let read = |t: &burn::tensor::ops::FloatTensor<B::InnerBackend>| {
                    read_unshared(Tensor::<B::InnerBackend, 1>::from_primitive(
                        TensorPrimitive::Float(t.clone()),
                    ))
                };
                let (mut m, mut v) = (read(m), read(v));
                m.shape = shapes[&id].clone().into();
                v.shape = shapes[&id].clone().into();
                out.insert(
                    path,
                    ParamMoments {
                        moment_1: m,
                        moment_2: v,
                        time: *time,
                    },
                );
            }
        }
        out
    }

    fn load_state<M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        state: &mut OptimizerState,
    ) -> Result<(), String> {
        let shapes = shapes::<B, M>(module);
        let device = module.devices().into_iter().next().unwrap_or_default();
        let mut loaded = HashMap::new();
        for (path, id) in named_params::<B, M>(module) {
            let Some(saved) = state.remove(&path) else {
                continue;
            };
            let dims = &shapes[&id];
            let n = dims.iter().product::<usize>();
            let (m, v, time) = moments_as::<B::InnerBackend, 1>(
                &path,
                ParamMoments {
                    moment_1: flat(saved.moment_1, dims, &path)?,
                    moment_2: flat(saved.moment_2, dims, &path)?,
                    time: saved.time,
                },
                &[n],
                &device,
            )?;
            loaded.insert(
                id,
                (
                    m.into_primitive().tensor(),
                    v.into_primitive().tensor(),
                    time,
                ),
            );
        }
        self.state = loaded;
        Ok(())
    }
}

/// `data` of shape `dims` flattened to one dimension, or an error naming both shapes.
fn flat(mut data: TensorData, dims: &[usize], path: &str) -> Result<TensorData, String> {
    if data.shape.as_slice() != dims {
        return Err(format!(
            "{path}: the saved moments have shape {:?}, the parameter {dims:?}",
            data.shape.as_slice()
        ));
    }
    data.shape = vec![dims.iter().product::<usize>()].into();
    Ok(data)
}

/// Each parameter's dimensions, by id.
fn shapes<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> HashMap<ParamId, Vec<usize>> {
    struct Shapes(HashMap<ParamId, Vec<usize>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.insert(param.id, param.val().dims().to_vec());
        }
    }
    let mut shapes = Shapes(HashMap::new());
    module.visit(&mut shapes);
    shapes.0
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> PreTrainingOptimizer<M, B> {
    /// The optimizer's state for a checkpoint: each stepped parameter's moments and step
    /// count, by the parameter's path in `module` (the module this optimizer steps).
    pub fn state(&self, module: &M) -> OptimizerState {
        match self {
            Self::AdamW(o) => o.state(module),
            Self::Lamb(o) => o.state(module),
            Self::MultiTensor(o) => o.state::<M>(module),
            Self::Onebit(o) => o.state(module),
        }
    }

    /// Each stepped parameter's moments m and v where they live (flat `[n]` handles on the
    /// device, no copy) and its step count t, by id: 1-bit LAMB reads them in its warm-up to
    /// track the trust ratios (`crate::onebit::optimizer`).
    pub fn device_moments(&self, module: &M) -> HashMap<ParamId, DeviceMoments<B::InnerBackend>> {
        match self {
            Self::AdamW(o) => o.device_moments(module),
            Self::Lamb(o) => o.device_moments(module),
            Self::MultiTensor(o) => o
                .state
                .iter()
                .map(|(id, (m, v, t))| {
                    let wrap = |x: &burn::tensor::ops::FloatTensor<B::InnerBackend>| {
                        Tensor::from_primitive(TensorPrimitive::Float(x.clone()))
                    };
                    (*id, (wrap(m), wrap(v), *t))
                })
                .collect(),
            // The compression stage's moments live on the host (`crate::onebit`).
            Self::Onebit(o) => o.exact.device_moments(module),
        }
    }

    /// Replaces the optimizer's state with `state` (from [`PreTrainingOptimizer::state`] of
    /// the same model and optimizer, possibly in another process).
    ///
    /// # Errors
    /// A message naming the parameter when a saved entry has no parameter in `module` or a
    /// shape that differs from its parameter's.
    pub fn load_state(&mut self, module: &M, mut state: OptimizerState) -> Result<(), String> {
        match self {
            Self::AdamW(o) => o.load_state(module, &mut state)?,
            Self::Lamb(o) => o.load_state(module, &mut state)?,
            Self::MultiTensor(o) => o.load_state::<M>(module, &mut state)?,
            Self::Onebit(o) => o.load_state(module, &mut state)?,
        }
        match state.keys().next() {
            Some(unknown) => Err(format!(
                "the saved optimizer state has {} entr{} for parameters this model lacks, first: {unknown}",
                state.len(),
                if state.len() == 1 { "y" } else { "ies" }
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OptimizerConfig, OptimizerKind};
    use burn::backend::{Autodiff, NdArray};
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;

    type B = Autodiff<NdArray>;

    fn grads(model: &Linear<B>, step: usize) -> GradientsParams {
        let device = Default::default();
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(
                (0..8)
                    .map(|i| ((i * 3 + step * 5) % 7) as f32 - 3.0)
                    .collect(),
                [2, 4],
            ),
            &device,
        );
        let loss = model.forward(x).powf_scalar(2.0).sum();
        GradientsParams::from_grads(loss.backward(), model)
    }

    fn values(model: &Linear<B>) -> Vec<f32> {
        let mut v = model.weight.val().into_data().to_vec::<f32>().unwrap();
        v.extend(
            model
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
        );
        v
    }

    /// Two steps, the state out and into a fresh optimizer, one more step: the same weights,
    /// bit for bit, as three steps of one optimizer; for Burn's AdamW, LAMB and the
    /// multi-tensor optimizer. A state for another shape or parameter is refused by name.
    #[test]
    fn state_out_and_back_in_continues_exactly() {
        let device = Default::default();
        for (name, fused) in [
            (OptimizerKind::AdamW, false),
            (OptimizerKind::Lamb, false),
            (OptimizerKind::AdamW, true),
            (OptimizerKind::Lamb, true),
        ] {
            let config = OptimizerConfig {
                name,
                weight_decay: 0.1,
                ..Default::default()
            };
            // Constant initial weights: no draw from NdArray's process-wide generator, which
            // the other optimizer test of this binary seeds and draws from concurrently.
            let model: Linear<B> = LinearConfig::new(4, 3)
                .with_initializer(burn::nn::Initializer::Constant { value: 0.3 })
                .init(&device);
            let _ = (model.weight.val(), model.bias.as_ref().unwrap().val());
            let mut a = PreTrainingOptimizer::new(&config, &model, fused);
            let mut m = model;
            for step in 0..2 {
                let g = grads(&m, step);
                m = a.step(1e-2, m, g);
            }
            let state = a.state(&m);
            assert_eq!(state.len(), 2, "{name:?}: weight and bias");
            assert_eq!(state["weight"].time, 2);
            assert_eq!(state["weight"].moment_1.shape.as_slice(), &[4, 3]);
            let mut b = PreTrainingOptimizer::new(&config, &m, fused);
            b.load_state(&m, state.clone()).unwrap();
            let (x, y) = (
                a.step(1e-2, m.clone(), grads(&m, 2)),
                b.step(1e-2, m.clone(), grads(&m, 2)),
            );
            assert_eq!(values(&x), values(&y), "{name:?} fused {fused}");
            assert_ne!(values(&x), values(&m), "the step moved the weights");

            let mut wrong = state.clone();
            let bias = wrong.remove("bias").unwrap();
            wrong.insert("cls.extra".into(), bias);
            let e = b.load_state(&m, wrong).unwrap_err();
            assert!(e.contains("cls.extra"), "{e}");
            let mut wrong = state;
            wrong.get_mut("weight").unwrap().moment_1.shape = vec![3, 4].into();
            let e = b.load_state(&m, wrong).unwrap_err();
            assert!(
                e.contains("weight") && e.contains("[3, 4]") && e.contains("[4, 3]"),
                "{e}"
            );
        }
    }
}
