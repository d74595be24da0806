//! `scripts/gpu-check.sh` runs only on a GPU machine, lent to a session for minutes: a flag
//! renamed since it was written would cost one of its parts. This test finds every command
//! the script gives this binary (`"$dir/xtask" ...`, also inside shell functions) and parses
//! it with the binary's own command line (`xtask::parse_error`), the shell's variables
//! standing for values of the kinds they hold.

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

#[test]
fn gpu_check_script_commands_parse() {
    let script = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/gpu-check.sh"
    ))
    .expect("scripts/gpu-check.sh");
    let script = script.replace("\\\n", " ");
    let mut commands: Vec<(String, Vec<String>)> = Vec::new();
    for line in script.lines() {
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
            // A shell function's body (`run_train() { "$dir/xtask" train ... "$@"; }`): every
            // call of it adds its own words.
            if let Some(name) = line
                .trim()
                .strip_suffix("")
                .and_then(|l| l.split_once("() {"))
            {
                let name = name.0.trim();
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
    let script = std::fs::read_to_string(format!("{root}/scripts/gpu-check.sh")).unwrap();
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
            stderr.contains(&format!("unknown part {named} (launch step gemm")),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("bins.tar.xz"), "{args:?}: {stderr}");
        assert!(
            !out_dir.path().join("out").exists(),
            "{args:?}: the run started"
        );
    }
}
