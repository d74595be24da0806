//! ember under the launchers users start it with. Multi-process data parallelism through MPI:
//! `mpirun -np 2` ends with the same parameters as two in-process ranks. The test build
//! enables xtask's `mpi` feature (xtask/Cargo.toml's dev-dependencies); it needs OpenMPI
//! (Debian: libopenmpi-dev, openmpi-bin and libclang-dev, which `.ci/run` installs). And a
//! real torchrun, where the machine has PyTorch: its ranks find each other through the
//! agent's store.

use std::path::Path;
use std::process::Command;

/// Tiny model without dropout; one masked token per sample so that rank means average to the
/// global mean (as in tests/tests/integration/data_parallel/mod.rs).
const CONFIG: &str = r#"
[model]
preset = "tiny"
hidden_dropout_prob = 0.0
attention_probs_dropout_prob = 0.0

[instances]
max_seq_length = 64
max_predictions_per_seq = 1
dupe_factor = 1

[train]
steps = 3
batch_size = 2
eval_every = 3
eval_samples = 16
log_every = 1

[parallel]
clip = "global"
timeout_s = 120.0
"#;

fn ember(args: &[&str], dir: &Path) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running the ember binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "ember {args:?} failed:\n{text}");
    text
}

#[test]
fn mpirun_two_processes_equal_two_in_process_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("dp.toml");
    std::fs::write(&config, CONFIG).unwrap();
    let config = config.to_str().unwrap();
    let threads = ember(
        &[
            "train",
            "--config",
            config,
            "--nproc",
            "2",
            "--out",
            "threads",
            "--no-progress",
        ],
        dir.path(),
    );
    assert!(threads.contains("on 2 rank(s)"), "{threads}");
    let mpi = ember(
        &[
            "launch",
            "--nproc",
            "2",
            "--",
            "train",
            "--config",
            config,
            "--out",
            "mpi",
            "--no-progress",
        ],
        dir.path(),
    );
    assert!(mpi.contains("on 2 rank(s)"), "{mpi}");
    // One summary line: only rank 0 reports.
    assert_eq!(mpi.matches("ember: 3 steps").count(), 1, "{mpi}");
    let worst = ember_tests::assert_same_weights(
        &dir.path().join("threads/model.safetensors"),
        &dir.path().join("mpi/model.safetensors"),
        1e-5,
    );
    eprintln!("largest difference between MPI and in-process ranks: {worst:e}");
}

/// 1-bit Adam and 1-bit LAMB over MPI (the compressed allreduce's all-to-all and allgather on
/// MPI_Ialltoall and MPI_Iallgatherv) end with the parameters of two in-process ranks: two
/// warm-up steps, then three compressed.
#[test]
fn onebit_optimizers_over_mpirun_equal_in_process_ranks() {
    for optimizer in ["onebit-adam", "onebit-lamb"] {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("onebit.toml");
        std::fs::write(
            &config,
            CONFIG
                .replace("steps = 3", "steps = 5")
                .replace("eval_every = 3", "eval_every = 5"),
        )
        .unwrap();
        let config = config.to_str().unwrap();
        let flags = [
            "train",
            "--config",
            config,
            "--optimizer",
            optimizer,
            "--freeze-step",
            "2",
            "--no-progress",
            "--out",
        ];
        let mut threads = flags.to_vec();
        threads.extend(["threads", "--nproc", "2"]);
        ember(&threads, dir.path());
        let mut mpi = vec!["launch", "--nproc", "2", "--"];
        mpi.extend(flags);
        mpi.push("mpi");
        let text = ember(&mpi, dir.path());
        assert!(text.contains("ember: 5 steps"), "{text}");
        let metrics = std::fs::read_to_string(dir.path().join("mpi/metrics.jsonl")).unwrap();
        let compressed = metrics.matches("\"compressed\":true").count();
        assert_eq!(compressed, 3, "{optimizer}: {metrics}");
        let worst = ember_tests::assert_same_weights(
            &dir.path().join("threads/model.safetensors"),
            &dir.path().join("mpi/model.safetensors"),
            1e-5,
        );
        eprintln!("{optimizer}: largest difference between MPI and in-process ranks: {worst:e}");
    }
}

/// The collectives of a launched job are timed by `comm-check`; a rank held back past the
/// timeout before an allgather ends the whole job with an error naming the allgather, well
/// before the held-back rank would have arrived.
#[test]
fn a_rank_stalled_in_allgather_ends_the_job_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let healthy = ember(
        &[
            "launch",
            "--nproc",
            "2",
            "--",
            "comm-check",
            "--mb",
            "1",
            "--rounds",
            "2",
        ],
        dir.path(),
    );
    assert!(healthy.contains("| allgather |"), "{healthy}");
    assert!(healthy.contains("| allreduce 1.0 MiB |"), "{healthy}");

    let started = std::time::Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_ember"))
        .args([
            "launch",
            "--nproc",
            "2",
            "--",
            "comm-check",
            "--timeout",
            "1",
            "--stall-rank",
            "1",
            "--stall-s",
            "60",
        ])
        .current_dir(dir.path())
        .output()
        .expect("running the ember binary");
    let elapsed = started.elapsed().as_secs_f64();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !output.status.success(),
        "a stalled rank must fail the job:\n{text}"
    );
    // The rank writes its error line in one write, so mpirun's own abort notice, which shares
    // the stream, cannot split it (CI once saw it split when the line went out in pieces).
    assert!(
        text.contains("error: allgather (lengths) #0 on MPI rank 0 timed out after 1.0 s"),
        "{text}"
    );
    // Rank 1 sleeps 60 s: ending well before it shows the timeout, not rank 1, ended the job.
    assert!(elapsed < 40.0, "the job took {elapsed:.1} s to end");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// torchrun (`EMBER_TORCHRUN`, else `torchrun` on the PATH, else the one beside
/// `EMBER_PYTHON`), if this machine has one.
fn torchrun() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("EMBER_TORCHRUN") {
        return Some(path.into());
    }
    let beside_python =
        std::env::var_os("EMBER_PYTHON").map(|p| Path::new(&p).with_file_name("torchrun"));
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("torchrun"));
    beside_python
        .into_iter()
        .chain(on_path)
        .find(|p| p.is_file())
}

/// Real torchrun, as a user starts a GPU job, without a GPU: its agent holds `MASTER_PORT`
/// (a worker that binds it fails), and ember's ranks join the agent's c10d store instead
/// (Note [Rendezvous through the agent's store]) and all hold rank 0's blob. On a machine
/// without PyTorch the same exchange is checked against PyTorch's recorded bytes
/// (`recorded_exchange_replays_byte_for_byte` in the trainer's unit tests); this test then
/// says so and checks nothing more.
#[test]
fn torchrun_ranks_meet_in_the_agents_store() {
    let Some(torchrun) = torchrun() else {
        eprintln!(
            "no torchrun here (set EMBER_TORCHRUN, or EMBER_PYTHON to a Python with torch): the \
             rendezvous is covered by the recorded exchange only"
        );
        return;
    };
    for (nodes, per_node) in [(1, 2), (1, 3)] {
        let output = Command::new(&torchrun)
            .args([
                &format!("--nnodes={nodes}"),
                &format!("--nproc-per-node={per_node}"),
                "--master-addr=127.0.0.1",
                &format!("--master-port={}", free_port()),
                "--no-python",
                env!("CARGO_BIN_EXE_ember"),
                "comm-check",
                "--rendezvous",
                "--timeout",
                "60",
            ])
            .env("RUST_LOG", "warn")
            .output()
            .expect("running torchrun");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "torchrun failed:\n{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("rank ")).collect();
        assert_eq!(lines.len(), per_node as usize, "{stdout}");
        let digests: std::collections::BTreeSet<&str> = lines
            .iter()
            .map(|l| l.rsplit(' ').next().unwrap())
            .collect();
        assert_eq!(digests.len(), 1, "every rank holds rank 0's blob: {stdout}");
        assert!(
            lines.iter().all(|l| l.contains("torchrun's agent store")),
            "{stdout}"
        );
    }
}
