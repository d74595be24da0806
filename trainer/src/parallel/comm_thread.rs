//! The communication thread: it owns the rank's communicator and runs collectives one after
//! another, in the order they were submitted, while the compute thread goes on with backward
//! (PyTorch DDP runs its allreduces on a separate CUDA stream for the same reason; a thread
//! does it for every backend, and on CUDA the thread enqueues NCCL on its own stream).

use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use burn::tensor::backend::Backend;

use super::collective::{Collective, CommError, DeviceCollective};

/// A rank's communicator: host collectives only, or host and device collectives.
pub enum Communicator<B: Backend> {
    /// Collectives on host buffers (in-process ranks on NdArray, MPI, the link model): the
    /// reducer keeps host buckets.
    Host(Box<dyn Collective>),
    /// Collectives on device buffers too (NCCL, in-process ranks sharing a device): the
    /// reducer can keep its buckets on the device.
    Device(Box<dyn DeviceCollective<B>>),
}

impl<B: Backend> Communicator<B> {
    /// The host collectives (every communicator has them).
    pub fn host(&mut self) -> &mut dyn Collective {
        match self {
            Communicator::Host(c) => c.as_mut(),
            Communicator::Device(c) => c.as_mut(),
        }
    }

    fn host_ref(&self) -> &dyn Collective {
        match self {
            Communicator::Host(c) => c.as_ref(),
            Communicator::Device(c) => c.as_ref(),
        }
    }

    /// Whether it can reduce device buffers.
    pub fn has_device_collectives(&self) -> bool {
        matches!(self, Communicator::Device(_))
    }
}

type Job<B> = Box<dyn FnOnce(&mut Communicator<B>) -> bool + Send>;

/// The thread that owns the communicator; collectives run on it in the order submitted.
pub struct CommThread<B: Backend> {
    jobs: Option<Sender<Job<B>>>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
    world_size: usize,
    name: &'static str,
    device_collectives: bool,
}

impl<B: Backend> CommThread<B> {
    /// Moves `comm` onto a new thread.
    ///
    /// # Panics
    /// If the operating system cannot start a thread.
    pub fn spawn(comm: Communicator<B>) -> Self {
        let host = comm.host_ref();
        let (rank, world_size, name) = (host.rank(), host.world_size(), host.name());
        let device_collectives = comm.has_device_collectives();
        let (jobs, queue) = mpsc::channel::<Job<B>>();
        let thread = std::thread::Builder::new()
            .name(format!("ember-comm-{rank}"))
            .spawn(move || {
                let mut comm = comm;
                // A job returns false after a failure: later jobs would only wait for ranks
                // that are gone, so the thread stops and drops the communicator, which tells
                // the other ranks.
                for job in queue {
                    if !job(&mut comm) {
                        break;
                    }
                }
            })
            .expect("spawning the communication thread");
        Self {
            jobs: Some(jobs),
            thread: Some(thread),
            rank,
            world_size,
            name,
            device_collectives,
        }
    }

    /// A thread for a host-only communicator.
    pub fn host(comm: Box<dyn Collective>) -> Self {
        Self::spawn(Communicator::Host(comm))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The communicator's name (`in-process`, `mpi`, `nccl`, …).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the communicator reduces device buffers ([`Communicator::Device`]).
    pub fn has_device_collectives(&self) -> bool {
        self.device_collectives
    }

    fn enqueue<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Communicator<B>) -> Result<T, CommError> + Send + 'static,
    ) -> Receiver<Result<T, CommError>> {
        let (tx, rx) = mpsc::channel();
        let job: Job<B> = Box::new(move |comm| {
            let result = f(comm);
            let ok = result.is_ok();
            let _ = tx.send(result);
            ok
        });
        if let Some(jobs) = &self.jobs {
            // If the thread has stopped, `rx` reports a closed channel.
            let _ = jobs.send(job);
        }
        rx
    }

    /// Runs `f` with the host collectives on the communication thread (after everything
    /// submitted before) and returns its result without waiting for it.
    pub fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T, CommError> + Send + 'static,
    ) -> Receiver<Result<T, CommError>> {
        self.enqueue(move |comm| f(comm.host()))
    }

    /// Runs `f` with the device collectives on the communication thread, as
    /// [`CommThread::submit`]. A host-only communicator answers with [`CommError::Backend`]
    /// (the reducer only asks for device collectives when [`CommThread::has_device_collectives`]).
    pub fn submit_device<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn DeviceCollective<B>) -> Result<T, CommError> + Send + 'static,
    ) -> Receiver<Result<T, CommError>> {
        self.enqueue(move |comm| match comm {
            Communicator::Device(c) => f(c.as_mut()),
            Communicator::Host(c) => Err(CommError::Backend {
                backend: c.name(),
                message: "this communicator has no device collectives".into(),
            }),
        })
    }

    /// Runs `f` with the host collectives on the communication thread and waits for its
    /// result.
    ///
    /// # Errors
    /// `f`'s error, or [`CommError::Backend`] if the thread stopped after an earlier failure.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Collective) -> Result<T, CommError> + Send + 'static,
    ) -> Result<T, CommError> {
        receive(&self.submit(f))
    }
}

/// The result of a submitted collective, or [`CommError::Backend`] if the communication thread
/// stopped before running it (after an earlier failure).
pub fn receive<T>(rx: &Receiver<Result<T, CommError>>) -> Result<T, CommError> {
    rx.recv().unwrap_or_else(|_| {
        Err(CommError::Backend {
            backend: "comm thread",
            message: "stopped after an earlier collective failed".into(),
        })
    })
}

impl<B: Backend> Drop for CommThread<B> {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
