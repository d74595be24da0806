//! Rendezvous through torchrun's own store. Note [Rendezvous through the agent's store]:
//! torchrun (PyTorch ≥ 2.5, static and c10d rendezvous alike) serves a c10d `TCPStore` on
//! `MASTER_PORT` from its agent and tells its workers `TORCHELASTIC_USE_AGENT_STORE=True`; a
//! worker that binds the port itself fails with `EADDRINUSE`. PyTorch's workers join that
//! store as clients (`_create_c10d_store` in `torch/distributed/rendezvous.py`), and so do
//! ember's ranks: every rank says who it is, rank 0 checks that every rank arrived once with
//! its world size, then publishes NCCL's unique id and a verdict, which the others wait for.
//! A refusal is published as the verdict, so both sides fail with the same message. Keys are
//! ember's own, under `ember/attempt_<TORCHELASTIC_RESTART_COUNT>/`, so a restarted job never
//! reads its previous attempt's id:
//!
//! | key | who sets it | value |
//! |---|---|---|
//! | `…/rank/<r>` | rank r (`ADD 1`) | how many processes came as rank r |
//! | `…/world/<r>` | rank r | its `WORLD_SIZE`, decimal |
//! | `…/id` | rank 0 | the blob (NCCL's 128-byte unique id) |
//! | `…/verdict` | rank 0, after `…/id` | `ok`, or why the job cannot start |

use std::time::{Duration, Instant};

use super::RendezvousError;
use super::tcp_store::{StoreError, TcpStore};

/// The verdict that lets the ranks go on.
const OK: &[u8] = b"ok";
/// How much longer than rank 0 the other ranks wait for its verdict.
const VERDICT_GRACE: Duration = Duration::from_secs(5);

/// Hands `make_blob()`'s bytes from rank 0 to every rank through the `TCPStore` at
/// `host:port` (Note [Rendezvous through the agent's store]); `attempt` is torchrun's
/// `TORCHELASTIC_RESTART_COUNT`.
///
/// # Errors
/// [`RendezvousError`] naming the store's address: no store, rank 0 never published, a rank
/// never came or came twice, world sizes differ (every rank fails with rank 0's message).
pub fn exchange(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    attempt: u64,
    timeout: Duration,
    make_blob: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, RendezvousError> {
    exchange_with_nonce(
        host,
        port,
        rank,
        world_size,
        attempt,
        timeout,
        std::process::id(),
        make_blob,
    )
}

/// [`exchange`] with the handshake's ping nonce given (PyTorch's client sends its process
/// id; the recorded-exchange test replays a recorded one).
#[allow(clippy::too_many_arguments)]
pub(crate) fn exchange_with_nonce(
    host: &str,
    port: u16,
    rank: usize,
    world_size: usize,
    attempt: u64,
    timeout: Duration,
    nonce: u32,
    make_blob: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, RendezvousError> {
    let addr = format!("{host}:{port} (torchrun's store)");
    let deadline = Instant::now() + timeout;
    let failed = |e: StoreError| match e {
        StoreError::Unreachable(last_error) => RendezvousError::NoStore {
            addr: addr.clone(),
            timeout_s: timeout.as_secs_f64(),
            last_error,
        },
        other => RendezvousError::Refused {
            addr: addr.clone(),
            message: other.to_string(),
        },
    };
    let mut store = TcpStore::connect(host, port, deadline, nonce).map_err(&failed)?;
    let prefix = format!("ember/attempt_{attempt}");
    let arrivals = store
        .add(&format!("{prefix}/rank/{rank}"), 1)
        .map_err(&failed)?;
    if arrivals > 1 {
        return Err(RendezvousError::Refused {
            addr,
            message: format!(
                "rank {rank} came twice or is not a rank of a world of {world_size} (two \
                 processes with the same RANK?)"
            ),
        });
    }
    store
        .set(
            &format!("{prefix}/world/{rank}"),
            world_size.to_string().as_bytes(),
        )
        .map_err(&failed)?;
    let verdict_key = format!("{prefix}/verdict");
    let id_key = format!("{prefix}/id");
    if rank != 0 {
        let no_rank_zero = |what: &str| {
            let what = what.to_string();
            |e: StoreError| match e {
                StoreError::Timeout { .. } => RendezvousError::NoRankZero {
                    addr: addr.clone(),
                    timeout_s: timeout.as_secs_f64(),
                    last_error: what,
                },
                other => failed(other),
            }
        };
        // A rank outside rank 0's world is not waited for there: it finds out here.
        let ours = store
            .get(&format!("{prefix}/world/0"), deadline)
            .map_err(no_rank_zero("rank 0 never arrived"))?;
        let ours = String::from_utf8_lossy(&ours);
        if ours != world_size.to_string() {
            return Err(RendezvousError::WorldMismatch {
                addr,
                rank,
                theirs: world_size,
                ours: ours.parse().unwrap_or(0),
            });
        }
        // Rank 0 publishes a refusal when its own wait ends: a few seconds more here, so that
        // this rank reports rank 0's reason rather than a timeout of its own.
        let verdict = store
            .get(&verdict_key, deadline + VERDICT_GRACE)
            .map_err(no_rank_zero("rank 0 published no verdict"))?;
        if verdict != OK {
            return Err(RendezvousError::Refused {
                addr,
                message: String::from_utf8_lossy(&verdict).into_owned(),
            });
        }
        // The id was set before the verdict: within the verdict's grace too.
        return store
            .get(&id_key, deadline + VERDICT_GRACE)
            .map_err(&failed);
    }
    // Rank 0: every other rank must arrive, once, with the same world size.
    let refuse = |store: &mut TcpStore, error: RendezvousError| {
        let message = error.reason();
        // Best effort: the others time out on their own if this fails too.
        let _ = store.set(&verdict_key, message.as_bytes());
        error
    };
    let blob = match make_blob() {
        Ok(blob) => blob,
        Err(message) => {
            let error = RendezvousError::Refused {
                addr: addr.clone(),
                message: format!("rank 0 could not make the id: {message}"),
            };
            return Err(refuse(&mut store, error));
        }
    };
    let world_keys: Vec<String> = (1..world_size)
        .map(|r| format!("{prefix}/world/{r}"))
        .collect();
    let keys: Vec<&str> = world_keys.iter().map(String::as_str).collect();
    match store.wait(&keys, deadline) {
        Ok(()) => {}
        Err(StoreError::Timeout { .. }) => {
            let mut missing = Vec::new();
            for (r, key) in (1..world_size).zip(&keys) {
                if !store.check(key).map_err(&failed)? {
                    missing.push(r);
                }
            }
            let error = RendezvousError::MissingRanks {
                addr: addr.clone(),
                missing,
                timeout_s: timeout.as_secs_f64(),
            };
            return Err(refuse(&mut store, error));
        }
        Err(e) => return Err(failed(e)),
    }
    for (r, key) in (1..world_size).zip(&keys) {
        let theirs = store.get(key, deadline).map_err(&failed)?;
        let theirs = String::from_utf8_lossy(&theirs);
        if theirs != world_size.to_string() {
            let error = RendezvousError::WorldMismatch {
                addr: addr.clone(),
                rank: r,
                theirs: theirs.parse().unwrap_or(0),
                ours: world_size,
            };
            return Err(refuse(&mut store, error));
        }
        let arrivals = store
            .add(&format!("{prefix}/rank/{r}"), 0)
            .map_err(&failed)?;
        if arrivals > 1 {
            let error = RendezvousError::Refused {
                addr: addr.clone(),
                message: format!(
                    "rank {r} came twice or is not a rank of a world of {world_size} (two \
                     processes with the same RANK?)"
                ),
            };
            return Err(refuse(&mut store, error));
        }
    }
    store.set(&id_key, &blob).map_err(&failed)?;
    store.set(&verdict_key, OK).map_err(&failed)?;
    Ok(blob)
}
