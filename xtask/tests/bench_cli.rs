//! `cargo xtask bench train-step` as a user runs it, without the PyTorch reference (CI has no
//! torch): the step runs, and the JSON it writes holds the configuration's model FLOPs
//! (`BertConfig::train_step_flops`), phases that add up to the step, and an untrained model's
//! loss. On the CPU always, under both GEMM settings (a row each); on wgpu (Mesa's lavapipe)
//! with the `wgpu` feature, f32 and fp16, and without it `--device wgpu` is a clear error; a
//! precision the device lacks is a clear error.

use std::path::Path;
use std::process::{Command, Output};

use ember_model::{BertConfig, Preset};
use serde_json::Value;

const BATCH: usize = 2;
const SEQ_LEN: usize = 32;
const MAX_PREDICTIONS: usize = 4;

fn bench(device: &str, out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args([
            "bench",
            "train-step",
            "--reference",
            "none",
            "--presets",
            "tiny",
        ])
        .args([
            "--batch-size",
            &BATCH.to_string(),
            "--seq-len",
            &SEQ_LEN.to_string(),
        ])
        .args(["--max-predictions", &MAX_PREDICTIONS.to_string()])
        .args(["--steps", "2", "--rounds", "1", "--gemm-size", "128"])
        .args(["--device", device])
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .expect("running xtask")
}

/// The JSON result a benchmark wrote in `out`: its path and its contents.
fn result_json(out: &Path) -> (std::path::PathBuf, Value) {
    let json = std::fs::read_dir(out)
        .expect("the results folder")
        .map(|entry| entry.expect("an entry").path())
        .find(|path| path.extension().is_some_and(|e| e == "json"))
        .expect("a JSON result");
    let results =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    (json, results)
}

/// The run's JSON, checked: one row for tiny at the requested shape per GEMM setting
/// (`gemm_threads`, `None` on GPUs), its FLOPs the formula's, its phases summing to the step,
/// its first loss that of a model that predicts uniformly (ln 30522 + ln 2 ≈ 11.0 for MLM +
/// NSP).
fn check_results(device: &str, out: &Path, output: &Output, gemm_threads: &[Option<&str>]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "bench on {device} failed: {stderr}"
    );
    let (json, results) = result_json(out);
    let markdown = std::fs::read_to_string(json.with_extension("md")).expect("the markdown table");
    assert!(markdown.contains("| tiny |"), "{markdown}");
    assert_eq!(results["device"], device);
    let rows = results["rows"].as_array().expect("rows");
    assert_eq!(
        rows.len(),
        gemm_threads.len(),
        "one preset × batch × seq per GEMM setting: {rows:?}"
    );
    let rates = results["gemm_gflops"]["ember_by_setting"]
        .as_array()
        .expect("ember's GEMM rate per setting");
    assert_eq!(rates.len(), gemm_threads.len(), "{rates:?}");
    assert!(
        rates
            .iter()
            .all(|r| r["gflops"].as_f64().is_some_and(|g| g > 0.0)),
        "{rates:?}"
    );
    for (row, setting) in rows.iter().zip(gemm_threads) {
        assert_eq!(row["gemm_threads"].as_str(), *setting, "{row}");
        if let Some(setting) = setting {
            assert!(markdown.contains(&format!("| {setting} |")), "{markdown}");
        }
        check_row(row, "f32");
        // Launches and device memory are counted by CubeCL's runtime: not on NdArray.
        let ember = &row["ember"];
        assert!(ember["launches_per_step"].is_null(), "{ember}");
        assert!(ember["reserved_bytes"].is_null(), "{ember}");
    }
}

fn check_row(row: &Value, precision: &str) {
    assert_eq!(row["preset"], "tiny");
    assert_eq!(row["precision"], precision);
    assert_eq!(row["batch_size"], BATCH);
    assert_eq!(row["seq_len"], SEQ_LEN);
    let flops =
        BertConfig::preset(Preset::Tiny).train_step_flops(BATCH, SEQ_LEN, BATCH * MAX_PREDICTIONS);
    assert_eq!(row["step_flops"].as_f64(), Some(flops));
    let ember = &row["ember"];
    let number = |key: &str| {
        ember[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {ember}"))
    };
    let step = number("step_s");
    let phases = number("forward_s") + number("backward_s") + number("optimizer_s");
    assert!(step > 0.0);
    // Medians of each phase and of the whole step over two steps: the sums agree to rounding.
    assert!(
        (phases - step).abs() <= 1e-6 * step + 1e-9,
        "phases {phases} s, step {step} s"
    );
    assert!((number("samples_per_s") - BATCH as f64 / step).abs() < 1e-9 * number("samples_per_s"));
    assert!(number("mfu") > 0.0);
    let loss = number("first_loss");
    assert!((10.5..11.5).contains(&loss), "untrained first loss {loss}");
}

#[test]
fn train_step_bench_on_the_cpu_writes_its_results() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("cpu", out.path(), &["--gemm-threads", "rayon,blas"]);
    check_results("cpu", out.path(), &output, &[Some("rayon"), Some("blas")]);
}

/// A half precision where the backend has none is refused before any step, naming the flag.
#[test]
fn train_step_bench_refuses_a_precision_the_device_lacks_and_a_sync_without_cublaslt() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("cpu", out.path(), &["--precision", "f32,bf16"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--precision bf16: --device cpu does not compute in bf16"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
    // A setting without effect beside the GEMM chosen is refused, naming both.
    let output = bench("cpu", out.path(), &["--cublaslt-sync", "device"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--cublaslt-sync device has no effect beside --gemm auto"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
}

/// On wgpu (lavapipe): an f32 and an fp16 row (lavapipe has shader f16), each with the kernel
/// launches of its step and the device memory CubeCL's pools hold; fp16 launches more (the
/// casts of autocast).
#[cfg(feature = "wgpu")]
#[test]
fn train_step_bench_on_wgpu_writes_its_results() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("wgpu", out.path(), &["--precision", "f32,fp16"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(out.path());
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let launches: Vec<u64> = rows
        .iter()
        .zip(["f32", "fp16"])
        .map(|(row, precision)| {
            check_row(row, precision);
            let ember = &row["ember"];
            assert!(ember["reserved_bytes"].as_u64().unwrap() > 0, "{ember}");
            ember["launches_per_step"].as_u64().unwrap()
        })
        .collect();
    assert!(launches[0] > 0 && launches[1] > launches[0], "{launches:?}");
}

#[cfg(not(feature = "wgpu"))]
#[test]
fn train_step_bench_on_wgpu_without_the_feature_says_so() {
    let out = tempfile::tempdir().unwrap();
    let output = bench("wgpu", out.path(), &[]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--device wgpu needs the wgpu feature"),
        "{stderr}"
    );
}

/// `bench embed` without the sentence-transformers side (CI has no torch), on a given model
/// folder (the tests' small random BERT): a row per batch size with the sentences embedded and
/// a rate; batch 1 takes a quarter of the sentences.
#[test]
fn embed_bench_writes_its_results() {
    let dir = tempfile::tempdir().unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/st_tiny");
    let output = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(["bench", "embed", "--reference", "none", "--model"])
        .arg(&model)
        .args([
            "--batch-size",
            "4,1",
            "--sentences",
            "12",
            "--rounds",
            "1",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .expect("running xtask");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(dir.path());
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (
            rows[0]["batch_size"].as_u64(),
            rows[0]["sentences"].as_u64()
        ),
        (Some(4), Some(12))
    );
    assert_eq!(
        (
            rows[1]["batch_size"].as_u64(),
            rows[1]["sentences"].as_u64()
        ),
        (Some(1), Some(3))
    );
    for row in rows {
        assert!(row["ember_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["reference_s"].is_null(), "{row}");
    }
    assert!(
        stdout.contains("| ember sentences/s |") || stdout.contains("ember sentences/s"),
        "{stdout}"
    );
}

/// `bench gemm` on the CPU without the PyTorch side (CI has no torch): the attention products
/// of the tiny model, each timed, written with the shapes `BertConfig::train_step_gemms` gives;
/// bf16 on the CPU, cuBLASLt off CUDA and mismatched shape lists are clear errors.
#[test]
fn gemm_bench_times_the_step_products() {
    let dir = tempfile::tempdir().unwrap();
    let gemm = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["bench", "gemm", "--device", "cpu", "--preset", "tiny"])
            .args(["--reference", "none", "--iters", "1", "--out"])
            .arg(dir.path())
            .args(extra)
            .output()
            .expect("running xtask")
    };
    let output = gemm(&[
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--max-predictions",
        "4",
        "--only",
        "attn ",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (_, results) = result_json(dir.path());
    let shape = &results.as_array().unwrap()[0];
    let expected: Vec<_> = BertConfig::preset(Preset::Tiny)
        .train_step_gemms(2, 32, 8)
        .into_iter()
        .filter(|g| g.name.starts_with("attn "))
        .collect();
    assert_eq!(expected.len(), 6);
    assert_eq!(shape["gemms"], serde_json::to_value(&expected).unwrap());
    let paths = shape["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1, "NdArray's one path: {paths:?}");
    assert_eq!(paths[0]["name"], "ember ndarray f32");
    let seconds = paths[0]["seconds"].as_array().unwrap();
    assert_eq!(seconds.len(), 6);
    assert!(
        seconds.iter().all(|s| s.as_f64().unwrap() > 0.0),
        "{seconds:?}"
    );
    assert!(
        stdout.contains("| attn Q·Kᵀ fwd | 2 | 4 × 32 × 64 × 32ᵀ |"),
        "{stdout}"
    );

    let bf16 = gemm(&["--dtypes", "bf16"]);
    assert!(!bf16.status.success());
    assert!(
        String::from_utf8_lossy(&bf16.stderr).contains("--dtypes bf16 needs --device cuda"),
        "{}",
        String::from_utf8_lossy(&bf16.stderr)
    );
    // NVIDIA's library is for --device cuda only, whatever the build.
    let cublaslt = gemm(&["--gemm", "cublaslt"]);
    assert!(!cublaslt.status.success());
    assert!(
        String::from_utf8_lossy(&cublaslt.stderr)
            .contains("model.gemm = \"cublaslt\" runs on --device cuda only"),
        "{}",
        String::from_utf8_lossy(&cublaslt.stderr)
    );
    let mismatched = gemm(&["--seq-len", "128,512", "--batch-size", "8"]);
    assert!(!mismatched.status.success());
    assert!(
        String::from_utf8_lossy(&mismatched.stderr).contains("one value each per sequence length"),
        "{}",
        String::from_utf8_lossy(&mismatched.stderr)
    );
}

/// `bench train-step --largest-batch` on the CPU, each try's address space capped (the
/// smallest model at seq 32, so that a try takes a second): the JSON's largest batch and the
/// smallest failing one are at most a step (8) apart, every try agrees with them, a try at the
/// largest batch under the same cap fits, one at the failing batch runs out of memory (Rust's
/// allocator says so) and fits without the cap. The CPU needs a cap; a cap beside cuda is
/// refused.
#[test]
fn largest_batch_search_on_the_cpu_brackets_what_fits_under_the_cap() {
    const LIMIT_MIB: &str = "768";
    let xtask = |args: &[&str], limit: Option<&str>| {
        let mut command = match limit {
            Some(mib) => {
                let mut command = Command::new("sh");
                command
                    .args(["-c", "ulimit -v $(($0 * 1024)) && exec \"$@\""])
                    .arg(mib)
                    .arg(env!("CARGO_BIN_EXE_xtask"));
                command
            }
            None => Command::new(env!("CARGO_BIN_EXE_xtask")),
        };
        command
            .args([
                "bench",
                "train-step",
                "--reference",
                "none",
                "--presets",
                "tiny",
            ])
            .args(["--seq-len", "32", "--threads", "1"])
            .args(if args.contains(&"--max-predictions") {
                &[][..]
            } else {
                &["--max-predictions", "4"][..]
            })
            .args(args)
            // The thread counts the search gives its tries, for the tries by hand below:
            // OpenBLAS reads its own when the library loads and maps buffers per thread,
            // which count against the cap.
            .env("OPENBLAS_NUM_THREADS", "1")
            .env("RAYON_NUM_THREADS", "1")
            .output()
            .expect("running xtask")
    };
    let out = tempfile::tempdir().unwrap();
    let out_dir = out.path().to_str().unwrap();
    let output = xtask(
        &[
            "--largest-batch",
            "--batch-size",
            "16",
            "--memory-limit-mib",
            LIMIT_MIB,
            "--out",
            out_dir,
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let (_, results) = result_json(out.path());
    let rows = results["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{results}");
    let ember = &rows[0]["ember"];
    let largest = ember["largest_batch"].as_u64().unwrap();
    let failing = ember["smallest_failing_batch"]
        .as_u64()
        .expect("a batch that does not fit");
    assert!(
        largest >= 16 && failing > largest && failing - largest <= 8,
        "{ember}"
    );
    assert!(rows[0]["pytorch"].is_null());
    for attempt in ember["tries"].as_array().unwrap() {
        let batch = attempt["batch"].as_u64().unwrap();
        assert_eq!(
            attempt["fits"].as_bool().unwrap(),
            batch <= largest,
            "{ember}"
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&format!(
            "| tiny | 32 | f32 | {largest} ({failing} does not) |"
        )),
        "{stdout}"
    );
    // The bracket, tried again by hand: the largest fits under the cap, the failing batch
    // runs out of memory there and fits without it.
    let try_batch =
        |batch: u64, limit| xtask(&["--probe", "--batch-size", &batch.to_string()], limit);
    let fits = try_batch(largest, Some(LIMIT_MIB));
    assert!(
        fits.status.success() && String::from_utf8_lossy(&fits.stdout).contains("fits"),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );
    let too_big = try_batch(failing, Some(LIMIT_MIB));
    let stderr = String::from_utf8_lossy(&too_big.stderr);
    assert!(
        !too_big.status.success() && stderr.contains("memory allocation of"),
        "{stderr}"
    );
    assert!(try_batch(failing, None).status.success());
    // A try that fails for another reason than memory stops the search with its error (the
    // first try: `--batch-size` is 8 by default).
    let output = xtask(
        &[
            "--largest-batch",
            "--memory-limit-mib",
            LIMIT_MIB,
            "--max-predictions",
            "32",
            "--out",
            out_dir,
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success()
            && stderr.contains("the try of batch 8 (tiny, seq 32, f32) failed")
            && stderr.contains("not for memory")
            && stderr.contains("--max-predictions 32 must be in 1..32"),
        "{stderr}"
    );
    // The CPU needs a cap; cuda takes none.
    let output = xtask(&["--largest-batch", "--out", out_dir], None);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success()
            && stderr.contains("--largest-batch on the CPU needs --memory-limit-mib"),
        "{stderr}"
    );
    let output = xtask(
        &[
            "--largest-batch",
            "--device",
            "cuda",
            "--memory-limit-mib",
            "100",
            "--out",
            out_dir,
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("on cuda the GPU's memory is the limit"),
        "{stderr}"
    );
}

/// Every threshold from 0 to 300, from several starts and steps: the search brackets the
/// threshold within its granularity, never tries a batch twice, and takes about
/// 2·log₂ tries.
#[test]
fn largest_batch_search_brackets_the_threshold() {
    for threshold in 0..=300usize {
        for start in [1, 8, 32, 100, 512] {
            for step in [1, 8] {
                let found = xtask::largest_batch_search(start, step, xtask::MAX_BATCH, |b| {
                    Ok(b <= threshold)
                })
                .unwrap();
                let failing = found
                    .smallest_failing
                    .expect("a failing batch under MAX_BATCH");
                assert!(failing > threshold, "{found:?} for threshold {threshold}");
                assert!(found.largest <= threshold);
                // Within one step of the threshold.
                assert!(
                    threshold - found.largest < step,
                    "threshold {threshold}, start {start}, step {step}: {found:?}"
                );
                assert!(failing - found.largest <= step.max(1));
                let mut batches: Vec<usize> = found.tries.iter().map(|(b, _)| *b).collect();
                batches.sort_unstable();
                batches.dedup();
                assert_eq!(
                    batches.len(),
                    found.tries.len(),
                    "a batch tried twice: {found:?}"
                );
                assert!(found.tries.len() <= 2 * 17 + 2, "{found:?}");
                for (batch, fitted) in &found.tries {
                    assert_eq!(*fitted, *batch <= threshold);
                }
            }
        }
    }
}

#[test]
fn largest_batch_search_stops_at_the_cap_and_passes_errors_on() {
    let found = xtask::largest_batch_search(8, 8, 64, |_| Ok(true)).unwrap();
    assert_eq!((found.largest, found.smallest_failing), (64, None));
    assert_eq!(
        found.tries.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        [8, 16, 32, 64]
    );
    let error = xtask::largest_batch_search(8, 8, 64, |b| {
        if b > 8 {
            anyhow::bail!("a bug at {b}")
        } else {
            Ok(true)
        }
    })
    .unwrap_err();
    assert_eq!(error.to_string(), "a bug at 16");
}

#[test]
fn largest_batch_tells_running_out_of_memory_from_other_failures() {
    assert!(xtask::out_of_memory(
        "memory allocation of 1048576 bytes failed\n"
    ));
    assert!(xtask::out_of_memory(
        "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 4294967296"
    ));
    assert!(xtask::out_of_memory(
        "panicked at ...: BufferTooBig { size: 1073741824 }"
    ));
    assert!(xtask::out_of_memory(
        "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"
    ));
    assert!(!xtask::out_of_memory(
        "panicked at src/lib.rs:1: index out of bounds"
    ));
    assert!(!xtask::out_of_memory(
        "error: --seq-len 600 exceeds the model's 512 positions"
    ));
}

/// A try past its timeout is killed, its output kept; one that ends keeps its exit status.
#[test]
fn largest_batch_tries_are_killed_at_their_timeout() {
    let shell = |script: &str| {
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        command
    };
    let start = std::time::Instant::now();
    let (status, stdout, stderr) = xtask::run_with_timeout(
        shell("echo out; echo err >&2; sleep 30"),
        std::time::Duration::from_millis(500),
    )
    .unwrap();
    assert!(status.is_none());
    assert_eq!((stdout.as_str(), stderr.as_str()), ("out\n", "err\n"));
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    let (status, _, _) =
        xtask::run_with_timeout(shell("exit 3"), std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(3));
}
