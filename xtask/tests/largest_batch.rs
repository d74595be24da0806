//! `cargo xtask bench train-step --largest-batch` (Note [Largest batch] in
//! `xtask/src/bench_largest_batch.rs`): the search itself against every threshold, what counts
//! as running out of memory, the tries' timeout, and the command on the CPU under a cap on
//! each try's address space (CI has no GPU and no torch: the PyTorch side and CUDA's tries run
//! in `scripts/gpu-check.sh run largest-batch`).

use std::process::Command;

mod common;
use common::result_json;

/// `bench train-step --largest-batch` on the CPU, each try's address space capped (the
/// smallest model at seq 32, so that a try takes a second): the JSON's largest batch and the
/// smallest failing one are at most a step (8) apart, every try agrees with them, a try at half
/// the largest batch under the same cap fits, one at twice the failing batch runs out of memory
/// (Rust's allocator says so) and fits without the cap. The CPU needs a cap; a cap beside cuda is
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
    // The bracket, tried again by hand with a margin (the address space a process maps under
    // the cap varies a little from run to run, with the allocator's reservations and the
    // threads' timing, so a try at the boundary itself may go either way): half the largest
    // batch fits under the cap; twice the failing batch runs out of memory there and fits
    // without it.
    let try_batch =
        |batch: u64, limit| xtask(&["--probe", "--batch-size", &batch.to_string()], limit);
    let fits = try_batch(largest / 2, Some(LIMIT_MIB));
    assert!(
        fits.status.success() && String::from_utf8_lossy(&fits.stdout).contains("fits"),
        "{}",
        String::from_utf8_lossy(&fits.stderr)
    );
    let too_big = try_batch(2 * failing, Some(LIMIT_MIB));
    let stderr = String::from_utf8_lossy(&too_big.stderr);
    assert!(
        !too_big.status.success() && stderr.contains("memory allocation of"),
        "{stderr}"
    );
    assert!(try_batch(2 * failing, None).status.success());
    // A try that fails for another reason than memory stops the search with its error (the
    // first try: `--batch-size` is 8 by default), which the report keeps in its row.
    let failed = tempfile::tempdir().unwrap();
    let output = xtask(
        &[
            "--largest-batch",
            "--memory-limit-mib",
            LIMIT_MIB,
            "--max-predictions",
            "32",
            "--out",
            failed.path().to_str().unwrap(),
        ],
        None,
    );
    let error = result_json(failed.path()).1["rows"][0]["ember"]["error"].clone();
    assert!(
        error
            .as_str()
            .is_some_and(|e| e.contains("the try of batch 8")),
        "{error}"
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
        "called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 4294967296\n"
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
        // Room for a loaded machine to start the shell and let it write both lines.
        std::time::Duration::from_secs(3),
    )
    .unwrap();
    assert!(status.is_none());
    assert_eq!((stdout.as_str(), stderr.as_str()), ("out\n", "err\n"));
    assert!(start.elapsed() < std::time::Duration::from_secs(10));
    let (status, _, _) =
        xtask::run_with_timeout(shell("exit 3"), std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(status.and_then(|s| s.code()), Some(3));
}
