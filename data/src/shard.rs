//! MLPerf BERT's HDF5 shards: read, validate and write.
//!
//! The fixed-length format (MLPerf Training's `create_pretraining_data` output converted to
//! HDF5; `language_model/tensorflow/bert/cleanup_scripts` and NVIDIA's `hdf5_helper`), per
//! shard of N samples, sequence length S and at most P predictions:
//!
//! | field | dtype | shape |
//! |---|---|---|
//! | `input_ids` | i4 | `[N, S]`, 0 after the sample's end |
//! | `input_mask` | i1 | `[N, S]`, 1 for real tokens (a prefix), 0 after |
//! | `segment_ids` | i1 | `[N, S]` |
//! | `masked_lm_positions` | i4 | `[N, P]`, 0-padded (position 0 is `[CLS]`, so 0 ends the list) |
//! | `masked_lm_ids` | i4 | `[N, P]`, 0-padded |
//! | `next_sentence_labels` | i1 | `[N]` |
//!
//! Datasets may be uncompressed or gzip-compressed. Reading also accepts NVIDIA's variants:
//! ids and positions stored as i2, and the variable-length format of NVIDIA's MLPerf
//! submissions (`convert_fixed2variable.py`): `input_ids`, `segment_ids`,
//! `masked_lm_positions`, `masked_lm_ids` as vlen integer arrays of shape `[N]`, no
//! `input_mask`, `next_sentence_labels` `[N]`. Any integer width is read; floats are refused.
//!
//! Every sample is validated on read (ids below the vocabulary size, mask a prefix, positions
//! inside the sample, labels 0/1), and every problem is a [`DataError`] naming the file and the
//! field. Writes go to a temporary file in the same folder, renamed into place when complete.

use std::ops::Range;
use std::path::{Path, PathBuf};

use hdf5::types::{IntSize, TypeDescriptor, VarLenArray};
use hdf5::{Dataset, File, H5Type};

use crate::{DataError, TrainingInstance};

mod write;
pub use write::write_shard;

/// The fields of the fixed-length format, in file order.
pub const FIELDS: [&str; 6] = [
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
];

/// How datasets are stored when writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Contiguous, uncompressed (MLPerf's `hdf5_4320_shards_uncompressed`).
    None,
    /// gzip (deflate) at a level 1..=9, chunked by up to 1024 samples.
    Gzip(u8),
}

/// The on-disk layout of a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[N, S]` padded fields with `input_mask`.
    Fixed,
    /// NVIDIA's vlen fields, no `input_mask`.
    VarLen,
}

/// What a shard holds, read from its metadata (no sample data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// The file.
    pub path: PathBuf,
    /// N, the number of samples.
    pub num_samples: usize,
    /// S of the fixed layout; 0 for vlen shards (no fixed width).
    pub seq_len: usize,
    /// The layout.
    pub layout: Layout,
}

fn shard_error(path: &Path, field: &str, problem: impl Into<String>) -> DataError {
    DataError::Shard {
        path: path.to_path_buf(),
        field: field.to_string(),
        problem: problem.into(),
    }
}

/// Opens `path` as HDF5, with a clear error for a missing, truncated or non-HDF5 file.
fn open(path: &Path) -> Result<File, DataError> {
    if let Err(error) = std::fs::metadata(path) {
        return Err(DataError::Io {
            path: path.to_path_buf(),
            error,
        });
    }
    File::open(path).map_err(|e| DataError::NotHdf5 {
        path: path.to_path_buf(),
        reason: first_line(&e.to_string()),
    })
}

fn first_line(message: &str) -> String {
    message.lines().next().unwrap_or(message).to_string()
}

fn dataset(file: &File, path: &Path, field: &str) -> Result<Dataset, DataError> {
    if !file.link_exists(field) {
        return Err(DataError::MissingField {
            path: path.to_path_buf(),
            field: field.to_string(),
        });
    }
    file.dataset(field)
        .map_err(|e| shard_error(path, field, first_line(&e.to_string())))
}

/// A field's element type: an integer of some width, or a vlen array of integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntType {
    Int(IntSize, bool),
    VarLen(IntSize, bool),
}

fn describe(d: &TypeDescriptor) -> String {
    match d {
        TypeDescriptor::Integer(s) => format!("i{}", *s as usize),
        TypeDescriptor::Unsigned(s) => format!("u{}", *s as usize),
        TypeDescriptor::Float(s) => format!("f{}", *s as usize),
        TypeDescriptor::VarLenArray(inner) => format!("vlen {}", describe(inner)),
        other => format!("{other:?}"),
    }
}

fn int_type(ds: &Dataset, path: &Path, field: &str) -> Result<IntType, DataError> {
    let descriptor = ds
        .dtype()
        .and_then(|t| t.to_descriptor())
        .map_err(|e| shard_error(path, field, first_line(&e.to_string())))?;
    let wrong = || DataError::WrongDtype {
        path: path.to_path_buf(),
        field: field.to_string(),
        found: describe(&descriptor),
    };
    match &descriptor {
        TypeDescriptor::Integer(s) => Ok(IntType::Int(*s, true)),
        TypeDescriptor::Unsigned(s) => Ok(IntType::Int(*s, false)),
        TypeDescriptor::VarLenArray(inner) => match **inner {
            TypeDescriptor::Integer(s) => Ok(IntType::VarLen(s, true)),
            TypeDescriptor::Unsigned(s) => Ok(IntType::VarLen(s, false)),
            _ => Err(wrong()),
        },
        _ => Err(wrong()),
    }
}

/// A field read as i64 values: `[N·W]` for fixed fields, one row per sample for vlen fields.
enum Values {
    Fixed { data: Vec<i64>, width: usize },
    Rows(Vec<Vec<i64>>),
}

/// Rows `range` of a fixed field (all of it in one read when the range is every row).
fn read_fixed<T: H5Type + Copy + Into<i64>>(
    ds: &Dataset,
    range: &Range<usize>,
) -> hdf5::Result<Vec<i64>> {
    read_fixed_with::<T>(ds, range, Into::into)
}

fn read_fixed_with<T: H5Type + Copy>(
    ds: &Dataset,
    range: &Range<usize>,
    to_i64: impl Fn(T) -> i64,
) -> hdf5::Result<Vec<i64>> {
    if range.start == 0 && range.end == ds.shape()[0] {
        return Ok(ds.read_raw::<T>()?.into_iter().map(to_i64).collect());
    }
    Ok(match ds.ndim() {
        1 => ds
            .read_slice_1d::<T, _>(range.clone())?
            .iter()
            .map(|&v| to_i64(v))
            .collect(),
        _ => ds
            .read_slice_2d::<T, _>((range.clone(), ..))?
            .iter()
            .map(|&v| to_i64(v))
            .collect(),
    })
}

/// Rows `range` of a vlen field.
fn read_rows<T: H5Type + Copy + Into<i64>>(
    ds: &Dataset,
    range: &Range<usize>,
) -> hdf5::Result<Vec<Vec<i64>>> {
    let rows = ds.read_slice_1d::<VarLenArray<T>, _>(range.clone())?;
    Ok(rows
        .iter()
        .map(|row| row.as_slice().iter().map(|&v| v.into()).collect())
        .collect())
}

/// Reads rows `range` of `field`, checking it is an integer field of `rows` rows
/// (`expect_width`: `Some(w)` for a fixed `[N, w]` field, `Some(0)` for `[N]`, `None` for
/// vlen).
fn read_field(
    file: &File,
    path: &Path,
    field: &str,
    rows: usize,
    expect_width: Option<usize>,
    range: &Range<usize>,
) -> Result<Values, DataError> {
    let ds = dataset(file, path, field)?;
    let ty = int_type(&ds, path, field)?;
    let shape = ds.shape();
    let bad_shape = |expected: String| DataError::ShapeMismatch {
        path: path.to_path_buf(),
        field: field.to_string(),
        shape: shape.clone(),
        expected,
    };
    let io = |e: hdf5::Error| shard_error(path, field, first_line(&e.to_string()));
    match (ty, expect_width) {
        (IntType::Int(size, signed), Some(width)) => {
            let ok = match (width, shape.as_slice()) {
                (0, [n]) | (0, [n, 1]) => *n == rows,
                (w, [n, s]) => *n == rows && *s == w,
                _ => false,
            };
            if !ok {
                let expected = if width == 0 {
                    format!("[{rows}]")
                } else {
                    format!("[{rows}, {width}]")
                };
                return Err(bad_shape(expected));
            }
            let data = match (size, signed) {
                (IntSize::U1, true) => read_fixed::<i8>(&ds, range),
                (IntSize::U2, true) => read_fixed::<i16>(&ds, range),
                (IntSize::U4, true) => read_fixed::<i32>(&ds, range),
                (IntSize::U8, true) => read_fixed::<i64>(&ds, range),
                (IntSize::U1, false) => read_fixed::<u8>(&ds, range),
                (IntSize::U2, false) => read_fixed::<u16>(&ds, range),
                (IntSize::U4, false) => read_fixed::<u32>(&ds, range),
                (IntSize::U8, false) => {
                    read_fixed_with::<u64>(&ds, range, |x| x.min(i64::MAX as u64) as i64)
                }
            }
            .map_err(io)?;
            Ok(Values::Fixed {
                data,
                width: width.max(1),
            })
        }
        (IntType::VarLen(size, signed), None) => {
            if shape != [rows] {
                return Err(bad_shape(format!("[{rows}] (vlen)")));
            }
            let data = match (size, signed) {
                (IntSize::U1, true) => read_rows::<i8>(&ds, range),
                (IntSize::U2, true) => read_rows::<i16>(&ds, range),
                (IntSize::U4, true) => read_rows::<i32>(&ds, range),
                (IntSize::U8, true) => read_rows::<i64>(&ds, range),
                (IntSize::U1, false) => read_rows::<u8>(&ds, range),
                (IntSize::U2, false) => read_rows::<u16>(&ds, range),
                (IntSize::U4, false) => read_rows::<u32>(&ds, range),
                (IntSize::U8, false) => Err(hdf5::Error::from("vlen u8 is not supported")),
            }
            .map_err(io)?;
            Ok(Values::Rows(data))
        }
        (IntType::VarLen(..), Some(_)) => Err(DataError::WrongDtype {
            path: path.to_path_buf(),
            field: field.to_string(),
            found: "a vlen array where the fixed layout has a fixed-width integer".into(),
        }),
        (IntType::Int(..), None) => Err(DataError::WrongDtype {
            path: path.to_path_buf(),
            field: field.to_string(),
            found: "a fixed-width integer where the vlen layout has a vlen array".into(),
        }),
    }
}

impl Values {
    fn row(&self, i: usize) -> &[i64] {
        match self {
            Values::Fixed { data, width } => &data[i * width..(i + 1) * width],
            Values::Rows(rows) => &rows[i],
        }
    }
}

/// The real length of a mask row: the number of leading 1s, if only 0s follow.
fn mask_length(mask: &[i64]) -> Option<usize> {
    let len = mask.iter().take_while(|&&m| m == 1).count();
    mask[len..].iter().all(|&m| m == 0).then_some(len)
}

/// Reads a shard's metadata: layout, N and S, checking `input_ids` is there and is integer.
///
/// # Errors
/// [`DataError::Io`] (missing file), [`DataError::NotHdf5`] (truncated or not HDF5),
/// [`DataError::MissingField`], [`DataError::WrongDtype`], [`DataError::ShapeMismatch`],
/// [`DataError::EmptyShard`] (zero samples).
pub fn shard_info(path: &Path) -> Result<ShardInfo, DataError> {
    let file = open(path)?;
    info_of(&file, path)
}

fn info_of(file: &File, path: &Path) -> Result<ShardInfo, DataError> {
    let ds = dataset(file, path, "input_ids")?;
    let ty = int_type(&ds, path, "input_ids")?;
    let shape = ds.shape();
    let (layout, num_samples, seq_len) = match (ty, shape.as_slice()) {
        (IntType::Int(..), [n, s]) if *s > 0 => (Layout::Fixed, *n, *s),
        (IntType::VarLen(..), [n]) => (Layout::VarLen, *n, 0),
        _ => {
            return Err(DataError::ShapeMismatch {
                path: path.to_path_buf(),
                field: "input_ids".into(),
                shape,
                expected: "[N, S] (or [N] of vlen arrays)".into(),
            });
        }
    };
    if num_samples == 0 {
        return Err(DataError::EmptyShard {
            path: path.to_path_buf(),
        });
    }
    Ok(ShardInfo {
        path: path.to_path_buf(),
        num_samples,
        seq_len,
        layout,
    })
}

/// Reads and validates every sample of a shard.
///
/// `vocab_size`: every id of `input_ids` and `masked_lm_ids` must be below it.
///
/// # Errors
/// Those of [`shard_info`], and for any field: [`DataError::MissingField`],
/// [`DataError::WrongDtype`] (not an integer, e.g. float ids), [`DataError::ShapeMismatch`]
/// (shapes that disagree between fields), [`DataError::IdOutOfRange`], and
/// [`DataError::Shard`] for inconsistent contents (mask not a prefix, a masked position outside
/// the sample, a label other than 0/1), each naming the file, field and sample.
pub fn read_shard(path: &Path, vocab_size: usize) -> Result<Vec<TrainingInstance>, DataError> {
    let file = open(path)?;
    let info = info_of(&file, path)?;
    read_samples(&file, &info, vocab_size, 0..info.num_samples)
}

/// An open shard, for reading ranges of its samples ([`OpenShard::read`]): what the streaming
/// reader keeps open between reads.
pub struct OpenShard {
    file: File,
    /// The shard's metadata.
    pub info: ShardInfo,
}

impl OpenShard {
    /// Opens `path` and reads its metadata.
    ///
    /// # Errors
    /// As [`shard_info`].
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let file = open(path)?;
        let info = info_of(&file, path)?;
        Ok(Self { file, info })
    }

    /// The real lengths of samples `range`: their `input_mask` rows (the vlen layout: their
    /// `input_ids` rows), without the rest of the samples.
    ///
    /// # Errors
    /// As [`read_lengths`]; [`DataError::Shard`] for a range past the shard's end.
    pub fn lengths(&self, range: Range<usize>) -> Result<Vec<u16>, DataError> {
        let (path, n) = (self.info.path.as_path(), self.info.num_samples);
        if range.end > n || range.start > range.end {
            return Err(shard_error(
                path,
                "input_mask",
                format!(
                    "samples {}..{} asked of a shard of {n}",
                    range.start, range.end
                ),
            ));
        }
        let to_len = |l: usize| u16::try_from(l).unwrap_or(u16::MAX);
        match self.info.layout {
            Layout::Fixed => {
                let mask = read_field(
                    &self.file,
                    path,
                    "input_mask",
                    n,
                    Some(self.info.seq_len),
                    &range,
                )?;
                (0..range.len())
                    .map(|i| {
                        mask_length(mask.row(i)).map(to_len).ok_or_else(|| {
                            shard_error(
                                path,
                                "input_mask",
                                format!("sample {}: is not 1s followed by 0s", range.start + i),
                            )
                        })
                    })
                    .collect()
            }
            Layout::VarLen => {
                let ids = read_field(&self.file, path, "input_ids", n, None, &range)?;
                Ok((0..range.len()).map(|i| to_len(ids.row(i).len())).collect())
            }
        }
    }

    /// Reads and validates samples `range` (as [`read_shard`] validates every sample; errors
    /// name the sample by its index in the shard).
    ///
    /// # Errors
    /// As [`read_shard`]; [`DataError::Shard`] for a range past the shard's end.
    pub fn read(
        &self,
        vocab_size: usize,
        range: Range<usize>,
    ) -> Result<Vec<TrainingInstance>, DataError> {
        if range.end > self.info.num_samples || range.start > range.end {
            return Err(shard_error(
                &self.info.path,
                "input_ids",
                format!(
                    "samples {}..{} asked of a shard of {}",
                    range.start, range.end, self.info.num_samples
                ),
            ));
        }
        read_samples(&self.file, &self.info, vocab_size, range)
    }
}

fn read_samples(
    file: &File,
    info: &ShardInfo,
    vocab_size: usize,
    range: Range<usize>,
) -> Result<Vec<TrainingInstance>, DataError> {
    let path = info.path.as_path();
    let n = info.num_samples;
    let (width, vlen) = match info.layout {
        Layout::Fixed => (Some(info.seq_len), false),
        Layout::VarLen => (None, true),
    };
    let r = &range;
    let input_ids = read_field(file, path, "input_ids", n, width, r)?;
    let input_mask = if vlen {
        None
    } else {
        Some(read_field(file, path, "input_mask", n, width, r)?)
    };
    let segment_ids = read_field(file, path, "segment_ids", n, width, r)?;
    let predictions = if vlen {
        None
    } else {
        let ds = dataset(file, path, "masked_lm_positions")?;
        match ds.shape().as_slice() {
            [_, p] if *p > 0 => Some(*p),
            shape => {
                return Err(DataError::ShapeMismatch {
                    path: path.to_path_buf(),
                    field: "masked_lm_positions".into(),
                    shape: shape.to_vec(),
                    expected: format!("[{n}, P] with P ≥ 1"),
                });
            }
        }
    };
    let positions = read_field(file, path, "masked_lm_positions", n, predictions, r)?;
    let masked_ids = read_field(file, path, "masked_lm_ids", n, predictions, r)?;
    let labels = read_field(file, path, "next_sentence_labels", n, Some(0), r)?;

    // Errors name the sample by its index in the shard; rows are indexed from the range.
    let first = range.start;
    let content = |field: &str, row: usize, what: String| {
        shard_error(path, field, format!("sample {}: {what}", first + row))
    };
    let check_id = |field: &str, sample: usize, id: i64| {
        if id < 0 || id as u64 >= vocab_size as u64 {
            Err(DataError::IdOutOfRange {
                path: path.to_path_buf(),
                field: field.to_string(),
                sample: first + sample,
                id,
                vocab_size,
            })
        } else {
            Ok(id as u32)
        }
    };

    let mut instances = Vec::with_capacity(range.len());
    for i in 0..range.len() {
        let ids_row = input_ids.row(i);
        let len = match &input_mask {
            Some(mask) => mask_length(mask.row(i))
                .ok_or_else(|| content("input_mask", i, "is not 1s followed by 0s".into()))?,
            None => ids_row.len(),
        };
        if len == 0 {
            return Err(content("input_mask", i, "has no real token".into()));
        }
        let input: Vec<u32> = ids_row[..len]
            .iter()
            .map(|&id| check_id("input_ids", i, id))
            .collect::<Result<_, _>>()?;
        let segments = segment_ids.row(i);
        if segments.len() < len {
            return Err(content(
                "segment_ids",
                i,
                format!("has {} entries for {len} tokens", segments.len()),
            ));
        }
        let segment_ids: Vec<u8> = segments[..len]
            .iter()
            .map(|&s| match s {
                0 | 1 => Ok(s as u8),
                other => Err(content("segment_ids", i, format!("holds {other}, not 0/1"))),
            })
            .collect::<Result<_, _>>()?;
        let (pos_row, id_row) = (positions.row(i), masked_ids.row(i));
        let count = if vlen {
            pos_row.len()
        } else {
            pos_row.iter().take_while(|&&p| p != 0).count()
        };
        if id_row.len() < count {
            return Err(content(
                "masked_lm_ids",
                i,
                format!("has {} entries for {count} positions", id_row.len()),
            ));
        }
        let mut masked_lm_positions = Vec::with_capacity(count);
        let mut masked_lm_ids = Vec::with_capacity(count);
        for (&p, &id) in pos_row[..count].iter().zip(&id_row[..count]) {
            if p <= 0 || p as usize >= len {
                return Err(content(
                    "masked_lm_positions",
                    i,
                    format!("position {p} is outside the sample's tokens 1..{len}"),
                ));
            }
            masked_lm_positions.push(p as u32);
            masked_lm_ids.push(check_id("masked_lm_ids", i, id)?);
        }
        let label = labels.row(i)[0];
        if !(0..=1).contains(&label) {
            return Err(content(
                "next_sentence_labels",
                i,
                format!("holds {label}, not 0/1"),
            ));
        }
        instances.push(TrainingInstance {
            input_ids: input,
            segment_ids,
            masked_lm_positions,
            masked_lm_ids,
            next_sentence_label: label as u8,
        });
    }
    Ok(instances)
}

/// The real length (sum of `input_mask`, or the vlen row length) of every sample, reading only
/// what that needs.
///
/// # Errors
/// As [`shard_info`], and a missing or malformed `input_mask`.
pub fn read_lengths(path: &Path) -> Result<Vec<u16>, DataError> {
    let file = open(path)?;
    let info = info_of(&file, path)?;
    let to_len = |l: usize| u16::try_from(l).unwrap_or(u16::MAX);
    match info.layout {
        Layout::Fixed => {
            let mask = read_field(
                &file,
                path,
                "input_mask",
                info.num_samples,
                Some(info.seq_len),
                &(0..info.num_samples),
            )?;
            (0..info.num_samples)
                .map(|i| {
                    mask_length(mask.row(i)).map(to_len).ok_or_else(|| {
                        shard_error(
                            path,
                            "input_mask",
                            format!("sample {i}: is not 1s followed by 0s"),
                        )
                    })
                })
                .collect()
        }
        Layout::VarLen => {
            let ids = read_field(
                &file,
                path,
                "input_ids",
                info.num_samples,
                None,
                &(0..info.num_samples),
            )?;
            Ok((0..info.num_samples)
                .map(|i| to_len(ids.row(i).len()))
                .collect())
        }
    }
}

/// The `*.hdf5` / `*.h5` files of a folder, in name order (or `path` itself if it is a file).
///
/// # Errors
/// [`DataError::Io`] if the folder cannot be read; [`DataError::NoShards`] if it holds none.
pub fn list_shards(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path).map_err(|error| DataError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension().is_some_and(|e| e == "hdf5" || e == "h5")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::NoShards {
            path: path.to_path_buf(),
        });
    }
    Ok(files)
}

/// Refuses an output folder that already holds shards (or length-bin folders): new shards
/// beside old ones would be read as one dataset.
///
/// # Errors
/// [`DataError::InvalidSetting`] naming the folder.
pub fn ensure_no_shards(out: &Path) -> Result<(), DataError> {
    let Ok(entries) = std::fs::read_dir(out) else {
        return Ok(());
    };
    let taken = entries.filter_map(|e| e.ok()).find(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name.ends_with(".hdf5") || name.ends_with(".h5") || name.starts_with("len_")
    });
    match taken {
        Some(entry) => Err(DataError::InvalidSetting {
            field: "out",
            reason: format!(
                "{} already holds {} (shards of an earlier run would be read together with the new ones); choose an empty folder or remove them",
                out.display(),
                entry.file_name().to_string_lossy()
            ),
        }),
        None => Ok(()),
    }
}
