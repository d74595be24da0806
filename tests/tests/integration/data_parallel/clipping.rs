//! The clip modes against their formulas.

use super::*;

/// The clip formulas by hand, in f64 (ClipMode's docs): the ranks' gradients `per_rank[r][b]`
/// (bucket b of rank r) clipped as `clip` says (`bucket`: each bucket to `max_norm/√K`, K =
/// `bucket_count`) and averaged, bucket by bucket; with the averaged gradient's norm before
/// `global` clipping.
fn clipped_mean(
    per_rank: &[Vec<Vec<f64>>],
    clip: ClipMode,
    max_norm: f64,
    bucket_count: usize,
) -> (Vec<Vec<f64>>, f64) {
    let factor = |n: f64, c: f64| if n > c { c / (n + 1e-6) } else { 1.0 };
    let ranks = per_rank.len() as f64;
    let local_norms: Vec<f64> = per_rank.iter().map(|r| norm(&r.concat())).collect();
    let mut mean: Vec<Vec<f64>> = per_rank[0].iter().map(|b| vec![0.0; b.len()]).collect();
    for (r, buckets) in per_rank.iter().enumerate() {
        for (b, g) in buckets.iter().enumerate() {
            let f = match clip {
                ClipMode::LocalGlobal => factor(local_norms[r], max_norm),
                ClipMode::Bucket => factor(norm(g), max_norm / (bucket_count as f64).sqrt()),
                ClipMode::None | ClipMode::Global => 1.0,
            };
            mean[b]
                .iter_mut()
                .zip(g)
                .for_each(|(m, x)| *m += x * f / ranks);
        }
    }
    let averaged_norm = norm(&mean.concat());
    if clip == ClipMode::Global {
        let f = factor(averaged_norm, max_norm);
        mean.iter_mut().flatten().for_each(|x| *x *= f);
    }
    (mean, averaged_norm)
}

#[test]
fn clipping_modes_follow_their_formulas() {
    let _serial = serial();
    let model = tiny_model(2);
    let rank_grads = gradients_of(&model, batches(2, 4));
    let order = backward_order(&model);
    // Small caps, so the plan has several buckets.
    let plan = bucket_plan::<B, _>(&model, &order, None, 0.25, 0.5);
    let k = plan.buckets.len();
    assert!(k >= 4, "{}", plan.summary());
    // Each rank's gradient, bucket by bucket, as f64.
    let flat: Vec<Vec<Vec<f64>>> = rank_grads
        .iter()
        .map(|grads| {
            plan.buckets
                .iter()
                .map(|b| {
                    b.params
                        .iter()
                        .flat_map(|p| grads[&p.id].iter().map(|&x| f64::from(x)))
                        .collect()
                })
                .collect()
        })
        .collect();
    let local_norms: Vec<f64> = flat.iter().map(|r| norm(&r.concat())).collect();
    let max_norm = 0.5 * local_norms.iter().copied().fold(f64::INFINITY, f64::min);

    // Host buckets, and device buckets (on NdArray: Burn tensors reduced by Burn ops).
    // `bucket` also with K pinned to Samsung's 22 (`parallel.bucket_clip_count`).
    for ((clip, pinned), on_device) in [
        (ClipMode::None, None),
        (ClipMode::Global, None),
        (ClipMode::LocalGlobal, None),
        (ClipMode::Bucket, None),
        (ClipMode::Bucket, Some(22)),
    ]
    .into_iter()
    .flat_map(|case| [(case, false), (case, true)])
    {
        let bucket_count = pinned.unwrap_or(k);
        let results = on_ranks(2, Duration::from_secs(60), |rank, comm| {
            let comm = Arc::new(CommThread::spawn(if on_device {
                Communicator::<NdArray>::Device(Box::new(comm))
            } else {
                Communicator::Host(Box::new(comm))
            }));
            let reducer = Reducer::new(plan.clone(), clip, max_norm, on_device, comm)
                .with_bucket_clip_count(pinned);
            assert_eq!(reducer.bucket_clip_count(), bucket_count);
            reducer.prepare_backward(true, true);
            let grads = plan
                .buckets
                .iter()
                .flat_map(|b| &b.params)
                .map(|p| {
                    let data = TensorData::new(rank_grads[rank][&p.id].clone(), p.shape.clone());
                    (
                        p.id,
                        <NdArray as FloatTensorOps<NdArray>>::float_from_data(
                            data,
                            &Default::default(),
                        ),
                    )
                })
                .collect::<Vec<_>>();
            reducer.mark_params_ready(grads);
            let step = reducer.finalize_backward().unwrap();
            let buckets: Vec<Vec<f64>> = (0..k)
                .map(|b| {
                    reducer
                        .bucket_values(b)
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect()
                })
                .collect();
            (step.grad_norm.value(), buckets)
        });
        let (expected, averaged_norm) = clipped_mean(&flat, clip, max_norm, bucket_count);
        let scale = expected.iter().map(|b| max_abs(b)).fold(0.0, f64::max);
        for (rank, (grad_norm, buckets)) in results.iter().enumerate() {
            for b in 0..k {
                let diff = max_abs_diff(&buckets[b], &expected[b]);
                assert!(
                    diff <= 1e-5 * scale,
                    "{clip}, device buckets {on_device}, rank {rank}, bucket {b}: differs by \
                     {diff:e} (scale {scale:e})"
                );
            }
            let expected_norm = match clip {
                ClipMode::None | ClipMode::Global => averaged_norm,
                ClipMode::LocalGlobal | ClipMode::Bucket => local_norms[rank],
            };
            assert!(
                (grad_norm - expected_norm).abs() <= 1e-4 * expected_norm,
                "{clip}: norm {grad_norm} vs {expected_norm}"
            );
        }
        let total = norm(&results[0].1.concat());
        match clip {
            ClipMode::None => assert!(total > max_norm),
            ClipMode::Global | ClipMode::LocalGlobal | ClipMode::Bucket => {
                assert!(
                    total <= max_norm * (1.0 + 1e-5),
                    "{clip}: norm {total} > {max_norm}"
                )
            }
        }
    }
}

/// The applied gradient of one AdamW step from the weights before and after it: with
/// `epsilon = 1`, no weight decay and a first step (m̂ = g, v̂ = g²), the step moves each
/// weight by `lr · g / (|g| + 1)`, which inverts to `g = d / (1 − |d|)` with `d = (w0 − w1)/lr`.
fn applied_gradient(w0: &[f64], w1: &[f64], lr: f64) -> Vec<f64> {
    w0.iter()
        .zip(w1)
        .map(|(a, b)| {
            let d = (a - b) / lr;
            d / (1.0 - d.abs())
        })
        .collect()
}

/// `bucket`, `local-global` and `global` through the trainer, 2 in-process ranks, one step:
/// the gradient the optimizer applied (read back from the weights, see [`applied_gradient`])
/// equals the clip formula computed by hand from each rank's real gradient at the initial
/// weights, on that rank's own batch, bucket by bucket as the trainer's plan cuts them.
#[test]
fn clip_modes_through_the_trainer_equal_their_formulas() {
    use ember_data::InstanceLoader;
    use ember_model::checkpoint::ember_path_to_hf;
    use ember_tests::read_safetensors;

    let _serial = serial();
    let data = shared_data();
    let dir = tempfile::tempdir().unwrap();
    let mut base = small_config(&dir.path().join("w0"));
    base.train.steps = 1;
    base.train.batch_size = 2;
    base.train.eval_every = Some(1);
    base.optimizer.epsilon = 1.0;
    base.optimizer.weight_decay = 0.0;
    base.schedule.warmup_steps = Some(0);
    base.parallel.tied_embedding = TiedEmbedding::Whole;
    // The initial weights: a step too small to move any of them (by at most 1e-20).
    base.optimizer.lr = 1e-20;
    let w0 = read_safetensors(&run(&base, 2));
    let lr = 0.1;

    // Each rank's gradient at the initial weights, on the batch its loader deals it first.
    let bert_config = base.bert_config(data.tokenizer.vocab_size());
    let model = bert_config
        .init_for_pretraining::<B>(&Default::default())
        .load_hf_safetensors(&dir.path().join("w0/model.safetensors"))
        .unwrap();
    let rank_grads: Vec<HashMap<ParamId, Vec<f32>>> = (0..2)
        .map(|rank| {
            let mut loader = InstanceLoader::for_rank(
                data.train.clone(),
                base.train.batch_size,
                base.instances.max_seq_length,
                base.train.seed,
                "training set",
                rank,
                2,
            )
            .unwrap();
            plain_gradients(
                &model,
                loader.next_batch().to_device::<B>(&Default::default()),
            )
        })
        .collect();
    // The trainer's bucket plan, from the same probe and caps.
    let probe = InstanceLoader::new(data.eval.clone(), 4, 64, 0, "eval")
        .unwrap()
        .sequential_batches()
        .next()
        .unwrap()
        .to_device::<B>(&Default::default());
    let order = ready_order(&model, probe, None);
    let plan = bucket_plan::<B, _>(
        &model,
        &order.params(),
        None,
        base.parallel.first_bucket_mb,
        base.parallel.bucket_cap_mb,
    );
    let k = plan.buckets.len();
    let max_norm = base.optimizer.max_grad_norm;
    let per_rank: Vec<Vec<Vec<f64>>> = (0..2)
        .map(|r| {
            plan.buckets
                .iter()
                .map(|bucket| {
                    bucket
                        .params
                        .iter()
                        .flat_map(|p| rank_grads[r][&p.id].iter().map(|&x| f64::from(x)))
                        .collect()
                })
                .collect()
        })
        .collect();
    let local_norms: Vec<f64> = per_rank.iter().map(|r| norm(&r.concat())).collect();
    assert!(
        local_norms.iter().all(|&n| n > max_norm),
        "clipping must be active: local norms {local_norms:?}"
    );

    let mut applied_by_mode = Vec::new();
    for clip in [ClipMode::Bucket, ClipMode::LocalGlobal, ClipMode::Global] {
        let mut config = base.clone();
        config.optimizer.lr = lr;
        config.parallel.clip = clip;
        config.train.out = dir.path().join(clip.to_string());
        let w1 = read_safetensors(&run(&config, 2));
        let (expected, _) = clipped_mean(&per_rank, clip, max_norm, k);
        let scale = expected.iter().map(|b| max_abs(b)).fold(0.0, f64::max);
        let mut applied_all = Vec::new();
        for (b, bucket) in plan.buckets.iter().enumerate() {
            let mut offset = 0;
            for p in &bucket.params {
                let name = ember_path_to_hf(&p.name);
                let applied = applied_gradient(&w0[&name], &w1[&name], lr);
                let n = applied.len();
                let ours = &expected[b][offset..offset + n];
                // Burn's Linear weights are `[in, out]`, the checkpoint's `[out, in]`.
                let ours: Vec<f64> = if p.shape.len() == 2 && !name.contains("embeddings") {
                    let (rows, cols) = (p.shape[0], p.shape[1]);
                    (0..n).map(|k| ours[(k % rows) * cols + k / rows]).collect()
                } else {
                    ours.to_vec()
                };
                let diff = max_abs_diff(&applied, &ours);
                assert!(
                    diff <= 1e-4 * scale,
                    "{clip}: {name} differs from the formula by {diff:e} (scale {scale:e})"
                );
                offset += n;
                applied_all.extend(applied);
            }
        }
        eprintln!("{clip}: the applied gradient follows the formula (scale {scale:e})");
        applied_by_mode.push((clip, applied_all));
    }
    // The three modes apply different gradients here: the test can tell them apart.
    for i in 0..applied_by_mode.len() {
        for j in i + 1..applied_by_mode.len() {
            let (a, b) = (&applied_by_mode[i], &applied_by_mode[j]);
            let apart = max_abs_diff(&a.1, &b.1) / max_abs(&a.1);
            assert!(apart > 1e-2, "{} and {} apply the same gradient", a.0, b.0);
        }
    }
}
