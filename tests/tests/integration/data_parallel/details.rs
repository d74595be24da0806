//! The details that decide whether a run is right: how accumulated micro-batches weigh their
//! losses (`train.loss_normalization`), and dropout masks keyed per (seed, rank, step, layer,
//! sample), with dropout on and several masked tokens per sample.

use ember_backend_ext::DropoutScope;
use ember_data::{HostBatch, TrainingInstance, collate};
use ember_trainer::{LossNormalization, loss_weights};

use super::*;

const SEED: u64 = 42;

/// Instances with up to 20 masked tokens (P = 20), for tests with several predictions.
fn data_p20() -> Arc<PreparedData> {
    static DATA: Mutex<Option<Arc<PreparedData>>> = Mutex::new(None);
    let mut data = DATA.lock().unwrap();
    data.get_or_insert_with(|| {
        Arc::new(prepare_data(&dropout_p20_config(Path::new("unused"))).unwrap())
    })
    .clone()
}

/// The data-parallel test configuration with dropout 0.1 on both sites and up to 20 masked
/// tokens in sequences of up to 128 (the instances of [`data_p20`]).
fn dropout_p20_config(out: &Path) -> TrainConfig {
    let mut config = small_config(out);
    config.model.hidden_dropout_prob = Some(0.1);
    config.model.attention_probs_dropout_prob = Some(0.1);
    config.instances.max_predictions_per_seq = 20;
    config.instances.max_seq_length = 128;
    config
}

/// The tiny model with dropout 0.1 on both sites.
fn tiny_model_with_dropout() -> BertForPreTraining<B> {
    let mut config = BertConfig::preset(Preset::Tiny);
    config.num_hidden_layers = 2;
    crate::fused_training::seeded_model(&config, 7, &Default::default())
}

/// Eight held-out samples sorted by length, longest first (`--padding grouped`): the local
/// batch of the accumulation tests.
fn sorted_samples(data: &PreparedData) -> Vec<&TrainingInstance> {
    let mut samples: Vec<&TrainingInstance> = data.eval.iter().skip(40).take(8).collect();
    samples.sort_by_key(|s| std::cmp::Reverse(s.len()));
    samples
}

/// Gradients of `weights`-weighted losses of `micro_batches`, summed as the trainer does: each
/// micro-batch's forward inside its dropout scope (rank 0, step 0, its first sample).
fn accumulated(
    model: &BertForPreTraining<B>,
    micro_batches: &[HostBatch],
    weights: &[(f64, f64)],
) -> HashMap<ParamId, Vec<f64>> {
    let mut sum: HashMap<ParamId, Vec<f64>> = HashMap::new();
    let mut offset = 0;
    for (micro, &(w_mlm, w_nsp)) in micro_batches.iter().zip(weights) {
        let batch = micro.to_device::<B>(&Default::default());
        let scope = DropoutScope::enter(SEED, 0, 0, offset);
        let (_, loss) = ember_trainer::eval::forward_loss(model, batch);
        drop(scope);
        offset += micro.batch_size;
        let total = loss.mlm.mul_scalar(w_mlm) + loss.nsp.mul_scalar(w_nsp);
        let mut grads = GradientsParams::from_grads(total.backward(), model);
        let ids: Vec<ParamId> = named_params::<B, _>(model)
            .into_iter()
            .map(|(_, id)| id)
            .collect();
        for (id, g) in take_grads(model, &mut grads, &ids) {
            let entry = sum.entry(id).or_default();
            let g = host(g);
            entry.resize(g.len(), 0.0);
            entry
                .iter_mut()
                .zip(g)
                .for_each(|(s, x)| *s += f64::from(x));
        }
    }
    sum
}

fn worst_relative(a: &HashMap<ParamId, Vec<f64>>, b: &HashMap<ParamId, Vec<f64>>) -> f64 {
    let scale = a.values().map(|v| max_abs(v)).fold(0.0, f64::max);
    a.iter()
        .map(|(id, v)| max_abs_diff(v, &b[id]))
        .fold(0.0, f64::max)
        / scale
}

/// `loss_normalization = "batch"`: K = 2 and 4 micro-batches of a length-sorted local batch,
/// each padded to its own longest sample, with P = 20 and dropout 0.1, give the gradient of one
/// pass over the whole batch (the same masks: keyed by sample, not by batch or padding).
/// `"micro-batch"` gives the mean of the micro-batches' mean-loss gradients (NVIDIA's rule),
/// computed here by hand from each micro-batch's own gradient, which differs from the whole
/// batch's.
#[test]
fn accumulated_micro_batches_weigh_their_losses_as_configured() {
    let _serial = serial();
    let data = data_p20();
    let model = tiny_model_with_dropout();
    let samples = sorted_samples(&data);
    let whole = vec![collate(&samples, 128)];
    let reference = accumulated(&model, &whole, &[(1.0, 1.0)]);
    for k in [2, 4] {
        let micro: Vec<HostBatch> = samples
            .chunks(samples.len() / k)
            .map(|c| collate(c, 128))
            .collect();
        let lengths: Vec<usize> = micro.iter().map(|b| b.seq_len).collect();
        let masked: Vec<usize> = micro.iter().map(|b| b.num_masked_tokens()).collect();
        assert!(
            lengths.windows(2).any(|w| w[0] != w[1]),
            "paddings {lengths:?}"
        );
        assert!(
            masked.windows(2).any(|w| w[0] != w[1]),
            "masked tokens {masked:?}"
        );
        assert!(
            masked.iter().sum::<usize>() > 2 * samples.len(),
            "P > 1: {masked:?}"
        );

        let weights = loss_weights(&micro, LossNormalization::Batch);
        let batch = accumulated(&model, &micro, &weights);
        let worst = worst_relative(&reference, &batch);
        eprintln!("K = {k}, batch normalisation: largest difference {worst:e} of the largest");
        assert!(
            worst <= 1e-5,
            "K = {k}: batch normalisation differs by {worst:e}"
        );

        let weights = loss_weights(&micro, LossNormalization::MicroBatch);
        assert!(
            weights
                .iter()
                .all(|&w| w == (1.0 / k as f64, 1.0 / k as f64))
        );
        let rule = accumulated(&model, &micro, &weights);
        // By hand: each micro-batch's own mean-loss gradient (in its scope), averaged.
        let mut by_hand: HashMap<ParamId, Vec<f64>> = HashMap::new();
        let mut offset = 0;
        for one in &micro {
            let alone = accumulated_at(&model, one, offset);
            offset += one.batch_size;
            for (id, g) in alone {
                let entry = by_hand.entry(id).or_insert_with(|| vec![0.0; g.len()]);
                entry
                    .iter_mut()
                    .zip(g)
                    .for_each(|(s, x)| *s += x / k as f64);
            }
        }
        let worst = worst_relative(&by_hand, &rule);
        assert!(
            worst <= 1e-5,
            "K = {k}: micro-batch rule differs by {worst:e}"
        );
        let apart = worst_relative(&reference, &rule);
        eprintln!("K = {k}, micro-batch normalisation: {apart:e} from the whole batch");
        assert!(
            apart > 1e-3,
            "the two rules should differ here, by {apart:e}"
        );
    }
}

/// One micro-batch's mean-loss gradient, its dropout scope starting at sample `offset`.
fn accumulated_at(
    model: &BertForPreTraining<B>,
    micro: &HostBatch,
    offset: usize,
) -> HashMap<ParamId, Vec<f64>> {
    let _scope = DropoutScope::enter(SEED, 0, 0, offset);
    plain_gradients(model, micro.to_device::<B>(&Default::default()))
        .into_iter()
        .map(|(id, g)| (id, g.into_iter().map(f64::from).collect()))
        .collect()
}

/// Dropout keys: the same batch under rank 0's and rank 1's scope draws different masks (the
/// losses differ), under the same scope the same ones; the trainer with 2 in-process ranks,
/// dropout on, 20 masked tokens and 2 micro-batches ends on the same weights, bit for bit, in
/// two runs with one seed, and on other weights with another seed.
#[test]
fn dropout_masks_differ_between_ranks_and_repeat_between_runs() {
    let _serial = serial();
    let data = data_p20();
    let model = tiny_model_with_dropout();
    let samples = sorted_samples(&data);
    let host = collate(&samples[..4], 128);
    let loss_on = |rank: usize| {
        let batch = host.to_device::<B>(&Default::default());
        let _scope = DropoutScope::enter(SEED, rank, 3, 0);
        let (_, loss) = ember_trainer::eval::forward_loss(&model, batch);
        loss.total.into_scalar()
    };
    let (rank0, rank1, again) = (loss_on(0), loss_on(1), loss_on(0));
    assert_eq!(rank0, again, "the same scope, the same masks");
    assert_ne!(rank0, rank1, "ranks 0 and 1 drew the same masks");

    let dir = tempfile::tempdir().unwrap();
    let run_with = |name: &str, seed: u64| {
        let mut config = dropout_p20_config(&dir.path().join(name));
        config.train.batch_size = 2;
        config.parallel.grad_accum = 2;
        config.train.seed = seed;
        let summary = train_in_process_with_data::<B>(
            &config,
            2,
            &Default::default(),
            RunOptions::default(),
            Some(data.clone()),
        )
        .unwrap();
        summary.checkpoint
    };
    let first = run_with("first", SEED);
    let second = run_with("second", SEED);
    assert_eq!(
        assert_same_weights(&first, &second, 0.0),
        0.0,
        "two runs with one seed"
    );
    let other = run_with("other", SEED + 1);
    let (a, b) = (
        ember_tests::read_safetensors(&first),
        ember_tests::read_safetensors(&other),
    );
    let name = "bert.encoder.layer.0.attention.self.query.weight";
    assert!(
        max_abs_diff(&a[name], &b[name]) > 0.0,
        "another seed, other masks"
    );
}

/// Through the trainer: with `loss_normalization = "batch"`, dropout on and 20 masked tokens,
/// two accumulated micro-batches (each padded to its own longest sample) end where one step on
/// the whole batch ends.
#[test]
fn the_trainer_accumulates_as_one_step_on_the_whole_batch_with_dropout() {
    let _serial = serial();
    let data = data_p20();
    let dir = tempfile::tempdir().unwrap();
    let mut one = dropout_p20_config(&dir.path().join("one"));
    one.train.batch_size = 4;
    one.train.loss_normalization = LossNormalization::Batch;
    let run_on = |config: &TrainConfig| summary(config, 1, data.clone()).checkpoint;
    let reference = run_on(&one);
    let mut accumulated = one.clone();
    accumulated.train.batch_size = 2;
    accumulated.parallel.grad_accum = 2;
    accumulated.train.out = dir.path().join("accum");
    let worst = assert_same_weights(&reference, &run_on(&accumulated), 1e-5);
    eprintln!("batch normalisation through the trainer: largest difference {worst:e}");
}
