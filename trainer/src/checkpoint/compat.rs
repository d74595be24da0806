//! What a resumed run may change (Note [What a resume may change]).
//!
//! Note [What a resume may change]: a checkpoint continues the run that wrote it. The model's
//! shape (`model.preset`, the vocabulary's padding `model.make_vocab_size_divisible_by`: the
//! multiple itself is compared, so 1 → 2 is refused even for an even vocabulary) and
//! activation (`model.hidden_act`), the world size, the global batch size, the optimizer, the data and the seed must stay
//! as they were: with any of them changed the saved moments, sampler positions or dropout keys
//! describe another run, and the resumed run would be neither that run nor a fresh one.
//! Everything else may change: more steps (the schedule's decay then stretches to the new
//! end, as Hugging Face's Trainer does on `resume_from_checkpoint` with more epochs), the
//! evaluation and logging cadence, the init passes (`train.init_passes`), the evaluation set (`data.eval_shards`), the checkpoint
//! cadence, the output folder, the kernels, the GEMMs (`model.gemm_threads`, `model.gemm`,
//! `model.cublaslt_sync`, `model.qkv_projections`, `model.reference_ops`, `model.unpad`), the
//! bucket sizes, the reader's prefetch, the handling of bad input (`skip_bad_shards`,
//! `strict`), the collectives' timeout, and the
//! precision (`train.precision`, `loss_scale`, `parallel.allreduce_dtype`: the checkpoint
//! holds f32 weights and moments whatever the run computed in; a saved loss scale continues
//! when the resumed run scales its loss). The schedule's decay may stretch, but its warmup
//! and a 1-bit optimizer's freeze step may not move: unset, both are fractions of
//! `train.steps`, so more steps would silently lengthen the warmup of a run past it, or send a
//! 1-bit run that has frozen its variance back into the exact warm-up with its error feedback
//! dropped. The checkpoint keeps both as resolved ([`RunState`]), and a resume that would
//! resolve them otherwise is refused with both values.

use toml::Value;

use super::RunState;
use crate::{TrainConfig, TrainError};

/// The settings compared, as `section` or `section.field` of the TOML configuration.
const KEPT: [&str; 8] = [
    "model.preset",
    "model.make_vocab_size_divisible_by",
    "model.hidden_dropout_prob",
    "model.attention_probs_dropout_prob",
    "optimizer",
    "data",
    "instances",
    "train.seed",
];

/// Settings inside the compared sections that do not change what is trained: where the
/// evaluation set comes from, how far the reader prefetches, and how bad input is handled.
const FREE: [&str; 4] = [
    "data.eval_shards",
    "data.prefetch",
    "data.skip_bad_shards",
    "data.strict",
];

/// Checks that `given` may resume a checkpoint written under `saved` by `saved_world_size`
/// ranks (Note [What a resume may change]).
///
/// # Errors
/// [`TrainError::ResumeMismatch`] naming the first setting that differs, with both values.
pub fn check_resume_compatible(
    saved: &TrainConfig,
    saved_world_size: usize,
    given: &TrainConfig,
    given_world_size: usize,
) -> Result<(), TrainError> {
    let mismatch = |setting: String, saved: String, given: String| {
        Err(TrainError::ResumeMismatch {
            setting,
            saved,
            given,
        })
    };
    if saved_world_size != given_world_size {
        return mismatch(
            "world size".into(),
            saved_world_size.to_string(),
            given_world_size.to_string(),
        );
    }
    let global = |c: &TrainConfig, w: usize| c.train.batch_size * c.parallel.grad_accum * w;
    let (g_saved, g_given) = (
        global(saved, saved_world_size),
        global(given, given_world_size),
    );
    if g_saved != g_given {
        return mismatch(
            "global batch size (train.batch_size × parallel.grad_accum × world size)".into(),
            g_saved.to_string(),
            g_given.to_string(),
        );
    }
    // The GELU as resolved: unset is the presets' `gelu`, so `--hidden-act gelu` resumes a
    // run that left it unset.
    let gelu = |c: &TrainConfig| c.model.hidden_act.unwrap_or_default();
    if gelu(saved) != gelu(given) {
        return mismatch(
            "model.hidden_act".into(),
            gelu(saved).to_string(),
            gelu(given).to_string(),
        );
    }
    let (a, b) = (as_value(saved), as_value(given));
    for setting in KEPT {
        let (x, y) = (lookup(&a, setting), lookup(&b, setting));
        if let Some((path, x, y)) = first_difference(setting, x, y) {
            return mismatch(path, x, y);
        }
    }
    Ok(())
}

/// Checks that `given` resolves the warmup and a 1-bit freeze step as the checkpoint's run
/// did (`saved_run`'s values; from `saved`, its configuration, for checkpoints of earlier
/// versions): Note [What a resume may change].
///
/// # Errors
/// [`TrainError::ResumeMismatch`] with both values and the setting that keeps the saved one.
pub fn check_schedule_kept(
    saved_run: &RunState,
    saved: &TrainConfig,
    given: &TrainConfig,
) -> Result<(), TrainError> {
    let warmup = saved_run
        .warmup_steps
        .unwrap_or_else(|| saved.warmup_steps());
    if warmup != given.warmup_steps() {
        return Err(TrainError::ResumeMismatch {
            setting: format!(
                "the warmup (schedule.warmup_steps, else warmup_proportion × train.steps; \
                 --warmup-steps {warmup} keeps it)"
            ),
            saved: format!("{warmup} steps"),
            given: format!("{} steps", given.warmup_steps()),
        });
    }
    if given.optimizer.name.is_onebit() {
        let freeze = saved_run.freeze_step.unwrap_or_else(|| saved.freeze_step());
        if freeze != given.freeze_step() {
            return Err(TrainError::ResumeMismatch {
                setting: format!(
                    "the 1-bit freeze step (optimizer.onebit.freeze_step, else 20% of \
                     train.steps; --freeze-step {freeze} keeps it)"
                ),
                saved: format!("step {freeze}"),
                given: format!("step {}", given.freeze_step()),
            });
        }
    }
    Ok(())
}

fn as_value(config: &TrainConfig) -> Value {
    Value::try_from(config).expect("a TrainConfig always serialises")
}

fn lookup<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(value, |v, key| v.get(key))
}

fn show(value: Option<&Value>) -> String {
    value.map_or_else(|| "(unset)".into(), ToString::to_string)
}

/// The first leaf where `a` and `b` differ, as (path, a's value, b's value).
fn first_difference(
    path: &str,
    a: Option<&Value>,
    b: Option<&Value>,
) -> Option<(String, String, String)> {
    match (a, b) {
        (Some(Value::Table(x)), Some(Value::Table(y))) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .find_map(|key| first_difference(&format!("{path}.{key}"), x.get(key), y.get(key)))
        }
        _ if FREE.contains(&path) => None,
        (x, y) if x == y => None,
        (x, y) => Some((path.to_string(), show(x), show(y))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OptimizerKind;

    fn refusal(given: &TrainConfig, world_size: usize) -> String {
        check_resume_compatible(&TrainConfig::default(), 2, given, world_size)
            .unwrap_err()
            .to_string()
    }

    /// Each refused change names the setting and both values; allowed changes pass.
    #[test]
    fn refuses_changes_of_model_world_batch_optimizer_and_data() {
        let base = TrainConfig::default();
        assert!(check_resume_compatible(&base, 2, &base, 2).is_ok());

        let mut c = base.clone();
        c.model.preset = ember_model::Preset::Mini;
        let e = refusal(&c, 2);
        assert!(
            e.contains("model.preset") && e.contains("tiny") && e.contains("mini"),
            "{e}"
        );

        let mut c = base.clone();
        c.model.make_vocab_size_divisible_by = 8;
        let e = refusal(&c, 2);
        assert!(
            e.contains("model.make_vocab_size_divisible_by") && e.contains('1') && e.contains('8'),
            "{e}"
        );

        let e = refusal(&base, 4);
        assert!(
            e.contains("world size") && e.contains('2') && e.contains('4'),
            "{e}"
        );

        let mut c = base.clone();
        c.train.batch_size *= 2;
        let e = refusal(&c, 2);
        assert!(
            e.contains("global batch size") && e.contains("64") && e.contains("128"),
            "{e}"
        );

        let mut c = base.clone();
        c.model.hidden_act = Some(ember_model::Gelu::Tanh);
        let e = refusal(&c, 2);
        assert!(
            e.contains("model.hidden_act") && e.contains("gelu_new"),
            "{e}"
        );
        // Unset is the presets' erf GELU: naming it resumes.
        c.model.hidden_act = Some(ember_model::Gelu::Erf);
        assert!(check_resume_compatible(&base, 2, &c, 2).is_ok());
        // A gelu_new run resumed without the setting is refused.
        let mut tanh = base.clone();
        tanh.model.hidden_act = Some(ember_model::Gelu::Tanh);
        let e = check_resume_compatible(&tanh, 2, &base, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gelu_new") && e.contains("gelu"), "{e}");

        let mut c = base.clone();
        c.optimizer.name = OptimizerKind::Lamb;
        let e = refusal(&c, 2);
        assert!(e.contains("optimizer.name") && e.contains("lamb"), "{e}");

        let mut c = base.clone();
        c.optimizer.lr = 1e-2;
        assert!(refusal(&c, 2).contains("optimizer.lr"));

        let mut c = base.clone();
        c.data.corpus = Some("other.txt".into());
        let e = refusal(&c, 2);
        assert!(
            e.contains("data.corpus") && e.contains("(unset)") && e.contains("other.txt"),
            "{e}"
        );

        let mut c = base.clone();
        c.instances.max_seq_length = 64;
        assert!(refusal(&c, 2).contains("instances.max_seq_length"));

        let mut c = base.clone();
        c.train.seed += 1;
        assert!(refusal(&c, 2).contains("train.seed"));

        // The same global batch split differently, more steps, another cadence and folder.
        let mut c = base.clone();
        c.train.batch_size /= 2;
        c.parallel.grad_accum *= 2;
        c.train.steps *= 2;
        c.train.eval_every = Some(7);
        c.train.log_every = 1;
        c.train.out = "elsewhere".into();
        // Another evaluation set, prefetch depth or handling of bad input.
        c.data.eval_shards = Some("eval/".into());
        c.data.prefetch = 8;
        c.data.skip_bad_shards = true;
        c.data.strict = true;
        // Other kernels: single ops composed, Q, K, V separate.
        c.model.reference_ops = "attention,layer_norm".parse().unwrap();
        c.model.qkv_projections = ember_model::QkvProjections::Separate;
        assert!(check_resume_compatible(&base, 2, &c, 2).is_ok());
        c.data.shards = Some("other/".into());
        assert!(refusal(&c, 2).contains("data.shards"));
    }

    /// More steps may stretch the decay but not move a warmup or freeze step that was a
    /// fraction of the steps; pinning the saved values resumes.
    #[test]
    fn a_resume_that_would_move_the_warmup_or_freeze_step_is_refused() {
        let mut saved = TrainConfig::default();
        saved.train.steps = 1000;
        saved.optimizer.name = OptimizerKind::OnebitAdam;
        let run = RunState {
            step: 300,
            world_size: 1,
            global_batch_size: 32,
            losses: Vec::new(),
            tokens: 0,
            last_eval: None,
            loss_scaler: None,
            warmup_steps: Some(saved.warmup_steps()),
            freeze_step: Some(saved.freeze_step()),
        };
        assert_eq!((saved.warmup_steps(), saved.freeze_step()), (100, 200));
        assert!(check_schedule_kept(&run, &saved, &saved).is_ok());
        let mut longer = saved.clone();
        longer.train.steps = 2000;
        let e = check_schedule_kept(&run, &saved, &longer)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("warmup") && e.contains("100 steps") && e.contains("200 steps"),
            "{e}"
        );
        assert!(e.contains("--warmup-steps 100"), "{e}");
        longer.schedule.warmup_steps = Some(100);
        let e = check_schedule_kept(&run, &saved, &longer)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("freeze step") && e.contains("step 200") && e.contains("step 400"),
            "{e}"
        );
        longer.optimizer.onebit.freeze_step = Some(200);
        assert!(check_schedule_kept(&run, &saved, &longer).is_ok());
        // A checkpoint of an earlier version: the values resolved from its configuration.
        let old = RunState {
            warmup_steps: None,
            freeze_step: None,
            ..run
        };
        assert!(check_schedule_kept(&old, &saved, &longer).is_ok());
    }
}
