//! A CubeCL runtime that counts host synchronisations and kernel launches:
//! [`CountingRuntime<R>`] runs `R` unchanged and counts every read of device memory to the
//! host and every wait of the host for the device (`ComputeServer::read`,
//! `ComputeServer::sync`), every kernel launch (`ComputeServer::launch`) and every explicit
//! flush of the queue (`ComputeServer::flush`; not a wait in itself, [`HostSyncs::flushes`]),
//! per calling thread. Launches are what a GPU step pays per kernel whatever its size (a few microseconds
//! of the host's enqueueing and the device's scheduling): a step of thousands of small kernels
//! is bound by them, which is why apex's multi-tensor kernels and fused epilogues exist.
//!
//! A training step on a GPU should not wait for the GPU except where it must decide something
//! (a loss read at log time): each wait empties the device's queue and leaves it idle until
//! the host has enqueued more work. Counting at the server catches every wait, whoever causes
//! it (the trainer, Burn's ops, this crate's kernels): `CubeBackend<CountingRuntime<R>, ..>`
//! is a Burn backend like `CubeBackend<R, ..>` (burn-cubecl's `CubeRuntime` covers every CubeCL
//! runtime), with the same kernels (the [`crate::FusedOps`] implementation is generic over the
//! runtime).
//!
//! The wrapper runs its own server for each device (CubeCL keys servers by device and server
//! type), so tensors of `CubeBackend<R>` and `CubeBackend<CountingRuntime<R>>` do not mix.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cubecl::Runtime;
use cubecl::bytes::Bytes;
use cubecl::client::ComputeClient;
use cubecl::device::{DeviceId, DeviceService, DeviceServiceStage, ServerUtilitiesHandle};
use cubecl::future::DynFut;
use cubecl::ir::TargetProperties;
use cubecl::profile::ProfileDuration;
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, KernelArguments, MemoryLayout, MemoryLayoutDescriptor,
    MemoryLayoutPolicy, ProfileError, ProfilingToken, ServerCommunication, ServerError,
    ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides};
use cubecl::{CubeCount, ExecutionMode, MemoryAllocationMode, MemoryUsage};
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::storage::{ComputeStorage, ManagedResource};

/// Counts per calling thread (CubeCL names each thread's stream by a [`StreamId`]; a server
/// call carries the caller's), so that ranks running as threads of one process count only
/// their own waits.
static COUNTS: Mutex<BTreeMap<u64, HostSyncs>> = Mutex::new(BTreeMap::new());

fn count(stream_id: StreamId, f: impl FnOnce(&mut HostSyncs)) {
    let mut counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
    f(counts.entry(stream_id.value).or_default());
}

/// Counts a launch that bypassed CubeCL's server (a cuBLASLt product: one launch, though
/// cuBLASLt may split it into two kernels) for the calling thread, under `name`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count_foreign_launch(name: &'static str) {
    let stream = StreamId::current();
    count(stream, |c| c.launches += 1);
    if RECORD_BY_KERNEL.load(Ordering::Relaxed) {
        let mut by_kernel = BY_KERNEL.lock().unwrap_or_else(|e| e.into_inner());
        *by_kernel.entry((stream.value, name)).or_default() += 1;
    }
}

/// Launches per calling thread and kernel name, kept while [`KernelLaunches::record`] is on.
static BY_KERNEL: Mutex<BTreeMap<(u64, &'static str), u64>> = Mutex::new(BTreeMap::new());
static RECORD_BY_KERNEL: AtomicBool = AtomicBool::new(false);

/// Kernel launches by kernel, to find what a step launches (a diagnostic: off by default, one
/// map update per launch while on). The names are CubeCL's `KernelMetadata::name`: the
/// kernel's Rust type, such as `burn_cubecl::kernel::binary::..` for an element-wise op, or
/// this crate's kernels by their function's name.
pub struct KernelLaunches;

impl KernelLaunches {
    /// Start (or stop) recording launches by kernel, for every thread.
    pub fn record(on: bool) {
        RECORD_BY_KERNEL.store(on, Ordering::Relaxed);
    }

    /// The calling thread's launches by kernel name since recording started, most first.
    pub fn now() -> Vec<(&'static str, u64)> {
        let stream = StreamId::current().value;
        let by_kernel = BY_KERNEL.lock().unwrap_or_else(|e| e.into_inner());
        let mut counts: Vec<(&'static str, u64)> = by_kernel
            .iter()
            .filter(|((s, _), _)| *s == stream)
            .map(|((_, name), n)| (*name, *n))
            .collect();
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        counts
    }

    /// The launches by kernel of `later` less those of `earlier` (two [`KernelLaunches::now`],
    /// or two such differences), most first; kernels with more in `later` only.
    pub fn since(
        later: &[(&'static str, u64)],
        earlier: &[(&'static str, u64)],
    ) -> Vec<(&'static str, u64)> {
        let before: BTreeMap<&str, u64> = earlier.iter().copied().collect();
        let mut counts: Vec<(&'static str, u64)> = later
            .iter()
            .map(|&(name, n)| {
                (
                    name,
                    n.saturating_sub(before.get(name).copied().unwrap_or(0)),
                )
            })
            .filter(|&(_, n)| n > 0)
            .collect();
        counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        counts
    }
}

/// Host synchronisations and kernel launches counted by [`CountingRuntime`] servers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostSyncs {
    /// Reads of device memory to the host (a tensor's `into_data`, `into_scalar`, ...).
    pub reads: u64,
    /// Waits for the device's queue to drain without a read (`Backend::sync`).
    pub syncs: u64,
    /// Kernels launched (not a synchronisation: counted here because the same server calls
    /// see them). Autotuning launches its candidates once per shape, on first use. The server
    /// counts a launch when it takes it from the caller's queue: the count is complete after
    /// a read or a sync, and a count taken without one may leave out the last few launches
    /// (they are counted in the next interval, so sums over several intervals are exact).
    pub launches: u64,
    /// Explicit flushes of the queue (`ComputeClient::flush`). Not a wait on every backend,
    /// and not in [`HostSyncs::total`]: but CubeCL's CUDA flush waits on the host for the
    /// event it recorded at the previous flush (its drop queue's fence), so a flush per GEMM
    /// window would hold the host to one window ahead (Note [Device-side GEMM windows]). The
    /// flushes CubeCL's CUDA server makes by itself after a launch (its drop queue's policy)
    /// are not calls to the server, and not counted.
    pub flushes: u64,
}

impl HostSyncs {
    /// The counts of the calling thread so far.
    pub fn now() -> Self {
        let counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .get(&StreamId::current().value)
            .copied()
            .unwrap_or_default()
    }

    /// The counts of every thread of the process so far.
    pub fn process() -> Self {
        let counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .values()
            .fold(HostSyncs::default(), |a, c| HostSyncs {
                reads: a.reads + c.reads,
                syncs: a.syncs + c.syncs,
                launches: a.launches + c.launches,
                flushes: a.flushes + c.flushes,
            })
    }

    /// Reads plus syncs: every time the host waited for the device (launches are not waits).
    pub fn total(&self) -> u64 {
        self.reads + self.syncs
    }

    /// The counts since `earlier`.
    pub fn since(&self, earlier: HostSyncs) -> HostSyncs {
        HostSyncs {
            reads: self.reads - earlier.reads,
            syncs: self.syncs - earlier.syncs,
            launches: self.launches - earlier.launches,
            flushes: self.flushes - earlier.flushes,
        }
    }
}

/// The CubeCL runtime `R` with host synchronisations counted (see the module docs).
#[derive(Debug, Clone)]
pub struct CountingRuntime<R>(PhantomData<R>);

/// `R`'s server, counting.
#[derive(Debug)]
pub struct CountingServer<S: ComputeServer> {
    inner: S,
    utilities: Arc<ServerUtilities<CountingServer<S>>>,
}

/// The inner server's memory layout policy, shared (CubeCL's policies are not `Clone`).
#[derive(Debug)]
pub struct SharedLayoutPolicy<S: ComputeServer>(Arc<ServerUtilities<S>>);

/// The inner server's runtime information.
pub struct SharedInfo<S: ComputeServer>(Arc<ServerUtilities<S>>);

impl<S: ComputeServer> std::fmt::Debug for SharedInfo<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.info.fmt(f)
    }
}

impl<S: ComputeServer> MemoryLayoutPolicy for SharedLayoutPolicy<S> {
    fn apply(
        &self,
        stream_id: StreamId,
        descriptors: &[MemoryLayoutDescriptor],
    ) -> (cubecl::server::Handle, Vec<MemoryLayout>) {
        self.0.layout_policy.apply(stream_id, descriptors)
    }
}

impl<S: ComputeServer> DeviceService for CountingServer<S> {
    fn init(device_id: DeviceId) -> Self {
        let inner = S::init(device_id);
        let theirs = ComputeServer::utilities(&inner);
        let utilities = ServerUtilities::new(
            theirs.properties.clone(),
            theirs.logger.clone(),
            SharedInfo(theirs.clone()),
            SharedLayoutPolicy(theirs.clone()),
        );
        Self {
            inner,
            utilities: Arc::new(utilities),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }

    fn stage() -> DeviceServiceStage {
        S::stage()
    }
}

impl<S: ComputeServer> ServerCommunication for CountingServer<S> {
    const SERVER_COMM_ENABLED: bool = false;
}

impl<S: ComputeServer> ComputeServer for CountingServer<S> {
    type Kernel = S::Kernel;
    type Info = SharedInfo<S>;
    type MemoryLayoutPolicy = SharedLayoutPolicy<S>;
    type Storage = S::Storage;

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, stream_id: StreamId) {
        self.inner.initialize_memory(memory, size, stream_id)
    }

    fn staging(&mut self, sizes: &[usize], stream_id: StreamId) -> Result<Vec<Bytes>, ServerError> {
        self.inner.staging(sizes, stream_id)
    }

    fn logger(&self) -> Arc<ServerLogger> {
        self.inner.logger()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        count(stream_id, |c| c.reads += 1);
        self.inner.read(descriptors, stream_id)
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: StreamId) {
        self.inner.write(descriptors, stream_id)
    }

    fn sync(&mut self, stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        count(stream_id, |c| c.syncs += 1);
        self.inner.sync(stream_id)
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: StreamId,
    ) -> Result<ManagedResource<<Self::Storage as ComputeStorage>::Resource>, ServerError> {
        self.inner.get_resource(binding, stream_id)
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        bindings: KernelArguments,
        kind: ExecutionMode,
        stream_id: StreamId,
    ) {
        self::count(stream_id, |c| c.launches += 1);
        if RECORD_BY_KERNEL.load(Ordering::Relaxed) {
            use cubecl_runtime::kernel::KernelMetadata;
            let name = kernel.name();
            let mut by_kernel = BY_KERNEL.lock().unwrap_or_else(|e| e.into_inner());
            *by_kernel.entry((stream_id.value, name)).or_default() += 1;
        }
        // SAFETY: the caller's guarantees for `kind` are passed on unchanged.
        unsafe { self.inner.launch(kernel, count, bindings, kind, stream_id) }
    }

    fn flush(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        count(stream_id, |c| c.flushes += 1);
        self.inner.flush(stream_id)
    }

    fn memory_usage(&mut self, stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        self.inner.memory_usage(stream_id)
    }

    fn memory_cleanup(&mut self, stream_id: StreamId) {
        self.inner.memory_cleanup(stream_id)
    }

    fn start_profile(&mut self, stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        self.inner.start_profile(stream_id)
    }

    fn end_profile(
        &mut self,
        stream_id: StreamId,
        token: ProfilingToken,
    ) -> Result<ProfileDuration, ProfileError> {
        self.inner.end_profile(stream_id, token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, stream_id: StreamId) {
        self.inner.allocation_mode(mode, stream_id)
    }
}

impl<R: Runtime> Runtime for CountingRuntime<R> {
    type Compiler = R::Compiler;
    type Server = CountingServer<R::Server>;
    type Device = R::Device;

    fn client(device: &Self::Device) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    fn name(_client: &ComputeClient<Self>) -> &'static str {
        "counting"
    }

    fn require_array_lengths() -> bool {
        R::require_array_lengths()
    }

    fn max_cube_count() -> (u32, u32, u32) {
        R::max_cube_count()
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        R::can_read_tensor(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        R::target_properties()
    }

    fn enumerate_devices(
        type_id: u16,
        info: &<Self::Server as ComputeServer>::Info,
    ) -> Vec<DeviceId> {
        R::enumerate_devices(type_id, &info.0.info)
    }
}
