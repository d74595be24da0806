//! A client of PyTorch's c10d `TCPStore`: the key-value store that torchrun's elastic agent
//! serves on `MASTER_PORT` for its workers (`TORCHELASTIC_USE_AGENT_STORE=True`), and that
//! PyTorch's own workers join as clients (`torch/distributed/rendezvous.py`,
//! `_create_c10d_store`).
//!
//! Note [TCPStore wire protocol] (PyTorch 2.5 to 2.15; `torch/csrc/distributed/c10d/
//! TCPStore.cpp`, `TCPStoreBackend.hpp`, `TCPStoreLibUvBackend.cpp`): every request is one
//! `QueryType` byte and its arguments; integers travel in the host's byte order (little
//! endian on every machine PyTorch builds for), a key or value as a `u64` length and its bytes.
//! A connection starts with `VALIDATE` and the magic `0x3C85F7CE` (no reply), then `PING`
//! with a `u32` nonce that the server echoes. `SET key value` has no reply; `ADD key delta`
//! answers the new `i64` (the store keeps it as decimal text); `WAIT n keys` answers one
//! `STOP_WAITING` byte once every key exists; `GET key` answers the value, and the client
//! always waits for the key first (the classic server drops a connection that asks for a
//! missing key); `CHECK n keys` answers `READY` or `NOT_READY`; a wait that runs out of time
//! is withdrawn with `CANCEL_WAIT`, answered `WAIT_CANCELED` (after a `STOP_WAITING` that may
//! already be on its way). PyTorch's client puts `/` before every key on the wire
//! (`keyPrefix_`); so does this one, so that a key set here reads the same from Python.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// `QueryType` values (`TCPStoreBackend.hpp`).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
}

/// `validationMagicNumber` (`TCPStoreBackend.hpp`).
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// `CheckResponseType::READY`.
const READY: u8 = 0;
/// `WaitResponseType::STOP_WAITING`.
const STOP_WAITING: u8 = 0;
/// `WaitResponseType::WAIT_CANCELED`.
const WAIT_CANCELED: u8 = 1;
/// The largest value accepted in a reply (the libuv server's own limit is 8 MiB).
const MAX_VALUE: u64 = 8 << 20;
/// How long the store may take to answer a query that does not wait for keys.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// What went wrong talking to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No connection could be made, or it broke: worth retrying until the deadline.
    Unreachable(String),
    /// The keys did not all appear before the deadline.
    Timeout {
        /// The keys waited for (without the wire prefix).
        keys: Vec<String>,
    },
    /// The peer does not speak the protocol.
    Protocol(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Unreachable(e) => write!(f, "{e}"),
            StoreError::Timeout { keys } => write!(f, "keys {keys:?} did not appear in time"),
            StoreError::Protocol(e) => write!(f, "not a c10d TCPStore: {e}"),
        }
    }
}

fn broken(e: std::io::Error) -> StoreError {
    StoreError::Unreachable(e.to_string())
}

/// One connection to a `TCPStore`.
pub struct TcpStore {
    stream: TcpStream,
}

impl TcpStore {
    /// Connects to `host:port`, retrying until `deadline` (the store may not listen yet), and
    /// does the handshake with `nonce` as the ping's (PyTorch's client sends its process id).
    ///
    /// # Errors
    /// [`StoreError::Unreachable`] with the last connection error when the deadline passes;
    /// [`StoreError::Protocol`] when the peer answers the ping wrongly.
    pub fn connect(
        host: &str,
        port: u16,
        deadline: Instant,
        nonce: u32,
    ) -> Result<Self, StoreError> {
        let mut last = StoreError::Unreachable("no attempt".into());
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last);
            }
            match Self::try_connect(host, port, left, nonce) {
                Ok(store) => return Ok(store),
                Err(e @ StoreError::Protocol(_)) => return Err(e),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(100).min(left));
        }
    }

    fn try_connect(host: &str, port: u16, left: Duration, nonce: u32) -> Result<Self, StoreError> {
        let target = (host, port)
            .to_socket_addrs()
            .map_err(broken)?
            .next()
            .ok_or_else(|| StoreError::Unreachable(format!("{host} resolves to no address")))?;
        let stream = TcpStream::connect_timeout(&target, left.min(Duration::from_secs(2)))
            .map_err(broken)?;
        stream.set_nodelay(true).map_err(broken)?;
        let mut store = Self { stream };
        store.set_timeout(left)?;
        let mut hello = vec![query::VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_ne_bytes());
        hello.push(query::PING);
        hello.extend_from_slice(&nonce.to_ne_bytes());
        store.stream.write_all(&hello).map_err(broken)?;
        let echo = u32::from_ne_bytes(store.read_array()?);
        if echo != nonce {
            return Err(StoreError::Protocol(format!(
                "the ping's nonce {nonce} came back as {echo}"
            )));
        }
        Ok(store)
    }

    /// Read and write timeouts of the socket (at least 1 ms: 0 would mean none).
    fn set_timeout(&self, timeout: Duration) -> Result<(), StoreError> {
        let timeout = Some(timeout.max(Duration::from_millis(1)));
        self.stream.set_read_timeout(timeout).map_err(broken)?;
        self.stream.set_write_timeout(timeout).map_err(broken)
    }

    fn read_array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut bytes = [0u8; N];
        self.stream.read_exact(&mut bytes).map_err(broken)?;
        Ok(bytes)
    }

    /// `SET key value`.
    ///
    /// # Errors
    /// [`StoreError::Unreachable`] when the connection breaks.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.set_timeout(REPLY_TIMEOUT)?;
        let mut message = vec![query::SET];
        push_bytes(&mut message, wire_key(key).as_bytes());
        push_bytes(&mut message, value);
        self.stream.write_all(&message).map_err(broken)
    }

    /// `ADD key delta`: the counter's new value.
    ///
    /// # Errors
    /// [`StoreError::Unreachable`] when the connection breaks.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.set_timeout(REPLY_TIMEOUT)?;
        let mut message = vec![query::ADD];
        push_bytes(&mut message, wire_key(key).as_bytes());
        message.extend_from_slice(&delta.to_ne_bytes());
        self.stream.write_all(&message).map_err(broken)?;
        Ok(i64::from_ne_bytes(self.read_array()?))
    }

    /// `CHECK key`: whether the key exists now.
    ///
    /// # Errors
    /// As [`TcpStore::add`]; [`StoreError::Protocol`] for an answer that is neither.
    pub fn check(&mut self, key: &str) -> Result<bool, StoreError> {
        self.set_timeout(REPLY_TIMEOUT)?;
        let mut message = vec![query::CHECK];
        push_keys(&mut message, &[key]);
        self.stream.write_all(&message).map_err(broken)?;
        match self.read_array::<1>()?[0] {
            READY => Ok(true),
            1 => Ok(false),
            other => Err(StoreError::Protocol(format!("CHECK answered {other}"))),
        }
    }

    /// `WAIT keys` until `deadline`; a wait that runs out of time is withdrawn
    /// (`CANCEL_WAIT`) and is [`StoreError::Timeout`].
    ///
    /// # Errors
    /// [`StoreError::Timeout`]; as [`TcpStore::add`].
    pub fn wait(&mut self, keys: &[&str], deadline: Instant) -> Result<(), StoreError> {
        self.set_timeout(REPLY_TIMEOUT)?;
        let mut message = vec![query::WAIT];
        push_keys(&mut message, keys);
        self.stream.write_all(&message).map_err(broken)?;
        self.set_timeout(deadline.saturating_duration_since(Instant::now()))?;
        let mut reply = [0u8; 1];
        match self.stream.read_exact(&mut reply) {
            Ok(()) if reply[0] == STOP_WAITING => return Ok(()),
            Ok(()) => {
                return Err(StoreError::Protocol(format!("WAIT answered {}", reply[0])));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(broken(e)),
        }
        // Withdraw the wait; the keys may have appeared meanwhile (STOP_WAITING first).
        self.set_timeout(Duration::from_secs(10))?;
        self.stream
            .write_all(&[query::CANCEL_WAIT])
            .map_err(broken)?;
        loop {
            match self.read_array::<1>()?[0] {
                STOP_WAITING => continue,
                WAIT_CANCELED => break,
                other => {
                    return Err(StoreError::Protocol(format!(
                        "CANCEL_WAIT answered {other}"
                    )));
                }
            }
        }
        Err(StoreError::Timeout {
            keys: keys.iter().map(|k| k.to_string()).collect(),
        })
    }

    /// `GET key`, waiting until `deadline` for the key to exist (as PyTorch's client).
    ///
    /// # Errors
    /// As [`TcpStore::wait`]; [`StoreError::Protocol`] for a value over 8 MiB.
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>, StoreError> {
        self.wait(&[key], deadline)?;
        self.set_timeout(REPLY_TIMEOUT)?;
        let mut message = vec![query::GET];
        push_bytes(&mut message, wire_key(key).as_bytes());
        self.stream.write_all(&message).map_err(broken)?;
        let len = u64::from_ne_bytes(self.read_array()?);
        if len > MAX_VALUE {
            return Err(StoreError::Protocol(format!("a value of {len} bytes")));
        }
        let mut value = vec![0u8; len as usize];
        self.stream.read_exact(&mut value).map_err(broken)?;
        Ok(value)
    }
}

/// The key as PyTorch's `TCPStore` client sends it: `/` first.
fn wire_key(key: &str) -> String {
    format!("/{key}")
}

fn push_bytes(message: &mut Vec<u8>, bytes: &[u8]) {
    message.extend_from_slice(&(bytes.len() as u64).to_ne_bytes());
    message.extend_from_slice(bytes);
}

fn push_keys(message: &mut Vec<u8>, keys: &[&str]) {
    message.extend_from_slice(&(keys.len() as u64).to_ne_bytes());
    for key in keys {
        push_bytes(message, wire_key(key).as_bytes());
    }
}
