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
    /// Why: `miss`, `prefetch`, `victim`, `idle`, `evict_all`, `retry`.
    pub reason: &'static str,
    /// Weights on the device after the event.
    pub resident_bytes: u64,
    /// Bytes in use on the whole device, measured outside the allocator (GPU step markers).
    pub device_used_bytes: Option<u64>,
}

/// A recorded history with the budget it ran under.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryHistory {
    /// The device.
    pub device: String,
    /// The budget.
    pub budget_bytes: u64,
    /// The caller's reservation (KV cache, activations, workspace).
    pub reserve_bytes: u64,
    /// What weights may take.
    pub weight_capacity_bytes: u64,
    /// Device memory in use when recording started (the CUDA context and anything before).
    pub baseline_device_bytes: Option<u64>,
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

    /// Renders the timeline as SVG: resident weights (area), weights plus the reservation,
    /// the device memory measured outside the allocator (less the baseline), and the budget.
    pub fn to_svg(&self) -> String {
        let (w, h, left, right, top, bottom) = (960.0, 420.0, 70.0, 20.0, 40.0, 50.0);
        let t_max = self.events.last().map_or(1.0, |e| e.t_s).max(1e-6);
        let mib = |b: u64| b as f64 / 1048576.0;
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
                self.events
                    .iter()
                    .map(|e| mib(e.resident_bytes + self.reserve_bytes)),
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
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="22" font-size="14">Device memory on {} (MiB)</text>"#,
            self.device
        );
        // Axes and grid.
        for i in 0..=5 {
            let m = y_max / 1.08 * i as f64 / 5.0;
            let (x1, x2, yy, tx, ty) = (left, w - right, y(m), left - 6.0, y(m) + 4.0);
            let _ = writeln!(
                s,
                r##"<line x1="{x1}" x2="{x2}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{m:.0}</text>"##
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
        // Resident weights as a step area.
        let mut pts = vec![(x(0.0), y(0.0))];
        let mut last = 0.0;
        for e in &self.events {
            pts.push((x(e.t_s), y(last)));
            last = mib(e.resident_bytes);
            pts.push((x(e.t_s), y(last)));
        }
        pts.push((x(t_max), y(last)));
        let area: String = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1} ")).collect();
        let _ = writeln!(
            s,
            r##"<polygon points="{area}{:.1},{:.1}" fill="#4c78a8" fill-opacity="0.5" stroke="#4c78a8"/>"##,
            x(t_max),
            y(0.0)
        );
        // Weights plus the reservation.
        let top_line: String = pts
            .iter()
            .map(|(a, b)| {
                let m = (h - bottom - b) / (h - top - bottom) * y_max + mib(self.reserve_bytes);
                format!("{a:.1},{:.1} ", y(m))
            })
            .collect();
        let _ = writeln!(
            s,
            r##"<polyline points="{top_line}" fill="none" stroke="#f58518" stroke-dasharray="4 3"/>"##
        );
        // Measured device memory.
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
        // Budget.
        let yb = y(mib(self.budget_bytes));
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yb:.1}" y2="{yb:.1}" stroke="#e45756" stroke-width="2"/>"##,
            w - right
        );
        let legend = [
            ("#4c78a8", "resident weights (in flight included)"),
            ("#f58518", "+ reservation (KV cache, activations)"),
            ("#54a24b", "measured on the device, less the baseline"),
            ("#e45756", "budget"),
        ];
        for (i, (color, label)) in legend.iter().enumerate() {
            let lx = left + 10.0 + 220.0 * i as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{label}</text>"#,
                h - 22.0,
                lx + 16.0,
                h - 12.0
            );
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
