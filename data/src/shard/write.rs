//! Writing a fixed-length MLPerf shard, complete or not at all.

use std::path::Path;

use hdf5::{File, H5Type};

use super::{Compression, first_line, shard_error};
use crate::{DataError, TrainingInstance};

/// Writes `instances` as a fixed-length MLPerf shard: S = `seq_len`, P = `max_predictions`,
/// the dtypes of the table in the module docs, 0-padded. The file appears only when complete
/// (a temporary file in the same folder, then a rename).
///
/// # Errors
/// [`DataError::InvalidSetting`] if there is no instance, or one is longer than `seq_len` or
/// has more than `max_predictions` predictions; [`DataError::Shard`] naming `path` if HDF5
/// fails to write; [`DataError::Io`] if the folder is not writable.
pub fn write_shard(
    path: &Path,
    instances: &[TrainingInstance],
    seq_len: usize,
    max_predictions: usize,
    compression: Compression,
) -> Result<(), DataError> {
    if instances.is_empty() {
        return Err(DataError::InvalidSetting {
            field: "instances",
            reason: format!("{}: a shard needs at least one sample", path.display()),
        });
    }
    if let Some((i, inst)) = instances
        .iter()
        .enumerate()
        .find(|(_, x)| x.len() > seq_len || x.masked_lm_positions.len() > max_predictions)
    {
        return Err(DataError::InvalidSetting {
            field: "instances",
            reason: format!(
                "{}: sample {i} has {} tokens and {} predictions, beyond the shard's {seq_len} and {max_predictions}",
                path.display(),
                inst.len(),
                inst.masked_lm_positions.len()
            ),
        });
    }
    let (n, s, p) = (instances.len(), seq_len, max_predictions.max(1));
    let mut input_ids = vec![0i32; n * s];
    let mut input_mask = vec![0i8; n * s];
    let mut segment_ids = vec![0i8; n * s];
    let mut positions = vec![0i32; n * p];
    let mut masked_ids = vec![0i32; n * p];
    let mut labels = vec![0i8; n];
    for (i, inst) in instances.iter().enumerate() {
        for (k, (&id, &seg)) in inst.input_ids.iter().zip(&inst.segment_ids).enumerate() {
            input_ids[i * s + k] = id as i32;
            input_mask[i * s + k] = 1;
            segment_ids[i * s + k] = seg as i8;
        }
        for (k, (&pos, &id)) in inst
            .masked_lm_positions
            .iter()
            .zip(&inst.masked_lm_ids)
            .enumerate()
        {
            positions[i * p + k] = pos as i32;
            masked_ids[i * p + k] = id as i32;
        }
        labels[i] = inst.next_sentence_label as i8;
    }

    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut builder = tempfile::Builder::new();
    builder.prefix(".ember-shard-").suffix(".tmp");
    // Readable by all, as a plain file would be (tempfile's default is owner-only).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let tmp = builder.tempfile_in(dir).map_err(|error| DataError::Io {
        path: dir.to_path_buf(),
        error,
    })?;
    let write_error =
        |field: &str, e: hdf5::Error| shard_error(path, field, first_line(&e.to_string()));
    {
        let file = File::create(tmp.path()).map_err(|e| write_error("(file)", e))?;
        let chunk_rows = n.min(1024);
        fn put<T: H5Type>(
            file: &File,
            name: &str,
            data: &[T],
            shape: &[usize],
            chunk_rows: usize,
            compression: Compression,
        ) -> hdf5::Result<()> {
            let mut builder = file.new_dataset::<T>().shape(shape.to_vec());
            if let Compression::Gzip(level) = compression {
                let mut chunk = shape.to_vec();
                chunk[0] = chunk_rows;
                builder = builder.chunk(chunk).deflate(level.clamp(1, 9));
            }
            builder.create(name)?.write_raw(data)
        }
        let c = compression;
        put(&file, "input_ids", &input_ids, &[n, s], chunk_rows, c)
            .map_err(|e| write_error("input_ids", e))?;
        put(&file, "input_mask", &input_mask, &[n, s], chunk_rows, c)
            .map_err(|e| write_error("input_mask", e))?;
        put(&file, "segment_ids", &segment_ids, &[n, s], chunk_rows, c)
            .map_err(|e| write_error("segment_ids", e))?;
        put(
            &file,
            "masked_lm_positions",
            &positions,
            &[n, p],
            chunk_rows,
            c,
        )
        .map_err(|e| write_error("masked_lm_positions", e))?;
        put(&file, "masked_lm_ids", &masked_ids, &[n, p], chunk_rows, c)
            .map_err(|e| write_error("masked_lm_ids", e))?;
        put(&file, "next_sentence_labels", &labels, &[n], chunk_rows, c)
            .map_err(|e| write_error("next_sentence_labels", e))?;
        file.close().map_err(|e| write_error("(file)", e))?;
    }
    tmp.persist(path).map_err(|e| DataError::Io {
        path: path.to_path_buf(),
        error: e.error,
    })?;
    Ok(())
}
