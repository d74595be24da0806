//! `scripts/gpu-check.sh` (its parts in `scripts/gpu-check-parts.sh`) runs only on a GPU
//! machine, lent to a session for minutes: a flag renamed since it was written would cost
//! one of its parts. The first test finds every command the script gives this binary
//! (`"$dir/xtask" ...`, also inside shell functions) and parses it with the binary's own
//! command line (`xtask::parse_error`), the shell's variables standing for values of the
//! kinds they hold.

mod common;

/// What the script's variables stand for here: arrays by the words they hold, values by one
/// of theirs; any other `$...` word is a path.
fn expand(word: &str) -> Vec<String> {
    let owned = |words: &[&str]| words.iter().map(|w| w.to_string()).collect();
    match word {
        "\"${reference[@]}\"" => owned(&["--reference", "pytorch", "--python", "/usr/bin/python3"]),
        "\"${compile[@]}\"" => owned(&["--compile"]),
        // A shell function's arguments: its calls' words are added (below).
        "\"$@\"" => Vec::new(),
        "\"$gemm\"" => owned(&["autotune"]),
        "\"$opt\"" => owned(&["onebit-lamb"]),
        "\"$comp\"" => owned(&["gzip"]),
        "\"$seq\"" => owned(&["512"]),
        "\"$batch\"" => owned(&["8"]),
        "\"$multiple\"" => owned(&["128"]),
        "\"$prec\"" => owned(&["fp16"]),
        "\"$ops\"" => owned(&["layer_norm,attention"]),
        w if w.contains('$') => owned(&["/tmp/gpu-check/path"]),
        w => vec![w.trim_matches('"').to_string()],
    }
}

/// The words of a command after `"$dir/xtask"`, up to its redirection, pipe or end.
fn command_words(rest: &str) -> Vec<String> {
    let mut words = Vec::new();
    for word in rest.split_whitespace() {
        if word.starts_with("2>") || word.starts_with('>') || word == "|" || word == "||" {
            break;
        }
        if word == ")" || word.ends_with(')') && !word.contains('(') {
            words.extend(expand(word.trim_end_matches(')')));
            break;
        }
        words.extend(expand(word));
    }
    words
}

/// The runner and its parts, one after the other.
fn script_text() -> String {
    ["gpu-check.sh", "gpu-check-parts.sh"]
        .iter()
        .map(|name| {
            let path = format!("{}/../scripts/{name}", env!("CARGO_MANIFEST_DIR"));
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn gpu_check_script_commands_parse() {
    let script = script_text().replace("\\\n", " ");
    let mut commands: Vec<(String, Vec<String>)> = Vec::new();
    // The function whose body a line is in (`name() {` alone on a line, to `}`).
    let mut body_of: Option<&str> = None;
    for line in script.lines() {
        if let Some(name) = line.strip_suffix("() {") {
            body_of = Some(name);
        } else if line == "}" {
            body_of = None;
        }
        let mut rest = line;
        while let Some(at) = rest.find("\"$dir/xtask\"") {
            rest = &rest[at + "\"$dir/xtask\"".len()..];
            let words = command_words(rest);
            // `"$dir/xtask"` as a file (`cp`, `strip`, `ldd`, `[ -x ... ]`), not a command.
            if !words
                .first()
                .is_some_and(|w| w.starts_with(|c: char| c.is_ascii_lowercase()))
            {
                continue;
            }
            // A shell function's body (`run_train() { "$dir/xtask" train ... "$@"; }`, or a
            // command with `"$@"` in a body of several lines): every call of it adds its own
            // words.
            let function = match line.split_once("() {") {
                Some((name, _)) => Some(name.trim()),
                None => body_of.filter(|_| line.contains("\"$@\"")),
            };
            if let Some(name) = function {
                for call in script.lines().map(str::trim) {
                    if let Some(args) = call.strip_prefix(&format!("{name} ")) {
                        let mut called = words.clone();
                        called.extend(command_words(args));
                        commands.push((call.to_string(), called));
                    }
                }
                continue;
            }
            commands.push((line.trim().to_string(), words));
        }
    }
    // gpu-libs exists in builds with the cuda feature only; CI's has none.
    let checked: Vec<_> = commands
        .iter()
        .filter(|(_, words)| words.first().is_some_and(|w| w != "gpu-libs"))
        .collect();
    // Every part's commands: the extraction itself must not lose them.
    assert!(
        checked.len() >= 19,
        "{} commands found: {commands:#?}",
        checked.len()
    );
    for sub in ["train", "bench", "prepare-data", "comm-check"] {
        assert!(
            checked.iter().any(|(_, w)| w[0] == sub),
            "no {sub} command found"
        );
    }
    assert!(
        checked
            .iter()
            .any(|(_, w)| w.iter().any(|x| x == "--largest-batch")),
        "the largest-batch part's command was not found"
    );
    // A function of several lines: each call's flags (the headline's fallback) are parsed.
    assert!(
        checked.iter().any(|(line, w)| {
            line.starts_with("headline_train_step --gemm cmma")
                && w.len() > 1
                && (w[0].as_str(), w[1].as_str()) == ("bench", "train-step")
                && w.windows(2).any(|p| p[0] == "--gemm" && p[1] == "cmma")
        }),
        "the headline's fallback was not found: {commands:#?}"
    );
    let failures: Vec<String> = checked
        .iter()
        .filter_map(|(line, words)| {
            xtask::parse_error(words).map(|e| format!("{line}\n  as {words:?}\n  {e}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The `kernels` part runs the integration tests' `kernels::cuda::` module by name: the module
/// is there (in `tests/tests/integration/`), so the filter selects tests rather than none.
#[test]
fn gpu_check_kernel_test_filter_names_a_module() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let script = script_text();
    assert!(
        script.contains("\"$dir/kernels\" kernels::cuda:: "),
        "the kernels part's filter changed"
    );
    let main = std::fs::read_to_string(format!("{root}/tests/tests/integration/main.rs")).unwrap();
    let kernels =
        std::fs::read_to_string(format!("{root}/tests/tests/integration/kernels/mod.rs")).unwrap();
    assert!(main.lines().any(|l| l.trim() == "mod kernels;"));
    assert!(kernels.lines().any(|l| l.trim() == "mod cuda;"));
    let cuda =
        std::fs::read_to_string(format!("{root}/tests/tests/integration/kernels/cuda.rs")).unwrap();
    assert!(cuda.lines().any(|l| l.starts_with("kernel_tests!(")));
}

/// Every part `run` knows (its `all` list) is a function of `scripts/gpu-check-parts.sh`
/// (`part_NAME`, `-` as `_`), and every such function is a part `run` knows: a part left out
/// of either would end a GPU session's run with "command not found" or never run.
#[test]
fn gpu_check_every_part_has_its_function() {
    let script = script_text();
    let all: Vec<String> = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("all=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("the runner's all=(...) list")
        .split_whitespace()
        .map(|p| p.replace('-', "_"))
        .collect();
    let functions: Vec<String> = script
        .lines()
        .filter_map(|l| l.strip_prefix("part_")?.strip_suffix("() {"))
        .map(str::to_string)
        .collect();
    assert_eq!(all.len(), 16, "{all:?}");
    let mut sorted = all.clone();
    sorted.sort();
    let mut defined = functions.clone();
    defined.sort();
    assert_eq!(sorted, defined);
}

/// `run` checks every part's name, exactly, before the first part starts (a misspelt last
/// part would otherwise be found minutes into a device call), and `all` stands alone. The refusal comes
/// before the script looks for its binaries, so it shows here, where there are none.
#[test]
fn gpu_check_refuses_an_unknown_part_before_running_any() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");
    let out_dir = tempfile::tempdir().unwrap();
    for (args, named) in [
        (&["run", "launch", "kernal"][..], "kernal"),
        (&["run", "all", "vocab"][..], "all"),
        // Two names in one word: no part, not two (a substring test took it).
        (&["run", "launch step"][..], "launch step"),
    ] {
        let out = std::process::Command::new("bash")
            .arg(script)
            .args(args)
            .env("OUT", out_dir.path().join("out"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("unknown part {named} (launch headline step gemm")),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("bins.tar.xz"), "{args:?}: {stderr}");
        assert!(
            !out_dir.path().join("out").exists(),
            "{args:?}: the run started"
        );
    }
}

/// `run` keeps its deadline (Note [One table per GPU check]) and ends with `bench summary`'s
/// one table, here with stand-ins for the GPU binaries (`GPU_CHECK_DIR`): the kernel tests
/// (one passed, one failed), a train-step part whose first benchmark never ends (its timeout
/// cut to the time left, the later commands not run, the part "cut at the deadline"), then a
/// part with no time left (skipped): the run exits with the kernel tests' 101. Beside it, a
/// run where nothing fails but a part is cut and one skipped exits 3, and a run whose
/// headline fails with the default GEMMs and passes with `--gemm cmma`, which the part then
/// runs (failed, exit 1). The real binary writes the summaries.
#[test]
fn gpu_check_run_keeps_its_deadline_and_ends_with_one_table() {
    use std::os::unix::fs::PermissionsExt;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/gpu-check.sh");
    let dir = tempfile::tempdir().unwrap();
    let bins = dir.path().join("bins");
    std::fs::create_dir_all(&bins).unwrap();
    let write = |name: &str, text: String| {
        let path = bins.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write(
        "xtask",
        format!(
            "#!/bin/sh\ncase \"$1 $2\" in\n\
             'bench summary') exec {real} \"$@\" ;;\n\
             'gpu-libs --ld-library-path') echo /nonexistent; exit 0 ;;\n\
             'gpu-libs '*) echo 'libraries: stand-in'; exit 0 ;;\n\
             'bench train-step') if [ -n \"$STAND_IN_DEFAULT_FAILS\" ]; then case \"$*\" in\n\
                 *'--gemm cmma'*) echo '| model | params | stand-in row |'; exit 0 ;;\n\
                 *) echo 'error: the default GEMMs failed'; exit 1 ;; esac; fi ;;\n\
             esac\necho 'ember: a run that never ends'\nexec sleep 300\n",
            real = env!("CARGO_BIN_EXE_xtask")
        ),
    );
    write(
        "kernels",
        "#!/bin/sh\necho 'test kernels::cuda::layer_norm ... ok'\n\
         echo 'test kernels::cuda::attention ... FAILED'\n\
         echo 'test result: FAILED. 1 passed; 1 failed'\nexit 101\n"
            .to_string(),
    );
    // Three runs at once: the one described above, one where nothing fails but the step part
    // is cut (its benchmark's table filter then finds nothing: no failure) and launch is
    // skipped, and the headline's fallback (below).
    let started = std::time::Instant::now();
    let spawn = |name: &str, parts: &[&str], deadline: &str| {
        std::process::Command::new("bash")
            .arg(script)
            .arg("run")
            .args(parts)
            .env("GPU_CHECK_DIR", &bins)
            .env(
                "STAND_IN_DEFAULT_FAILS",
                if name == "fallback" { "1" } else { "" },
            )
            .env("GPU_CHECK_DEADLINE_S", deadline)
            .env("OUT", dir.path().join(name))
            // No torch on this PATH's python3 either way: the parts take their no-reference
            // paths.
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let failing = spawn("failing", &["kernels", "train-step", "step"], "40");
    let cut = spawn("cut", &["step", "launch"], "34");
    // And a third: the headline's benchmark fails with the default GEMMs and passes with
    // `--gemm cmma`, which the part then runs.
    let fallback = spawn("fallback", &["headline"], "40");
    let (failing, cut, fallback) = (
        failing.wait_with_output().unwrap(),
        cut.wait_with_output().unwrap(),
        fallback.wait_with_output().unwrap(),
    );
    // The never-ending benchmarks were stopped near the deadline, not at their own 200 s and
    // 360 s.
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
    let check = |name: &str, run: &std::process::Output, code: i32, rows: &[(&str, &str)]| {
        let out = dir.path().join(name);
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        // Never 124 or 137 for a cut: the device machine's tool reads those as its own call
        // timed out.
        assert_eq!(run.status.code(), Some(code), "{name}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("not run, the deadline is near"),
            "{name}: {stdout}\n{stderr}"
        );
        let summary = std::fs::read_to_string(out.join("summary.md")).expect("summary.md");
        assert!(stdout.ends_with(&format!("{summary}\n")), "{stdout}");
        for (part, result) in rows {
            let row = summary
                .lines()
                .find(|l| l.starts_with(&format!("| {part} | ")))
                .unwrap_or_else(|| panic!("no row for {part}: {summary}"));
            assert!(row.ends_with(&format!("| {result} |")), "{name}: {summary}");
        }
        assert!(!out.join(".timed-out").exists());
        summary
    };
    // The kernel tests' failure is the run's status.
    let summary = check(
        "failing",
        &failing,
        101,
        &[
            ("kernels", "failed (exit 101)"),
            ("train-step", "cut at the deadline"),
            ("step", "skipped: the deadline"),
        ],
    );
    assert!(summary.contains("| step | 0 | skipped: the deadline |"));
    for expected in [
        "Kernel tests on CUDA: 1 passed, 1 failed: kernels::cuda::attention",
        "Training step: no `bench train-step` results",
    ] {
        assert!(summary.contains(expected), "{expected:?} in {summary}");
    }
    // Nothing failed, parts were cut or skipped: 3.
    let summary = check(
        "cut",
        &cut,
        3,
        &[
            ("step", "cut at the deadline"),
            ("launch", "skipped: the deadline"),
        ],
    );
    assert!(
        summary.contains("Kernel tests on CUDA: not run"),
        "{summary}"
    );
    // The headline failed: the part failed (the run exits 1) and the fallback's table is
    // in the log, after the line that says why it ran.
    let stdout = String::from_utf8_lossy(&fallback.stdout);
    assert_eq!(fallback.status.code(), Some(1), "{stdout}");
    let said = stdout
        .find("failed (exit 1): once more with --gemm cmma")
        .unwrap_or_else(|| panic!("{stdout}"));
    let row = stdout
        .find("| stand-in row |")
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(said < row, "{stdout}");
    assert!(
        stdout.contains("error: the default GEMMs failed"),
        "{stdout}"
    );
    let summary = std::fs::read_to_string(dir.path().join("fallback/summary.md")).unwrap();
    let row = summary
        .lines()
        .find(|l| l.starts_with("| headline | "))
        .unwrap_or_else(|| panic!("no row for headline: {summary}"));
    assert!(row.ends_with("| failed (exit 1) |"), "{summary}");
}

/// `bench summary` on `bench train-step`'s own JSON (a CPU run of tiny, then the same row made
/// a BERT-large one measured against two references): each row's samples/s, launches and
/// ratios, and for BERT-large the targets it misses (below 1.0× a reference, over
/// 1,500 launches, more memory reserved than the reference); tiny gets none.
#[test]
fn bench_summary_names_the_targets_a_large_row_misses() {
    let dir = tempfile::tempdir().unwrap();
    let xtask = env!("CARGO_BIN_EXE_xtask");
    let cpu = common::train_step_bench(
        "cpu",
        &dir.path().join("train-step"),
        &["--gemm-threads", "rayon"],
    );
    assert!(
        cpu.status.success(),
        "{}",
        String::from_utf8_lossy(&cpu.stderr)
    );
    let written = std::fs::read_dir(dir.path().join("train-step"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "json"))
        .unwrap();
    let mut results: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&written).unwrap()).unwrap();
    let tiny = results["rows"][0].clone();
    let rate = tiny["ember"]["samples_per_s"].as_f64().unwrap();
    let gib = 1u64 << 30;
    let mut large = tiny.clone();
    large["preset"] = "large".into();
    large["ember"]["launches_per_step"] = 1_700.into();
    large["ember"]["reserved_bytes"] = (30 * gib).into();
    large["references"] = serde_json::json!([
        {"name": "pytorch", "ratio": 0.8, "reserved_bytes": 20 * gib},
        {"name": "torch.compile", "ratio": 1.25, "reserved_bytes": 40 * gib},
    ]);
    results["rows"] = serde_json::json!([tiny, large]);
    std::fs::create_dir_all(dir.path().join("later")).unwrap();
    std::fs::write(
        dir.path().join("later/train-step-cuda-1.json"),
        results.to_string(),
    )
    .unwrap();
    // nvidia-smi's CSV: the GPU's line, not the header.
    std::fs::write(
        dir.path().join("gpu.txt"),
        "name, driver_version, memory.total [MiB]\nNVIDIA H200, 580.159.04, 143771 MiB\n",
    )
    .unwrap();
    // A results file cut while written: named in its row, the rest still summed up.
    std::fs::write(
        dir.path().join("later/train-step-cuda-2.json"),
        "{\"rows\": [",
    )
    .unwrap();
    let run = std::process::Command::new(xtask)
        .args(["bench", "summary"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}");
    let summary = std::fs::read_to_string(dir.path().join("summary.md")).unwrap();
    assert!(stdout.contains(&summary), "{stdout}");
    let rows: Vec<&str> = summary
        .lines()
        .filter(|l| l.contains("train-step-"))
        .collect();
    assert_eq!(rows.len(), 4, "{summary}");
    let cells =
        |line: &str| -> Vec<String> { line.split('|').map(|c| c.trim().to_string()).collect() };
    // By path: the later folder's two rows, then the CPU run's as written.
    let first = cells(rows[3]);
    assert!(
        first[1].starts_with("train-step/train-step-cpu-"),
        "{rows:?}"
    );
    assert_eq!(first[2..6], ["tiny", "f32", "2 × 32", "false"]);
    assert_eq!(first[6], format!("{rate:.1}"));
    assert_eq!(
        (first[8].as_str(), first[10].as_str(), first[11].as_str()),
        ("–", "–", "–")
    );
    assert_eq!(cells(rows[0])[11], "–", "tiny has no targets: {rows:?}");
    let large = cells(rows[1]);
    assert_eq!(large[1], "later/train-step-cuda-1.json");
    assert_eq!(
        (large[2].as_str(), large[8].as_str(), large[9].as_str()),
        ("large", "1700", "30.0")
    );
    assert_eq!(large[10], "0.80× pytorch, 1.25× torch.compile");
    assert_eq!(
        large[11],
        "0.80× pytorch < 1.0×; 30.0 GiB reserved > pytorch's 20.0; 1700 launches > 1500"
    );
    let cut = cells(rows[2]);
    assert_eq!(cut[1], "later/train-step-cuda-2.json");
    assert!(cut[2].starts_with("not valid JSON: "), "{rows:?}");
    assert!(
        summary.contains("\nGPU: NVIDIA H200, 580.159.04, 143771 MiB\n"),
        "{summary}"
    );
    // Without the script's files: said, not an error.
    assert!(summary.contains("No parts.tsv"), "{summary}");
    assert!(
        summary.contains("Kernel tests on CUDA: not run"),
        "{summary}"
    );
}
