//! SIGTERM and SIGINT end a run cleanly: the first one asks the loop to finish its step, write
//! a checkpoint and return; a second one (of either kind) ends the process at once (the usual
//! double Ctrl-C). Slurm (`scancel`, the end of a job's time limit) and Kubernetes send SIGTERM
//! and wait (Slurm's `KillWait`, 30 s by default; Kubernetes' grace period, 30 s) before they
//! kill.
//!
//! The handlers are installed by [`install`] (the `train` command does), never by the library
//! on its own: a program that embeds the trainer keeps its own signal handling.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};

static RECEIVED: OnceLock<Arc<AtomicUsize>> = OnceLock::new();

/// Installs the handlers (once per process; later calls do nothing).
///
/// # Errors
/// The operating system's error if a handler cannot be installed.
pub fn install() -> std::io::Result<()> {
    if RECEIVED.get().is_some() {
        return Ok(());
    }
    let received = Arc::new(AtomicUsize::new(0));
    let stopping = Arc::new(AtomicBool::new(false));
    for signal in [SIGTERM, SIGINT] {
        // Registered first, so it sees `stopping` as an earlier signal left it: a second
        // signal ends the process with the status a shell gives a killed one.
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, stopping.clone())?;
        signal_hook::flag::register(signal, stopping.clone())?;
        signal_hook::flag::register_usize(signal, received.clone(), signal as usize)?;
    }
    let _ = RECEIVED.set(received);
    Ok(())
}

/// The signal that asked the run to stop, if one did since [`install`].
pub fn received() -> Option<&'static str> {
    match RECEIVED.get()?.load(Ordering::Relaxed) {
        0 => None,
        s if s == SIGTERM as usize => Some("SIGTERM"),
        s if s == SIGINT as usize => Some("SIGINT"),
        _ => Some("a signal"),
    }
}
