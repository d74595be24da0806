//! `optimizer.safetensors`: the optimizer's state in a safetensors file. Each stepped parameter
//! `P` (ember path) has the tensors `P.exp_avg` and `P.exp_avg_sq` (PyTorch's names for Adam's
//! moments), f32, in the parameter's shape in ember's layout, and `P.step`, its step count as
//! one i64 (PyTorch's Adam also keeps `step` as a tensor). The header's only metadata is
//! `format = ember-optimizer`, so the same state always gives the same bytes.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use burn::tensor::{DType, TensorData};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::{SafeTensors, serialize_to_file};

use super::manifest::checkpoint_error;
use crate::TrainError;
use crate::optim::{OptimizerState, ParamMoments};

const FORMAT: &str = "ember-optimizer";

/// A tensor to write: name, dtype, shape, bytes.
type Buffer<'a> = (String, Dtype, Vec<usize>, Cow<'a, [u8]>);

/// Writes `state` to `path` through a temporary file and a rename.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the file when it cannot be written.
pub fn write_optimizer_state(path: &Path, state: &OptimizerState) -> Result<(), TrainError> {
    // The moments' bytes are borrowed where they are f32 already (always, from
    // `PreTrainingOptimizer::state`): a copy of BERT-large's 2.7 GB costs seconds.
    let mut buffers: Vec<Buffer<'_>> = Vec::new();
    let metadata = HashMap::from([("format".to_string(), FORMAT.to_string())]);
    for (name, moments) in state {
        for (suffix, data) in [
            ("exp_avg", &moments.moment_1),
            ("exp_avg_sq", &moments.moment_2),
        ] {
            let bytes = if data.dtype == DType::F32 {
                Cow::Borrowed(data.as_bytes())
            } else {
                Cow::Owned(data.clone().convert::<f32>().as_bytes().to_vec())
            };
            buffers.push((
                format!("{name}.{suffix}"),
                Dtype::F32,
                data.shape.as_slice().to_vec(),
                bytes,
            ));
        }
        buffers.push((
            format!("{name}.step"),
            Dtype::I64,
            vec![1],
            Cow::Owned((moments.time as i64).to_le_bytes().to_vec()),
        ));
    }
    let views = buffers
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes).map(|view| (name.clone(), view))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| checkpoint_error(path, e))?;
    let tmp = ember_model::checkpoint::temp_path(path);
    serialize_to_file(views, Some(metadata), &tmp)
        .map_err(|e| checkpoint_error(path, e))
        .and_then(|()| super::sync_and_rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Reads a file of [`write_optimizer_state`].
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the file: unreadable, not safetensors, not an optimizer
/// state, a tensor that is not f32, a moment without its pair or step count.
pub fn read_optimizer_state(path: &Path) -> Result<OptimizerState, TrainError> {
    let bytes = std::fs::read(path).map_err(|e| checkpoint_error(path, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| checkpoint_error(path, e))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    if metadata.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(checkpoint_error(
            path,
            format!("not an ember optimizer state (metadata format is not {FORMAT:?})"),
        ));
    }
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| checkpoint_error(path, e))?;
    let read = |name: &str| -> Result<TensorData, TrainError> {
        let view = tensors
            .tensor(name)
            .map_err(|_| checkpoint_error(path, format!("tensor {name} is missing")))?;
        if view.dtype() != Dtype::F32 {
            return Err(checkpoint_error(
                path,
                format!("tensor {name} is {:?}, not F32", view.dtype()),
            ));
        }
        Ok(TensorData::from_bytes_vec(
            view.data().to_vec(),
            view.shape().to_vec(),
            DType::F32,
        ))
    };
    let mut state = OptimizerState::new();
    for key in tensors.names() {
        let Some(name) = key.strip_suffix(".step") else {
            continue;
        };
        let view = tensors.tensor(key).map_err(|e| checkpoint_error(path, e))?;
        let time = match (view.dtype(), view.data().try_into()) {
            (Dtype::I64, Ok(bytes)) => usize::try_from(i64::from_le_bytes(bytes)).ok(),
            _ => None,
        }
        .ok_or_else(|| checkpoint_error(path, format!("{key} is not one i64 step count")))?;
        state.insert(
            name.to_string(),
            ParamMoments {
                moment_1: read(&format!("{name}.exp_avg"))?,
                moment_2: read(&format!("{name}.exp_avg_sq"))?,
                time,
            },
        );
    }
    let expected = 3 * state.len();
    if tensors.len() != expected {
        return Err(checkpoint_error(
            path,
            format!(
                "{} tensors for {} parameters with a step count (expected {expected})",
                tensors.len(),
                state.len()
            ),
        ));
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optimizer_state_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        let mut state = OptimizerState::new();
        state.insert(
            "bert.pooler.dense.weight".into(),
            ParamMoments {
                moment_1: TensorData::new(vec![1.0f32, -2.5e-8, 3.0, f32::MIN_POSITIVE], [2, 2]),
                moment_2: TensorData::new(vec![0.1f32, 0.2, 0.3, 0.4], [2, 2]),
                time: 17,
            },
        );
        state.insert(
            "cls.predictions.bias".into(),
            ParamMoments {
                moment_1: TensorData::new(vec![7.0f32; 3], [3]),
                moment_2: TensorData::new(vec![1e-12f32; 3], [3]),
                time: 16,
            },
        );
        write_optimizer_state(&path, &state).unwrap();
        let back = read_optimizer_state(&path).unwrap();
        assert_eq!(back.len(), 2);
        for (name, saved) in &state {
            let loaded = &back[name];
            assert_eq!(loaded.time, saved.time);
            assert_eq!(loaded.moment_1, saved.moment_1);
            assert_eq!(loaded.moment_2, saved.moment_2);
        }
        // The same state gives the same bytes (a checkpoint's files can be compared).
        let first = std::fs::read(&path).unwrap();
        write_optimizer_state(&path, &back).unwrap();
        assert!(first == std::fs::read(&path).unwrap());
        // A model file is not an optimizer state.
        std::fs::write(&path, b"not safetensors").unwrap();
        let e = read_optimizer_state(&path).unwrap_err().to_string();
        assert!(e.contains("optimizer.safetensors"), "{e}");
    }
}
