//! The TCP rendezvous between processes, as torchrun starts them: each process is this test
//! binary started again with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` in its
//! environment; it reads them as a GPU rank does ([`LaunchEnv::from_env`]) and fetches (rank
//! 0: serves) a 128-byte id, then prints it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ember_trainer::parallel::{LaunchEnv, LaunchSource, exchange_unique_id};

/// Set in the environment of a process started by [`spawn`].
const CHILD: &str = "EMBER_RENDEZVOUS_TEST_CHILD";

/// The body of a started process (a no-op in the normal test run).
#[test]
fn rendezvous_child() {
    let Ok(timeout_ms) = std::env::var(CHILD) else {
        return;
    };
    let launch = LaunchEnv::from_env(None).unwrap();
    assert_eq!(launch.source, LaunchSource::Torchrun);
    let timeout = Duration::from_millis(timeout_ms.parse().unwrap());
    // Rank 0's id: 128 bytes that differ between runs (its process id in them).
    let id = || {
        Ok((0..128u32)
            .map(|i| (std::process::id() + i * 31) as u8)
            .collect())
    };
    match exchange_unique_id(&launch, timeout, id) {
        // On a line of its own (the test harness has printed the test's name).
        Ok(blob) => println!("\nID {}", hex(&blob)),
        Err(e) => println!("\nERR {e}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts rank `rank` of `world_size` as a process of its own.
fn spawn(rank: usize, world_size: usize, port: u16, timeout: Duration) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rendezvous_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, timeout.as_millis().to_string())
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world_size.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// What a started process printed: `ID <hex>` or `ERR <message>`.
fn outcome(child: Child) -> String {
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    stdout
        .lines()
        .find(|l| l.starts_with("ID ") || l.starts_with("ERR "))
        .unwrap_or_else(|| panic!("no outcome in {stdout:?}"))
        .to_string()
}

#[test]
fn processes_exchange_rank_zeros_id() {
    for world_size in [2, 4] {
        let port = free_port();
        // The other ranks first: they wait for rank 0 to listen.
        let mut children: Vec<(usize, Child)> = (1..world_size)
            .rev()
            .map(|rank| (rank, spawn(rank, world_size, port, Duration::from_secs(30))))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        children.push((0, spawn(0, world_size, port, Duration::from_secs(30))));
        children.sort_by_key(|(rank, _)| *rank);
        let outcomes: Vec<String> = children.into_iter().map(|(_, c)| outcome(c)).collect();
        assert!(outcomes[0].starts_with("ID "), "{outcomes:?}");
        assert_eq!(outcomes[0].len(), 3 + 256, "128 bytes");
        for o in &outcomes {
            assert_eq!(o, &outcomes[0], "world {world_size}: {outcomes:?}");
        }
    }
}

#[test]
fn a_missing_rank_zero_ends_in_a_timeout_naming_the_address() {
    let port = free_port();
    let started = Instant::now();
    let o = outcome(spawn(1, 2, port, Duration::from_millis(1500)));
    assert!(o.starts_with("ERR "), "{o}");
    assert!(o.contains(&format!("127.0.0.1:{port}")), "{o}");
    assert!(o.contains("no answer from rank 0 within 1.5 s"), "{o}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_world_mismatch_is_refused_on_both_sides() {
    let port = free_port();
    let rank0 = spawn(0, 2, port, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(200));
    let rank1 = spawn(1, 3, port, Duration::from_secs(20));
    let (zero, one) = (outcome(rank0), outcome(rank1));
    for o in [&zero, &one] {
        assert!(o.starts_with("ERR "), "{o}");
        assert!(
            o.contains("rank 1 has world size 3 but rank 0 has 2"),
            "{o}"
        );
    }
}
