//! Memory history: an opt-in record of every fetch (allocation and copy) and eviction (free)
//! with its time, bytes, unit and reason, and step markers with the device memory measured
//! outside the allocator; dumped as JSON and rendered as an SVG timeline (the seed's
//! `_record_memory_history` and `_dump_snapshot`).

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{Error, Result};

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A unit was allocated on the device and its copy enqueued.
    Fetch,
    /// A unit's device memory was released.
    Evict,
    /// A step began.
    StepBegin,
    /// A step ended.
    StepEnd,
    /// A unit was acquired for use (a prefetched unit stops being "in flight").
    Acquire,
    /// The reservation beside the weights changed to `bytes`
    /// ([`OffloadRuntime::set_reserve_bytes`](crate::OffloadRuntime::set_reserve_bytes): a
    /// model's prompt and decode phases).
    Reserve,
}

/// One entry of the history.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryEvent {
    /// Seconds since recording started.
    pub t_s: f64,
    /// What happened.
    pub kind: EventKind,
    /// The unit, for fetches and evictions.
    pub unit: Option<String>,
    /// Bytes moved or released.
    pub bytes: u64,
    /// Why: `miss`, `prefetch`, `victim`, `idle`, `evict_all`, `retry`, `reserve`.
    pub reason: &'static str,
    /// Weights on the device after the event.
    pub resident_bytes: u64,
    /// Bytes in use on the whole device, measured outside the allocator (GPU step markers).
    pub device_used_bytes: Option<u64>,
}

/// A recorded history with the budget it ran under.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryHistory {
    /// The device (`cuda:0`, `cpu`: [`crate::diag::device_label`]).
    pub device: String,
    /// The budget.
    pub budget_bytes: u64,
    /// The caller's reservation (KV cache, activations, workspace) when recording started;
    /// [`EventKind::Reserve`] events change it ([`reserve_series`](Self::reserve_series)).
    pub reserve_bytes: u64,
    /// What weights may take.
    pub weight_capacity_bytes: u64,
    /// Device memory in use when recording started (the CUDA context and anything before).
    pub baseline_device_bytes: Option<u64>,
    /// The reservation by part, as the caller declared it (KV cache, activations, ...). Where
    /// the reservation changes, the part named for activations (the last part if none is)
    /// takes the difference in the timeline.
    pub reservation_parts: Vec<(String, u64)>,
    /// The events, in order.
    pub events: Vec<MemoryEvent>,
}

impl MemoryHistory {
    /// Writes the history as JSON.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::File {
            path: path.into(),
            reason: e.to_string(),
        })?;
        std::fs::write(path, text).map_err(|e| Error::File {
            path: path.into(),
            reason: format!("cannot write: {e}"),
        })
    }

    /// Weights on the device after each event, split into settled and in flight (prefetched,
    /// not yet used): `(t, settled, in_flight)`.
    pub fn weight_series(&self) -> Vec<(f64, u64, u64)> {
        let mut in_flight: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
        let mut out = Vec::with_capacity(self.events.len());
        for e in &self.events {
            let unit = e.unit.as_deref().unwrap_or("");
            match e.kind {
                EventKind::Fetch if e.reason == "prefetch" => {
                    in_flight.insert(unit, e.bytes);
                }
                EventKind::Acquire | EventKind::Evict => {
                    in_flight.remove(unit);
                }
                _ => {}
            }
            let flying: u64 = in_flight.values().sum::<u64>().min(e.resident_bytes);
            out.push((e.t_s, e.resident_bytes - flying, flying));
        }
        out
    }

    /// The reservation in force after each event.
    pub fn reserve_series(&self) -> Vec<u64> {
        let mut now = self.reserve_bytes;
        self.events
            .iter()
            .map(|e| {
                if e.kind == EventKind::Reserve {
                    now = e.bytes;
                }
                now
            })
            .collect()
    }

    /// The reservation's parts after each event (part-major: `out[part][event]`): as declared,
    /// with the part named for activations (the last if none is) taking any change of the
    /// reservation since the declaration.
    fn part_series(&self, parts: &[(String, u64)]) -> Vec<Vec<u64>> {
        let declared: u64 = parts.iter().map(|p| p.1).sum();
        let varying = parts
            .iter()
            .position(|(n, _)| n.contains("activation"))
            .unwrap_or(parts.len().saturating_sub(1));
        let reserve = self.reserve_series();
        parts
            .iter()
            .enumerate()
            .map(|(i, &(_, bytes))| {
                reserve
                    .iter()
                    .map(|&r| {
                        if i == varying {
                            (bytes + r).saturating_sub(declared)
                        } else {
                            bytes
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Renders the timeline as SVG: device memory by category, stacked (resident weights,
    /// weights in flight, then each declared part of the reservation: KV cache, activations),
    /// the device memory measured outside the allocator (less the baseline), and the budget.
    pub fn to_svg(&self) -> String {
        let (w, h, left, right, top, bottom) = (960.0, 440.0, 70.0, 20.0, 40.0, 70.0);
        let t_max = self.events.last().map_or(1.0, |e| e.t_s).max(1e-6);
        let mib = |b: u64| b as f64 / 1048576.0;
        let series = self.weight_series();
        let parts: Vec<(String, u64)> = if self.reservation_parts.is_empty() {
            vec![("reservation".to_string(), self.reserve_bytes)]
        } else {
            self.reservation_parts.clone()
        };
        let part_values = self.part_series(&parts);
        let reserved: Vec<u64> = (0..series.len())
            .map(|k| part_values.iter().map(|v| v[k]).sum())
            .collect();
        let measured: Vec<(f64, f64)> = self
            .events
            .iter()
            .filter_map(|e| {
                e.device_used_bytes.map(|u| {
                    (
                        e.t_s,
                        mib(u.saturating_sub(self.baseline_device_bytes.unwrap_or(0))),
                    )
                })
            })
            .collect();
        let y_max = [mib(self.budget_bytes)]
            .into_iter()
            .chain(
                series
                    .iter()
                    .zip(&reserved)
                    .map(|(&(_, a, b), &r)| mib(a + b + r)),
            )
            .chain(measured.iter().map(|p| p.1))
            .fold(1.0, f64::max)
            * 1.08;
        let x = |t: f64| left + (w - left - right) * t / t_max;
        let y = |m: f64| h - bottom - (h - top - bottom) * m / y_max;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let (unit, ticks) = y_ticks(y_max / 1.08);
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="22" font-size="14">Device memory on {} ({unit})</text>"#,
            self.device
        );
        for (m, label) in ticks {
            let (x1, x2, yy, tx, ty) = (left, w - right, y(m), left - 6.0, y(m) + 4.0);
            let _ = writeln!(
                s,
                r##"<line x1="{x1}" x2="{x2}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{label}</text>"##
            );
        }
        for i in 0..=5 {
            let t = t_max * i as f64 / 5.0;
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{t:.2} s</text>"#,
                x(t),
                h - bottom + 18.0
            );
        }
        // Stacked step bands: the value of each band after each event.
        let mut bands: Vec<(String, &str, Vec<u64>)> = vec![
            (
                "resident weights".into(),
                "#4c78a8",
                series.iter().map(|p| p.1).collect(),
            ),
            (
                "weights in flight".into(),
                "#72b7b2",
                series.iter().map(|p| p.2).collect(),
            ),
        ];
        let colors = ["#f58518", "#eeca3b", "#b279a2", "#9d755d"];
        for (i, ((name, _), values)) in parts.iter().zip(part_values).enumerate() {
            bands.push((name.clone(), colors[i % colors.len()], values));
        }
        let mut below = vec![0u64; series.len()];
        for (_, color, values) in &bands {
            let above: Vec<u64> = below.iter().zip(values).map(|(a, b)| a + b).collect();
            let mut pts = Vec::new();
            let mut prev = below.first().copied().unwrap_or(0);
            let mut prev_top = above.first().copied().unwrap_or(0);
            pts.push((x(0.0), y(mib(prev_top))));
            for (k, &(t, _, _)) in series.iter().enumerate() {
                pts.push((x(t), y(mib(prev_top))));
                prev_top = above[k];
                pts.push((x(t), y(mib(prev_top))));
            }
            pts.push((x(t_max), y(mib(prev_top))));
            let mut lower = vec![(x(t_max), y(mib(*below.last().unwrap_or(&0))))];
            for (k, &(t, _, _)) in series.iter().enumerate().rev() {
                lower.push((x(t), y(mib(below[k]))));
                prev = if k > 0 { below[k - 1] } else { below[0] };
                lower.push((x(t), y(mib(prev))));
            }
            lower.push((x(0.0), y(mib(prev))));
            let poly: String = pts
                .iter()
                .chain(lower.iter())
                .map(|(a, b)| format!("{a:.1},{b:.1} "))
                .collect();
            let _ = writeln!(
                s,
                r#"<polygon points="{poly}" fill="{color}" fill-opacity="0.6" stroke="none"/>"#
            );
            below = above;
        }
        if !measured.is_empty() {
            let line: String = measured
                .iter()
                .map(|(t, m)| format!("{:.1},{:.1} ", x(*t), y(*m)))
                .collect();
            let _ = writeln!(
                s,
                r##"<polyline points="{line}" fill="none" stroke="#54a24b" stroke-width="2"/>"##
            );
        }
        let yb = y(mib(self.budget_bytes));
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yb:.1}" y2="{yb:.1}" stroke="#e45756" stroke-width="2"/>"##,
            w - right
        );
        let mut legend: Vec<(String, String)> = bands
            .iter()
            .map(|(n, c, _)| (c.to_string(), n.clone()))
            .collect();
        legend.push((
            "#54a24b".into(),
            "measured on the device, less the baseline".into(),
        ));
        legend.push(("#e45756".into(), "budget".into()));
        // Legend items laid out left to right by the length of their labels, wrapping.
        let (mut lx, mut ly) = (left, h - 40.0);
        for (color, label) in &legend {
            let width = 16.0 + 6.6 * label.chars().count() as f64 + 24.0;
            if lx + width > w - right {
                lx = left;
                ly += 18.0;
            }
            let _ = writeln!(
                s,
                r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{ly:.1}">{label}</text>"#,
                ly - 10.0,
                lx + 16.0
            );
            lx += width;
        }
        s.push_str("</svg>\n");
        s
    }

    /// Writes [`to_svg`](Self::to_svg) to `path`.
    pub fn write_svg(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_svg()).map_err(|e| Error::File {
            path: path.into(),
            reason: format!("cannot write: {e}"),
        })
    }
}

/// The y axis' ticks for values up to `max_mib`: round values (1, 2 or 5 times a power of
/// ten) in MiB, or in GiB from 1 GiB up, from zero to at most `max_mib`, three to eight
/// intervals. Returns the unit, and each tick's position in MiB with its label in the unit.
fn y_ticks(max_mib: f64) -> (&'static str, Vec<(f64, String)>) {
    let (unit, scale) = if max_mib >= 1024.0 {
        ("GiB", 1024.0)
    } else {
        ("MiB", 1.0)
    };
    let max = max_mib / scale;
    if !(max > 0.0 && max.is_finite()) {
        return (unit, vec![(0.0, "0".to_string())]);
    }
    let raw = max / 8.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude);
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10() - 1e-9).ceil() as usize
    };
    let ticks = (0..)
        .map(|i| step * i as f64)
        .take_while(|&v| v <= max * (1.0 + 1e-9))
        .map(|v| (v * scale, format!("{v:.decimals$}")))
        .collect();
    (unit, ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(max_mib: f64) -> (&'static str, Vec<String>) {
        let (unit, ticks) = y_ticks(max_mib);
        (unit, ticks.into_iter().map(|t| t.1).collect())
    }

    #[test]
    fn ticks_fall_on_round_values() {
        // A 512 MiB budget: not 102, 205, 307, 410.
        assert_eq!(
            labels(512.0),
            (
                "MiB",
                ["0", "100", "200", "300", "400", "500"]
                    .map(String::from)
                    .to_vec()
            )
        );
        assert_eq!(
            labels(4096.0 * 1.02),
            ("GiB", ["0", "1", "2", "3", "4"].map(String::from).to_vec())
        );
        assert_eq!(
            labels(1536.0),
            (
                "GiB",
                ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0", "1.2", "1.4"]
                    .map(String::from)
                    .to_vec()
            )
        );
        assert_eq!(labels(80.0 * 1024.0).1.last().unwrap(), "80");
        assert_eq!(labels(1.0).1, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        for max in [3.0, 47.0, 700.0, 999.0, 1024.0, 3000.0, 150_000.0] {
            let (unit, ticks) = y_ticks(max);
            let scale = if unit == "GiB" { 1024.0 } else { 1.0 };
            assert!((4..=9).contains(&ticks.len()), "{max}: {ticks:?}");
            let step = ticks[1].0 / scale;
            let mantissa = step / 10f64.powf(step.log10().floor());
            assert!(
                [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-6),
                "{max}: step {step}"
            );
            assert!(
                ticks.last().unwrap().0 <= max * (1.0 + 1e-9),
                "{max}: {ticks:?}"
            );
        }
    }

    #[test]
    fn the_timeline_names_the_unit_of_its_ticks() {
        let h = MemoryHistory {
            device: "cuda:0".into(),
            budget_bytes: 6 << 30,
            reserve_bytes: 1 << 30,
            weight_capacity_bytes: 5 << 30,
            baseline_device_bytes: None,
            reservation_parts: Vec::new(),
            events: Vec::new(),
        };
        let svg = h.to_svg();
        assert!(svg.contains("Device memory on cuda:0 (GiB)"), "{svg}");
        assert!(svg.contains(r#"text-anchor="end">6</text>"#), "{svg}");
    }

    #[test]
    fn a_changed_reservation_moves_the_activations_part() {
        let ev = |kind, bytes| MemoryEvent {
            t_s: 0.0,
            kind,
            unit: None,
            bytes,
            reason: "",
            resident_bytes: 0,
            device_used_bytes: None,
        };
        let h = MemoryHistory {
            device: "cuda:0".into(),
            budget_bytes: 1000,
            reserve_bytes: 600,
            weight_capacity_bytes: 400,
            baseline_device_bytes: None,
            reservation_parts: vec![
                ("KV cache".into(), 200),
                ("activations and workspace".into(), 300),
                ("caller's reservation".into(), 100),
            ],
            events: vec![
                ev(EventKind::StepBegin, 0),
                ev(EventKind::Reserve, 350),
                ev(EventKind::StepEnd, 0),
                ev(EventKind::Reserve, 600),
            ],
        };
        assert_eq!(h.reserve_series(), [600, 350, 350, 600]);
        assert_eq!(
            h.part_series(&h.reservation_parts),
            [vec![200; 4], vec![300, 50, 50, 300], vec![100; 4]]
        );
    }
}
