//! ember's own rendezvous server, for launchers that leave `MASTER_PORT` free (srun, a plain
//! environment, torchrun without its agent store): rank 0 listens on `MASTER_PORT` and hands
//! the blob to every other rank, as PyTorch's rank 0 serves a `TCPStore` there for `env://`
//! initialisation.
//!
//! Protocol (one connection per rank, big-endian integers): the rank sends
//! `b"EMBER-RDZV"`, a version byte, its rank and its world size as `u32`; rank 0 answers with a
//! status byte (0: the blob follows; 1: a refusal, a UTF-8 message follows) and a `u32` length.
//! Rank 0 refuses a world size other than its own, a rank outside the world and a rank that has
//! already been served, and fails itself after answering, naming both sides. Every wait is
//! bounded by the timeout; a missing rank 0 or a missing rank is an error naming the address.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::RendezvousError;

const MAGIC: &[u8; 10] = b"EMBER-RDZV";
const VERSION: u8 = 1;
/// Largest blob or message accepted (a unique id is 128 bytes).
const MAX_PAYLOAD: u32 = 1 << 16;

/// Hands `make_blob()`'s bytes from rank 0 to every rank through `host:port` and returns
/// them (on rank 0 too). Rank 0 listens on every interface at `port` and returns once each
/// of the `world_size − 1` other ranks has its copy; the others connect to `host:port`,
/// retrying until rank 0 listens.
///
/// # Errors
/// [`RendezvousError`] naming `host:port`: rank 0 never answered, a rank never came, world
/// sizes differ (both sides fail), a rank came twice or out of range, the port is taken.
pub fn exchange(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    make_blob: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, RendezvousError> {
    let addr = format!("{host}:{port}");
    if rank == 0 {
        let blob = make_blob().map_err(|message| RendezvousError::Refused {
            addr: addr.clone(),
            message: format!("rank 0 could not make the id: {message}"),
        })?;
        serve(&addr, host, port, world_size, timeout, &blob)?;
        Ok(blob)
    } else {
        fetch(&addr, rank, world_size, timeout)
    }
}

/// Rank 0: answers each other rank once.
fn serve(
    addr: &str,
    host: &str,
    port: u16,
    world_size: usize,
    timeout: Duration,
    blob: &[u8],
) -> Result<(), RendezvousError> {
    let address_error = |reason: String| RendezvousError::Address {
        addr: addr.to_string(),
        reason,
    };
    // Every interface, in the family MASTER_ADDR resolves to (as PyTorch's TCPStore server).
    let ipv6 = (host, port)
        .to_socket_addrs()
        .map_err(|e| address_error(format!("cannot resolve {host}: {e}")))?
        .next()
        .is_some_and(|a| a.is_ipv6());
    let bind: SocketAddr = if ipv6 {
        (std::net::Ipv6Addr::UNSPECIFIED, port).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, port).into()
    };
    let listener = TcpListener::bind(bind).map_err(|e| {
        address_error(format!(
            "rank 0 cannot listen on port {port}: {e} (is another job, or the launcher's own \
             store, using MASTER_PORT?)"
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| address_error(e.to_string()))?;
    let deadline = Instant::now() + timeout;
    let mut served = BTreeSet::new();
    let mut refusal = None;
    while served.len() + 1 < world_size {
        let now = Instant::now();
        if now >= deadline {
            return Err(RendezvousError::MissingRanks {
                addr: addr.to_string(),
                missing: (1..world_size).filter(|r| !served.contains(r)).collect(),
                timeout_s: timeout.as_secs_f64(),
            });
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(address_error(format!("accepting a connection: {e}"))),
        };
        // A peer gets a few seconds to say who it is; a stray connection is dropped.
        let patience = (deadline - now).min(Duration::from_secs(10));
        match answer(stream, patience, world_size, &served, blob) {
            Ok(Some(rank)) => {
                served.insert(rank);
            }
            Ok(None) => {}
            Err(e) => {
                refusal = Some(e);
                break;
            }
        }
    }
    match refusal {
        Some(e) => Err(with_addr(e, addr)),
        None => Ok(()),
    }
}

/// Reads one hello and answers it: `Ok(Some(rank))` when served, `Ok(None)` for a connection
/// that is not a rank of this protocol, `Err` after refusing a rank of another world (the
/// refusal is this job's error too).
fn answer(
    mut stream: TcpStream,
    patience: Duration,
    world_size: usize,
    served: &BTreeSet<usize>,
    blob: &[u8],
) -> Result<Option<usize>, RendezvousError> {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(patience));
    let _ = stream.set_write_timeout(Some(patience));
    let mut hello = [0u8; MAGIC.len() + 1 + 8];
    if stream.read_exact(&mut hello).is_err() || &hello[..MAGIC.len()] != MAGIC {
        return Ok(None);
    }
    let version = hello[MAGIC.len()];
    let rank = u32::from_be_bytes(hello[MAGIC.len() + 1..MAGIC.len() + 5].try_into().unwrap());
    let theirs = u32::from_be_bytes(hello[MAGIC.len() + 5..].try_into().unwrap());
    let (rank, theirs) = (rank as usize, theirs as usize);
    let refuse = |stream: &mut TcpStream, message: String| {
        let _ = reply(stream, 1, message.as_bytes());
        message
    };
    if version != VERSION {
        let message = refuse(
            &mut stream,
            format!("rank {rank} speaks rendezvous version {version}, rank 0 version {VERSION}"),
        );
        return Err(RendezvousError::Refused {
            addr: String::new(),
            message,
        });
    }
    if theirs != world_size {
        refuse(
            &mut stream,
            format!(
                "rank {rank} has world size {theirs} but rank 0 has {world_size}: start every \
                 rank with the same WORLD_SIZE"
            ),
        );
        return Err(RendezvousError::WorldMismatch {
            addr: String::new(),
            rank,
            theirs,
            ours: world_size,
        });
    }
    if rank == 0 || rank >= world_size || served.contains(&rank) {
        let message = refuse(
            &mut stream,
            format!(
                "rank {rank} came twice or is not a rank of a world of {world_size} (two \
                 processes with the same RANK?)"
            ),
        );
        return Err(RendezvousError::Refused {
            addr: String::new(),
            message,
        });
    }
    match reply(&mut stream, 0, blob) {
        Ok(()) => Ok(Some(rank)),
        // The rank went away before it had its copy: it will retry or fail on its side.
        Err(_) => Ok(None),
    }
}

fn reply(stream: &mut TcpStream, status: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut message = Vec::with_capacity(5 + payload.len());
    message.push(status);
    message.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    message.extend_from_slice(payload);
    stream.write_all(&message)?;
    stream.flush()
}

fn with_addr(e: RendezvousError, addr: &str) -> RendezvousError {
    match e {
        RendezvousError::Refused { message, .. } => RendezvousError::Refused {
            addr: addr.to_string(),
            message,
        },
        RendezvousError::WorldMismatch {
            rank, theirs, ours, ..
        } => RendezvousError::WorldMismatch {
            addr: addr.to_string(),
            rank,
            theirs,
            ours,
        },
        other => other,
    }
}

/// A rank other than 0: connects (retrying until rank 0 listens) and reads the blob.
fn fetch(
    addr: &str,
    rank: usize,
    world_size: usize,
    timeout: Duration,
) -> Result<Vec<u8>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let mut last_error = String::from("no attempt");
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(RendezvousError::NoRankZero {
                addr: addr.to_string(),
                timeout_s: timeout.as_secs_f64(),
                last_error,
            });
        }
        match try_fetch(addr, rank, world_size, deadline - now) {
            Ok(blob) => return Ok(blob),
            Err(Attempt::Retry(e)) => {
                last_error = e;
                std::thread::sleep(Duration::from_millis(100).min(deadline - Instant::now()));
            }
            Err(Attempt::Refused(message)) => {
                return Err(RendezvousError::Refused {
                    addr: addr.to_string(),
                    message: format!("rank 0 refused rank {rank}: {message}"),
                });
            }
        }
    }
}

enum Attempt {
    /// Rank 0 is not (yet) there or hung up: try again until the deadline.
    Retry(String),
    /// Rank 0 answered with a refusal.
    Refused(String),
}

fn try_fetch(
    addr: &str,
    rank: usize,
    world_size: usize,
    left: Duration,
) -> Result<Vec<u8>, Attempt> {
    let retry = |e: std::io::Error| Attempt::Retry(e.to_string());
    let target = addr
        .to_socket_addrs()
        .map_err(retry)?
        .next()
        .ok_or_else(|| Attempt::Retry(format!("{addr} resolves to no address")))?;
    let mut stream =
        TcpStream::connect_timeout(&target, left.min(Duration::from_secs(2))).map_err(retry)?;
    stream.set_read_timeout(Some(left)).map_err(retry)?;
    stream.set_write_timeout(Some(left)).map_err(retry)?;
    let mut hello = Vec::with_capacity(MAGIC.len() + 9);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&(rank as u32).to_be_bytes());
    hello.extend_from_slice(&(world_size as u32).to_be_bytes());
    stream.write_all(&hello).map_err(retry)?;
    let mut header = [0u8; 5];
    stream.read_exact(&mut header).map_err(retry)?;
    let len = u32::from_be_bytes(header[1..].try_into().unwrap());
    if len > MAX_PAYLOAD {
        return Err(Attempt::Refused(format!(
            "answer of {len} bytes: not an ember rank 0"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload).map_err(retry)?;
    match header[0] {
        0 => Ok(payload),
        _ => Err(Attempt::Refused(
            String::from_utf8_lossy(&payload).into_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn threads_exchange_the_blob() {
        let port = free_port();
        let blob: Vec<u8> = (0..128).map(|i| (i * 7 % 251) as u8).collect();
        let results: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let blob = blob.clone();
                    scope.spawn(move || {
                        exchange("127.0.0.1", port, rank, 3, Duration::from_secs(20), || {
                            Ok(blob)
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for result in results {
            assert_eq!(result.unwrap(), blob);
        }
    }

    #[test]
    fn a_rank_without_rank_zero_times_out_naming_the_address() {
        let port = free_port();
        let started = Instant::now();
        let error = exchange("127.0.0.1", port, 1, 2, Duration::from_millis(600), || {
            unreachable!("only rank 0 makes the id")
        })
        .unwrap_err();
        assert!(
            matches!(error, RendezvousError::NoRankZero { .. }),
            "{error}"
        );
        assert!(
            error.to_string().contains(&format!("127.0.0.1:{port}")),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn rank_zero_names_the_ranks_that_never_came() {
        let port = free_port();
        let error = exchange("127.0.0.1", port, 0, 3, Duration::from_millis(400), || {
            Ok(vec![1; 128])
        })
        .unwrap_err();
        assert_eq!(
            error,
            RendezvousError::MissingRanks {
                addr: format!("127.0.0.1:{port}"),
                missing: vec![1, 2],
                timeout_s: 0.4
            }
        );
    }
}
