//! The GPU a rank takes: the driver asked how many GPUs this process sees, the rank's index
//! among them ([`crate::parallel::cuda_device_index`]), and what the log says of it.

use cudarc::driver::result;
use cudarc::driver::sys::CUdevice_attribute;

/// The library names cudarc tries for `name` ("nccl", "nvrtc", "cuda"), in its order (Note
/// [CUDA library names] in `libs.rs`).
pub fn cudarc_names(name: &str) -> Vec<String> {
    cudarc::get_lib_name_candidates(name)
}

/// The CUDA major version of the installed driver (`cuDriverGetVersion`: 13000 is 13), or
/// `None` when the driver does not answer. Call only once the driver library opens.
pub fn driver_cuda_major() -> Option<u32> {
    let mut version = 0;
    // SAFETY: an out-parameter for one int; the driver library was found (the caller's check).
    let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    (status == cudarc::driver::sys::CUresult::CUDA_SUCCESS && version > 0)
        .then_some(version as u32 / 1000)
}

/// A GPU as the start-up log names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// CUDA's ordinal among the visible GPUs.
    pub index: usize,
    /// How many GPUs the process sees.
    pub visible: usize,
    /// The product name ("NVIDIA H200").
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-...`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// `00000000:18:00.0`, as `nvidia-smi` prints it.
    pub bus_id: String,
}

impl std::fmt::Display for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} of {} visible: {}, {}, bus {}",
            self.index, self.visible, self.name, self.uuid, self.bus_id
        )
    }
}

fn driver_error(what: &str, e: result::DriverError) -> String {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{e:?}"));
    format!("{what}: {name}")
}

/// The GPU for local rank `local_rank` of `local_world_size` among those the driver shows
/// this process (`CUDA_VISIBLE_DEVICES`, read by the driver, is named in errors).
///
/// # Errors
/// One line: the driver does not start (no GPU, a driver too old), no GPU is visible, or the
/// local rank is past the visible GPUs.
pub fn select_gpu(local_rank: usize, local_world_size: Option<usize>) -> Result<Gpu, String> {
    let visible_devices = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    result::init().map_err(|e| {
        driver_error(
            &format!(
                "the NVIDIA driver did not start (cuInit; CUDA_VISIBLE_DEVICES={})",
                visible_devices.as_deref().unwrap_or("unset")
            ),
            e,
        )
    })?;
    let visible = result::device::get_count()
        .map_err(|e| driver_error("counting the GPUs (cuDeviceGetCount)", e))?
        as usize;
    let index = crate::parallel::cuda_device_index(
        local_rank,
        local_world_size,
        visible,
        visible_devices.as_deref(),
    )?;
    let device = result::device::get(index as i32)
        .map_err(|e| driver_error(&format!("GPU {index} (cuDeviceGet)"), e))?;
    let name = result::device::get_name(device).unwrap_or_else(|_| "unknown".into());
    let uuid = result::device::get_uuid(device)
        .map(|u| format_uuid(&u.bytes.map(|b| b as u8)))
        .unwrap_or_else(|_| "GPU-unknown".into());
    let attribute = |a| {
        // SAFETY: a device handle from cuDeviceGet and an attribute of the driver's enum.
        unsafe { result::device::get_attribute(device, a) }.unwrap_or(0)
    };
    let bus_id = format!(
        "{:08x}:{:02x}:{:02x}.0",
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID),
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID),
    );
    Ok(Gpu {
        index,
        visible,
        name,
        uuid,
        bus_id,
    })
}

/// A UUID's 16 bytes as `nvidia-smi` writes them: `GPU-8-4-4-4-12` hex digits.
fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}
