//! The data commands as a user runs them: prepare-data → stratify → balance-report on a slice
//! of the embedded corpus, and the errors a user sees for bad input.

use std::path::Path;
use std::process::{Command, Output};

fn xtask(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask"))
        .args(args)
        .output()
        .expect("the xtask binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn prepare_stratify_and_report_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let text = ember_data::embedded::corpus_text();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(
        &corpus,
        text.split("\n\n")
            .take(300)
            .collect::<Vec<_>>()
            .join("\n\n"),
    )
    .unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let (shards, strat, report) = (
        dir.path().join("shards"),
        dir.path().join("strat"),
        dir.path().join("report"),
    );

    let o = xtask(&[
        "prepare-data",
        "--corpus",
        &p(&corpus),
        "--out",
        &p(&shards),
        "--seq-len",
        "128",
        "--num-shards",
        "4",
        "--dupe-factor",
        "2",
        "--compression",
        "gzip:1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("270 documents (30 held out)"), "{out}");
    assert!(
        out.contains("tokens/s") && out.contains("peak memory"),
        "{out}"
    );
    // `bench data` reads these numbers from this summary (xtask/src/bench_data.rs).
    let number = |key| xtask::number_after(&out, key);
    assert!(number("→").is_some_and(|n| n >= 1.0), "{out}");
    assert!(number("samples,").is_some_and(|t| t > 0.0), "{out}");
    assert!(number("throughput:").is_some_and(|r| r > 0.0), "{out}");
    assert!(number("peak memory").is_some_and(|m| m > 0.0), "{out}");
    assert_eq!(number("missing"), None);
    let text = "prepare-data: 2000 documents (0 held out) → 3559 samples, 326417 tokens in 4 shards under eb1 (S = 128, P = 20)\nthroughput: 1,608,210 tokens/s (0.2 s, 1 worker(s)); peak memory 63 MiB\n";
    assert_eq!(xtask::number_after(text, "samples,"), Some(326417.0));
    assert_eq!(xtask::number_after(text, "throughput:"), Some(1608210.0));
    assert_eq!(xtask::number_after(text, "peak memory"), Some(63.0));
    assert_eq!(std::fs::read_dir(&shards).unwrap().count(), 4);

    let o = xtask(&[
        "stratify",
        "--in",
        &p(&shards),
        "--out",
        &p(&strat),
        "--bins",
        "64,128",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("len_1-64") && stdout(&o).contains("len_65-128"));

    let o = xtask(&[
        "balance-report",
        "--data",
        &p(&strat),
        "--world-size",
        "2,4",
        "--local-batch",
        "8",
        "--steps",
        "5",
        "--out",
        &p(&report),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let md = std::fs::read_to_string(report.join("balance.md")).unwrap();
    assert_eq!(stdout(&o).lines().next(), md.lines().next());
    assert!(md.contains("**W = 2**") && md.contains("**W = 4**"), "{md}");
    // 3 samplers × (max, dynamic, grouped k=2, grouped k=4) per world size.
    assert_eq!(md.matches("| presort |").count(), 8, "{md}");
    assert!(
        md.contains("| random | max | ") && md.contains("| 1.000 | 1.000 |"),
        "{md}"
    );
    let png = std::fs::read(report.join("balance.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 10_000, "a plot, not an empty image");
}

#[test]
fn bad_data_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x");
    let out = out.to_str().unwrap();
    // A corpus that does not exist.
    let o = xtask(&[
        "prepare-data",
        "--corpus",
        "/nonexistent/corpus.txt",
        "--out",
        out,
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("/nonexistent/corpus.txt"),
        "{}",
        stderr(&o)
    );
    // A shard folder with a non-HDF5 file.
    let bad = dir.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("part-0.hdf5"), "not hdf5").unwrap();
    let o = xtask(&[
        "balance-report",
        "--data",
        bad.to_str().unwrap(),
        "--out",
        out,
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("part-0.hdf5") && stderr(&o).contains("HDF5"),
        "{}",
        stderr(&o)
    );
    // Unsorted bin edges.
    let o = xtask(&[
        "stratify",
        "--in",
        bad.to_str().unwrap(),
        "--out",
        out,
        "--bins",
        "256,128",
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("not strictly ascending"),
        "{}",
        stderr(&o)
    );
    // Sampler flags without shards.
    let o = xtask(&[
        "train",
        "--sampler",
        "presort",
        "--steps",
        "1",
        "--out",
        out,
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("data.shards"), "{}", stderr(&o));
}
