//! Diagnostics: what the GPU is, what the binary was built for, how fast the host link is,
//! how much device memory the process really holds (measured outside any allocator), and how
//! much host memory the machine has.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::{Device, DeviceLocation};

use crate::error::Result;
use crate::sys;

pub use crate::sys::UmRow;

/// A CUDA version such as 13.0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CudaVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

impl CudaVersion {
    /// From the driver's integer form (13000 is 13.0).
    pub fn from_int(v: i32) -> Self {
        let v = v.max(0) as u32;
        Self {
            major: v / 1000,
            minor: (v % 1000) / 10,
        }
    }
}

impl std::fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Identity and memory of one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// Compute capability (9, 0 for an H100/H200).
    pub compute_capability: (u32, u32),
    /// Total device memory.
    pub total_bytes: u64,
    /// Free device memory now.
    pub free_bytes: u64,
    /// The newest CUDA version the installed driver supports.
    pub driver_cuda_version: Option<CudaVersion>,
    /// The CUDA version this binary was built against.
    pub built_for_cuda: Option<CudaVersion>,
    /// `CUDA_COMPUTE_CAP` at build time (the kernels' target architecture).
    pub compiled_arch: Option<String>,
    /// What the GPU supports of Unified Memory.
    pub unified_memory: UnifiedMemory,
}

/// What a GPU supports of Unified Memory (`cudaMallocManaged`), from its device attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UnifiedMemory {
    /// Managed allocations work at all.
    pub managed: bool,
    /// The CPU and the GPU may access managed memory concurrently: pages migrate on demand, one
    /// at a time, and prefetching and access advice apply (Pascal or newer on Linux). Without
    /// it a kernel launch makes every managed allocation the GPU may touch migrate whole.
    pub concurrent_access: bool,
    /// The GPU reads ordinary (pageable) host memory directly (HMM or ATS).
    pub pageable_access: bool,
}

/// The device as messages name it: `cuda:0` (the GPU's ordinal), `metal:0` or `cpu`, instead
/// of Candle's `Cuda(CudaDevice(DeviceId(1)))`, whose id is not the GPU's ordinal.
pub fn device_label(device: &Device) -> String {
    location_label(device.location())
}

fn location_label(location: DeviceLocation) -> String {
    match location {
        DeviceLocation::Cpu => "cpu".to_string(),
        DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Identity and memory of the GPU behind `device` (an error on a CPU, or without `cuda`).
pub fn device_info(device: &Device) -> Result<DeviceInfo> {
    let f = sys::device_info(device)?;
    Ok(DeviceInfo {
        ordinal: f.ordinal,
        name: f.name,
        compute_capability: f.compute_capability,
        total_bytes: f.total_bytes,
        free_bytes: f.free_bytes,
        driver_cuda_version: f.driver_version.map(CudaVersion::from_int),
        built_for_cuda: f.built_version.map(CudaVersion::from_int),
        compiled_arch: f.compiled_arch,
        unified_memory: UnifiedMemory {
            managed: f.managed_memory,
            concurrent_access: f.concurrent_managed_access,
            pageable_access: f.pageable_memory_access,
        },
    })
}

/// Median host-to-device copy rate in GB/s (10^9 B/s) from pinned or pageable host memory.
pub fn measure_h2d_gbps(
    device: &Device,
    bytes: usize,
    pinned: bool,
    reps: usize,
) -> candle_core::Result<f64> {
    sys::measure_h2d_gbps(device, bytes, pinned, reps)
}

/// The seed's Unified Memory table measured on `device`'s GPU for `bytes` of F32 data: a
/// plain copy, managed memory read by a kernel where it lies (pages migrate on the GPU's
/// faults), and managed memory prefetched first. Errors on a CPU or a build without `cuda`.
pub fn unified_memory_table(device: &Device, bytes: usize) -> candle_core::Result<Vec<UmRow>> {
    sys::um_table(device, bytes)
}

/// Bytes in use on the whole device (total minus free), as the driver reports them: this
/// counts the CUDA context, memory pools and every allocation, whoever made it.
pub fn device_used_bytes(device: &Device) -> candle_core::Result<u64> {
    sys::device_used_bytes(device)
}

/// Lets `device`'s stream-ordered memory pool keep the memory freed on it across
/// synchronizations (`keep`: what a training loop wants, since each step allocates the same
/// shapes again), or give it back to the driver at every synchronization (the driver's
/// default, under which each step maps its activations' memory afresh). A no-op on a CPU,
/// without `cuda`, or on a GPU without memory pools.
pub fn keep_pool_memory(device: &Device, keep: bool) -> candle_core::Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    sys::keep_pool_memory(device, keep)
}

/// Runs `alloc` with the GPU's memory pool for long-lived buffers as the current one, so that
/// the stream-ordered allocations in it (Candle's tensors) come from the pool the runtime
/// keeps weights in, apart from the activations in the default pool: for buffers that live
/// as long as the model, such as its KV cache. Allocated among a prompt's activations, such a
/// buffer keeps the memory around it from being returned when the prompt ends (the pool gives
/// back only whole chunks). Just `alloc()` on a CPU, without `cuda`, or where no runtime made
/// that pool ([`crate::Tuning::weight_pool`] off).
pub fn long_lived<R>(
    device: &Device,
    alloc: impl FnOnce() -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    if device.is_cpu() {
        return alloc();
    }
    sys::long_lived(device, alloc)
}

/// Whether [`long_lived`] can allocate from a pool of its own on `device` (a GPU with
/// stream-ordered memory pools, once a runtime with [`crate::Tuning::weight_pool`] made it).
pub fn has_long_lived_pool(device: &Device) -> candle_core::Result<bool> {
    if device.is_cpu() {
        return Ok(false);
    }
    sys::has_long_lived_pool(device)
}

/// Waits for the device and returns the memory its stream-ordered pool holds unused to the
/// driver (a no-op on a CPU or without `cuda`).
pub fn trim_memory_pool(device: &Device) -> candle_core::Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    sys::trim_memory_pool(device)
}

/// Waits for the device, then returns memory its stream-ordered pool holds unused to the
/// driver until the pool holds at most `keep` bytes, in use or not (a no-op on a CPU or
/// without `cuda`). What is in use stays: `keep` is a ceiling on the cache, not on use.
pub fn trim_memory_pool_to(device: &Device, keep: u64) -> candle_core::Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    sys::trim_memory_pool_to(device, keep)
}

/// Starts (`on`) or stops the capture of a CUDA profiler started with
/// `--profile-from-start off` (`ncu`, `nsys`), so that it records only the kernels in between
/// (a no-op on a CPU, without `cuda`, or with no profiler attached).
pub fn profiler_capture(device: &Device, on: bool) -> candle_core::Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    sys::profiler_capture(device, on)
}

/// Launches an empty marker kernel, `profile_mark(phase)`, on `device`'s stream, so that a
/// profiler's kernel list (ncu's, in launch order) shows where a program's phase `phase`
/// begins (a no-op on a CPU or without `cuda`).
pub fn profile_mark(device: &Device, phase: u32) -> candle_core::Result<()> {
    if device.is_cpu() {
        return Ok(());
    }
    sys::profile_mark(device, phase)
}

/// The machine's RAM, from `/proc/meminfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`: what can be allocated without swapping (free plus reclaimable cache).
    pub available_bytes: u64,
}

/// The machine's RAM (`None` where `/proc/meminfo` cannot be read, off Linux).
pub fn host_memory() -> Option<HostMemory> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// [`HostMemory`] from the text of `/proc/meminfo` (values in kB).
pub fn parse_meminfo(text: &str) -> Option<HostMemory> {
    let field = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    };
    let total_bytes = field("MemTotal:")?;
    Some(HostMemory {
        total_bytes,
        available_bytes: field("MemAvailable:").unwrap_or(total_bytes),
    })
}

/// The locked-memory limit of this process (`ulimit -l`, `RLIMIT_MEMLOCK`) in bytes, from
/// `/proc/self/limits` (`None`: unlimited or unknown).
pub fn memlock_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Polls [`device_used_bytes`] on a background thread and keeps the maximum.
#[derive(Debug)]
pub struct PeakMemorySampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
}

impl PeakMemorySampler {
    /// Starts polling every `period`.
    pub fn start(device: &Device, period: Duration) -> candle_core::Result<Self> {
        let first = device_used_bytes(device)?;
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(first));
        let (d, s, p) = (device.clone(), stop.clone(), peak.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Ok(used) = device_used_bytes(&d) {
                    p.fetch_max(used, Ordering::Relaxed);
                }
                std::thread::sleep(period);
            }
        });
        Ok(Self {
            stop,
            peak,
            handle: Some(handle),
        })
    }

    /// The maximum so far.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Resets the maximum to the current reading.
    pub fn reset(&self, current: u64) {
        self.peak.store(current, Ordering::Relaxed);
    }

    /// Stops polling and returns the maximum.
    pub fn stop(mut self) -> u64 {
        self.finish();
        self.peak()
    }

    fn finish(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for PeakMemorySampler {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Turns direct GPU-to-GPU access between every pair of `devices` on (or off), both ways.
/// Returns, per ordered pair `(i, j)` of indices into `devices`, whether the GPUs can access
/// each other; where they cannot, copies between them are staged through host memory by the
/// driver. A no-op returning `false` for CPU devices and CPU builds.
pub fn set_peer_access(
    devices: &[Device],
    enable: bool,
) -> candle_core::Result<Vec<(usize, usize, bool)>> {
    let mut out = Vec::new();
    for (i, a) in devices.iter().enumerate() {
        for (j, b) in devices.iter().enumerate() {
            if i == j || a.is_cpu() || b.is_cpu() {
                continue;
            }
            out.push((i, j, sys::set_peer_access(a, b, enable)?));
        }
    }
    Ok(out)
}

/// The most memory that was in use at once (allocated by Candle or the runtime and not yet
/// freed) since the last reset, from the driver's memory pool: the analogue of PyTorch's
/// `max_memory_allocated`, without the pool's cached free blocks that
/// [`device_used_bytes`] also counts. `reset` starts a new measurement.
pub fn pool_peak_used_bytes(device: &Device, reset: bool) -> candle_core::Result<u64> {
    sys::pool_used_high_bytes(device, reset)
}

/// The most memory the driver's pool held at once since the last reset: what was in use
/// ([`pool_peak_used_bytes`]) plus the freed blocks it kept and what fragmentation left
/// unusable. Its excess over the used mark is memory the budget's accounting of live buffers
/// does not see. `reset` starts a new measurement.
pub fn pool_peak_reserved_bytes(device: &Device, reset: bool) -> candle_core::Result<u64> {
    sys::pool_reserved_high_bytes(device, reset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_host_memory_from_meminfo() {
        let text = "MemTotal:       16318412 kB\nMemFree:  1000 kB\nMemAvailable:   9000000 kB\n";
        let m = parse_meminfo(text).unwrap();
        assert_eq!(m.total_bytes, 16318412 * 1024);
        assert_eq!(m.available_bytes, 9000000 * 1024);
        assert_eq!(parse_meminfo("MemFree: 3 kB\n"), None);
        if let Some(m) = host_memory() {
            assert!(m.total_bytes > 0 && m.available_bytes <= m.total_bytes);
        }
    }

    /// On a CPU there is no pool: `long_lived` runs the allocation as it is and hands its
    /// result (or its error) back.
    #[test]
    fn long_lived_is_the_allocation_itself_on_a_cpu() {
        let dev = Device::Cpu;
        assert!(!has_long_lived_pool(&dev).unwrap());
        let t = long_lived(&dev, || {
            candle_core::Tensor::ones(3, candle_core::DType::F32, &dev)
        })
        .unwrap();
        assert_eq!(t.to_vec1::<f32>().unwrap(), vec![1.0; 3]);
        let e = long_lived(&dev, || -> candle_core::Result<()> {
            candle_core::bail!("no room")
        });
        assert!(e.unwrap_err().to_string().contains("no room"));
    }

    #[test]
    fn devices_are_labelled_by_kind_and_ordinal() {
        assert_eq!(device_label(&Device::Cpu), "cpu");
        assert_eq!(location_label(DeviceLocation::Cuda { gpu_id: 1 }), "cuda:1");
        assert_eq!(
            location_label(DeviceLocation::Metal { gpu_id: 0 }),
            "metal:0"
        );
    }
}
