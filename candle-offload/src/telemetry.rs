//! What the runtime did: bytes moved, link rate achieved, time compute stalled on copies,
//! hits and misses per unit, resident and pinned bytes; per step and in total.
//!
//! [`OffloadStats`] is the struct for programs; [`OffloadStats::summary`] prints it like
//! PyTorch's `memory_summary()`.

use std::fmt::Write as _;
use std::time::Instant;

use crate::budget::human_bytes;
use crate::cache::ActivePolicy;

pub(crate) use crate::sys::Timings;

/// Counters of one unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitStats {
    /// The unit's name.
    pub name: String,
    /// Its size on the device.
    pub bytes: u64,
    /// Accesses that found it on the device (or already on its way).
    pub hits: u64,
    /// Accesses that had to fetch it.
    pub misses: u64,
    /// Fetches issued ahead of use.
    pub prefetches: u64,
    /// Times it was evicted.
    pub evictions: u64,
    /// Whether it is on the device now.
    pub resident: bool,
}

/// Transfer counters over an interval (a step, or the whole run).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferStats {
    /// Host-to-device bytes.
    pub bytes: u64,
    /// Number of unit fetches.
    pub fetches: u64,
    /// Seconds the copy engine was busy with them (device timing on a GPU).
    pub copy_s: f64,
    /// Seconds compute waited for weights to arrive.
    pub stall_s: f64,
    /// Wall-clock seconds of the interval (steps only).
    pub wall_s: f64,
    /// GGML tensors written into a buffer an evicted unit left, instead of a new allocation
    /// (GPU only).
    pub reused_buffers: u64,
    /// Times the weight pool's freed memory went back to the driver before a fetch, after an
    /// upload freed evicted buffers whose room no new buffer took back (GPU only;
    /// `OffloadRuntime`'s fetch).
    pub pool_trims: u64,
}

impl TransferStats {
    /// The rate copies ran at while they ran, GB/s (10^9 bytes per second).
    pub fn copy_gbps(&self) -> f64 {
        if self.copy_s > 0.0 {
            self.bytes as f64 / self.copy_s / 1e9
        } else {
            0.0
        }
    }

    /// Bytes moved over the interval's wall time, GB/s.
    pub fn effective_gbps(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.bytes as f64 / self.wall_s / 1e9
        } else {
            0.0
        }
    }

    fn add_timings(&mut self, t: Timings) {
        self.copy_s += t.copy_s.unwrap_or(0.0);
        self.stall_s += t.stall_s;
    }
}

/// A snapshot of the runtime's counters.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadStats {
    /// The device (`cuda:0`, `cpu`: [`crate::diag::device_label`]).
    pub device: String,
    /// The budget for everything on the device, bytes.
    pub budget_bytes: u64,
    /// The caller's reservation inside the budget.
    pub reserve_bytes: u64,
    /// What weights may take (resident plus in flight).
    pub weight_capacity_bytes: u64,
    /// Weights on the device now.
    pub resident_bytes: u64,
    /// The most weights ever on the device at once.
    pub peak_resident_bytes: u64,
    /// Buffers of evicted GGML units held for the next fetch to write its blocks into (GPU;
    /// within the weights' capacity, beside `resident_bytes`).
    pub spare_bytes: u64,
    /// Page-locked host bytes of the store.
    pub pinned_bytes: u64,
    /// Pageable host bytes of the store (transfers go through staging).
    pub pageable_bytes: u64,
    /// Bytes of the store in managed (Unified) memory (the managed engine).
    pub managed_bytes: u64,
    /// Bytes of the units left in their checkpoint file (the disk tier).
    pub disk_bytes: u64,
    /// The units left in their checkpoint file, in order.
    pub disk_units: Vec<String>,
    /// Of those, the units read with O_DIRECT; the others are read through the page cache.
    pub disk_direct_units: Vec<String>,
    /// Read-ahead of the disk units (`None` when the store has none, or no reader threads
    /// could start).
    pub read_ahead: Option<ReadAheadStats>,
    /// The host-memory cap the store was built under (`None`: no cap).
    pub host_limit_bytes: Option<u64>,
    /// The machine's RAM now (`None` where `/proc/meminfo` cannot be read).
    pub host_memory: Option<crate::diag::HostMemory>,
    /// The locked-memory limit (`ulimit -l`; `None`: unlimited or unknown).
    pub memlock_limit: Option<u64>,
    /// Prefetch depth in force.
    pub prefetch_depth: usize,
    /// The policy in force.
    pub policy: ActivePolicy,
    /// Completed steps.
    pub steps: u64,
    /// Since the runtime started.
    pub total: TransferStats,
    /// The last completed step.
    pub last_step: Option<TransferStats>,
    /// Per unit.
    pub units: Vec<UnitStats>,
}

/// How the disk units were read ahead of their fetches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadAheadStats {
    /// Reader threads.
    pub threads: usize,
    /// At most this many disk units are read ahead at a time (the next ones the schedule
    /// fetches).
    pub units_ahead: usize,
    /// The bound on the staging memory this takes, outside the host cap: `units_ahead` + 1
    /// times the largest disk unit, the read-aheads and the one spare buffer kept for the
    /// next (reads dropped before they finish free theirs when they do).
    pub staging_bound_bytes: u64,
    /// Read-aheads started.
    pub issued: u64,
    /// Fetches of disk units.
    pub disk_fetches: u64,
    /// Of those, fetches that found their bytes already read.
    pub ready: u64,
    /// Of those, fetches that waited for a read-ahead still running.
    pub waited: u64,
}

impl OffloadStats {
    /// Hits over all units.
    pub fn hits(&self) -> u64 {
        self.units.iter().map(|u| u.hits).sum()
    }

    /// Misses over all units.
    pub fn misses(&self) -> u64 {
        self.units.iter().map(|u| u.misses).sum()
    }

    /// A printable report, like PyTorch's `memory_summary()`.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "candle-offload memory summary ({})", self.device);
        let budget = if self.budget_bytes >= u64::MAX / 8 {
            "unlimited".to_string()
        } else {
            human_bytes(self.budget_bytes)
        };
        let _ = writeln!(
            s,
            "  budget {:>11}   reserved for activations/KV {:>11}   weight capacity {:>11}",
            budget,
            human_bytes(self.reserve_bytes),
            human_bytes(self.weight_capacity_bytes)
        );
        let n_res = self.units.iter().filter(|u| u.resident).count();
        let _ = writeln!(
            s,
            "  resident {:>11} ({} of {} units)   peak {:>11}{}",
            human_bytes(self.resident_bytes),
            n_res,
            self.units.len(),
            human_bytes(self.peak_resident_bytes),
            if self.spare_bytes > 0 {
                format!("   spare buffers {}", human_bytes(self.spare_bytes))
            } else {
                String::new()
            }
        );
        let _ = writeln!(
            s,
            "  host     {:>11} pinned   {:>11} pageable   {:>11} on disk   cap {}",
            human_bytes(self.pinned_bytes),
            human_bytes(self.pageable_bytes),
            human_bytes(self.disk_bytes),
            self.host_limit_bytes.map_or("none".into(), human_bytes)
        );
        if self.managed_bytes > 0 {
            let _ = writeln!(
                s,
                "  managed  {:>11} in Unified Memory (migrated by prefetch, not copied)",
                human_bytes(self.managed_bytes)
            );
        }
        let ram = self.host_memory.map_or("RAM unknown".into(), |m| {
            format!(
                "RAM {} total, {} available",
                human_bytes(m.total_bytes),
                human_bytes(m.available_bytes)
            )
        });
        let _ = writeln!(
            s,
            "  machine  {ram}; locked-memory limit {}",
            self.memlock_limit.map_or("unlimited".into(), human_bytes)
        );
        if !self.disk_units.is_empty() {
            let how = match self.disk_direct_units.len() {
                0 => "through the page cache".to_string(),
                n if n == self.disk_units.len() => "with O_DIRECT".to_string(),
                n => format!(
                    "{n} with O_DIRECT ({}), the others through the page cache",
                    self.disk_direct_units.join(", ")
                ),
            };
            let _ = writeln!(
                s,
                "  disk     {} unit{} read from the checkpoint file on every fetch, {how}: {}",
                self.disk_units.len(),
                if self.disk_units.len() == 1 { "" } else { "s" },
                self.disk_units.join(", ")
            );
            match &self.read_ahead {
                Some(r) => {
                    let _ = writeln!(
                        s,
                        "  read-ahead {} unit{} ahead on {} thread{} (staging at most {}, outside \
                         the cap): {} of {} disk fetches found their bytes read, {} waited \
                         for them",
                        r.units_ahead,
                        if r.units_ahead == 1 { "" } else { "s" },
                        r.threads,
                        if r.threads == 1 { "" } else { "s" },
                        human_bytes(r.staging_bound_bytes),
                        r.ready,
                        r.disk_fetches,
                        r.waited
                    );
                }
                None => {
                    let _ = writeln!(s, "  read-ahead none (each fetch reads the file itself)");
                }
            }
        }
        let policy = match self.policy {
            ActivePolicy::Lru => "LRU".to_string(),
            ActivePolicy::Schedule { period } => format!("schedule (Belady, period {period})"),
        };
        let _ = writeln!(
            s,
            "  policy   {policy}, prefetch depth {}",
            self.prefetch_depth
        );
        let t = &self.total;
        let _ = writeln!(
            s,
            "  moved    {:>11} in {} fetches, {:.1} GB/s while copying, compute stalled {:.3} s; \
             {} hits, {} misses over {} steps",
            human_bytes(t.bytes),
            t.fetches,
            t.copy_gbps(),
            t.stall_s,
            self.hits(),
            self.misses(),
            self.steps
        );
        if let Some(l) = &self.last_step {
            let _ = writeln!(
                s,
                "  last step {:>10} in {:.4} s ({:.1} GB/s effective, {:.1} GB/s copying), stalled {:.4} s",
                human_bytes(l.bytes),
                l.wall_s,
                l.effective_gbps(),
                l.copy_gbps(),
                l.stall_s
            );
        }
        s
    }
}

/// Mutable counters kept by the runtime.
#[derive(Debug)]
pub(crate) struct Telemetry {
    pub total: TransferStats,
    pub step: TransferStats,
    pub step_started: Option<Instant>,
    pub last_step: Option<TransferStats>,
    pub steps: u64,
    pub peak_resident: u64,
    pub read_ahead: ReadAheadStats,
}

impl Telemetry {
    pub fn new() -> Self {
        Self {
            total: TransferStats::default(),
            step: TransferStats::default(),
            step_started: None,
            last_step: None,
            steps: 0,
            peak_resident: 0,
            read_ahead: ReadAheadStats::default(),
        }
    }

    pub fn reused(&mut self, tensors: u64) {
        for t in [&mut self.total, &mut self.step] {
            t.reused_buffers += tensors;
        }
    }

    pub fn trimmed(&mut self) {
        for t in [&mut self.total, &mut self.step] {
            t.pool_trims += 1;
        }
    }

    pub fn fetched(&mut self, bytes: u64) {
        for t in [&mut self.total, &mut self.step] {
            t.bytes += bytes;
            t.fetches += 1;
        }
    }

    pub fn timings(&mut self, t: Timings) {
        self.total.add_timings(t);
        self.step.add_timings(t);
    }

    pub fn begin_step(&mut self) {
        self.step = TransferStats::default();
        self.step_started = Some(Instant::now());
    }

    pub fn end_step(&mut self) {
        if let Some(t0) = self.step_started.take() {
            self.step.wall_s = t0.elapsed().as_secs_f64();
        }
        self.last_step = Some(self.step);
        self.step = TransferStats::default();
        self.steps += 1;
    }
}
