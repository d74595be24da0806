//! `cargo xtask bench train-step --largest-batch`: the largest batch whose training step fits
//! in the device's memory, ember's and PyTorch's, at each model × sequence length × precision.
//!
//! Note [Largest batch]: a batch fits when two training steps at it (forward, losses,
//! backward, AdamW; the second step runs with the optimizer's moments allocated, the step's
//! peak from then on) complete without the allocator running out of memory. The search
//! ([`search`]) starts at `--batch-size`, doubles while the batch fits (halves while it does
//! not), then bisects between the largest batch that fitted and the smallest that did not in
//! steps of `--largest-batch-step` (8 by default; multiples of it from a start that is one:
//! NVIDIA's BERT batch sizes are multiples of 8, and so are the sizes where tensor cores run
//! best), so that the answer is "B fits, B + step or less does not". It assumes what PyTorch's users assume of
//! `accelerate.find_executable_batch_size`: that a batch fits when a larger one does.
//!
//! - **ember**: each try is a process of its own (this binary, `bench train-step --probe`),
//!   so that an allocation failure ends only that try and leaves no pools behind. CubeCL
//!   allocates on its device thread, where a failed allocation panics and is caught: the
//!   thread goes on, later kernels on the missing buffer are skipped, and the main thread
//!   could finish its steps on garbage. So a try ends its process at the first panic on any
//!   thread (a panic hook), and a try whose stderr says it ran out of memory (CUDA's
//!   `CUDA_ERROR_OUT_OF_MEMORY`, CubeCL's "can't allocate buffer", Rust's "memory allocation
//!   of … failed") does not fit, whatever its exit status. Any other failure, or a try past
//!   `--largest-batch-timeout-s`, ends that side's search with the try's own error (the
//!   report keeps it, and the command fails after writing it), so that a bug is never
//!   reported as a batch size. The processes share the kernel cache (`EMBER_KERNEL_CACHE`),
//!   as the runs they stand for would.
//! - **PyTorch** (CUDA): one reference process tries every batch in turn and catches
//!   `torch.cuda.OutOfMemoryError` (and the "out of memory" `RuntimeError`s of cuBLAS and
//!   cuDNN, as `accelerate`'s `should_reduce_batch_size`), emptying the caching allocator and
//!   dropping AdamW's state after a failed try (`accelerate`'s way; a process per try would
//!   load BERT-large ~10 times). It runs after
//!   ember's tries, and this process holds no GPU memory during either side's.
//! - **CPU** (NdArray): the device's memory is the machine's, so a try has a cap,
//!   `--memory-limit-mib`, on its process's address space (`ulimit -v`, `RLIMIT_AS`: libraries
//!   and thread stacks count). PyTorch is not tried there: its libraries alone map about a
//!   GiB of address space, so the same cap would not measure the same thing.
//!
//! Reported per row: each side's largest batch that fitted, the smallest that did not, and
//! the tries; in `--out` as `largest-batch-DEVICE-*.{md,json}`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::AutodiffBackend;
use ember_backend_ext::FusedOps;
use ember_model::{BertConfig, BertForPreTraining, Precision, Preset};
use ember_trainer::config::OptimizerConfig;
use serde_json::{Value, json};

use crate::bench_reference::{HostInputs, Reference};
use crate::bench_train_step::{TrainStepArgs, reference_device};
use crate::bench_train_step_ember::EmberStep;

/// The batches no search goes beyond: a "fits" there is reported as "at least".
pub const MAX_BATCH: usize = 1 << 16;

/// What a search found: `largest` fitted (0: not even a batch of one), `smallest_failing`
/// did not (`None`: every try up to [`MAX_BATCH`] fitted); the tries in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Search {
    pub largest: usize,
    pub smallest_failing: Option<usize>,
    pub tries: Vec<(usize, bool)>,
}

/// Searches for the largest batch that `fits` (Note [Largest batch]): from `start`, doubling
/// while it fits (up to `max`) or halving while it does not, then bisecting in multiples of
/// `step` until the largest batch that fitted and the smallest that did not are at most
/// `step` apart.
///
/// # Errors
/// The first error of `fits` (a try that failed for another reason than memory).
pub fn search(
    start: usize,
    step: usize,
    max: usize,
    mut fits: impl FnMut(usize) -> Result<bool>,
) -> Result<Search> {
    let step = step.max(1);
    let mut tries = Vec::new();
    let mut try_batch = |batch: usize, tries: &mut Vec<(usize, bool)>| -> Result<bool> {
        let fitted = fits(batch)?;
        tries.push((batch, fitted));
        Ok(fitted)
    };
    let max = max.max(1);
    let start = start.clamp(1, max);
    // The bracket: `lo` fitted (0: none yet), `hi` did not (None: none yet).
    let (mut lo, mut hi) = if try_batch(start, &mut tries)? {
        let mut lo = start;
        let mut hi = None;
        while lo < max {
            let next = (lo * 2).min(max);
            if try_batch(next, &mut tries)? {
                lo = next;
            } else {
                hi = Some(next);
                break;
            }
        }
        (lo, hi)
    } else {
        let mut hi = start;
        let mut lo = 0;
        while hi > 1 {
            let next = hi / 2;
            if try_batch(next, &mut tries)? {
                lo = next;
                break;
            }
            hi = next;
        }
        (lo, Some(hi))
    };
    // Bisect: a multiple of `step` strictly inside the bracket (`lo + step` where the middle
    // rounds down to `lo`), until the bracket is no wider than a step.
    while let Some(failing) = hi {
        if failing - lo <= step {
            break;
        }
        let mid = ((lo + failing) / 2 / step * step).max(lo + step);
        if try_batch(mid, &mut tries)? {
            lo = mid;
        } else {
            hi = Some(mid);
        }
    }
    Ok(Search {
        largest: lo,
        smallest_failing: hi,
        tries,
    })
}

/// Whether a try's stderr says it ran out of memory: CUDA's driver, CubeCL's allocator
/// (`IoError::BufferTooBig`, whose message is "can't allocate buffer of size: N"), Rust's
/// global allocator, PyTorch's caching allocator.
pub fn out_of_memory(stderr: &str) -> bool {
    const MARKERS: [&str; 7] = [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "BufferTooBig",
        "can't allocate buffer",
        "out of memory",
        "Out of memory",
        "OutOfMemory",
        "memory allocation of",
    ];
    MARKERS.iter().any(|marker| stderr.contains(marker))
}

/// `--largest-batch`: the search for every model × sequence length × precision, ember's then
/// PyTorch's, and the report.
///
/// # Errors
/// A flag the device cannot take (named), a try that failed for another reason than memory
/// (its error), the reference's errors, the report's folder.
pub(crate) fn run(args: &TrainStepArgs, python: Option<&Path>, threads: usize) -> Result<()> {
    let step = args.largest_batch_step;
    if step == 0 {
        bail!("--largest-batch-step must be at least 1");
    }
    if args.largest_batch_timeout_s == 0 {
        bail!("--largest-batch-timeout-s must be at least 1");
    }
    if args.unpad.len() > 1 {
        bail!(
            "--largest-batch searches one configuration: give --unpad one value (true or false), not {:?}",
            args.unpad
        );
    }
    match (args.device.as_str(), args.memory_limit_mib) {
        ("cpu", None) => bail!(
            "--largest-batch on the CPU needs --memory-limit-mib: there a batch fits in the machine's memory, and the tries would take it all (each try's address space is capped at that many MiB)"
        ),
        ("cpu", Some(0)) => bail!("--memory-limit-mib must be at least 1"),
        ("cpu", Some(_)) => {}
        ("cuda", None) => {}
        ("cuda", Some(_)) => bail!(
            "--memory-limit-mib caps a try's host memory (cpu); on cuda the GPU's memory is the limit"
        ),
        (other, _) => bail!(
            "--largest-batch runs on cuda, or on cpu with --memory-limit-mib; on {other} an allocation failure is not told apart from other errors"
        ),
    }
    let exe = std::env::current_exe().context("this program's path, for the tries")?;
    let mut rows = Vec::new();
    // The searches that ended in an error (kept in their rows; the command fails at the end).
    let mut failures: Vec<String> = Vec::new();
    // The reference's versions and attention implementation (its `ready` message).
    let mut versions = Value::Null;
    for &preset in &args.presets {
        let config =
            crate::bench_train_step_ember::bench_config(preset, args.make_vocab_size_divisible_by);
        for &seq_len in &args.seq_len {
            for &precision in &args.precision {
                let start = args.batch_size[0];
                eprintln!("{preset} seq {seq_len} {precision}: ember's tries from batch {start}");
                let ember = search(start, step, MAX_BATCH, |batch| {
                    ember_fits(&exe, args, threads, (preset, precision, batch, seq_len))
                });
                let reference = match (python, args.device.as_str()) {
                    (Some(python), "cuda") => {
                        eprintln!("{preset} seq {seq_len} {precision}: PyTorch's tries");
                        Some(reference_search(
                            args,
                            (&config, crate::bench_train_step_ember::token_vocab(preset)),
                            python,
                            threads,
                            (precision, start, seq_len),
                        ))
                    }
                    _ => None,
                };
                let label = format!("{preset} seq {seq_len} {precision}");
                rows.push(json!({
                    "preset": preset.name(),
                    "seq_len": seq_len,
                    "precision": precision.to_string(),
                    "ember": side_json(&ember, &label, "ember", &mut failures),
                    "pytorch": reference.map(|r| side_json(&r.map(|(search, ready)| {
                        versions = ready;
                        search
                    }), &label, "PyTorch", &mut failures)),
                }));
            }
        }
    }
    report(args, threads, &rows, &versions)?;
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(())
}

/// A side's search for the report: its result, or its error (also added to `failures`).
fn side_json(
    search: &Result<Search>,
    label: &str,
    side: &str,
    failures: &mut Vec<String>,
) -> Value {
    match search {
        Ok(search) => search_json(search),
        Err(error) => {
            failures.push(format!("{label}: {side}'s search: {error:#}"));
            json!({ "error": format!("{error:#}") })
        }
    }
}

/// One ember try: a process of this binary at `batch`. `Ok(false)` when it ran out of memory.
fn ember_fits(
    exe: &Path,
    args: &TrainStepArgs,
    threads: usize,
    (preset, precision, batch, seq_len): (Preset, Precision, usize, usize),
) -> Result<bool> {
    let mut command = match args.memory_limit_mib {
        // `ulimit -v` (KiB) caps the try's address space (RLIMIT_AS), then runs it.
        Some(mib) => {
            let mut command = Command::new("sh");
            command
                .args(["-c", "ulimit -v \"$0\" && exec \"$@\""])
                .arg((mib * 1024).to_string())
                .arg(exe);
            command
        }
        None => Command::new(exe),
    };
    command
        .args(["bench", "train-step", "--probe", "--reference", "none"])
        .args(["--device", &args.device])
        .args(["--presets", preset.name()])
        .args(["--precision", &precision.to_string()])
        .args(["--batch-size", &batch.to_string()])
        .args(["--seq-len", &seq_len.to_string()])
        .args(["--max-predictions", &args.max_predictions.to_string()])
        .args(["--lengths", args.lengths.name()])
        .args(["--unpad", &args.unpad[0].to_string()])
        .args(["--threads", &threads.to_string()])
        .args(["--gemm", args.gemm.name()])
        .args(["--cublaslt-sync", args.cublaslt_sync.name()])
        .args(["--gemm-threads", &args.gemm_threads[0].to_string()])
        .args(["--lr", &args.lr.to_string()])
        .args([
            "--make-vocab-size-divisible-by",
            &args.make_vocab_size_divisible_by.to_string(),
        ]);
    let timeout = std::time::Duration::from_secs(args.largest_batch_timeout_s);
    let (status, stdout, stderr) = run_with_timeout(command, timeout)
        .with_context(|| format!("a try of batch {batch} ({})", exe.display()))?;
    // Out of memory first: CubeCL's device thread catches its panics and goes on, so a try
    // that ran out of memory there may still exit 0 (Note [Largest batch]).
    let fitted =
        !out_of_memory(&stderr) && status.is_some_and(|s| s.success()) && stdout.contains("fits");
    if fitted || out_of_memory(&stderr) {
        eprintln!(
            "  batch {batch}: {}",
            if fitted { "fits" } else { "does not fit" }
        );
        return Ok(fitted);
    }
    let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
    let how = match status {
        Some(status) => format!("failed ({status})"),
        None => format!(
            "did not finish in {} s (--largest-batch-timeout-s)",
            timeout.as_secs()
        ),
    };
    bail!(
        "the try of batch {batch} ({preset}, seq {seq_len}, {precision}) {how}, not for memory:\n{}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    )
}

/// Runs `command` with its stdout and stderr in temporary files, killing it after `timeout`:
/// its exit status (`None` when killed), stdout and stderr.
pub fn run_with_timeout(
    mut command: Command,
    timeout: std::time::Duration,
) -> Result<(Option<std::process::ExitStatus>, String, String)> {
    let dir = tempfile::tempdir().context("a temporary folder for a try's output")?;
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = command
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()
        .context("starting it")?;
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() >= timeout {
            child.kill()?;
            child.wait()?;
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let read = |path: &Path| std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned());
    Ok((status, read(&out_path)?, read(&err_path)?))
}

/// PyTorch's search: the reference process on the model and a batch of `start` sequences,
/// which it tiles to each try's batch.
fn reference_search(
    args: &TrainStepArgs,
    (config, tokens): (&BertConfig, usize),
    python: &Path,
    threads: usize,
    (precision, start, seq_len): (Precision, usize, usize),
) -> Result<(Search, Value)> {
    let dir = tempfile::tempdir().context("a temporary folder for the exported model")?;
    // On the CPU: the weights are the same function of the seed on every backend.
    let model: ember_model::BertForPreTraining<burn::backend::NdArray> =
        config.init_for_pretraining(&Default::default());
    model.save_hf_safetensors(&dir.path().join("model.safetensors"))?;
    std::fs::write(dir.path().join("config.json"), config.to_hf_json())?;
    HostInputs::random(tokens, start, seq_len, args.max_predictions, args.lengths)
        .write_safetensors(&dir.path().join("batch.safetensors"))?;
    let optimizer = OptimizerConfig {
        lr: args.lr,
        ..OptimizerConfig::default()
    };
    let mut reference = Reference::start(
        python,
        dir.path(),
        threads,
        &optimizer,
        false,
        reference_device(&args.device),
        precision,
    )?;
    let parameters = burn::module::Module::num_params(&model);
    if reference.ready["parameters"].as_u64() != Some(parameters as u64) {
        bail!(
            "PyTorch's model has {} parameters, ember's {parameters}: not the same model",
            reference.ready["parameters"]
        );
    }
    let ready = reference.ready.clone();
    let found = search(start, args.largest_batch_step, MAX_BATCH, |batch| {
        let reply = reference.ask(json!({"cmd": "fits", "batch": batch}))?;
        let fitted = reply["fits"]
            .as_bool()
            .with_context(|| format!("the reference's reply {reply} lacks fits"))?;
        eprintln!(
            "  batch {batch}: {}",
            if fitted { "fits" } else { "does not fit" }
        );
        Ok(fitted)
    })?;
    Ok((found, ready))
}

/// One try of `--largest-batch` (`bench train-step --probe`; Note [Largest batch]): the first
/// model, precision, batch size and sequence length of `args`, two training steps (the second
/// with AdamW's moments allocated), then `fits` on stdout. A panic on any thread aborts the
/// process after its message on stderr, as Rust's allocator does on the CPU.
///
/// # Errors
/// `--max-predictions` outside the sequence.
pub(crate) fn probe<B: AutodiffBackend<InnerBackend: FusedOps> + FusedOps>(
    args: &TrainStepArgs,
    device: &B::Device,
) -> Result<()> {
    // The first panic on any thread ends the try: CubeCL's device thread catches its own
    // (a failed allocation among them) and goes on (Note [Largest batch]).
    let report_panic = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report_panic(info);
        // Not `exit`: its handlers (CUDA's teardown among them) would run while other threads
        // may still be inside the driver.
        std::process::abort();
    }));
    let (preset, precision) = (args.presets[0], args.precision[0]);
    let (batch_size, seq_len) = (args.batch_size[0], args.seq_len[0]);
    let config =
        crate::bench_train_step_ember::bench_config(preset, args.make_vocab_size_divisible_by);
    crate::bench_train_step_ember::check_shape(&config, seq_len, args.max_predictions)?;
    let mut model: BertForPreTraining<B> = config.init_for_pretraining(device);
    model.set_precision(precision);
    model.set_unpad(args.unpad[0]);
    let inputs = crate::bench_train_step_ember::bench_inputs(args, preset, batch_size, seq_len);
    let mut ember = EmberStep::new(model, &inputs, args.lr, device, None);
    ember.timed_steps(2);
    let reserved = ember.reserved.map_or(String::new(), |bytes| {
        format!(", {:.0} MiB reserved", bytes as f64 / (1u64 << 20) as f64)
    });
    println!("probe: {preset} batch {batch_size} × seq {seq_len} {precision} fits{reserved}");
    Ok(())
}

fn search_json(search: &Search) -> Value {
    json!({
        "largest_batch": search.largest,
        "smallest_failing_batch": search.smallest_failing,
        "tries": search.tries.iter().map(|(b, f)| json!({"batch": b, "fits": f})).collect::<Vec<_>>(),
    })
}

/// "B (B' does not fit)", "at least B", "none (1 does not fit)", or the search's error.
fn describe(search: &Value) -> String {
    if let Some(error) = search["error"].as_str() {
        return format!("error: {}", error.lines().next().unwrap_or(""));
    }
    let largest = search["largest_batch"].as_u64().unwrap_or(0);
    match search["smallest_failing_batch"].as_u64() {
        None => format!("≥ {largest}"),
        Some(failing) if largest == 0 => format!("none ({failing} does not fit)"),
        Some(failing) => format!("{largest} ({failing} does not)"),
    }
}

fn report(args: &TrainStepArgs, threads: usize, rows: &[Value], versions: &Value) -> Result<()> {
    let limit = args.memory_limit_mib.map_or(String::new(), |mib| {
        format!(", each try capped at {mib} MiB of address space")
    });
    let reference = match versions["torch"].as_str() {
        Some(torch) => format!(
            "; PyTorch {torch} + transformers {} ({} attention)",
            versions["transformers"].as_str().unwrap_or("?"),
            versions["attn_implementation"].as_str().unwrap_or("?")
        ),
        None => String::new(),
    };
    let mut markdown = format!(
        "Largest batch whose training step fits, {} ({threads} thread(s){limit}; the search bisects in steps of {}; GEMMs: {}{reference}; Note [Largest batch])\n\n| model | seq | precision | ember | ember tries | PyTorch | PyTorch tries |\n|---|---|---|---|---|---|---|\n",
        args.device,
        args.largest_batch_step,
        args.gemm.name()
    );
    for row in rows {
        let tries = |side: &Value| {
            side["tries"]
                .as_array()
                .map_or(0, |tries| tries.len())
                .to_string()
        };
        let (reference, reference_tries) = match row["pytorch"].is_null() {
            true => ("–".to_string(), "–".to_string()),
            false => (describe(&row["pytorch"]), tries(&row["pytorch"])),
        };
        markdown.push_str(&format!(
            "| {} | {} | {} | {} | {} | {reference} | {reference_tries} |\n",
            row["preset"].as_str().unwrap_or("?"),
            row["seq_len"],
            row["precision"].as_str().unwrap_or("?"),
            describe(&row["ember"]),
            tries(&row["ember"]),
        ));
    }
    if args.make_vocab_size_divisible_by > 1 {
        markdown.push_str(&format!(
            "\nBoth models' vocabulary padded to a multiple of {} (`--make-vocab-size-divisible-by`).\n",
            args.make_vocab_size_divisible_by
        ));
    }
    if args.device == "cpu" {
        markdown.push_str("\nPyTorch is not tried on the CPU: its libraries alone map about a GiB of address space, so the same cap would not measure the same thing.\n");
    }
    println!("\n{markdown}");
    let base = crate::bench_reference::results_base(
        args.out.as_deref(),
        &format!("largest-batch-{}", args.device),
    )?;
    let summary = json!({
        "device": args.device,
        "threads": threads,
        "memory_limit_mib": args.memory_limit_mib,
        "step": args.largest_batch_step,
        "gemm": args.gemm.name(),
        "make_vocab_size_divisible_by": args.make_vocab_size_divisible_by,
        "reference": versions,
        "rows": rows,
    });
    crate::bench_train_step_report::write_atomically(
        &base.with_extension("md"),
        markdown.as_bytes(),
    )?;
    crate::bench_train_step_report::write_atomically(
        &base.with_extension("json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    println!("ember: wrote {}.{{md,json}}", base.display());
    Ok(())
}
