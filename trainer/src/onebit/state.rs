//! A 1-bit optimizer's state in checkpoints. The moments (identical on every rank: the
//! momentum is the compressed average, the variance frozen) go into `optimizer.safetensors`
//! with the exact optimizers' ([`OnebitOptimizer::state`]); what only this optimizer has goes
//! into each rank's `rank-NNNNN.onebit.safetensors` ([`OnebitOptimizer::rank_state`]): the
//! error feedback (different on every rank), and for 1-bit LAMB the fresh variance, the
//! scaling coefficients, the averaged trust ratios and the last factors (the same on every
//! rank; written by each so that a rank reads one file). DeepSpeed resets the error feedback
//! at a resume; ember keeps it, so a resumed run continues bit for bit.

use std::collections::{BTreeMap, HashMap};

use burn::module::AutodiffModule;
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;
use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};

use super::optimizer::{OnebitKind, OnebitOptimizer, compressed_param};
use crate::grads::named_params;
use crate::optim::OptimizerState;

/// The file name of a rank's 1-bit state in a checkpoint folder.
pub fn onebit_rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.onebit.safetensors")
}

/// The scalars of a rank file (its safetensors metadata, key `onebit`).
#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Header {
    kind: String,
    steps: u64,
    world_size: usize,
    rank: usize,
    compressing: bool,
    /// 1-bit LAMB: per parameter path, (scaling_coeff, coeff_freeze, last_factor).
    lamb: BTreeMap<String, (f32, f32, f32)>,
}

fn kind_name(kind: OnebitKind) -> &'static str {
    match kind {
        OnebitKind::Adam => "onebit-adam",
        OnebitKind::Lamb => "onebit-lamb",
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl<M: AutodiffModule<B>, B: AutodiffBackend<InnerBackend: FusedOps>> OnebitOptimizer<M, B> {
    /// Replaces the state with `state` (moments by path, from [`OnebitOptimizer::state`]):
    /// before the freeze step the exact optimizer's; at or past it the compression stage's,
    /// whose error feedback and LAMB terms [`OnebitOptimizer::load_rank_state`] then restores.
    ///
    /// # Errors
    /// A message naming the parameter whose saved moments do not fit `module`.
    pub fn load_state(&mut self, module: &M, state: &mut OptimizerState) -> Result<(), String> {
        let time = state.values().map(|p| p.time).max().unwrap_or(0);
        self.steps = time as u64;
        self.coeff_freeze.clear();
        if self.steps < self.freeze_step {
            self.stage = None;
            return self.exact.load_state(module, std::mem::take(state));
        }
        let ids: HashMap<String, _> = named_params::<B, M>(module).into_iter().collect();
        struct Dims(HashMap<burn::module::ParamId, Vec<usize>>);
        impl<B: AutodiffBackend> burn::module::ModuleVisitor<B> for Dims {
            fn visit_float<const D: usize>(
                &mut self,
                param: &burn::module::Param<burn::tensor::Tensor<B, D>>,
            ) {
                self.0.insert(param.id, param.val().dims().to_vec());
            }
        }
        let mut dims = Dims(HashMap::new());
        module.visit(&mut dims);
        let mut params = Vec::new();
        for (path, id) in named_params::<B, M>(module) {
            if let Some(moments) = state.remove(&path) {
                for (which, data) in [("m", &moments.moment_1), ("v", &moments.moment_2)] {
                    if data.shape.as_slice() != dims.0[&id].as_slice() {
                        return Err(format!(
                            "{path}: the saved {which} has shape {:?}, the parameter {:?}",
                            data.shape.as_slice(),
                            dims.0[&id]
                        ));
                    }
                }
                params.push(compressed_param(path.clone(), ids[&path], moments, 0.0));
            }
        }
        self.stage = Some(self.stage_for(params, time, self.freeze_step as usize));
        Ok(())
    }

    /// This rank's 1-bit state as safetensors bytes (see the module docs).
    pub fn rank_state(&self, module: &M) -> Vec<u8> {
        let (world_size, rank) = self
            .comm
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let mut header = Header {
            kind: kind_name(self.kind).into(),
            steps: self.steps,
            world_size,
            rank,
            compressing: self.stage.is_some(),
            lamb: BTreeMap::new(),
        };
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        match &self.stage {
            None => {
                for (path, id) in named_params::<B, M>(module) {
                    if let Some(c) = self.coeff_freeze.get(&id) {
                        let c = c.clone().into_data().convert::<f32>().to_vec::<f32>();
                        let c = c.expect("f32")[0];
                        header.lamb.insert(path, (1.0, c, 1.0));
                    }
                }
            }
            Some(stage) => {
                let errors = stage.allreduce.as_ref().expect("between steps");
                for (s, (w, e)) in errors
                    .worker_errors
                    .iter()
                    .zip(&errors.server_errors)
                    .enumerate()
                {
                    tensors.push((format!("worker_error.{s}"), vec![w.len()], f32_bytes(w)));
                    tensors.push((format!("server_error.{s}"), vec![e.len()], f32_bytes(e)));
                }
                for p in &stage.params {
                    if self.kind == OnebitKind::Lamb {
                        header.lamb.insert(
                            p.path.clone(),
                            (p.scaling_coeff, p.coeff_freeze, p.last_factor),
                        );
                    }
                    if !p.v_fresh.is_empty() {
                        tensors.push((
                            format!("{}.exp_avg_sq_fresh", p.path),
                            vec![p.v_fresh.len()],
                            f32_bytes(&p.v_fresh),
                        ));
                    }
                }
            }
        }
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(name, shape, bytes)| {
                let view = TensorView::new(Dtype::F32, shape.clone(), bytes).expect("sizes match");
                (name.clone(), view)
            })
            .collect();
        let metadata = HashMap::from([(
            "onebit".to_string(),
            serde_json::to_string(&header).expect("a header serialises"),
        )]);
        safetensors::serialize(views, Some(metadata)).expect("safetensors serialises")
    }

    /// Restores this rank's 1-bit state from [`OnebitOptimizer::rank_state`]'s bytes, after
    /// [`OnebitOptimizer::load_state`] of the same checkpoint.
    ///
    /// # Errors
    /// A message saying what does not match: the optimizer, the step, the world size or rank,
    /// or a buffer's size.
    pub fn load_rank_state(&mut self, module: &M, bytes: &[u8]) -> Result<(), String> {
        let (_, metadata) =
            safetensors::SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
        let files = safetensors::SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let header: Header = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get("onebit"))
            .ok_or("no `onebit` header in the metadata")
            .and_then(|h| serde_json::from_str(h).map_err(|_| "a malformed `onebit` header"))
            .map_err(str::to_string)?;
        let (world_size, rank) = self
            .comm
            .as_ref()
            .map_or((1, 0), |c| (c.world_size(), c.rank()));
        let expected = (kind_name(self.kind), self.steps, world_size, rank);
        let found = (
            header.kind.as_str(),
            header.steps,
            header.world_size,
            header.rank,
        );
        if expected != found {
            return Err(format!(
                "holds (optimizer, step, world size, rank) = {found:?}, this run {expected:?}"
            ));
        }
        let read = |name: &str, len: usize| -> Result<Vec<f32>, String> {
            let view = files.tensor(name).map_err(|e| format!("{name}: {e}"))?;
            if view.dtype() != Dtype::F32 || view.shape() != [len] {
                return Err(format!(
                    "{name}: expected f32 [{len}], found {:?} {:?}",
                    view.dtype(),
                    view.shape()
                ));
            }
            Ok(view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect())
        };
        match &mut self.stage {
            None => {
                for (path, id) in named_params::<B, M>(module) {
                    if let Some(&(_, c, _)) = header.lamb.get(&path) {
                        let device = module.devices().into_iter().next().unwrap_or_default();
                        let tensor = burn::tensor::Tensor::from_data([c], &device);
                        self.coeff_freeze.insert(id, tensor);
                    }
                }
            }
            Some(stage) => {
                let errors = stage.allreduce.as_mut().expect("between steps");
                for s in 0..errors.worker_errors.len() {
                    let w = read(&format!("worker_error.{s}"), errors.worker_errors[s].len())?;
                    let e = read(&format!("server_error.{s}"), errors.server_errors[s].len())?;
                    errors.worker_errors[s] = w;
                    errors.server_errors[s] = e;
                }
                for p in &mut stage.params {
                    if self.kind == OnebitKind::Lamb {
                        let &(scaling, coeff, last) = header
                            .lamb
                            .get(&p.path)
                            .ok_or_else(|| format!("no LAMB terms for {}", p.path))?;
                        p.scaling_coeff = scaling;
                        p.coeff_freeze = coeff;
                        p.last_factor = last;
                    }
                    if !p.v_fresh.is_empty() {
                        p.v_fresh = read(&format!("{}.exp_avg_sq_fresh", p.path), p.v.len())?;
                    }
                }
            }
        }
        Ok(())
    }
}
