//! The doctor: what the machine offers the runtime, and plain verdicts on what would fail.
//!
//! It gathers the driver's CUDA version against the one the binary was built for, the GPU's
//! compute capability against the architecture compiled in (the cause of "no kernel image is
//! available for execution"), device memory, the locked-memory limit and whether pinning works,
//! host RAM, the PCIe link, and measured pinned and pageable copy rates. The verdicts are a
//! pure function of those facts ([`verdicts`]), tested on the CPU.

use std::fmt;

use candle_core::Device;

use std::path::PathBuf;

use crate::budget::human_bytes;
use crate::diag::{self, CudaVersion, DeviceInfo};
pub use crate::sys::{find_nccl, python_nccl_dirs, NcclFound, NcclSearch};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Fine.
    Ok,
    /// Works, but slower or smaller than it could be.
    Warning,
    /// Will fail.
    Error,
}

/// One finding with its advice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// How bad it is.
    pub severity: Severity,
    /// What was found and what to do.
    pub message: String,
}

/// The PCIe link of a GPU, as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PcieLink {
    /// Generation in use (5 for 32 GT/s).
    pub generation: Option<u32>,
    /// Lanes in use.
    pub width: Option<u32>,
    /// The most the device supports.
    pub max_generation: Option<u32>,
    /// The most lanes the device supports.
    pub max_width: Option<u32>,
}

/// Everything the doctor found.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Whether this binary has CUDA compiled in.
    pub cuda_compiled: bool,
    /// The GPU, when there is one and CUDA is compiled in.
    pub device: Option<DeviceInfo>,
    /// Why the GPU could not be opened, if it could not.
    pub device_error: Option<String>,
    /// `ulimit -l` in bytes (`None`: unlimited or unknown).
    pub memlock_limit: Option<u64>,
    /// The machine's RAM (`None` where `/proc/meminfo` cannot be read).
    pub host_memory: Option<diag::HostMemory>,
    /// Whether 64 MiB of host memory could be pinned (`None`: not tried).
    pub pinning_works: Option<bool>,
    /// The PCIe link.
    pub pcie: Option<PcieLink>,
    /// Measured pinned host-to-device rate, GB/s.
    pub pinned_gbps: Option<f64>,
    /// Measured pageable host-to-device rate, GB/s.
    pub pageable_gbps: Option<f64>,
    /// Device memory each step of bringing up CUDA took, in order (the bare context, Candle's
    /// device, the first kernels; `sys::context_memory`), measured before anything else; the
    /// budget's room is what is left after them. Empty without a GPU.
    pub context_memory: Vec<(&'static str, u64)>,
    /// Where NCCL was found, or where it was looked for ([`find_nccl`]).
    pub nccl: NcclSearch,
    /// The verdicts, worst first.
    pub verdicts: Vec<Verdict>,
}

/// The verdicts for a set of facts (pure).
pub fn verdicts(
    cuda_compiled: bool,
    device: Option<&DeviceInfo>,
    device_error: Option<&str>,
    memlock_limit: Option<u64>,
    pinning_works: Option<bool>,
    pcie: Option<&PcieLink>,
    nccl: &NcclSearch,
) -> Vec<Verdict> {
    let mut out = Vec::new();
    let mut say = |severity, message: String| out.push(Verdict { severity, message });
    if !cuda_compiled {
        say(
            Severity::Warning,
            "built without CUDA: everything runs on the CPU; build with `--features cuda` (and \
             `source scripts/cuda-toolkit.sh` where nvcc is missing) to use a GPU"
                .into(),
        );
    }
    if let Some(e) = device_error {
        say(Severity::Error, format!("no usable GPU: {e}"));
    }
    if let Some(d) = device {
        match (d.driver_cuda_version, d.built_for_cuda) {
            (Some(drv), Some(built)) if drv < built => say(
                Severity::Error,
                format!(
                    "the driver supports CUDA {drv} but this binary was built for CUDA {built}: \
                     update the NVIDIA driver, or build with a CUDA {drv} toolkit"
                ),
            ),
            (Some(drv), Some(built)) => say(
                Severity::Ok,
                format!("driver supports CUDA {drv}; built for CUDA {built}"),
            ),
            _ => say(
                Severity::Warning,
                "could not compare the driver's and the build's CUDA versions".into(),
            ),
        }
        let cc = d.compute_capability.0 * 10 + d.compute_capability.1;
        match d.compiled_arch.as_deref().and_then(|a| a.trim().parse::<u32>().ok()) {
            // CUDA_COMPUTE_CAP=90 builds sm_90a: arch-specific code that only a 9.0 GPU runs.
            Some(arch) if arch >= 90 && arch != cc => say(
                Severity::Error,
                format!(
                    "the kernels were compiled for sm_{arch}a, which only a compute capability \
                     {}.{} GPU runs, but this GPU is {}.{}: it would fail with \"no kernel image is \
                     available for execution\"; rebuild with CUDA_COMPUTE_CAP={cc}",
                    arch / 10,
                    arch % 10,
                    d.compute_capability.0,
                    d.compute_capability.1
                ),
            ),
            Some(arch) if arch > cc => say(
                Severity::Error,
                format!(
                    "the kernels need compute capability {}.{} or newer but this GPU is {}.{} (\"no \
                     kernel image is available for execution\"); rebuild with CUDA_COMPUTE_CAP={cc}",
                    arch / 10,
                    arch % 10,
                    d.compute_capability.0,
                    d.compute_capability.1
                ),
            ),
            Some(arch) => say(Severity::Ok, format!("kernels compiled for sm_{arch}; the GPU is sm_{cc}")),
            None => say(Severity::Warning, "unknown target architecture of the kernels".into()),
        }
        let um = d.unified_memory;
        match (um.managed, um.concurrent_access) {
            (false, _) => say(
                Severity::Warning,
                "this GPU cannot allocate managed (Unified) memory: the explicit engine (pinned \
                 host memory and copies) is the only one"
                    .into(),
            ),
            (true, false) => say(
                Severity::Warning,
                "managed (Unified) memory works but not concurrently with the CPU (pre-Pascal, \
                 Windows or a virtualized GPU): pages do not migrate on demand, every managed \
                 allocation moves whole at each kernel launch, and prefetch and advice have no \
                 effect; use the explicit engine"
                    .into(),
            ),
            (true, true) => say(
                Severity::Ok,
                format!(
                    "Unified Memory: managed allocations, concurrent access and on-demand page \
                     migration supported{}",
                    if um.pageable_access {
                        "; the GPU also reads pageable host memory (HMM/ATS)"
                    } else {
                        ""
                    }
                ),
            ),
        }
        if d.free_bytes < d.total_bytes / 2 {
            say(
                Severity::Warning,
                format!(
                    "only {} of {} are free on the GPU: other processes hold the rest",
                    human_bytes(d.free_bytes),
                    human_bytes(d.total_bytes)
                ),
            );
        }
    }
    match pinning_works {
        Some(false) => say(
            Severity::Warning,
            format!(
                "host memory cannot be pinned (locked-memory limit {}): weights go through the \
                 staging ring at a fraction of the link's speed; raise `ulimit -l`",
                memlock_limit.map_or("unknown".into(), human_bytes)
            ),
        ),
        Some(true) => say(Severity::Ok, "pinned host memory works".into()),
        None => {}
    }
    if let Some(p) = pcie {
        if let (Some(g), Some(w), Some(mg), Some(mw)) =
            (p.generation, p.width, p.max_generation, p.max_width)
        {
            if g < mg || w < mw {
                say(
                    Severity::Warning,
                    format!(
                        "the PCIe link runs at Gen{g} x{w}, below the device's Gen{mg} x{mw}: check the slot (an idle GPU may also train down)"
                    ),
                );
            } else {
                say(Severity::Ok, format!("PCIe Gen{g} x{w}"));
            }
        }
    }
    match &nccl.found {
        Some(n) if n.on_loader_path => say(
            Severity::Ok,
            format!(
                "NCCL {}.{}.{} loads ({}); the multi-process runs' tensors go over TCP (the \
                 NCCL transport is not built yet)",
                n.version.0, n.version.1, n.version.2, n.path
            ),
        ),
        Some(n) => {
            let dir = std::path::Path::new(&n.path)
                .parent()
                .map_or(String::new(), |d| d.display().to_string());
            say(
                Severity::Warning,
                format!(
                    "NCCL {}.{}.{} is at {} but not on the loader's path: \
                     `export LD_LIBRARY_PATH={dir}:$LD_LIBRARY_PATH`",
                    n.version.0, n.version.1, n.version.2, n.path
                ),
            );
        }
        None => say(
            Severity::Ok,
            format!(
                "NCCL not found ({} candidates: the loader's path, then Python's \
                 nvidia/*/lib): the multi-process runs use TCP",
                nccl.tried.len()
            ),
        ),
    }
    out.sort_by_key(|v| std::cmp::Reverse(v.severity));
    out
}

/// `ulimit -l` of this process, from /proc/self/limits (`None`: unlimited or unknown).
pub fn memlock_limit() -> Option<u64> {
    diag::memlock_limit()
}

fn pcie_generation(speed: &str) -> Option<u32> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    Some(match gts {
        x if x >= 64.0 => 6,
        x if x >= 32.0 => 5,
        x if x >= 16.0 => 4,
        x if x >= 8.0 => 3,
        x if x >= 5.0 => 2,
        _ => 1,
    })
}

/// The PCIe link of the device at `pci_bus_id` (`0000:3b:00.0`), from sysfs.
pub fn pcie_link(pci_bus_id: &str) -> Option<PcieLink> {
    let dir = std::path::Path::new("/sys/bus/pci/devices").join(pci_bus_id.to_ascii_lowercase());
    let read = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let link = PcieLink {
        generation: read("current_link_speed")
            .as_deref()
            .and_then(pcie_generation),
        width: read("current_link_width").and_then(|w| w.parse().ok()),
        max_generation: read("max_link_speed").as_deref().and_then(pcie_generation),
        max_width: read("max_link_width").and_then(|w| w.parse().ok()),
    };
    (link.generation.is_some() || link.width.is_some()).then_some(link)
}

/// Examines the machine. `measure` also times 256 MiB pinned and pageable copies;
/// `nccl_dirs` are where NCCL is looked for after the loader's own search (e.g.
/// [`python_nccl_dirs`] of the Python prefixes).
pub fn examine(ordinal: usize, measure: bool, nccl_dirs: &[PathBuf]) -> Report {
    let cuda_compiled = cfg!(feature = "cuda");
    let memlock = memlock_limit();
    let (mut device, mut device_error, mut pinning, mut pcie, mut pinned, mut pageable) =
        (None, None, None, None, None, None);
    // First, while the process has not opened the GPU: what CUDA itself takes.
    let context_memory = if cuda_compiled {
        crate::sys::context_memory(ordinal).unwrap_or_default()
    } else {
        Vec::new()
    };
    if cuda_compiled {
        match Device::new_cuda_with_stream(ordinal) {
            Ok(dev) => {
                match diag::device_info(&dev) {
                    Ok(info) => device = Some(info),
                    Err(e) => device_error = Some(e.to_string()),
                }
                pinning = Some(crate::sys::try_pin(&dev, 64 << 20));
                pcie = crate::sys::pci_bus_id(&dev).and_then(|id| pcie_link(&id));
                if measure {
                    pinned = diag::measure_h2d_gbps(&dev, 256 << 20, true, 5).ok();
                    pageable = diag::measure_h2d_gbps(&dev, 256 << 20, false, 3).ok();
                }
            }
            Err(e) => device_error = Some(e.to_string()),
        }
    }
    let nccl = find_nccl(nccl_dirs);
    let verdicts = verdicts(
        cuda_compiled,
        device.as_ref(),
        device_error.as_deref(),
        memlock,
        pinning,
        pcie.as_ref(),
        &nccl,
    );
    Report {
        cuda_compiled,
        device,
        device_error,
        memlock_limit: memlock,
        host_memory: diag::host_memory(),
        pinning_works: pinning,
        pcie,
        pinned_gbps: pinned,
        pageable_gbps: pageable,
        context_memory,
        nccl,
        verdicts,
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "candle-offload doctor")?;
        writeln!(
            f,
            "  CUDA compiled in   {}",
            if self.cuda_compiled { "yes" } else { "no" }
        )?;
        if let Some(d) = &self.device {
            writeln!(
                f,
                "  GPU                {} (cuda:{}), compute capability {}.{}",
                d.name, d.ordinal, d.compute_capability.0, d.compute_capability.1
            )?;
            writeln!(
                f,
                "  memory             {} total, {} free",
                human_bytes(d.total_bytes),
                human_bytes(d.free_bytes)
            )?;
            if !self.context_memory.is_empty() {
                let parts: Vec<String> = self
                    .context_memory
                    .iter()
                    .map(|(what, b)| format!("{what} {}", human_bytes(*b)))
                    .collect();
                writeln!(f, "  CUDA's own memory  {}", parts.join(", "))?;
            }
            let v = |x: Option<CudaVersion>| x.map_or("?".to_string(), |v| v.to_string());
            writeln!(
                f,
                "  driver / build     CUDA {} / CUDA {}, kernels for sm_{}",
                v(d.driver_cuda_version),
                v(d.built_for_cuda),
                d.compiled_arch.as_deref().unwrap_or("?")
            )?;
            let yes = |b: bool| if b { "yes" } else { "no" };
            let um = d.unified_memory;
            writeln!(
                f,
                "  unified memory     managed {}, concurrent access and page migration {}, \
                 pageable host memory {}",
                yes(um.managed),
                yes(um.concurrent_access),
                yes(um.pageable_access)
            )?;
        }
        if let Some(m) = self.host_memory {
            writeln!(
                f,
                "  host RAM           {} total, {} available; the store holds at most {} by \
                 default (3/4 of RAM; the rest stays in the checkpoint file)",
                human_bytes(m.total_bytes),
                human_bytes(m.available_bytes),
                human_bytes(crate::store::default_host_limit(m.total_bytes))
            )?;
        }
        writeln!(
            f,
            "  locked-memory limit {}",
            self.memlock_limit.map_or("unlimited".into(), human_bytes)
        )?;
        if let Some(p) = self.pinning_works {
            writeln!(
                f,
                "  pinning            {}",
                if p { "works" } else { "fails" }
            )?;
        }
        if let Some(p) = &self.pcie {
            let o = |x: Option<u32>| x.map_or("?".into(), |v| v.to_string());
            writeln!(
                f,
                "  PCIe               Gen{} x{} (device max Gen{} x{})",
                o(p.generation),
                o(p.width),
                o(p.max_generation),
                o(p.max_width)
            )?;
        }
        if let (Some(p), Some(q)) = (self.pinned_gbps, self.pageable_gbps) {
            writeln!(
                f,
                "  host->device       {p:.1} GB/s pinned, {q:.1} GB/s pageable (256 MiB copies)"
            )?;
        }
        match &self.nccl.found {
            Some(n) => writeln!(
                f,
                "  NCCL               {}.{}.{} ({})",
                n.version.0, n.version.1, n.version.2, n.path
            )?,
            None => writeln!(
                f,
                "  NCCL               not found ({} candidates tried)",
                self.nccl.tried.len()
            )?,
        }
        writeln!(f, "verdicts:")?;
        for v in &self.verdicts {
            let tag = match v.severity {
                Severity::Ok => "ok     ",
                Severity::Warning => "warning",
                Severity::Error => "ERROR  ",
            };
            writeln!(f, "  {tag} {}", v.message)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diag::UnifiedMemory;

    fn h200(driver: i32, built: i32, arch: &str) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            total_bytes: 140 << 30,
            free_bytes: 139 << 30,
            driver_cuda_version: Some(CudaVersion::from_int(driver)),
            built_for_cuda: Some(CudaVersion::from_int(built)),
            compiled_arch: Some(arch.into()),
            unified_memory: UnifiedMemory {
                managed: true,
                concurrent_access: true,
                pageable_access: false,
            },
        }
    }

    #[test]
    fn explains_no_kernel_image_and_old_drivers() {
        let ok = verdicts(
            true,
            Some(&h200(13000, 13000, "90")),
            None,
            None,
            Some(true),
            None,
            &NcclSearch::default(),
        );
        assert!(ok.iter().all(|v| v.severity == Severity::Ok), "{ok:?}");
        let mut ampere = h200(13000, 13000, "90");
        ampere.compute_capability = (8, 6);
        let v = verdicts(
            true,
            Some(&ampere),
            None,
            None,
            Some(true),
            None,
            &NcclSearch::default(),
        );
        assert_eq!(v[0].severity, Severity::Error);
        assert!(
            v[0].message.contains("no kernel image")
                && v[0].message.contains("CUDA_COMPUTE_CAP=86"),
            "{v:?}"
        );
        let v = verdicts(
            true,
            Some(&h200(12040, 13000, "90")),
            None,
            None,
            Some(true),
            None,
            &NcclSearch::default(),
        );
        assert!(v[0].message.contains("update the NVIDIA driver"), "{v:?}");
    }

    #[test]
    fn says_what_the_gpu_supports_of_unified_memory() {
        let find = |d: &DeviceInfo| {
            verdicts(
                true,
                Some(d),
                None,
                None,
                Some(true),
                None,
                &NcclSearch::default(),
            )
            .into_iter()
            .find(|v| v.message.contains("anaged"))
            .expect("a unified-memory finding")
        };
        let mut d = h200(13000, 13000, "90");
        let v = find(&d);
        assert_eq!(v.severity, Severity::Ok, "{v:?}");
        assert!(v.message.contains("on-demand page migration"), "{v:?}");
        d.unified_memory.concurrent_access = false;
        let v = find(&d);
        assert_eq!(v.severity, Severity::Warning);
        assert!(v.message.contains("moves whole"), "{v:?}");
        d.unified_memory = UnifiedMemory::default();
        let v = find(&d);
        assert_eq!(v.severity, Severity::Warning);
        assert!(v.message.contains("cannot allocate managed"), "{v:?}");
        let report = Report {
            cuda_compiled: true,
            device: Some(d.clone()),
            device_error: None,
            memlock_limit: None,
            host_memory: None,
            pinning_works: Some(true),
            pcie: None,
            pinned_gbps: None,
            pageable_gbps: None,
            context_memory: vec![("CUDA context", 500 << 20), ("Candle's device", 8 << 20)],
            nccl: NcclSearch::default(),
            verdicts: Vec::new(),
        }
        .to_string();
        assert!(report.contains("unified memory     managed no"), "{report}");
        assert!(
            report.contains("CUDA's own memory  CUDA context 500"),
            "{report}"
        );
    }

    #[test]
    fn cpu_builds_and_pinning_failures_say_what_is_missing() {
        let v = verdicts(
            false,
            None,
            None,
            Some(64 << 10),
            None,
            None,
            &NcclSearch::default(),
        );
        assert!(v.iter().any(|v| v.message.contains("--features cuda")));
        let v = verdicts(
            true,
            None,
            Some("CUDA_ERROR_NO_DEVICE"),
            Some(64 << 10),
            Some(false),
            None,
            &NcclSearch::default(),
        );
        assert_eq!(v[0].severity, Severity::Error);
        assert!(
            v.iter()
                .any(|v| v.message.contains("ulimit -l") && v.message.contains("64.0 KiB")),
            "{v:?}"
        );
    }

    #[test]
    fn says_where_nccl_is_and_how_to_reach_it() {
        let at = |path: &str, on_loader_path| NcclSearch {
            found: Some(NcclFound {
                path: path.into(),
                version: (2, 27, 3),
                on_loader_path,
            }),
            tried: Vec::new(),
        };
        let says = |search: &NcclSearch, severity: Severity, text: &str| {
            let v = verdicts(true, None, None, None, None, None, search);
            assert!(
                v.iter()
                    .any(|v| v.severity == severity && v.message.contains(text)),
                "{v:?}"
            );
        };
        let wheel = "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2";
        says(
            &at(wheel, false),
            Severity::Warning,
            "LD_LIBRARY_PATH=/venv/lib/python3.12/site-packages/nvidia/nccl/lib:",
        );
        says(&at("libnccl.so.2", true), Severity::Ok, "NCCL 2.27.3 loads");
        says(&NcclSearch::default(), Severity::Ok, "NCCL not found");
    }

    #[test]
    fn reads_pcie_speeds_and_limits() {
        assert_eq!(pcie_generation("32.0 GT/s PCIe"), Some(5));
        assert_eq!(pcie_generation("16.0 GT/s PCIe"), Some(4));
        assert_eq!(pcie_generation("2.5 GT/s PCIe"), Some(1));
        let slow = PcieLink {
            generation: Some(4),
            width: Some(8),
            max_generation: Some(5),
            max_width: Some(16),
        };
        let v = verdicts(
            true,
            None,
            None,
            None,
            None,
            Some(&slow),
            &NcclSearch::default(),
        );
        assert!(
            v.iter()
                .any(|v| v.severity == Severity::Warning && v.message.contains("Gen4 x8")),
            "{v:?}"
        );
        // /proc/self/limits exists on Linux; the value may be unlimited.
        let _ = memlock_limit();
    }
}
