//! The clip modes against their formulas.

use super::*;

#[test]
fn clipping_modes_follow_their_formulas() {
    let _serial = serial();
    let model = tiny_model(2);
    let rank_batches = batches(2, 4);
    let rank_grads: Vec<HashMap<ParamId, Vec<f32>>> = rank_batches
        .into_iter()
        .map(|b| plain_gradients(&model, b))
        .collect();
    let order: Vec<ParamId> = named_params::<B, _>(&model)
        .into_iter()
        .rev()
        .map(|(_, id)| id)
        .collect();
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
        // The formulas, by hand, in f64 (ClipMode's docs).
        let factor = |n: f64, c: f64| if n > c { c / (n + 1e-6) } else { 1.0 };
        let expected: Vec<Vec<f64>> = (0..k)
            .map(|b| {
                let per_rank: Vec<Vec<f64>> = (0..2)
                    .map(|r| {
                        let g = &flat[r][b];
                        let f = match clip {
                            ClipMode::LocalGlobal => factor(local_norms[r], max_norm),
                            ClipMode::Bucket => {
                                factor(norm(g), max_norm / (bucket_count as f64).sqrt())
                            }
                            ClipMode::None | ClipMode::Global => 1.0,
                        };
                        g.iter().map(|x| x * f).collect()
                    })
                    .collect();
                per_rank[0]
                    .iter()
                    .zip(&per_rank[1])
                    .map(|(a, b)| (a + b) / 2.0)
                    .collect()
            })
            .collect();
        let averaged_norm = norm(&expected.concat());
        let expected: Vec<Vec<f64>> = if clip == ClipMode::Global {
            let f = factor(averaged_norm, max_norm);
            expected
                .into_iter()
                .map(|b| b.into_iter().map(|x| x * f).collect())
                .collect()
        } else {
            expected
        };
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
