//! Ranks that disagree at start-up, die or stall.

use super::*;

#[test]
fn ranks_that_disagree_are_refused_at_start_up() {
    let _serial = serial();
    // Bucket plans: the same model bucketed with different caps.
    let model = tiny_model(2);
    let order = backward_order(&model);
    let plans = [
        bucket_plan::<B, _>(&model, &order, None, 1.0, 25.0),
        bucket_plan::<B, _>(&model, &order, None, 0.25, 25.0),
    ];
    let errors = on_ranks(2, Duration::from_secs(30), |rank, comm| {
        let comm = CommThread::<NdArray>::host(Box::new(comm));
        check_agreement(&comm, "bucket plan", plans[rank].describe())
            .unwrap_err()
            .to_string()
    });
    for e in &errors {
        assert!(
            e.contains("rank 1 disagrees with rank 0 on the bucket plan, line"),
            "{e}"
        );
        assert!(e.contains("bucket 1"), "{e}");
    }

    // Configurations: rank 1 has another learning rate.
    let dir = tempfile::tempdir().unwrap();
    let errors = on_ranks(2, Duration::from_secs(60), |rank, comm| {
        let mut config = small_config(dir.path());
        config.train.batch_size = 2;
        if rank == 1 {
            config.optimizer.lr = 5e-4;
        }
        let error = train_rank::<B>(
            &config,
            &Default::default(),
            RunOptions::default(),
            Communicator::Host(Box::new(comm)),
            Some(shared_data()),
        )
        .unwrap_err();
        assert!(
            matches!(
                error,
                TrainError::RankMismatch {
                    what: "configuration",
                    rank: 1,
                    ..
                }
            ),
            "{error}"
        );
        error.to_string()
    });
    assert!(
        errors[0].contains("lr = 0.001") && errors[0].contains("lr = 0.0005"),
        "{}",
        errors[0]
    );
}

/// Note [Ranks stay one model]: one rank's weight moved by the last bit of one element is
/// caught by the parameter check, naming the tensor and the rank, on every rank; equal
/// replicas pass. (Every multi-rank run of these tests is checked at start and before each
/// checkpoint, so the check raises no false alarm over their clip modes, optimizers, 1-bit
/// stages and device buckets either.)
#[test]
fn a_rank_whose_weights_drifted_is_caught_naming_the_tensor() {
    let _serial = serial();
    let model = tiny_model(2);
    let target = "bert.encoder.layer.1.intermediate.dense.weight";
    let outcomes = on_ranks(2, Duration::from_secs(30), |rank, comm| {
        let comm = CommThread::<NdArray>::host(Box::new(comm));
        let equal = check_parameters_agree::<B, _>(&model, &comm, "at start".into());
        let mut replica = model.clone();
        if rank == 1 {
            // The last bit of one element of one tensor.
            struct Nudge(ParamId);
            impl burn::module::ModuleMapper<B> for Nudge {
                fn map_float<const D: usize>(
                    &mut self,
                    param: burn::module::Param<burn::tensor::Tensor<B, D>>,
                ) -> burn::module::Param<burn::tensor::Tensor<B, D>> {
                    if param.id != self.0 {
                        return param;
                    }
                    param.map(|t| {
                        let shape = t.shape();
                        let mut values = t.to_data().convert::<f32>().into_vec::<f32>().unwrap();
                        values[7] = f32::from_bits(values[7].to_bits() ^ 1);
                        burn::tensor::Tensor::from_data(
                            TensorData::new(values, shape),
                            &Default::default(),
                        )
                        .require_grad()
                    })
                }
            }
            let id = named_params::<B, _>(&model)
                .into_iter()
                .find(|(name, _)| name == target)
                .unwrap()
                .1;
            replica = burn::module::Module::map(replica, &mut Nudge(id));
        }
        let drifted = check_parameters_agree::<B, _>(&replica, &comm, "after step 3".into());
        (equal, drifted)
    });
    for (rank, (equal, drifted)) in outcomes.into_iter().enumerate() {
        assert!(equal.is_ok(), "rank {rank}: {equal:?}");
        let error = drifted.unwrap_err();
        assert!(
            matches!(&error, TrainError::ParametersDiverged { rank: 1, name, .. } if name == target),
            "rank {rank}: {error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("after step 3") && message.contains(target),
            "{message}"
        );
    }
}

/// A gradient that never arrives in an earlier micro-batch of an accumulated step is an error
/// naming the parameter and the micro-batch, not a bucket silently left out of the sum.
#[test]
fn a_gradient_missing_in_an_earlier_micro_batch_is_named() {
    let _serial = serial();
    let model = tiny_model(1);
    let named = named_params::<B, _>(&model);
    let order: Vec<ParamId> = named.iter().rev().map(|(_, id)| *id).collect();
    let plan = bucket_plan::<B, _>(&model, &order, None, 1.0, 25.0);
    let comm = Arc::new(CommThread::<NdArray>::host(Box::new(
        ember_trainer::parallel::SingleRank,
    )));
    let reducer = Reducer::new(plan.clone(), ClipMode::Global, 1.0, false, comm);
    let grads = |skip: Option<ParamId>| {
        plan.buckets
            .iter()
            .flat_map(|b| &b.params)
            .filter(|p| Some(p.id) != skip)
            .map(|p| {
                let n = p.shape.iter().product();
                let data = TensorData::new(vec![0.5f32; n], p.shape.clone());
                (
                    p.id,
                    <NdArray as FloatTensorOps<NdArray>>::float_from_data(
                        data,
                        &Default::default(),
                    ),
                )
            })
            .collect::<Vec<_>>()
    };
    let skipped = plan.buckets[1].params[0].clone();
    reducer.prepare_backward(true, false);
    reducer.mark_params_ready(grads(Some(skipped.id)));
    reducer.prepare_backward(false, true);
    reducer.mark_params_ready(grads(None));
    let error = reducer.finalize_backward().unwrap_err().to_string();
    assert!(
        error.contains("micro-batch 1 of the step") && error.contains(&skipped.name),
        "{error}"
    );
    // Every gradient in both micro-batches: the step completes.
    reducer.prepare_backward(true, false);
    reducer.mark_params_ready(grads(None));
    reducer.prepare_backward(false, true);
    reducer.mark_params_ready(grads(None));
    assert!(reducer.finalize_backward().is_ok());
}

/// A communicator that works for `calls` collectives, then fails: `die` drops the rank's
/// communicator at once (as a killed process), otherwise it stalls until released.
struct Failing {
    inner: Option<Box<dyn Collective>>,
    calls: usize,
    stall: Option<Arc<AtomicBool>>,
}

impl Failing {
    fn next(&mut self) -> Result<&mut Box<dyn Collective>, CommError> {
        if self.calls == 0 {
            if let Some(released) = &self.stall {
                let started = Instant::now();
                while !released.load(Ordering::SeqCst)
                    && started.elapsed() < Duration::from_secs(60)
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            self.inner = None;
            return Err(CommError::Backend {
                backend: "test",
                message: "rank killed".into(),
            });
        }
        self.calls -= 1;
        Ok(self.inner.as_mut().unwrap())
    }
}

impl Collective for Failing {
    fn rank(&self) -> usize {
        1
    }
    fn world_size(&self) -> usize {
        2
    }
    fn name(&self) -> &'static str {
        "failing"
    }
    fn allreduce(&mut self, data: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.next()?.allreduce(data, op)
    }
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        self.next()?.broadcast(data, root)
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.next()?.allgather(data)
    }
    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        self.next()?.alltoall(send)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.next()?.barrier()
    }
}

#[test]
fn a_rank_that_dies_or_stalls_stops_the_others_with_its_name() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut config = small_config(dir.path());
    config.train.batch_size = 2;
    config.train.steps = 20;
    config.train.eval_every = Some(20);
    // Long enough that a slow step on a loaded machine is no timeout; the stalled case waits
    // it out.
    config.parallel.timeout_s = 6.0;
    for stall in [false, true] {
        let released = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        // Start-up takes a few collectives (configuration, plan, parameters); 12 calls end
        // in the middle of the training steps.
        let results = on_ranks(
            2,
            Duration::from_secs_f64(config.parallel.timeout_s),
            |rank, comm| {
                let comm: Box<dyn Collective> = if rank == 1 {
                    Box::new(Failing {
                        inner: Some(Box::new(comm)),
                        calls: 12,
                        stall: stall.then(|| released.clone()),
                    })
                } else {
                    Box::new(comm)
                };
                let result = train_rank::<B>(
                    &config,
                    &Default::default(),
                    RunOptions::default(),
                    Communicator::Host(comm),
                    Some(shared_data()),
                );
                if rank == 0 {
                    released.store(true, Ordering::SeqCst);
                }
                result.map(|_| ()).unwrap_err().to_string()
            },
        );
        let rank0 = &results[0];
        if stall {
            assert!(
                rank0.contains("timed out") && rank0.contains("rank(s) [1]"),
                "{rank0}"
            );
        } else {
            assert!(rank0.contains("rank 1 left the job"), "{rank0}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}",
            started.elapsed()
        );
    }
}
