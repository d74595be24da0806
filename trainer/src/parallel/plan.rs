//! The bucket plan: which gradients are reduced together, in which order (PyTorch DDP's
//! `_compute_bucket_assignment_by_size`; Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020, §3.2).
//!
//! Parameters are taken in the order backward makes their gradients final (see
//! [`super::hooks::ready_order`]) and cut into buckets by size: a small first bucket so that the
//! first allreduce starts early, then buckets of `bucket_cap_mb`. Every rank must build the same
//! plan; ranks compare [`BucketPlan::describe`] at start-up.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use super::tied::{DECODER_WEIGHT, WORD_EMBEDDINGS};
use crate::grads::named_params;

/// One parameter's place in a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedParam {
    /// Dotted path (`bert.encoder.layer.1.output.dense.weight`).
    pub name: String,
    /// The parameter.
    pub id: ParamId,
    /// Shape of the parameter (Burn's layout).
    pub shape: Vec<usize>,
    /// Offset of its first element in the bucket's flat buffer.
    pub offset: usize,
}

impl PlannedParam {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A contiguous run of parameters (in reverse model order) reduced as one flat f32 buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Its parameters, in the order they sit in the buffer.
    pub params: Vec<PlannedParam>,
    /// Total elements.
    pub numel: usize,
}

impl Bucket {
    /// Size of the flat f32 buffer in bytes.
    pub fn bytes(&self) -> usize {
        self.numel * 4
    }
}

/// The assignment of parameters to buckets: identical on every rank for the same model and
/// caps (checked at start-up, [`BucketPlan::describe`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    /// Buckets in launch order.
    pub buckets: Vec<Bucket>,
    /// The tied word embedding, when its gradient is split (Note [Tied embedding split]).
    pub tied: Option<TiedSplit>,
}

/// The tied word embedding in a plan that splits its gradient (Note [Tied embedding split]).
#[derive(Debug, Clone, PartialEq)]
pub struct TiedSplit {
    /// The table, `[V, H]`: its gradient (the lookup's share) is reduced by rows, after the
    /// last bucket. In no bucket (`offset` is 0).
    pub table: PlannedParam,
    /// The decoder's share of the gradient: a planned parameter of its own, in the heads'
    /// bucket.
    pub decoder: ParamId,
}

/// Whether the tied word embedding's gradient is split (`parallel.tied_embedding`; Note [Tied
/// embedding split]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TiedEmbedding {
    /// Split with more than one rank (one rank has nothing to reduce).
    #[default]
    Auto,
    /// The decoder's share in the heads' bucket, the lookup's rows after backward.
    Split,
    /// The whole gradient in the last bucket, after backward (PyTorch DDP's behaviour).
    Whole,
}

impl TiedEmbedding {
    /// Whether to split with `world_size` ranks.
    pub fn split(self, world_size: usize) -> bool {
        match self {
            TiedEmbedding::Auto => world_size > 1,
            TiedEmbedding::Split => true,
            TiedEmbedding::Whole => false,
        }
    }
}

impl std::fmt::Display for TiedEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TiedEmbedding::Auto => "auto",
            TiedEmbedding::Split => "split",
            TiedEmbedding::Whole => "whole",
        })
    }
}

impl std::str::FromStr for TiedEmbedding {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TiedEmbedding::Auto),
            "split" => Ok(TiedEmbedding::Split),
            "whole" => Ok(TiedEmbedding::Whole),
            other => Err(format!(
                "unknown tied-embedding mode {other:?} (expected auto, split or whole)"
            )),
        }
    }
}

const MB: f64 = 1024.0 * 1024.0;

impl BucketPlan {
    /// Assigns `params` (`(path, id, shape)`, in the order their gradients become ready:
    /// reverse model order, see [`super::hooks::ready_order`]) to buckets in that order.
    /// A bucket is closed once it holds at least its cap: `first_bucket_mb` for the first,
    /// `bucket_cap_mb` for the others (MiB of f32 gradients; PyTorch DDP's defaults are 1 and
    /// 25). A parameter is never split, so a bucket can exceed its cap by its last parameter.
    pub fn new(
        params: &[(String, ParamId, Vec<usize>)],
        first_bucket_mb: f64,
        bucket_cap_mb: f64,
    ) -> Self {
        let mut buckets = Vec::new();
        let mut current = Bucket {
            params: Vec::new(),
            numel: 0,
        };
        for (name, id, shape) in params {
            let numel: usize = shape.iter().product();
            current.params.push(PlannedParam {
                name: name.clone(),
                id: *id,
                shape: shape.clone(),
                offset: current.numel,
            });
            current.numel += numel;
            let cap = if buckets.is_empty() {
                first_bucket_mb
            } else {
                bucket_cap_mb
            };
            if current.bytes() as f64 >= cap * MB {
                buckets.push(std::mem::replace(
                    &mut current,
                    Bucket {
                        params: Vec::new(),
                        numel: 0,
                    },
                ));
            }
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Self {
            buckets,
            tied: None,
        }
    }

    /// Where the decoder's share of a split tied gradient sits: `(bucket, offset)`.
    pub fn decoder_place(&self) -> Option<(usize, usize)> {
        let decoder = self.tied.as_ref()?.decoder;
        self.buckets.iter().enumerate().find_map(|(k, b)| {
            b.params
                .iter()
                .find(|p| p.id == decoder)
                .map(|p| (k, p.offset))
        })
    }

    /// Buckets a step reduces: the planned ones, and the tied table's rows when split.
    pub fn num_reductions(&self) -> usize {
        self.buckets.len() + usize::from(self.tied.is_some())
    }

    /// One line per parameter, `bucket <k> <name> <shape>`: what ranks compare at start-up
    /// (parameter ids are per-process and left out).
    pub fn describe(&self) -> String {
        let mut text = String::new();
        for (k, bucket) in self.buckets.iter().enumerate() {
            for p in &bucket.params {
                text.push_str(&format!("bucket {k} {} {:?}\n", p.name, p.shape));
            }
        }
        if let Some(tied) = &self.tied {
            text.push_str(&format!(
                "rows of {} {:?} after bucket {}\n",
                tied.table.name,
                tied.table.shape,
                self.buckets.len().saturating_sub(1)
            ));
        }
        text
    }

    /// FNV-1a hash of [`BucketPlan::describe`], for logs.
    pub fn fingerprint(&self) -> u64 {
        self.describe().bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// `"K buckets: a, b, … MiB"` (and `", then the rows of <table>"` when split).
    pub fn summary(&self) -> String {
        let sizes: Vec<String> = self
            .buckets
            .iter()
            .map(|b| format!("{:.2}", b.bytes() as f64 / MB))
            .collect();
        let rows = match &self.tied {
            Some(tied) => format!(", then the batch's rows of {}", tied.table.name),
            None => String::new(),
        };
        format!(
            "{} buckets: {} MiB{rows}",
            self.buckets.len(),
            sizes.join(", ")
        )
    }

    /// `"N parameters, X of Y MiB"`: how much of the planned gradient is final only when
    /// backward returns (`late`, from [`super::hooks::ready_order`]), so that its allreduce
    /// cannot overlap backward (Note [Late gradients]). The tied table's rows, when split, are
    /// not counted: their size depends on the batch.
    pub fn after_backward(&self, late: &[ParamId]) -> String {
        let (count, numel) = self
            .buckets
            .iter()
            .flat_map(|b| &b.params)
            .filter(|p| late.contains(&p.id))
            .fold((0, 0), |(count, numel), p| (count + 1, numel + p.numel()));
        format!(
            "{count} parameters, {:.2} of {:.2} MiB",
            (numel * 4) as f64 / MB,
            (self.numel() * 4) as f64 / MB
        )
    }

    /// Total number of gradient elements.
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }
}

/// The first line where two plan descriptions differ, for the start-up error.
pub fn first_difference(ours: &str, theirs: &str) -> Option<(usize, String, String)> {
    let (mut a, mut b) = (ours.lines(), theirs.lines());
    for line in 1.. {
        match (a.next(), b.next()) {
            (None, None) => return None,
            (x, y) if x == y => {}
            (x, y) => {
                return Some((
                    line,
                    x.unwrap_or("(end of plan)").to_string(),
                    y.unwrap_or("(end of plan)").to_string(),
                ));
            }
        }
    }
    unreachable!()
}

/// The bucket plan of a model: its float parameters in `order` (the order their gradients
/// become ready, [`super::hooks::ready_order`]), bucketed by size as [`BucketPlan::new`].
/// With `decoder`, the tied word embedding's gradient is split (Note [Tied embedding split]):
/// `decoder` (listed in `order` where the decoder op delivers it) is planned as a parameter
/// of the table's shape named `cls.predictions.decoder.weight`, and the table itself is left
/// out of the buckets ([`BucketPlan::tied`]).
///
/// # Panics
/// If `order` lists a parameter `module` does not have, or one twice, or `decoder` is given
/// for a module without the tied table (bugs, not user input).
pub fn bucket_plan<B: Backend, M: Module<B>>(
    module: &M,
    order: &[ParamId],
    decoder: Option<ParamId>,
    first_bucket_mb: f64,
    bucket_cap_mb: f64,
) -> BucketPlan {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.shape().dims::<D>().to_vec());
        }
    }
    let mut shapes = Shapes(Vec::new());
    module.visit(&mut shapes);
    let mut by_id: HashMap<_, (String, Vec<usize>)> = named_params::<B, M>(module)
        .into_iter()
        .zip(shapes.0)
        .map(|((name, id), shape)| (id, (name, shape)))
        .collect();
    let tied = decoder.map(|decoder| {
        let (&id, (name, shape)) = by_id
            .iter()
            .find(|(_, (name, _))| name == WORD_EMBEDDINGS)
            .expect("a BERT model has the tied word-embedding table");
        let table = PlannedParam {
            name: name.clone(),
            id,
            shape: shape.clone(),
            offset: 0,
        };
        by_id.insert(decoder, (DECODER_WEIGHT.to_string(), shape.clone()));
        TiedSplit { table, decoder }
    });
    let params: Vec<(String, _, Vec<usize>)> = order
        .iter()
        .filter(|id| tied.as_ref().is_none_or(|t| **id != t.table.id))
        .map(|id| {
            let (name, shape) = by_id
                .remove(id)
                .expect("the order lists each parameter once");
            (name, *id, shape)
        })
        .collect();
    let mut plan = BucketPlan::new(&params, first_bucket_mb, bucket_cap_mb);
    plan.tied = tied;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The late share counts the late parameters' f32 bytes against the whole plan's.
    #[test]
    fn after_backward_counts_the_late_parameters_bytes() {
        let ids: Vec<ParamId> = (0..3).map(|_| ParamId::new()).collect();
        let params = vec![
            ("a".to_string(), ids[0], vec![512, 1024]), // 2 MiB
            ("b".to_string(), ids[1], vec![1024]),
            ("c".to_string(), ids[2], vec![256, 1024]), // 1 MiB
        ];
        let plan = BucketPlan::new(&params, 1.0, 25.0);
        assert_eq!(
            plan.after_backward(&[ids[2]]),
            "1 parameters, 1.00 of 3.00 MiB"
        );
        assert_eq!(plan.after_backward(&[]), "0 parameters, 0.00 of 3.00 MiB");
    }
}
