//! The rendezvous through torchrun's store: against PyTorch's own bytes (a recorded exchange),
//! and its refusals against a store in this process that answers as the protocol says (Note
//! [TCPStore wire protocol]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::RendezvousError;
use super::agent_store::{exchange, exchange_with_nonce};

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// `trainer/tests/fixtures/tcpstore_exchange.json` (made by `record_tcpstore_exchange.py` in
/// that folder with torch 2.15.0): PyTorch's TCPStore clients doing what ember's ranks 0 and 1
/// do, through a recording proxy to PyTorch's libuv server. Replayed to ember's client, each
/// rank must send exactly what PyTorch's client sent and read the server's answers.
#[test]
fn recorded_exchange_replays_byte_for_byte() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tcpstore_exchange.json"
    );
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let blob = hex(record["blob"].as_str().unwrap());
    for rank in [0usize, 1] {
        let side = &record["ranks"][rank.to_string()];
        let nonce = side["nonce"].as_u64().unwrap() as u32;
        let chunks: Vec<(String, Vec<u8>)> = side["exchange"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c[0].as_str().unwrap().to_string(),
                    hex(c[1].as_str().unwrap()),
                )
            })
            .collect();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut offset = 0;
            for (from, bytes) in chunks {
                if from == "c" {
                    let mut got = vec![0u8; bytes.len()];
                    stream.read_exact(&mut got).unwrap();
                    if let Some(i) = (0..got.len()).find(|&i| got[i] != bytes[i]) {
                        panic!(
                            "rank {rank}: client byte {} is {:#04x}, PyTorch's client sent \
                             {:#04x}",
                            offset + i,
                            got[i],
                            bytes[i]
                        );
                    }
                    offset += bytes.len();
                } else {
                    stream.write_all(&bytes).unwrap();
                }
            }
            // Nothing more: the client hangs up after the last answer.
            let mut rest = Vec::new();
            stream.read_to_end(&mut rest).unwrap();
            assert!(
                rest.is_empty(),
                "rank {rank}: {} bytes more than PyTorch's client",
                rest.len()
            );
        });
        let expected = blob.clone();
        let got = exchange_with_nonce(
            "127.0.0.1",
            port,
            rank,
            2,
            0,
            Duration::from_secs(10),
            nonce,
            move || Ok(expected),
        )
        .unwrap();
        assert_eq!(got, blob, "rank {rank}");
        server.join().unwrap();
    }
}

/// A c10d TCPStore server in this process: the queries ember sends, answered as PyTorch's
/// servers answer them.
struct FakeStore {
    port: u16,
}

#[derive(Default)]
struct Data {
    keys: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

impl FakeStore {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let data = Arc::new(Data::default());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let data = data.clone();
                std::thread::spawn(move || {
                    let _ = serve(stream.unwrap(), &data);
                });
            }
        });
        Self { port }
    }
}

fn read_u64(s: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b)?;
    Ok(u64::from_ne_bytes(b))
}

fn read_bytes(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let len = read_u64(s)? as usize;
    let mut b = vec![0u8; len];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// One client's queries until it hangs up.
fn serve(mut s: TcpStream, data: &Data) -> std::io::Result<()> {
    let mut magic = [0u8; 5];
    s.read_exact(&mut magic)?;
    assert_eq!(magic, [0, 0xce, 0xf7, 0x85, 0x3c], "VALIDATE first");
    loop {
        let mut query = [0u8; 1];
        if s.read_exact(&mut query).is_err() {
            return Ok(());
        }
        match query[0] {
            13 => {
                let mut nonce = [0u8; 4];
                s.read_exact(&mut nonce)?;
                s.write_all(&nonce)?;
            }
            1 => {
                let (key, value) = (read_bytes(&mut s)?, read_bytes(&mut s)?);
                data.keys.lock().unwrap().insert(key, value);
                data.changed.notify_all();
            }
            3 => {
                let key = read_bytes(&mut s)?;
                let value = data.keys.lock().unwrap().get(&key).cloned().unwrap();
                s.write_all(&(value.len() as u64).to_ne_bytes())?;
                s.write_all(&value)?;
            }
            4 => {
                let key = read_bytes(&mut s)?;
                let mut delta = [0u8; 8];
                s.read_exact(&mut delta)?;
                let mut keys = data.keys.lock().unwrap();
                let old: i64 = keys
                    .get(&key)
                    .map_or(0, |v| String::from_utf8_lossy(v).parse().unwrap());
                let new = old + i64::from_ne_bytes(delta);
                keys.insert(key, new.to_string().into_bytes());
                data.changed.notify_all();
                s.write_all(&new.to_ne_bytes())?;
            }
            5 | 6 => {
                let n = read_u64(&mut s)?;
                let keys: Vec<Vec<u8>> = (0..n)
                    .map(|_| read_bytes(&mut s))
                    .collect::<Result<_, _>>()?;
                let all_there =
                    |map: &HashMap<Vec<u8>, Vec<u8>>| keys.iter().all(|k| map.contains_key(k));
                if query[0] == 5 {
                    let ready = all_there(&data.keys.lock().unwrap());
                    s.write_all(&[if ready { 0 } else { 1 }])?;
                    continue;
                }
                // WAIT: answer once the keys exist, or take a CANCEL_WAIT.
                s.set_nonblocking(true)?;
                loop {
                    let map = data.keys.lock().unwrap();
                    if all_there(&map) {
                        s.set_nonblocking(false)?;
                        s.write_all(&[0])?;
                        break;
                    }
                    let _ = data
                        .changed
                        .wait_timeout(map, Duration::from_millis(10))
                        .unwrap();
                    let mut cancel = [0u8; 1];
                    match s.read(&mut cancel) {
                        Ok(1) => {
                            assert_eq!(cancel[0], 12, "only CANCEL_WAIT during a wait");
                            s.set_nonblocking(false)?;
                            s.write_all(&[1])?;
                            break;
                        }
                        Ok(_) => return Ok(()),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            other => panic!("query {other} is not one ember sends"),
        }
    }
}

/// Runs `ranks` (rank, world size) against one store, each in a thread (rank 0 after the
/// others by `rank_zero_late`); their outcomes in the same order.
fn run_late(
    store: &FakeStore,
    ranks: &[(usize, usize)],
    timeout: Duration,
    rank_zero_late: Duration,
) -> Vec<Result<Vec<u8>, RendezvousError>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&(rank, world)| {
                let port = store.port;
                scope.spawn(move || {
                    if rank == 0 {
                        std::thread::sleep(rank_zero_late);
                    }
                    exchange("127.0.0.1", port, rank, world, 0, timeout, || {
                        Ok((0..128).map(|i| (i * 7) as u8).collect())
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn run(
    store: &FakeStore,
    ranks: &[(usize, usize)],
    timeout: Duration,
) -> Vec<Result<Vec<u8>, RendezvousError>> {
    run_late(store, ranks, timeout, Duration::ZERO)
}

#[test]
fn three_ranks_get_rank_zeros_blob() {
    let store = FakeStore::start();
    let outcomes = run(&store, &[(2, 3), (1, 3), (0, 3)], Duration::from_secs(20));
    let blob: Vec<u8> = (0..128).map(|i| (i * 7) as u8).collect();
    for outcome in outcomes {
        assert_eq!(outcome.unwrap(), blob);
    }
}

#[test]
fn a_world_mismatch_fails_every_rank_with_rank_zeros_message() {
    let store = FakeStore::start();
    let outcomes = run(&store, &[(0, 2), (1, 3)], Duration::from_secs(20));
    for outcome in outcomes {
        let e = outcome.unwrap_err().to_string();
        assert!(
            e.contains("rank 1 has world size 3 but rank 0 has 2"),
            "{e}"
        );
        assert!(e.contains("torchrun's store"), "{e}");
        assert_eq!(e.matches("rendezvous at").count(), 1, "{e}");
    }
    // A rank outside rank 0's world is not waited for there: it finds out by itself.
    let store = FakeStore::start();
    let outcomes = run(&store, &[(0, 2), (1, 2), (2, 3)], Duration::from_secs(20));
    assert!(outcomes[0].is_ok() && outcomes[1].is_ok());
    let e = outcomes[2].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("rank 2 has world size 3 but rank 0 has 2"),
        "{e}"
    );
}

#[test]
fn missing_and_duplicate_ranks_are_named() {
    let store = FakeStore::start();
    let outcomes = run(&store, &[(0, 3), (1, 3)], Duration::from_millis(1500));
    let zero = outcomes[0].as_ref().unwrap_err();
    assert!(
        matches!(zero, RendezvousError::MissingRanks { missing, .. } if missing == &[2]),
        "{zero}"
    );
    let one = outcomes[1].as_ref().unwrap_err().to_string();
    assert!(one.contains("rank(s) [2] did not arrive"), "{one}");
    // Two processes with RANK=1: the second refuses itself, rank 0 refuses the job.
    let store = FakeStore::start();
    let outcomes = run_late(
        &store,
        &[(1, 2), (1, 2), (0, 2)],
        Duration::from_secs(5),
        Duration::from_millis(500),
    );
    for outcome in &outcomes {
        let e = outcome.as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1 came twice"), "{e}");
    }
}

#[test]
fn no_store_is_a_timeout_naming_the_address() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let e = exchange(
        "127.0.0.1",
        port,
        1,
        2,
        0,
        Duration::from_millis(700),
        || unreachable!("only rank 0 makes the id"),
    )
    .unwrap_err();
    assert!(matches!(e, RendezvousError::NoStore { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    assert!(started.elapsed() < Duration::from_secs(5));
}
