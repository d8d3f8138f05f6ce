//! GPU memory budgets: how they are written, and what they must hold.
//!
//! A budget is either a size (`3.5` meaning GiB as on the command line, `3.5GiB`, `3GB`,
//! `512MiB`, `4096MB`) or a share of the card (`50%`, like PyTorch's
//! `set_per_process_memory_fraction(0.5)`). It covers everything the runtime places on the
//! device: resident weights, weights in flight, and a reservation the caller declares for
//! activations, KV cache and workspace. This module is pure: it never touches a device.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

const KIB: f64 = 1024.0;
const MIB: f64 = KIB * 1024.0;
const GIB: f64 = MIB * 1024.0;

/// A device memory limit as the user wrote it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// An absolute number of bytes.
    Bytes(u64),
    /// A share of the device's total memory, in `(0, 1]`.
    FractionOfDevice(f64),
}

impl MemoryLimit {
    /// `gib` GiB.
    pub fn gib(gib: f64) -> Self {
        Self::Bytes((gib * GIB) as u64)
    }

    /// Parses a limit, naming `field` in the error (`--gpu-memory-limit`, `memory.max_gpu_memory`).
    ///
    /// A bare number is GiB (`3.5`); suffixes `B`, `KB`/`MB`/`GB`/`TB` (powers of 1000),
    /// `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024) and `%` (a share of the card) are accepted,
    /// in any case, with or without a space.
    pub fn parse(field: &str, input: &str) -> Result<Self> {
        let err = |reason: &str| Error::InvalidMemorySize {
            field: field.to_string(),
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let s = input.trim();
        if s.is_empty() {
            return Err(err("it is empty"));
        }
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+' || c == 'e'))
            .unwrap_or(s.len());
        // "1e3GB" is fine, but a unit that starts with 'e' is not a thing; keep it simple.
        let (num, unit) = s.split_at(split);
        let value: f64 = num
            .trim()
            .parse()
            .map_err(|_| err("expected a number such as 3.5, 3.5GiB, 512MiB or 50%"))?;
        if !value.is_finite() {
            return Err(err("it is not a finite number"));
        }
        if value <= 0.0 {
            return Err(err("it must be larger than zero"));
        }
        let unit = unit.trim().to_ascii_lowercase();
        if unit == "%" {
            if value > 100.0 {
                return Err(err("a share of the card cannot exceed 100%"));
            }
            return Ok(Self::FractionOfDevice(value / 100.0));
        }
        let scale = match unit.as_str() {
            "" | "g" | "gib" => GIB,
            "b" => 1.0,
            "k" | "kib" => KIB,
            "m" | "mib" => MIB,
            "t" | "tib" => GIB * KIB,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            _ => return Err(err("unknown unit (use B, MB, MiB, GB, GiB, TB, TiB or %)")),
        };
        let bytes = value * scale;
        if bytes < 1.0 {
            return Err(err("it is less than one byte"));
        }
        if bytes > u64::MAX as f64 / 2.0 {
            return Err(err("it is absurdly large"));
        }
        Ok(Self::Bytes(bytes as u64))
    }

    /// The limit in bytes on a device with `total` bytes (needed for a share of the card).
    pub fn resolve(&self, device: &str, total: Option<u64>) -> Result<u64> {
        match *self {
            Self::Bytes(b) => {
                if let Some(total) = total {
                    if b > total {
                        return Err(Error::BudgetExceedsDevice {
                            device: device.to_string(),
                            budget_mib: mib_ceil(b),
                            total_mib: total >> 20,
                        });
                    }
                }
                Ok(b)
            }
            Self::FractionOfDevice(f) => match total {
                Some(total) => Ok((total as f64 * f) as u64),
                None => Err(Error::InvalidConfig {
                    field: "gpu memory limit".into(),
                    reason: format!(
                        "a share of the card ({}%) needs a device that reports its memory; \
                         give a size such as 3.5GiB instead",
                        f * 100.0
                    ),
                }),
            },
        }
    }
}

impl FromStr for MemoryLimit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse("memory limit", s)
    }
}

impl fmt::Display for MemoryLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Bytes(b) => write!(f, "{}", human_bytes(b)),
            Self::FractionOfDevice(x) => write!(f, "{}%", x * 100.0),
        }
    }
}

/// Mebibytes, rounded up, for messages.
pub(crate) fn mib_ceil(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

/// Formats a byte count as `1.50 GiB`, `386.0 MiB`, `12 B`.
pub fn human_bytes(b: u64) -> String {
    let x = b as f64;
    if x >= GIB {
        format!("{:.2} GiB", x / GIB)
    } else if x >= MIB {
        format!("{:.1} MiB", x / MIB)
    } else if x >= KIB {
        format!("{:.1} KiB", x / KIB)
    } else {
        format!("{b} B")
    }
}

/// A resolved per-device budget: the limit and what the caller keeps for itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Everything the runtime and the caller may use on the device, in bytes.
    pub limit_bytes: u64,
    /// What the caller declared for activations, KV cache and workspace.
    pub reserve_bytes: u64,
}

impl Budget {
    /// The bytes left for weights (resident and in flight).
    pub fn weight_bytes(&self) -> u64 {
        self.limit_bytes.saturating_sub(self.reserve_bytes)
    }

    /// Bytes over the limit when the reservation plus `bytes` are placed (zero when they fit).
    pub fn missing(&self, bytes: u64) -> u64 {
        self.reserve_bytes
            .saturating_add(bytes)
            .saturating_sub(self.limit_bytes)
    }

    /// Whether the reservation plus `bytes` fit in the limit.
    pub fn fits(&self, bytes: u64) -> bool {
        self.missing(bytes) == 0
    }

    /// Refuses a budget that cannot hold `what` (`bytes` of it) plus the reservation.
    pub fn check_fits(&self, device: &str, what: &str, bytes: u64) -> Result<()> {
        if self.fits(bytes) {
            Ok(())
        } else {
            Err(self.too_small(device, what, bytes))
        }
    }

    /// The refusal of [`check_fits`](Self::check_fits), with the MiB missing.
    pub(crate) fn too_small(&self, device: &str, what: &str, bytes: u64) -> Error {
        Error::BudgetTooSmall {
            device: device.to_string(),
            budget_mib: self.limit_bytes >> 20,
            reserve_mib: mib_ceil(self.reserve_bytes),
            needed_what: what.to_string(),
            needed_mib: mib_ceil(bytes),
            missing_mib: mib_ceil(self.missing(bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(s: &str) -> u64 {
        match MemoryLimit::parse("t", s).unwrap() {
            MemoryLimit::Bytes(b) => b,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(bytes("3.5"), 3584 << 20);
        assert_eq!(bytes("3.5GiB"), 3584 << 20);
        assert_eq!(bytes("3 GB"), 3_000_000_000);
        assert_eq!(bytes("512MiB"), 512 << 20);
        assert_eq!(bytes("512mib"), 512 << 20);
        assert_eq!(bytes("100B"), 100);
        assert_eq!(
            MemoryLimit::parse("t", "50%").unwrap(),
            MemoryLimit::FractionOfDevice(0.5)
        );
    }

    #[test]
    fn refuses_nonsense_naming_the_field() {
        for bad in [
            "",
            "-1",
            "0",
            "0GiB",
            "abc",
            "3 parsecs",
            "150%",
            "NaN",
            "inf",
            "1e400",
        ] {
            let e = MemoryLimit::parse("--gpu-memory-limit", bad).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("--gpu-memory-limit"), "{bad}: {msg}");
            assert!(matches!(e, Error::InvalidMemorySize { .. }), "{bad}");
        }
    }

    #[test]
    fn resolves_against_the_card() {
        let total = 16u64 << 30;
        assert_eq!(
            MemoryLimit::FractionOfDevice(0.25)
                .resolve("cuda:0", Some(total))
                .unwrap(),
            4 << 30
        );
        assert!(matches!(
            MemoryLimit::gib(20.0).resolve("cuda:0", Some(total)),
            Err(Error::BudgetExceedsDevice { .. })
        ));
        assert!(MemoryLimit::FractionOfDevice(0.5)
            .resolve("cpu", None)
            .is_err());
    }

    #[test]
    fn too_small_says_how_much_is_missing() {
        let b = Budget {
            limit_bytes: 1 << 30,
            reserve_bytes: 768 << 20,
        };
        let e = b
            .check_fits("cuda:0", "the largest unit model.layers.0", 386 << 20)
            .unwrap_err();
        match &e {
            Error::BudgetTooSmall { missing_mib, .. } => assert_eq!(*missing_mib, 130),
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("130 MiB are missing"), "{e}");
        assert!(b.check_fits("cuda:0", "x", 256 << 20).is_ok());
    }
}
