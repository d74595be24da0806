//! `cargo xtask bench overlap`: how much of the gradient allreduce the bucketed hooks hide
//! behind backward.
//!
//! Two in-process ranks, one compute thread each (`RAYON_NUM_THREADS=1`,
//! `MATMUL_NUM_THREADS=1`), time a training step's forward and backward (no optimizer) three
//! ways: (a) with no communication at all, (b) with every bucket allreduced after backward
//! (serial), (c) with buckets launched from the hooks during backward (overlap). The fraction
//! of communication hidden is (b − c) / (b − a); each time is the median over the timed steps
//! of the slower rank. Measured without the compute's noise: the communication left after
//! backward (the step's wait for its buckets) in (c), against all of it in (b).
//!
//! On two cores the same CPU does compute and the in-process copies, so the second table runs
//! the collectives through a link model ([`Delayed`]): each allreduce takes the α-β time of
//! a ring over a link of the given bandwidth, sleeping instead of summing (the values are not
//! needed for timing), which is how a network-bound cluster behaves. By default the bandwidth is chosen so that the serial
//! allreduce of all gradients takes 40% of the measured backward time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use clap::{Args, Subcommand};
use ember_data::{HostBatch, InstanceLoader};
use ember_model::{BertConfig, BertForPreTraining, Preset};
use ember_trainer::grads::take_grads;
use ember_trainer::parallel::{
    ClipMode, Collective, CommError, CommThread, Delayed, GradHooks, InProcess, LinkModel,
    ReadyOrder, ReduceOp, Reducer, TiedEmbedding, ready_order,
};
use ember_trainer::{TrainConfig, bucket_plan, prepare_data};

type B = Autodiff<NdArray>;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Communication hidden behind backward by bucketed gradient hooks (2 ranks).
    Overlap(OverlapArgs),
    /// The fused ops of ember-backend-ext against the reference composition, at BERT shapes.
    Kernels(crate::bench_kernels::KernelArgs),
    /// Training steps through the whole trainer on one rank: step and backward time, host
    /// synchronisations per step, device against host gradient buckets.
    Step(crate::bench_step::StepArgs),
    /// Writing and loading the weights and optimizer state of a full-state checkpoint, against
    /// a plain file of the same size.
    Checkpoint(crate::bench_checkpoint::CheckpointArgs),
    /// Bytes sent and step time of AdamW vs 1-bit Adam and LAMB vs 1-bit LAMB (2 ranks, the
    /// whole trainer, a modelled network link).
    Onebit(crate::bench_onebit::OnebitArgs),
    /// ember's training step against Hugging Face BertForPreTraining + torch.optim.AdamW in
    /// the same run: samples/s, ratio, MFU against the GEMM peak measured in the run.
    TrainStep(crate::bench_train_step::TrainStepArgs),
    /// Pre-training example creation (text → HDF5 shard): ember's prepare-data against
    /// create_pretraining_data.py's algorithm in Python, on the same text, in the same run.
    Data(crate::bench_data::DataBenchArgs),
    /// Sentence embeddings: ember's Embedder against sentence-transformers, the same folder and
    /// sentences, in the same run (sentences/s, ratio, largest difference of the vectors).
    Embed(crate::bench_embed::EmbedBenchArgs),
    /// Every matrix product of a BERT training step alone, through ember's GEMM path (each
    /// `model.gemm` choice, f32 and bf16) against torch.matmul on the same device: TFLOP/s.
    Gemm(crate::bench_gemm::GemmArgs),
    /// One table of a GPU check's folder against the GPU-speed issue's targets: the parts and
    /// how each ended, the CUDA kernel tests, every `bench train-step` result (also written
    /// to `summary.md` there)
    Summary(crate::bench_summary::SummaryArgs),
}

/// `cargo xtask bench [--setup-reference] [COMMAND]`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = false, subcommand_required = false)]
pub struct BenchArgs {
    /// Create the virtualenv `reference-venv` in ember's cache folder (`$EMBER_CACHE_DIR`, else
    /// ~/.cache/ember) with torch and transformers (a large download, once) for `bench
    /// train-step --reference pytorch` and `bench data`
    #[arg(long)]
    setup_reference: bool,
    #[command(subcommand)]
    command: Option<BenchCommand>,
}

/// Flags of `bench overlap`.
#[derive(Args, Debug)]
pub struct OverlapArgs {
    /// Model size
    #[arg(long, default_value = "base")]
    preset: Preset,
    /// Samples per rank
    #[arg(long, default_value_t = 2)]
    batch_size: usize,
    /// Sequence length of the samples
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Timed steps per configuration (after one warm-up step); the tables give medians
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Link bandwidth in GB/s for the link model [default: serial allreduce = 40% of backward]
    #[arg(long)]
    bandwidth_gbps: Option<f64>,
    /// Link latency in microseconds (α)
    #[arg(long, default_value_t = 10.0)]
    latency_us: f64,
    /// Bucket cap, MiB
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// First bucket cap, MiB
    #[arg(long, default_value_t = 1.0)]
    first_bucket_mb: f64,
    /// Also print the bucket plans of BERT-base and BERT-large (initialises both)
    #[arg(long)]
    plans: bool,
    /// How the tied word embedding's gradient is reduced: split, whole, or both (compared)
    #[arg(long, value_delimiter = ',', default_value = "split,whole")]
    tied: Vec<TiedEmbedding>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.setup_reference {
        crate::bench_reference::setup_reference()?;
    }
    let Some(command) = args.command else {
        if args.setup_reference {
            return Ok(());
        }
        anyhow::bail!("bench: name a benchmark (cargo xtask bench --help lists them)");
    };
    match command {
        BenchCommand::Overlap(args) => overlap(args),
        BenchCommand::Kernels(args) => crate::bench_kernels::run(args),
        BenchCommand::Step(args) => crate::bench_step::run(args),
        BenchCommand::Checkpoint(args) => crate::bench_checkpoint::run(args),
        BenchCommand::Onebit(args) => crate::bench_onebit::run(args),
        BenchCommand::TrainStep(args) => crate::bench_train_step::run(args),
        BenchCommand::Data(args) => crate::bench_data::run(args),
        BenchCommand::Embed(args) => crate::bench_embed::run(args),
        BenchCommand::Gemm(args) => crate::bench_gemm::run(args),
        BenchCommand::Summary(args) => crate::bench_summary::run(args),
    }
}

/// A collective whose allreduce does nothing: the "no communication" baseline (a), and under
/// the link model the network (which sleeps for the transfer instead of summing on the
/// cores that compute). Barriers, allgathers and broadcasts are real.
struct NoAllreduce(InProcess);

impl Collective for NoAllreduce {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn name(&self) -> &'static str {
        "none"
    }
    fn allreduce(&mut self, _: &mut [f32], _: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), CommError> {
        self.0.broadcast(data, root)
    }
    fn allgather(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.0.allgather(data)
    }
    fn alltoall(&mut self, send: &[u8]) -> Result<Vec<u8>, CommError> {
        self.0.alltoall(send)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.0.barrier()
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// (a) no communication.
    Compute,
    /// (b) all buckets after backward.
    Serial,
    /// (c) buckets from the hooks.
    Overlap,
}

/// Mean seconds per step and mean seconds of backward alone, rank 0.
/// Medians over the timed steps, of the slower rank.
struct Timing {
    step: f64,
    backward: f64,
    /// From the end of backward until every bucket was averaged: the communication that
    /// backward did not hide.
    wait: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn model(preset: Preset) -> BertForPreTraining<B> {
    let mut config = BertConfig::preset(preset);
    config.hidden_dropout_prob = 0.0;
    config.attention_probs_dropout_prob = 0.0;
    B::seed(&Default::default(), 1);
    config.init_for_pretraining(&Default::default())
}

fn timed_run(
    mode: Mode,
    link: Option<LinkModel>,
    args: &OverlapArgs,
    models: &[BertForPreTraining<B>],
    batches: &[Vec<HostBatch>],
    orders: &[(ReadyOrder, Option<ParamId>)],
) -> Timing {
    let comms = InProcess::group(2, Duration::from_secs(600));
    let timings: Vec<Vec<(f64, f64, f64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                scope.spawn(move || {
                    let comm: Box<dyn Collective> = match (mode, link) {
                        (Mode::Compute, _) => Box::new(NoAllreduce(comm)),
                        // The link's time alone: the modelled network reduces, not the
                        // cores that compute (the values are not needed for timing).
                        (_, Some(link)) => Box::new(Delayed::new(NoAllreduce(comm), link)),
                        (_, None) => Box::new(comm),
                    };
                    let comm = Arc::new(CommThread::host(comm));
                    let model = &models[rank];
                    let (order, decoder) = &orders[rank];
                    let (hooked, late) = (order.hooked_set(), &order.late);
                    let plan = bucket_plan::<B, _>(
                        model,
                        &order.params(),
                        *decoder,
                        args.first_bucket_mb,
                        args.bucket_cap_mb,
                    );
                    // Serial: every bucket after backward (local-global with no clipping).
                    let clip = if mode == Mode::Serial {
                        ClipMode::LocalGlobal
                    } else {
                        ClipMode::None
                    };
                    let reducer = Reducer::new(plan, clip, 0.0, false, comm.clone());
                    let device = Default::default();
                    let mut samples = Vec::new();
                    for (i, host) in batches[rank].iter().enumerate() {
                        comm.call(|c| c.barrier()).unwrap();
                        let batch = host.to_device::<B>(&device);
                        let started = Instant::now();
                        reducer.begin_step(host.input_ids.iter().copied());
                        reducer.prepare_backward(true, true);
                        let hooks = GradHooks::new(model, reducer.callback(), Some(&hooked))
                            .with_decoder(*decoder);
                        let (_, loss) =
                            ember_trainer::eval::forward_loss_hooked(model, batch, &hooks);
                        let backward_started = Instant::now();
                        let mut grads = GradientsParams::from_grads(loss.total.backward(), model);
                        drop(hooks);
                        reducer.mark_params_ready(take_grads(model, &mut grads, late));
                        let backward = backward_started.elapsed().as_secs_f64();
                        let wait = reducer
                            .finalize_backward()
                            .unwrap()
                            .timings
                            .wait_after_backward
                            .as_secs_f64();
                        let step = started.elapsed().as_secs_f64();
                        if i > 0 {
                            samples.push((step, backward, wait));
                        }
                    }
                    samples
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // A step ends when the slower rank ends.
    let slower = |f: fn(&(f64, f64, f64)) -> f64| {
        median(
            (0..timings[0].len())
                .map(|i| timings.iter().map(|t| f(&t[i])).fold(0.0, f64::max))
                .collect(),
        )
    };
    Timing {
        step: slower(|s| s.0),
        backward: slower(|s| s.1),
        wait: slower(|s| s.2),
    }
}

fn overlap(args: OverlapArgs) -> Result<()> {
    // SAFETY: no other thread exists yet (the thread pools start lazily, at the first matmul
    // or parallel op), so nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("RAYON_NUM_THREADS", "1");
        std::env::set_var("MATMUL_NUM_THREADS", "1");
    }
    if args.plans {
        for preset in [Preset::Base, Preset::Large] {
            let m = model(preset);
            let probe = probe_batch(16);
            let order = ready_order(&m, probe, None);
            let plan = bucket_plan::<B, _>(
                &m,
                &order.params(),
                None,
                args.first_bucket_mb,
                args.bucket_cap_mb,
            );
            println!(
                "{preset}: {} parameters, {}",
                m.num_params(),
                plan.summary()
            );
        }
    }
    let mut config = TrainConfig::default();
    config.instances.max_seq_length = args.seq_len;
    config.instances.dupe_factor = 1;
    let data = prepare_data(&config)?;
    let batches: Vec<Vec<HostBatch>> = (0..2)
        .map(|rank| {
            let mut loader = InstanceLoader::for_rank(
                data.train.clone(),
                args.batch_size,
                args.seq_len,
                1,
                "training set",
                rank,
                2,
            )
            .expect("the corpus holds enough samples");
            (0..=args.steps).map(|_| loader.next_batch()).collect()
        })
        .collect();
    let models = [model(args.preset), model(args.preset)];
    // The rows of the tied table a split reduces: the union of both ranks' tokens.
    let rows = |step: usize| {
        let ids: std::collections::BTreeSet<i64> = batches
            .iter()
            .flat_map(|b| b[step].input_ids.iter().copied())
            .collect();
        ids.len()
    };
    let mean_rows = (1..=args.steps).map(rows).sum::<usize>() as f64 / args.steps as f64;
    let mut link = None;
    let mut a_backward = 0.0;
    for (t, &tied) in args.tied.iter().enumerate() {
        let split = tied.split(2);
        // Parameter ids are per model: each rank's model gets its own probe.
        let orders: Vec<(ReadyOrder, Option<ParamId>)> = models
            .iter()
            .map(|m| {
                let decoder = split.then(ParamId::new);
                let probe = batches[0][0].to_device::<B>(&Default::default());
                (ready_order(m, probe, decoder), decoder)
            })
            .collect();
        let (order, decoder) = &orders[0];
        let plan = bucket_plan::<B, _>(
            &models[0],
            &order.params(),
            *decoder,
            args.first_bucket_mb,
            args.bucket_cap_mb,
        );
        // A bucket holding a gradient that is final only after backward launches after it.
        let late = &order.late;
        let late_bytes: f64 = plan
            .buckets
            .iter()
            .filter(|b| b.params.iter().any(|p| late.contains(&p.id)))
            .map(|b| b.bytes() as f64)
            .sum::<f64>()
            + plan
                .tied
                .as_ref()
                .map_or(0.0, |t| mean_rows * (t.table.shape[1] * 4) as f64);
        let total_bytes = plan.numel() as f64 * 4.0
            + plan
                .tied
                .as_ref()
                .map_or(0.0, |t| mean_rows * (t.table.shape[1] * 4) as f64);
        println!(
            "{}, tied embedding {tied}: {} parameters, {}; {:.1} MiB ({:.0}%) of the reduced \
             bytes are reduced after backward{}",
            args.preset,
            models[0].num_params(),
            plan.summary(),
            late_bytes / 1048576.0,
            100.0 * late_bytes / total_bytes,
            if split {
                format!(" ({mean_rows:.0} rows of the table per step on average)")
            } else {
                " (tied word embedding, reshaped LayerNorm parameters)".into()
            }
        );
        let run = |mode, link| timed_run(mode, link, &args, &models, &batches, &orders);
        let a = run(Mode::Compute, None);
        // One link for every mode: the serial allreduce of all of the whole mode's gradients
        // takes 40% of the first mode's backward.
        let link = *link.get_or_insert_with(|| {
            a_backward = a.backward;
            let bytes = plan.numel() as f64 * 4.0;
            LinkModel {
                latency_s: args.latency_us * 1e-6,
                bandwidth_bytes_per_s: args
                    .bandwidth_gbps
                    .map(|g| g * 1e9)
                    .unwrap_or_else(|| bytes / (0.4 * a.backward)),
            }
        });
        if t == 0 {
            println!(
                "batch {} × {} tokens per rank, 2 ranks, 1 compute thread each; backward alone \
                 {a_backward:.3} s",
                args.batch_size, args.seq_len
            );
            println!();
            println!(
                "| tied embedding | collectives | (a) no comm s | (b) serial s | (c) overlap s | serial comm / backward | hidden (b−c)/(b−a) | exposed after backward (c) / (b) |"
            );
            println!("|---|---|---|---|---|---|---|---|");
        }
        for (name, link) in [
            ("in-process (shared memory, same 2 cores)".to_string(), None),
            (
                format!(
                    "link model {:.2} GB/s, {} µs",
                    link.bandwidth_bytes_per_s / 1e9,
                    args.latency_us
                ),
                Some(link),
            ),
        ] {
            let b = run(Mode::Serial, link);
            let c = run(Mode::Overlap, link);
            println!(
                "| {tied} | {name} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.3} / {:.3} s = {:.2} |",
                a.step,
                b.step,
                c.step,
                b.wait / a.backward,
                (b.step - c.step) / (b.step - a.step),
                c.wait,
                b.wait,
                c.wait / b.wait
            );
        }
    }
    Ok(())
}

fn probe_batch(seq_len: usize) -> ember_data::Batch<B> {
    let mut config = TrainConfig::default();
    config.instances.max_seq_length = seq_len.max(16);
    config.instances.dupe_factor = 1;
    let data = prepare_data(&config).expect("the embedded corpus");
    let loader = InstanceLoader::new(data.eval.clone(), 1, seq_len, 0, "eval").expect("eval data");
    loader
        .sequential_batches()
        .next()
        .expect("one batch")
        .to_device::<B>(&Default::default())
}
