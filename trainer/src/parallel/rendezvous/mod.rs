//! How GPU ranks started without MPI find each other: rank 0 hands a small blob (NCCL's
//! 128-byte unique id) to every other rank through `MASTER_ADDR:MASTER_PORT`, as PyTorch's
//! `env://` initialisation does for `ProcessGroupNCCL`. Under torchrun, whose agent already
//! serves a c10d `TCPStore` on that port (`TORCHELASTIC_USE_AGENT_STORE=True`), the ranks are
//! clients of that store ([`agent_store`], over [`tcp_store`]); elsewhere rank 0 serves the
//! blob itself ([`own_server`]).

pub mod agent_store;
pub mod own_server;
pub mod tcp_store;
#[cfg(test)]
mod tests;

use std::time::Duration;

use super::LaunchEnv;

/// A rendezvous that failed; each variant names the address.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RendezvousError {
    /// Rank 0 never answered at the address.
    #[error(
        "rendezvous at {addr}: no answer from rank 0 within {timeout_s:.1} s (last attempt: \
         {last_error}); is rank 0 running, and are MASTER_ADDR and MASTER_PORT the same on every \
         rank?"
    )]
    NoRankZero {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The timeout in force, seconds.
        timeout_s: f64,
        /// The last connection error.
        last_error: String,
    },
    /// The launcher's store never answered at the address (torchrun's agent store).
    #[error(
        "rendezvous at {addr}: the store did not answer within {timeout_s:.1} s (last attempt: \
         {last_error}); is torchrun's agent running, and are MASTER_ADDR and MASTER_PORT as it \
         set them?"
    )]
    NoStore {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The timeout in force, seconds.
        timeout_s: f64,
        /// The last connection error.
        last_error: String,
    },
    /// Rank 0 waited in vain for some ranks.
    #[error("rendezvous at {addr}: rank(s) {missing:?} did not arrive within {timeout_s:.1} s")]
    MissingRanks {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The ranks that never connected.
        missing: Vec<usize>,
        /// The timeout in force, seconds.
        timeout_s: f64,
    },
    /// A rank was started with another world size than rank 0.
    #[error(
        "rendezvous at {addr}: rank {rank} has world size {theirs} but rank 0 has {ours}: start \
         every rank with the same WORLD_SIZE"
    )]
    WorldMismatch {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The rank with the other world size.
        rank: usize,
        /// Its world size.
        theirs: usize,
        /// Rank 0's.
        ours: usize,
    },
    /// Rank 0 refused this rank (rank 0's message), or a peer broke the protocol.
    #[error("rendezvous at {addr}: {message}")]
    Refused {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// What was wrong.
        message: String,
    },
    /// The launcher gave no rendezvous address.
    #[error(
        "rank {rank} of {world_size} (from the {launcher}): NCCL's unique id goes from rank 0 \
         over TCP at MASTER_ADDR:MASTER_PORT, which are not both set (torchrun sets them; under \
         srun export them in the job script), or by MPI in a build with `--features cuda,mpi` \
         started by mpirun"
    )]
    NoAddress {
        /// This process's rank.
        rank: usize,
        /// Its world size.
        world_size: usize,
        /// Where they came from.
        launcher: super::LaunchSource,
    },
    /// The address cannot be used (no such host, port taken).
    #[error("rendezvous at {addr}: {reason}")]
    Address {
        /// `MASTER_ADDR:MASTER_PORT`.
        addr: String,
        /// The operating system's message, with a hint.
        reason: String,
    },
}

impl RendezvousError {
    /// What went wrong, without the address (rank 0 publishes it to the other ranks, which
    /// put their own address before it).
    pub fn reason(&self) -> String {
        let full = self.to_string();
        let addr = match self {
            RendezvousError::NoRankZero { addr, .. }
            | RendezvousError::NoStore { addr, .. }
            | RendezvousError::MissingRanks { addr, .. }
            | RendezvousError::WorldMismatch { addr, .. }
            | RendezvousError::Refused { addr, .. }
            | RendezvousError::Address { addr, .. } => addr,
            RendezvousError::NoAddress { .. } => return full,
        };
        full.strip_prefix(&format!("rendezvous at {addr}: "))
            .map(str::to_string)
            .unwrap_or(full)
    }
}

/// Hands `make_blob()`'s bytes from rank 0 to every rank of the job `launch` describes and
/// returns them (on rank 0 too): through torchrun's store when the launcher serves one
/// ([`LaunchEnv::agent_store`]), else through ember's own server on `MASTER_PORT`. Every wait
/// ends at `timeout`.
///
/// # Errors
/// [`RendezvousError`] naming the address: no address given, rank 0 never answered, a rank
/// never came, world sizes differ (both sides fail), a rank came twice, the port is taken.
pub fn exchange_unique_id(
    launch: &LaunchEnv,
    timeout: Duration,
    make_blob: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Vec<u8>, RendezvousError> {
    let (Some(host), Some(port)) = (&launch.master_addr, launch.master_port) else {
        return Err(RendezvousError::NoAddress {
            rank: launch.rank,
            world_size: launch.world_size,
            launcher: launch.source,
        });
    };
    if launch.agent_store {
        agent_store::exchange(
            host,
            port,
            launch.rank,
            launch.world_size,
            launch.restart_count,
            timeout,
            make_blob,
        )
    } else {
        own_server::exchange(
            host,
            port,
            launch.rank,
            launch.world_size,
            timeout,
            make_blob,
        )
    }
}

/// Which rendezvous [`exchange_unique_id`] uses for `launch`, for the start-up log.
pub fn rendezvous_name(launch: &LaunchEnv) -> &'static str {
    if launch.agent_store {
        "torchrun's agent store (c10d TCPStore)"
    } else {
        "ember's rendezvous server on rank 0"
    }
}
