//! `ember train` as a user runs it. Runs that survive a kill (Note [Checkpoints] in
//! `trainer/src/checkpoint/mod.rs`): a child is SIGKILLed between checkpoints or while one is
//! being written, `--resume` continues it, and its losses and final weights equal those of a
//! run never interrupted, bit for bit, with 1 rank and 2 in-process ranks, dropout on, AdamW,
//! LAMB, 1-bit Adam and 1-bit LAMB. SIGTERM writes a checkpoint and exits 0. The run draws `curves.png`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A tiny model with dropout on (the presets' 0.1), several masked positions per sample.
fn config(dir: &Path, steps: u64, every: u64) -> PathBuf {
    let corpus = dir.join("corpus.txt");
    if !corpus.exists() {
        // The first 120 documents of the embedded corpus.
        let text = ember_data::embedded::corpus_text();
        let docs: Vec<&str> = text.split("\n\n").take(120).collect();
        std::fs::write(&corpus, docs.join("\n\n")).unwrap();
    }
    let path = dir.join(format!("train-{steps}-{every}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
[model]
preset = "tiny"

[data]
corpus = "{}"
eval_documents = 8

[instances]
max_seq_length = 64
max_predictions_per_seq = 8
dupe_factor = 2

[optimizer]
lr = 1e-3

[train]
steps = {steps}
batch_size = 4
eval_every = 5
eval_samples = 16
log_every = 1

[checkpoint]
every = {every}
# The newest two only: 14 runs of 6 checkpoints each (moments, 1-bit error feedback) wrote
# gigabytes and filled a small disk.
keep = 2

[parallel]
timeout_s = 120.0
"#,
            corpus.display()
        ),
    )
    .unwrap();
    path
}

fn command(config: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ember"));
    command
        .args(["train", "--no-progress", "--config"])
        .arg(config)
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("RUST_LOG", "warn");
    command
}

fn run(config: &Path, out: &Path, extra: &[&str]) -> Output {
    let output = command(config, out, extra).output().unwrap();
    assert!(
        output.status.success(),
        "ember train {extra:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The `train` records of `metrics.jsonl`: (step, loss) in file order.
fn losses(out: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|r| r["event"] == "train")
        .map(|r| (r["step"].as_u64().unwrap(), r["loss"].as_f64().unwrap()))
        .collect()
}

/// Spawns `command` with its stdout and stderr in `log` (read back when the run fails).
fn spawn_logged(mut command: Command, log: &Path) -> Child {
    let file = std::fs::File::create(log).unwrap();
    command
        .stdout(Stdio::from(file.try_clone().unwrap()))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap()
}

/// Polls until `ready` holds, then SIGKILLs the child; fails if the child ended first,
/// printing what it wrote to `log`.
fn kill_when(mut child: Child, log: &Path, what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            let output = std::fs::read_to_string(log).unwrap_or_default();
            panic!("the run ended ({status}) before {what}: make it longer\n{output}");
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success(), "the child was killed: {status}");
}

/// The runs of `steps` steps in `full` and `resumed` logged the same losses and ended with the
/// same weights, optimizer state and 1-bit error feedback, bit for bit.
fn assert_same_run(full: &Path, resumed: &Path, what: &str, steps: u64) {
    let (a, b) = (losses(full), losses(resumed));
    assert!(a.len() as u64 >= steps, "{what}: {} logged steps", a.len());
    assert_eq!(a, b, "{what}: losses of the resumed run differ");
    assert!(
        std::fs::read(full.join("model.safetensors")).unwrap()
            == std::fs::read(resumed.join("model.safetensors")).unwrap(),
        "{what}: model.safetensors differs from the uninterrupted run's"
    );
    let last = |out: &Path, name: &str| {
        let dir = out.join(format!("checkpoints/step-{steps:07}"));
        std::fs::read(dir.join(name)).ok()
    };
    assert!(
        last(full, "optimizer.safetensors").is_some()
            && last(full, "optimizer.safetensors") == last(resumed, "optimizer.safetensors"),
        "{what}: the final optimizer state differs"
    );
    // 1-bit Adam/LAMB: each rank's error feedback too.
    for rank in [
        "rank-00000.onebit.safetensors",
        "rank-00001.onebit.safetensors",
    ] {
        assert!(
            last(full, rank) == last(resumed, rank),
            "{what}: {rank} differs"
        );
    }
}

/// SIGKILL at a random step between checkpoints, then `--resume`: the same losses, weights
/// and moments as a run never interrupted.
#[test]
fn killed_between_checkpoints_resumes_bit_for_bit() {
    // 20 steps, a checkpoint every 5: the kill (steps 6-9) leaves 10 or more steps to resume.
    const STEPS: u64 = 20;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), STEPS, 5);
    // 1-bit Adam/LAMB freezing at step 3: the kill (steps 6-9) resumes from step 5's
    // checkpoint in the compression stage (error feedback, LAMB's fresh variance and
    // factors); freezing at step 7: from the warm-up (LAMB's averaged trust ratios).
    for (nproc, optimizer, freeze) in [
        ("1", "adamw", ""),
        ("1", "lamb", ""),
        ("2", "adamw", ""),
        ("2", "lamb", ""),
        ("2", "onebit-adam", "3"),
        ("2", "onebit-lamb", "3"),
        ("2", "onebit-lamb", "7"),
    ] {
        let what = format!("{nproc} rank(s), {optimizer} {freeze}");
        let mut extra = vec!["--nproc", nproc, "--optimizer", optimizer];
        if !freeze.is_empty() {
            extra.extend(["--freeze-step", freeze]);
        }
        let full = dir
            .path()
            .join(format!("full-{nproc}-{optimizer}-{freeze}"));
        run(&config, &full, &extra);

        let cut = dir.path().join(format!("cut-{nproc}-{optimizer}-{freeze}"));
        let kill_at = 6 + (std::process::id() as u64 + nproc.len() as u64 * 7) % 4; // 6..=9
        let log = dir
            .path()
            .join(format!("cut-{nproc}-{optimizer}-{freeze}.log"));
        let child = spawn_logged(command(&config, &cut, &extra), &log);
        kill_when(child, &log, &format!("{what}: step {kill_at}"), || {
            losses(&cut).last().is_some_and(|(s, _)| *s >= kill_at)
        });
        let resumed_from = losses(&cut).len();
        let mut resume = extra.clone();
        let cut_str = cut.to_str().unwrap().to_string();
        resume.extend(["--resume", &cut_str]);
        let output = run(&config, &cut, &resume);
        assert!(
            resumed_from >= 6,
            "{what}: killed after {resumed_from} steps"
        );
        let text = std::fs::read_to_string(cut.join("metrics.jsonl")).unwrap();
        assert!(
            text.contains(r#""event":"resume""#),
            "{what}: no resume record"
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains(&format!("step-{STEPS:07}")),
            "{what}"
        );
        assert_same_run(&full, &cut, &what, STEPS);
        std::fs::remove_dir_all(&full).unwrap();
        std::fs::remove_dir_all(&cut).unwrap();
    }
}

/// SIGKILL while a checkpoint is being written (a step folder without its manifest): the
/// resume skips that folder and still ends as the uninterrupted run.
#[test]
fn killed_while_writing_a_checkpoint_resumes_from_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 30, 2);
    let full = dir.path().join("full");
    run(&config, &full, &[]);
    let cut = dir.path().join("cut");
    let log = dir.path().join("cut.log");
    let child = spawn_logged(command(&config, &cut, &[]), &log);
    let checkpoints = cut.join("checkpoints");
    // A folder after the first complete one, caught before its manifest is in place.
    kill_when(child, &log, "a checkpoint caught mid-write", || {
        let Ok(entries) = std::fs::read_dir(&checkpoints) else {
            return false;
        };
        let dirs: Vec<PathBuf> = entries.filter_map(Result::ok).map(|e| e.path()).collect();
        dirs.len() >= 2 && dirs.iter().any(|d| !d.join("manifest.json").exists())
    });
    let cut_str = cut.to_str().unwrap().to_string();
    run(&config, &cut, &["--resume", &cut_str]);
    assert_same_run(&full, &cut, "killed mid-checkpoint", 30);
}

/// SIGTERM: the step ends, a checkpoint of that step is written, the process exits 0 and says
/// how to continue; `--resume` then finishes the run.
#[test]
fn sigterm_writes_a_checkpoint_and_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 30, 0);
    let out = dir.path().join("run");
    let child = command(&config, &out, &["--steps", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while losses(&out).len() < 3 {
        assert!(Instant::now() < deadline, "no steps logged");
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}: {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("stopped by SIGTERM"), "{stdout}");
    assert!(stdout.contains("--resume"), "{stdout}");
    let last = losses(&out).last().unwrap().0;
    let checkpoint = out.join(format!("checkpoints/step-{last:07}"));
    assert!(
        stdout.contains(&checkpoint.display().to_string()),
        "{stdout}"
    );
    assert!(checkpoint.join("manifest.json").is_file());
    assert!(last < 100000);
}

/// `--resume` of a folder without checkpoints, and a resume that changes the optimizer: clear
/// errors naming the folder or setting.
#[test]
fn bad_resumes_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 30, 0);
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let output = command(
        &config,
        &dir.path().join("x"),
        &["--resume", empty.to_str().unwrap()],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("no complete checkpoint"), "{stderr}");
    assert!(
        stderr.contains(&empty.join("checkpoints").display().to_string()),
        "{stderr}"
    );

    let out = dir.path().join("run");
    run(&config, &out, &["--steps", "2"]);
    let output = command(
        &config,
        &out,
        &["--optimizer", "lamb", "--resume", out.to_str().unwrap()],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("optimizer.name") && stderr.contains("adamw") && stderr.contains("lamb"),
        "{stderr}"
    );
    // Nothing was deleted.
    assert!(out.join("checkpoints/step-0000002/manifest.json").is_file());
}

/// A truncated weights file in the newest checkpoint: `--resume` warns naming it and continues
/// from the checkpoint before; `convert` turns an ember checkpoint into a Hugging Face folder.
#[test]
fn a_corrupt_newest_checkpoint_falls_back_and_a_checkpoint_converts() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 30, 1);
    let out = dir.path().join("run");
    run(&config, &out, &["--steps", "2"]);
    let newest = out.join("checkpoints/step-0000002/model.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let output = run(
        &config,
        &out,
        &["--steps", "3", "--resume", out.to_str().unwrap()],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("skipped a checkpoint") && stderr.contains(&newest.display().to_string()),
        "{stderr}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let resume = metrics
        .lines()
        .find(|l| l.contains(r#""event":"resume""#))
        .unwrap();
    assert!(resume.contains(r#""step":1"#), "{resume}");
    assert_eq!(
        losses(&out).iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [1, 2, 3]
    );

    let converted = dir.path().join("hf");
    let status = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(["convert", "--from"])
        .arg(out.join("checkpoints/step-0000003"))
        .arg("--to")
        .arg(&converted)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        std::fs::read(converted.join("model.safetensors")).unwrap()
            == std::fs::read(out.join("checkpoints/step-0000003/model.safetensors")).unwrap()
    );
    assert!(converted.join("config.json").is_file());
}

/// `curves.png` beside `metrics.jsonl`: a 1200×800 PNG; without a font the run still succeeds
/// and warns.
#[test]
fn curves_png_is_drawn_and_a_missing_font_only_warns() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 30, 0);
    let out = dir.path().join("run");
    run(&config, &out, &["--steps", "10"]);
    let png = std::fs::read(out.join("curves.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let dims = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!((dims(16), dims(20)), (1200, 800), "IHDR width and height");
    assert!(
        png.len() > 10_000,
        "a drawn plot, not an empty canvas: {} bytes",
        png.len()
    );

    let out = dir.path().join("no-font");
    let output = command(&config, &out, &["--steps", "5"])
        .env("EMBER_FONT", dir.path().join("no-such-font.ttf"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        stderr.contains("curves.png not drawn") && stderr.contains("no-such-font.ttf"),
        "{stderr}"
    );
    assert!(!out.join("curves.png").exists());
}

/// The binary as `cargo install` leaves it (Note [Embedded files] in `data/src/embedded.rs`):
/// copied to another folder and run from an empty one, with a fresh home, it trains the smoke
/// run on the configuration, corpus and vocabulary it carries, and writes them into its cache
/// folder, never reading the checkout it was built in (whose paths it does not even contain).
#[test]
fn a_copied_binary_trains_from_an_empty_folder() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin/ember");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_ember"), &bin).unwrap();
    let bytes = std::fs::read(&bin).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for asset in ["data/corpus", "configs", "bench/reference"] {
        let path = root.join(asset);
        let needle = path.to_str().unwrap().as_bytes();
        assert!(
            !bytes.windows(needle.len()).any(|w| w == needle),
            "the binary names {}",
            path.display()
        );
    }
    let (home, work) = (dir.path().join("home"), dir.path().join("work"));
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let ember = |args: &[&str]| {
        Command::new(&bin)
            .args(args)
            .current_dir(&work)
            .env("HOME", &home)
            .env_remove("XDG_CACHE_HOME")
            .env_remove("EMBER_CACHE_DIR")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    };
    let output = ember(&[
        "train",
        "--steps",
        "2",
        "--eval-every",
        "2",
        "--eval-samples",
        "16",
        "--no-progress",
        "--out",
        "run",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("2 steps of 8 samples"), "{stdout}");
    assert!(work.join("run/model.safetensors").is_file());
    let cached: Vec<String> = std::fs::read_dir(home.join(".cache/ember/embedded"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(cached.len(), 2, "{cached:?}");
    assert!(
        cached.iter().any(|n| n.starts_with("wiki_vital_en-")),
        "{cached:?}"
    );
    // A shipped configuration by name; a name that is neither a file nor shipped lists them.
    let output = ember(&["train", "--config", "no-such-config", "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("no-such-config") && stderr.contains("mlperf-bert-large-lamb"),
        "{stderr}"
    );
}

/// On/off settings have their `--no-` form (the later flag wins); a cadence given on the
/// command line replaces the config's other one; settings without effect are refused.
#[test]
fn flags_switch_settings_both_ways() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(config(dir.path(), 1, 0)).unwrap();
    let lamb = dir.path().join("lamb.toml");
    std::fs::write(
        &lamb,
        base.replace(
            "[optimizer]\n",
            "[optimizer]\nname = \"lamb\"\nnvlamb = true\n",
        ),
    )
    .unwrap();
    let saved_nvlamb = |out: &Path| -> bool {
        let text = std::fs::read_to_string(out.join("train_config.toml")).unwrap();
        text.contains("nvlamb = true")
    };
    for (flags, expected) in [
        (&["--no-nvlamb"][..], false),
        (&["--nvlamb", "--no-nvlamb"][..], false),
        (&["--no-nvlamb", "--nvlamb"][..], true),
        (&[][..], true),
    ] {
        let out = dir.path().join(format!("run-{}", flags.join("")));
        run(&lamb, &out, flags);
        assert_eq!(saved_nvlamb(&out), expected, "{flags:?}");
    }
    // --eval-interval-samples replaces the config's eval_every (the saved config has no
    // eval_every), and the two flags together are refused by the parser.
    let out = dir.path().join("by-samples");
    run(&lamb, &out, &["--eval-interval-samples", "4"]);
    let saved = std::fs::read_to_string(out.join("train_config.toml")).unwrap();
    assert!(
        saved.contains("eval_interval_samples = 4") && !saved.contains("eval_every"),
        "{saved}"
    );
    let both = command(
        &lamb,
        &dir.path().join("both"),
        &["--eval-every", "2", "--eval-interval-samples", "4"],
    )
    .output()
    .unwrap();
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
    // NVLAMB with AdamW would change nothing: refused, naming the setting.
    let adamw = command(&lamb, &dir.path().join("adamw"), &["--optimizer", "adamw"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&adamw.stderr);
    assert!(!adamw.status.success());
    assert!(stderr.contains("optimizer.nvlamb"), "{stderr}");
}

/// The CPU's GEMMs run on its own vector units: where OpenBLAS takes the CPU for an older one
/// (Debian's 0.3.21 on a Sapphire Rapids Xeon: SSE3 kernels, half the training speed), ember
/// starts again with `OPENBLAS_CORETYPE` naming this CPU's kernels (trainer/src/blas.rs). A
/// user's `OPENBLAS_CORETYPE` is kept, even a slower one.
#[test]
fn the_cpu_gemm_runs_on_this_cpus_vector_units() {
    use ember_trainer::blas::SimdLevel;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 1, 1);
    // The kernels of the start-up log's `CPU GEMM` line, e.g. `OpenBLAS 0.3.21 (SkylakeX
    // kernels, …`, and the log.
    let kernels = |coretype: Option<&str>| {
        let mut command = command(&config, &dir.path().join("run"), &["--eval-every", "1"]);
        command.env("RUST_LOG", "info");
        match coretype {
            Some(name) => command.env("OPENBLAS_CORETYPE", name),
            None => command.env_remove("OPENBLAS_CORETYPE"),
        };
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{stderr}");
        let line = stderr
            .lines()
            .find(|l| l.contains("CPU GEMM"))
            .unwrap_or_else(|| panic!("no CPU GEMM line: {stderr}"));
        let name = line
            .split(" (")
            .nth(1)
            .and_then(|rest| rest.split(" kernels").next())
            .unwrap_or_else(|| panic!("no kernels named: {line}"))
            .to_string();
        (name, stderr)
    };
    let cpu = SimdLevel::of_this_cpu();
    let (chosen, log) = kernels(None);
    match SimdLevel::of_openblas_core(&chosen) {
        // A core newer than ember's list is OpenBLAS's own right choice.
        None => {}
        Some(level) => assert!(
            level >= cpu.min(SimdLevel::Avx2),
            "{chosen} kernels ({level}) on a CPU with {cpu}:\n{log}"
        ),
    }
    if cfg!(target_arch = "x86_64") {
        let (kept, log) = kernels(Some("Prescott"));
        assert_eq!(kept, "Prescott", "{log}");
        assert!(!log.contains("starting again"), "{log}");
    }
}

/// `--hidden-act` (`model.hidden_act`) takes Hugging Face's names, and a refused one is named
/// with the accepted ones.
#[test]
fn hidden_act_takes_hugging_faces_names() {
    let parse =
        |value: &str| xtask::parse_error(&["train".into(), "--hidden-act".into(), value.into()]);
    for name in ["gelu", "gelu_new", "gelu_pytorch_tanh"] {
        assert_eq!(parse(name), None, "{name}");
    }
    let e = parse("relu").expect("relu is refused");
    assert!(e.contains("relu") && e.contains("gelu_new"), "{e}");
}
