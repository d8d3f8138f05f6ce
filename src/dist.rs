//! The launch of a multi-process run: `--rank/--world-size/--master-addr/--master-port` and
//! `--dist-timeout`, or torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`), read once by the binaries; a flag wins over its variable.
//! Under torchrun, whose agent holds `MASTER_PORT` itself (it says so with
//! `TORCHELASTIC_USE_AGENT_STORE`), rank 0 listens on the port after it. docs/tuning.md's table
//! lists the variables.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use candle_core::Device;
use candle_offload::dist::{NcclTransport, NetConfig, TcpTransport, Transport};
use candle_offload::doctor::{find_nccl, python_nccl_dirs};

/// The variables a launcher such as torchrun sets, read by [`DistArgs::launch`].
pub const DIST_VARS: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// rank 0's address and port when neither flag nor variable gives them (torchrun's port).
const DEFAULT_ADDR: &str = "127.0.0.1";
const DEFAULT_PORT: u16 = 29500;

/// Where this process sits in a multi-process run (the pipeline over processes).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DistArgs {
    /// This process's rank in a multi-process run, 0..--world-size (or `RANK`). Rank 0 plans
    /// the layer split, runs the embeddings and prints the text; the last rank runs the head.
    #[arg(long)]
    pub rank: Option<usize>,
    /// How many processes run the model together (or `WORLD_SIZE`); 1 or unset: this one alone.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Rank 0's address, where the others join it (or `MASTER_ADDR`; default 127.0.0.1).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Rank 0's port (or `MASTER_PORT`; default 29500).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds any wait on another rank lasts at most (the rendezvous, each step's hidden
    /// state or token); a peer that died is noticed sooner, by its closed connection or its
    /// missing heartbeat.
    #[arg(long, default_value_t = 300.0, value_parser = crate::flags::positive)]
    pub dist_timeout: f64,
    /// How hidden states travel between ranks: `nccl` (GPU to GPU), `tcp` (through host
    /// memory), or `auto`: NCCL when this rank's device is a GPU and NCCL is found (on the
    /// loader's path, or in a Python environment's `nvidia/*/lib`), TCP otherwise. Every rank
    /// must end up with the same.
    #[arg(long, value_enum, default_value_t = TransportChoice::Auto)]
    pub dist_transport: TransportChoice,
    /// NCCL's library for `--dist-transport nccl|auto`, a path or a file name for the loader
    /// (default: the first `libnccl.so.2` found as the doctor finds it).
    #[arg(long)]
    pub nccl_library: Option<String>,
}

/// `--dist-transport`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// NCCL on a GPU where it is found, TCP otherwise.
    #[default]
    Auto,
    /// Through the TCP connections, via host memory.
    Tcp,
    /// NCCL between GPUs.
    Nccl,
}

/// A multi-process run's settings, from flags and variables.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// This process's rank.
    pub rank: usize,
    /// How many processes.
    pub world_size: usize,
    /// The GPU of this process on its host, where the launcher says (`LOCAL_RANK`).
    pub local_rank: Option<usize>,
    /// Rank 0's address.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
    /// The longest wait on another rank.
    pub timeout: Duration,
    /// `--dist-transport`.
    pub transport: TransportChoice,
    /// `--nccl-library`.
    pub nccl_library: Option<String>,
    /// Where NCCL is looked for beyond the loader's path (Python environments' `nvidia/*/lib`).
    pub nccl_dirs: Vec<PathBuf>,
}

impl Launch {
    /// The transport's settings.
    pub fn net_config(&self) -> NetConfig {
        NetConfig::new(
            self.rank,
            self.world_size,
            self.master_addr.clone(),
            self.master_port,
            self.timeout,
        )
    }

    /// Joins the other ranks, within the timeout, with the transport `--dist-transport` chose
    /// for this rank's `device`; returns it and a line saying which.
    pub fn connect(&self, device: &Device) -> Result<(Arc<dyn Transport>, String)> {
        let joining = |e: &dyn std::fmt::Display| {
            anyhow!(
                "rank {} of {}: joining at {}:{}: {e}",
                self.rank,
                self.world_size,
                self.master_addr,
                self.master_port
            )
        };
        match self.nccl_choice(device)? {
            None => {
                let t = TcpTransport::connect(&self.net_config()).map_err(|e| joining(&e))?;
                Ok((Arc::new(t), "hidden states over TCP".into()))
            }
            Some(library) => {
                let t = NcclTransport::connect(&self.net_config(), device, &library)
                    .map_err(|e| joining(&e))?;
                let (path, (a, b, c)) = t.nccl();
                let line = format!("hidden states over NCCL {a}.{b}.{c} ({path})");
                Ok((Arc::new(t), line))
            }
        }
    }

    /// The NCCL library to load, or `None` for TCP.
    fn nccl_choice(&self, device: &Device) -> Result<Option<String>> {
        let found = || {
            self.nccl_library
                .clone()
                .or_else(|| find_nccl(&self.nccl_dirs).found.map(|f| f.path))
        };
        match self.transport {
            TransportChoice::Tcp => Ok(None),
            TransportChoice::Auto if !device.is_cuda() => Ok(None),
            TransportChoice::Auto => Ok(found()),
            TransportChoice::Nccl => {
                if !device.is_cuda() {
                    bail!("--dist-transport nccl: this rank's device is {device:?}, not a GPU");
                }
                found().map(Some).ok_or_else(|| {
                    anyhow!(
                        "--dist-transport nccl: NCCL (libnccl.so.2) is not on the loader's \
                         path nor in {:?}; give --nccl-library, or add its directory to \
                         LD_LIBRARY_PATH (`doctor` looks for it too)",
                        self.nccl_dirs
                    )
                })
            }
        }
    }
}

/// Where a Python wheel may have put NCCL (PyTorch's `nvidia-nccl-cu*`): under the system
/// prefixes, `~/.local` (`HOME`), and the active virtual or conda environment (`VIRTUAL_ENV`,
/// `CONDA_PREFIX`); `env` gives a variable's value by name.
pub fn nccl_search_dirs(env: impl Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = vec!["/usr".into(), "/usr/local".into()];
    if let Some(home) = env("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
    }
    prefixes.extend(
        ["VIRTUAL_ENV", "CONDA_PREFIX"]
            .iter()
            .filter_map(|v| env(v).map(PathBuf::from)),
    );
    python_nccl_dirs(&prefixes)
}

impl DistArgs {
    /// The launch these flags and `env` (a variable's value by name: `std::env::var` in a
    /// binary) describe; `None` for a process alone (no world size, or 1).
    pub fn launch(&self, env: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        fn number<T: std::str::FromStr>(name: &str, value: Option<String>) -> Result<Option<T>> {
            match value {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| anyhow!("{name}={v:?}: not a whole number")),
            }
        }
        let world_size = match self.world_size {
            Some(w) => Some(w),
            None => number("WORLD_SIZE", env("WORLD_SIZE"))?,
        };
        let rank = match self.rank {
            Some(r) => Some(r),
            None => number("RANK", env("RANK"))?,
        };
        let world_size = match (world_size, rank) {
            (None | Some(1), None | Some(0)) => return Ok(None),
            (None, Some(r)) => {
                bail!("--rank {r} (or RANK) without --world-size (or WORLD_SIZE)")
            }
            (Some(0), _) => bail!("--world-size (or WORLD_SIZE) 0: must be at least 1"),
            (Some(w), _) => w,
        };
        let Some(rank) = rank else {
            bail!("--world-size {world_size} (or WORLD_SIZE) without --rank (or RANK)");
        };
        if rank >= world_size {
            bail!("--rank (or RANK) {rank} is not below the world size {world_size}");
        }
        let master_addr = self
            .master_addr
            .clone()
            .or_else(|| env("MASTER_ADDR"))
            .unwrap_or_else(|| DEFAULT_ADDR.to_string());
        let master_port = match self.master_port {
            Some(p) => p,
            None => match number::<u16>("MASTER_PORT", env("MASTER_PORT"))? {
                None => DEFAULT_PORT,
                // torchrun's agent listens on MASTER_PORT for its own store: the next is ours.
                Some(p) if agent_store(&env) => p.checked_add(1).ok_or_else(|| {
                    anyhow!("MASTER_PORT={p}: torchrun's agent holds it, and there is no next port")
                })?,
                Some(p) => p,
            },
        };
        Ok(Some(Launch {
            rank,
            world_size,
            local_rank: number("LOCAL_RANK", env("LOCAL_RANK"))?,
            master_addr,
            master_port,
            timeout: Duration::from_secs_f64(self.dist_timeout),
            transport: self.dist_transport,
            nccl_library: self.nccl_library.clone(),
            nccl_dirs: if self.dist_transport == TransportChoice::Tcp {
                Vec::new()
            } else {
                nccl_search_dirs(&env)
            },
        }))
    }
}

/// Whether a torchrun agent holds `MASTER_PORT` for its own store.
fn agent_store(env: &impl Fn(&str) -> Option<String>) -> bool {
    env("TORCHELASTIC_USE_AGENT_STORE")
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn args() -> DistArgs {
        DistArgs {
            dist_timeout: 300.0,
            ..Default::default()
        }
    }

    #[test]
    fn torchruns_variables_and_flags_over_them() {
        assert_eq!(args().launch(env(&[])).unwrap(), None);
        assert_eq!(args().launch(env(&[("WORLD_SIZE", "1")])).unwrap(), None);
        let vars = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29400"),
        ];
        let l = args().launch(env(&vars)).unwrap().unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank), (1, 2, Some(1)));
        // Under torchrun its agent holds MASTER_PORT: ours is the next.
        let mut torchrun = vars.to_vec();
        torchrun.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        let t = args().launch(env(&torchrun)).unwrap().unwrap();
        assert_eq!(t.master_port, 29401);
        assert_eq!((l.master_addr.as_str(), l.master_port), ("10.0.0.5", 29400));
        assert_eq!(l.timeout, Duration::from_secs(300));
        let flags = DistArgs {
            rank: Some(0),
            world_size: Some(3),
            master_addr: Some("localhost".into()),
            master_port: Some(1234),
            dist_timeout: 2.5,
            ..args()
        };
        let l = flags.launch(env(&vars)).unwrap().unwrap();
        assert_eq!((l.rank, l.world_size), (0, 3));
        assert_eq!((l.master_addr.as_str(), l.master_port), ("localhost", 1234));
        assert_eq!(l.timeout, Duration::from_millis(2500));
        let alone = DistArgs {
            rank: Some(1),
            world_size: Some(2),
            ..args()
        };
        let l = alone.launch(env(&[])).unwrap().unwrap();
        assert_eq!(
            (l.master_addr.as_str(), l.master_port),
            ("127.0.0.1", 29500)
        );
        assert_eq!(l.local_rank, None);
    }

    #[test]
    fn the_transport_follows_the_flag_and_the_device() {
        let vars = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let with = |transport, library: Option<&str>| {
            let a = DistArgs {
                dist_transport: transport,
                nccl_library: library.map(str::to_string),
                ..args()
            };
            a.launch(env(&vars)).unwrap().unwrap()
        };
        let cpu = Device::Cpu;
        // TCP when asked, and where the device is not a GPU unless NCCL is demanded.
        assert_eq!(
            with(TransportChoice::Tcp, None).nccl_choice(&cpu).unwrap(),
            None
        );
        assert_eq!(
            with(TransportChoice::Auto, Some("x.so"))
                .nccl_choice(&cpu)
                .unwrap(),
            None
        );
        let e = with(TransportChoice::Nccl, Some("x.so"))
            .nccl_choice(&cpu)
            .unwrap_err();
        assert!(e.to_string().contains("not a GPU"), "{e}");
        // TCP searches nowhere for NCCL.
        assert!(with(TransportChoice::Tcp, None).nccl_dirs.is_empty());
    }

    #[test]
    fn nccl_is_looked_for_in_the_python_environments_named() {
        let tmp = tempfile::Builder::new()
            .prefix("candle-offload-dist-nccl-")
            .tempdir()
            .unwrap();
        let root = tmp.path();
        let lib = root.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not a library").unwrap();
        let venv = root.join("venv").display().to_string();
        let dirs = nccl_search_dirs(|k| (k == "VIRTUAL_ENV").then(|| venv.clone()));
        assert!(dirs.contains(&lib), "{dirs:?}");
        assert!(!nccl_search_dirs(|_| None).contains(&lib));
    }

    #[test]
    fn bad_launches_name_the_flag_or_variable() {
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&[("RANK", "1")], "without --world-size"),
            (&[("WORLD_SIZE", "2")], "without --rank"),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")],
                "not below the world size 2",
            ),
            (
                &[("WORLD_SIZE", "two"), ("RANK", "0")],
                "WORLD_SIZE=\"two\"",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
        ];
        for (vars, want) in cases {
            let e = args().launch(env(vars)).unwrap_err().to_string();
            assert!(e.contains(want), "{vars:?}: {e}");
        }
    }
}
