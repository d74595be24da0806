//! Gradient hooks: firing order, final gradients, the tied table's two shares.

use super::*;

/// What hooks delivered: `(group, [(parameter, gradient on the host)])` in firing order.
type Fired = Arc<Mutex<Vec<(usize, Vec<(ParamId, Vec<f32>)>)>>>;

/// Hooks on `model` that record what they deliver (the tied table split with `decoder`).
fn recording_hooks(
    model: &BertForPreTraining<B>,
    decoder: Option<ParamId>,
) -> (GradHooks<B>, Fired) {
    let fired: Fired = Arc::default();
    let record = fired.clone();
    let hooks = GradHooks::new(
        model,
        GradCallback(Arc::new(move |group, grads| {
            let grads = grads.into_iter().map(|(id, g)| (id, host(g))).collect();
            record.lock().unwrap().push((group, grads))
        })),
        None,
    )
    .with_decoder(decoder);
    (hooks, fired)
}

#[test]
fn hooks_fire_deepest_layer_first_with_final_gradients() {
    let _serial = serial();
    let layers = 3;
    let model = tiny_model(layers);
    let batch = batches(1, 4).remove(0);
    let names: HashMap<ParamId, String> = named_params::<B, _>(&model)
        .into_iter()
        .map(|(name, id)| (id, name))
        .collect();
    let (hooks, fired) = recording_hooks(&model, None);
    let output = model.forward_hooked(
        batch.input_ids.clone(),
        batch.segment_ids.clone(),
        batch.input_mask.clone(),
        batch.masked_lm_flat_positions.clone(),
        &hooks,
    );
    let loss = model.loss(
        &output,
        batch.masked_lm_labels.clone(),
        batch.next_sentence_labels.clone(),
    );
    assert!(fired.lock().unwrap().is_empty(), "nothing fires in forward");
    let _ = loss.total.backward();
    // Every hook has fired by the time backward returns, deepest first: heads (0), then
    // layers 2, 1, 0 (groups 1, 2, 3).
    let fired = std::mem::take(&mut *fired.lock().unwrap());
    let groups: Vec<usize> = fired.iter().map(|(g, _)| *g).collect();
    assert_eq!(groups, vec![0, 1, 2, 3]);

    let plain = plain_gradients(&model, batch.clone());
    let fused = model.bert.encoder.kernels().fused::<B>();
    assert!(fused, "Kernels::Auto runs the fused ops on NdArray");
    for (group, grads) in &fired {
        let delivered: BTreeMap<&str, &Vec<f32>> = grads
            .iter()
            .map(|(id, d)| (names[id].as_str(), d))
            .collect();
        for (id, name) in &names {
            if hook_group(name, layers) != *group {
                continue;
            }
            // Note [Late gradients]: LayerNorm parameters reach their layer through a reshape
            // that Burn differentiates last, except under the fused ops (Kernels::Auto on
            // NdArray too), whose LayerNorm op has gamma and beta as direct parents: the
            // encoder layers' and the MLM transform's. (The MLM output bias was late too until
            // the decoder became one `dense` op with the bias as a direct parent.)
            let fused_norm = name.starts_with("bert.encoder.layer.")
                || name.starts_with("cls.predictions.transform.");
            let late = name.contains("layer_norm") && !(fused && fused_norm);
            match (late, delivered.get(name.as_str())) {
                (true, None) => {}
                (true, Some(_)) => {
                    panic!("{name} arrived at its hook; update Note [Late gradients]")
                }
                (false, None) => panic!("{name} was not delivered by hook {group}"),
                (false, Some(data)) => {
                    let ours: Vec<f64> = data.iter().map(|&x| f64::from(x)).collect();
                    let theirs: Vec<f64> = plain[id].iter().map(|&x| f64::from(x)).collect();
                    let diff = max_abs_diff(&ours, &theirs);
                    assert!(
                        diff <= 1e-6 * max_abs(&theirs),
                        "{name}: differs by {diff:e}"
                    );
                    assert!(max_abs(&theirs) > 0.0, "{name} has a zero gradient");
                }
            }
        }
    }
    // The probe the trainer runs finds the same split.
    let order = ready_order(&model, batch, None);
    assert_eq!(
        order.hooked.iter().map(|(g, _)| *g).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    let late: Vec<&str> = order.late.iter().map(|id| names[id].as_str()).collect();
    assert!(
        late.iter()
            .all(|n| n.starts_with("bert.embeddings.") || n.contains("layer_norm")),
        "{late:?}"
    );
    assert!(late.contains(&"bert.embeddings.word_embeddings.weight"));
    assert_eq!(order.params().len(), names.len());
}

/// Note [Tied embedding split]: the decoder op delivers the decoder's share of the tied
/// table's gradient among the heads' gradients (before any encoder layer's), the table's own
/// gradient is then the lookup's share, and the two add up to the gradient of plain backward.
#[test]
fn the_tied_tables_two_shares_add_up_to_its_gradient() {
    let _serial = serial();
    let model = tiny_model(2);
    let batch = batches(1, 4).remove(0);
    let table = named_params::<B, _>(&model)
        .into_iter()
        .find(|(name, _)| name == WORD_EMBEDDINGS)
        .unwrap()
        .1;
    let decoder = ParamId::new();
    let (hooks, fired) = recording_hooks(&model, Some(decoder));
    let (_, loss) = ember_trainer::eval::forward_loss_hooked(&model, batch.clone(), &hooks);
    let mut grads = GradientsParams::from_grads(loss.total.backward(), &model);
    drop(hooks);
    let lookup = host(take_grads(&model, &mut grads, &[table]).remove(0).1);
    let fired = std::mem::take(&mut *fired.lock().unwrap());
    // First the decoder op (group 0), then the heads' hook (group 0), then layers 1, 0.
    assert_eq!(
        fired.iter().map(|(g, _)| *g).collect::<Vec<_>>(),
        vec![0, 0, 1, 2]
    );
    assert_eq!(fired[0].1.len(), 1);
    assert_eq!(fired[0].1[0].0, decoder);
    let share = &fired[0].1[0].1;
    let whole = &plain_gradients(&model, batch.clone())[&table];
    let sum: Vec<f64> = share
        .iter()
        .zip(&lookup)
        .map(|(a, b)| f64::from(*a) + f64::from(*b))
        .collect();
    let whole: Vec<f64> = whole.iter().map(|&x| f64::from(x)).collect();
    let diff = max_abs_diff(&sum, &whole);
    assert!(
        diff <= 1e-6 * max_abs(&whole),
        "shares differ from the whole by {diff:e}"
    );
    // The lookup's share lives in the batch's rows only.
    let hidden = lookup.len() / 30522;
    let ids: std::collections::BTreeSet<usize> =
        batch_ids(&batch).into_iter().map(|i| i as usize).collect();
    for (row, values) in lookup.chunks(hidden).enumerate() {
        if !ids.contains(&row) {
            assert!(
                values.iter().all(|&x| x == 0.0),
                "row {row} is not in the batch"
            );
        }
    }
    // The start-up probe plans the decoder's share with the heads, the table after backward.
    let order = ready_order(&model, batch, Some(decoder));
    assert_eq!(order.hooked[0], (0, vec![decoder]));
    assert!(order.late.contains(&table));
    let plan = bucket_plan::<B, _>(&model, &order.params(), Some(decoder), 1.0, 25.0);
    assert_eq!(plan.buckets[0].params[0].name, DECODER_WEIGHT);
    assert!(
        plan.buckets
            .iter()
            .all(|b| b.params.iter().all(|p| p.id != table)),
        "the table is reduced by rows"
    );
    assert!(plan.describe().ends_with(&format!(
        "rows of {WORD_EMBEDDINGS} [30522, 128] after bucket {}\n",
        plan.buckets.len() - 1
    )));
}

fn batch_ids(batch: &Batch<B>) -> Vec<i64> {
    batch
        .input_ids
        .clone()
        .into_data()
        .convert::<i64>()
        .into_vec::<i64>()
        .unwrap()
}
