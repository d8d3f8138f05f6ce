//! What a model reserves on a device beside its weights, and whether its units fit: the KV
//! cache, activations and workspaces for a prompt's pass and for a decode step, the part a
//! stage that streams nothing may leave out, a near fit's prompt passes, and the runtime
//! settings of one stage. The builders (`builder.rs`, `host.rs`, `devices.rs`) size their
//! stages with these.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Result};
use candle_offload::{
    HostStore, KernelTuning, MemoryLimit, OffloadConfig, OffloadRuntime, PolicyChoice, UnitId,
};

use super::model::{CausalLm, PhaseReserve};
use crate::error::ModelError;
use crate::family::Config;

/// How a model places its weights: the runtime's own settings
/// ([`CausalLmBuilder::settings`](crate::CausalLmBuilder::settings)).
///
/// The model fills in what it knows: it adds its KV cache and activations to `reserve_bytes`
/// (which then means extra room the caller keeps), adds its non-layer units to `keep`, and
/// replaces [`PolicyChoice::Auto`] by Belady over its own sweep. `units` is the pipeline's to
/// set and must be `None`.
pub type OffloadSettings = OffloadConfig;

/// The rows of a decode step (batch 1): where a model spends its passes, so what it places
/// (host layers, the embedding table, what stays resident) is planned at this reservation; a
/// prompt streams what its activations leave no room for.
pub(super) const DECODE_ROWS: usize = 1;

/// Of [`Config::reserve_bytes`]'s 256 MiB allowance for workspaces and fragmentation, what a
/// decode step of GGML blocks on a GPU leaves unused where weights and KV caches live in a
/// pool apart from activations (`candle_offload::diag::long_lived`): the step runs the
/// library's own kernels (no GEMM workspace beyond what the prompt already made, which stays
/// counted), and a prompt's freed activations no longer leave chunks held around a cache
/// buffer. A prompt keeps the whole allowance: the share that goes to weights while decoding
/// ([`CausalLm::reserve_by_phase`]) takes this too.
///
/// Only a stage behind host layers plans with it (`host_stage_reserve`), and there at most a
/// quarter of what the longest prompt reserves beyond a decode step: the fragmentation the
/// separate pool avoids comes from the prompt's activations, so a short prompt saves little.
///
/// Whether a model fits whole, or keeps its embeddings on the host, is still decided with the
/// whole allowance: with the saving there, a resident model can take its embedding table onto
/// the GPU and pass its budget (measured: docs/tuning.md, workspace saved).
const QUANTIZED_DECODE_WORKSPACE_SAVING: u64 = 128 << 20;

/// The fewest rows a prompt's pass is cut to ([`CausalLm::prompt_chunk`]): below this a pass
/// runs the quantized matmuls' few-row kernels, which read the weights once per 8 rows.
pub const MIN_PROMPT_CHUNK: usize = 32;

/// A model built on one device: its configuration and weights, the device, the shape of its
/// runs (dtype, prompt and context lengths), the caller's settings and the path errors name.
/// What the reservations and fits below are computed from.
#[derive(Clone, Copy)]
pub(super) struct OnDevice<'a> {
    pub(super) cfg: &'a Config,
    pub(super) store: &'a Arc<HostStore>,
    pub(super) device: &'a Device,
    pub(super) dtype: DType,
    pub(super) prompt_len: usize,
    pub(super) max_len: usize,
    pub(super) settings: &'a OffloadSettings,
    pub(super) source: &'a Path,
}

impl CausalLm {
    /// The device bytes a model on one device reserves beside its weights on `device`, for
    /// prompts of `prompt_len` tokens and `max_len` positions in all: [`Config::reserve_bytes`]
    /// (without the composition's attention buffers where every layer's prompt attention runs
    /// as one kernel: [`Config::reserve_bytes_with`]), plus Candle's quantized-matmul
    /// workspaces ([`Config::quantized_matmul_bytes`]) on a GPU when `store` holds GGML blocks.
    /// A budget meant to hold some units computes from this.
    ///
    /// `tuning`: the ops' choices the model will run with (its settings'
    /// [`Tuning`](candle_offload::Tuning)'s kernels).
    pub fn reserve_bytes(
        cfg: &Config,
        store: &candle_offload::HostStore,
        device: &Device,
        prompt_len: usize,
        max_len: usize,
        dtype: DType,
        tuning: &KernelTuning,
    ) -> u64 {
        let kernel = prompt_attention_kernel(cfg, device, dtype, tuning);
        let reserve = cfg.reserve_bytes_with(prompt_len, max_len, dtype, kernel);
        if device.is_cuda() && store.ggml_tensor_count() > 0 {
            reserve + cfg.quantized_matmul_bytes(prompt_len, tuning)
        } else {
            reserve
        }
    }

    /// Lets every stage that reserves room give `share` bytes of it (see [`phase_reserves`])
    /// to weights while decoding ([`PhaseReserve`]); the stages start in the prompt's phase.
    pub(super) fn reserve_by_phase(&mut self, share: u64) {
        for stage in &mut self.stages {
            let prompt = stage.rt.budget().reserve_bytes;
            let decode = prompt.saturating_sub(share);
            stage.phase = (decode < prompt).then_some(PhaseReserve { prompt, decode });
        }
    }
}

impl OnDevice<'_> {
    /// The kernel choices the model will run with.
    fn kernels(&self) -> &KernelTuning {
        &self.settings.tuning.kernels
    }

    /// [`CausalLm::reserve_bytes`] for a pass of `rows` rows.
    pub(super) fn reserve(&self, rows: usize) -> u64 {
        CausalLm::reserve_bytes(
            self.cfg,
            self.store,
            self.device,
            rows,
            self.max_len,
            self.dtype,
            self.kernels(),
        )
    }

    /// What a stage that streams nothing may leave out of a prompt pass's reservation of `rows`
    /// rows: on a GPU, the allowance for the pool's fragmentation
    /// ([`Config::fragmentation_bytes`]), since the passes' activations are then the only
    /// allocations and come alike pass after pass (a 7B Q4_0 at 4 GiB, prompt 512, then runs
    /// passes of 256 instead of 171); nothing on a CPU, whose budget is the accounting alone.
    pub(super) fn pass_slack(&self, rows: usize) -> u64 {
        if !self.device.is_cuda() {
            return 0;
        }
        let kernel = prompt_attention_kernel(self.cfg, self.device, self.dtype, self.kernels());
        self.cfg
            .fragmentation_bytes(rows, self.max_len, self.dtype, kernel)
    }

    /// The bytes the caller's memory limit gives the device ([`device_budget`]).
    pub(super) fn budget(&self) -> std::result::Result<u64, ModelError> {
        device_budget(self.device, self.settings.gpu_memory_limit)
    }

    /// The device bytes of unit `name` at its own size (what a unit that stays takes, and what
    /// the host reads); 0 for a unit the store does not have.
    pub(super) fn own_bytes(&self, name: &str) -> u64 {
        self.store
            .unit_id(name)
            .map_or(0, |id| self.store.unit(id).resident_bytes())
    }

    /// Whether every unit of the model fits the device's budget at its own size beside a
    /// resident stage's reservation for passes of `rows` rows
    /// ([`resident_saving`](Self::resident_saving)): nothing would stream and nothing needs the
    /// host.
    pub(super) fn fits_whole(&self, rows: usize) -> std::result::Result<bool, ModelError> {
        let (need, budget) = self.whole_bytes(rows, true)?;
        Ok(need <= budget)
    }

    /// The device bytes every unit of the model takes at its own size (the embedding table only
    /// with `embed`) beside a resident stage's reservation for passes of `rows` rows:
    /// [`reserve`](Self::reserve) with the KV cache of every layer, less
    /// [`resident_saving`](Self::resident_saving), plus the caller's extra room; and the
    /// device's budget.
    pub(super) fn whole_bytes(
        &self,
        rows: usize,
        embed: bool,
    ) -> std::result::Result<(u64, u64), ModelError> {
        let budget = self.budget()?;
        let n = self.cfg.num_hidden_layers;
        let layout = self.cfg.layout();
        let reserve = self.reserve(rows) - self.resident_saving();
        let own = |name: &str| self.own_bytes(name);
        let need = reserve.saturating_add(self.settings.reserve_bytes)
            + if embed { own(&layout.embed) } else { 0 }
            + own(&layout.norm)
            + layout.head.as_deref().map_or(0, own)
            + (0..n).map(|l| own(&layout.layer(l))).sum::<u64>();
        Ok((need, budget))
    }

    /// The part of the workspace allowance in [`Config::reserve_bytes`] that a GPU stage of GGML
    /// blocks needs only while it streams, for the pool's fragmentation by buffers fetched and
    /// evicted: one unit's size, at most 96 of the allowance's 256 MiB (docs/tuning.md). A
    /// stage that holds every unit it runs reserves that much less. Dense weights (cuBLAS's
    /// workspaces) keep the whole allowance, and so do the strategies that stream what would
    /// fit (`balanced`, `aggressive`).
    pub(super) fn resident_saving(&self) -> u64 {
        let minimal = self.settings.strategy == candle_offload::OffloadStrategy::Minimal;
        if minimal && self.device.is_cuda() && self.store.ggml_tensor_count() > 0 {
            let unit = self
                .store
                .units()
                .iter()
                .map(|u| u.bytes())
                .max()
                .unwrap_or(0);
            unit.min(96 << 20)
        } else {
            0
        }
    }

    /// Whether a model with no host layers still looks its embeddings up on the host, as
    /// llama.cpp always does: on a GPU, with an output head of its own (tied embeddings are the
    /// head, which the GPU keeps), when the model does not fit the budget whole beside passes
    /// of `rows` rows ([`fits_whole`](Self::fits_whole)). The table then takes no device memory
    /// (70 MiB of a 7B Q4_K_M, 250 MiB in F16) and a decode step copies one row of the hidden
    /// state up.
    pub(super) fn embed_on_host(&self, rows: usize) -> std::result::Result<bool, ModelError> {
        let layout = self.cfg.layout();
        Ok(self.device.is_cuda()
            && layout.head.is_some()
            && self.store.unit_id(&layout.embed).is_some()
            && !self.fits_whole(rows)?)
    }

    /// The parts of a GPU stage's reservation behind host layers for passes of `rows` rows:
    /// [`reserve`](Self::reserve) without its KV cache (for a decode step of GGML blocks, less
    /// up to [`QUANTIZED_DECODE_WORKSPACE_SAVING`] where the GPU keeps long-lived buffers
    /// apart), and one layer's KV cache. The stage reserves the caches of its own layers and of
    /// two more (a host layer's cache passing through while a prompt runs: its copy and the new
    /// buffer), at most the whole model's; the split plans with the same parts.
    pub(super) fn host_stage_reserve(&self, rows: usize) -> (u64, u64) {
        let mut reserve = self.reserve(rows);
        if rows <= DECODE_ROWS
            && self.device.is_cuda()
            && self.store.ggml_tensor_count() > 0
            && self.settings.tuning.weight_pool
            && candle_offload::diag::has_long_lived_pool(self.device).unwrap_or(false)
        {
            // What the separate pool saves grows with the prompt's activations that no longer
            // fragment it (see the constant): a quarter of the longest prompt's share.
            let prompt = self.reserve(self.max_len);
            let saving =
                (prompt.saturating_sub(reserve) / 4).min(QUANTIZED_DECODE_WORKSPACE_SAVING);
            reserve = reserve.saturating_sub(saving);
        }
        let kv_all = self
            .cfg
            .kv_cache_bytes(self.max_len, self.dtype)
            .min(reserve);
        (
            reserve - kv_all,
            kv_all / self.cfg.num_hidden_layers.max(1) as u64,
        )
    }
}

/// Whether every layer's prompt attention runs as one kernel on `device` in `dtype`
/// ([`candle_offload::kernels::attention::prompt_attention`]): plain causal layers and a supported head
/// width, what the reservations count its buffers for.
fn prompt_attention_kernel(
    cfg: &Config,
    device: &Device,
    dtype: DType,
    tuning: &KernelTuning,
) -> bool {
    cfg.family.plain_attention(cfg)
        && candle_offload::kernels::attention::prompt_attention_supported(
            device,
            dtype,
            cfg.head_dim,
            tuning,
        )
}

/// A stage's reservation while a prompt runs, what it gives to weights while decoding (the
/// `share` of [`reserve_by_phase`](CausalLm::reserve_by_phase): the prompt's activations and
/// its rows' quantized-matmul buffers, which a decode step does not need) and the prompt's
/// pass size
/// ([`prompt_chunk`](CausalLm::prompt_chunk)), from `at(rows)`, the reservation for a pass of
/// `rows` before [`resident_saving`](OnDevice::resident_saving), and `fits(rows)`, whether every
/// unit of the stage fits at its own size beside it less the saving:
/// - every unit fits beside the whole prompt's: that reservation, less the saving;
/// - beside a pass of fewer rows (at least [`MIN_PROMPT_CHUNK`]): the most such rows, whose
///   reservation, less the saving and less `slack(rows)` (the allowance for fragmentation,
///   [`pass_slack`](OnDevice::pass_slack), which `fits(rows, slack)` discounts too), the stage
///   keeps, and prompts run in passes of that many rows, so that nothing streams;
/// - otherwise the whole prompt's reservation, and the stage streams. (Where every unit fits
///   only beside a decode step's, the units keep their own sizes and stay while decoding,
///   `OffloadConfig::steady_reserve_bytes`; the saving is not taken there: units evicted
///   for the prompt's activations and fetched again leave part of the pool unused, and the
///   peak can pass the budget.)
pub(super) fn phase_reserves(
    at: impl Fn(usize) -> u64,
    saving: u64,
    prompt_len: usize,
    slack: impl Fn(usize) -> u64,
    mut fits: impl FnMut(usize, u64) -> std::result::Result<bool, ModelError>,
) -> std::result::Result<(u64, u64, Option<usize>), ModelError> {
    let share = |rows| at(rows).saturating_sub(at(DECODE_ROWS));
    if fits(prompt_len, 0)? {
        return Ok((at(prompt_len) - saving, share(prompt_len), None));
    }
    let mut pass_fits = |rows| fits(rows, slack(rows));
    if prompt_len > MIN_PROMPT_CHUNK && pass_fits(MIN_PROMPT_CHUNK)? {
        // The most rows that fit: fits(lo) holds, fits(hi) does not.
        let (mut lo, mut hi) = (MIN_PROMPT_CHUNK, prompt_len);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if pass_fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let pass = at(lo).saturating_sub(slack(lo)).max(at(DECODE_ROWS));
        let share = pass - at(DECODE_ROWS);
        return Ok((pass - saving, share, Some(lo)));
    }
    Ok((at(prompt_len), share(prompt_len), None))
}

/// The runtime settings of one stage: the caller's `settings` with the model's reservation
/// added, its units kept, and (for [`PolicyChoice::Auto`]) Belady over `order`.
pub(super) fn stage_config(
    settings: &OffloadSettings,
    reserve: u64,
    mut keep: Vec<String>,
    order: impl FnOnce() -> Vec<UnitId>,
    units: Option<Vec<String>>,
) -> std::result::Result<OffloadConfig, ModelError> {
    if settings.units.is_some() {
        return Err(candle_offload::Error::InvalidConfig {
            field: "units".into(),
            reason: "a model decides which units each stage serves; leave `units` unset".into(),
        }
        .into());
    }
    for k in &settings.keep {
        if !keep.contains(k) {
            keep.push(k.clone());
        }
    }
    let policy = match &settings.policy {
        PolicyChoice::Auto => PolicyChoice::Schedule(order()),
        other => other.clone(),
    };
    Ok(OffloadConfig {
        reserve_bytes: reserve + settings.reserve_bytes,
        policy,
        keep,
        // A pipeline stage's hidden states cross devices through Candle's device-to-device
        // copy, which is ordered only by cudarc's event tracking.
        event_tracking: settings.event_tracking || units.is_some(),
        units,
        ..settings.clone()
    })
}

/// Names the reservation's parts for the memory history: the KV cache, the activations and
/// workspace, and the caller's extra room.
pub(super) fn declare_reservation(
    rt: &OffloadRuntime,
    kv: u64,
    reserve: u64,
    extra: u64,
) -> Result<()> {
    let kv = kv.min(reserve);
    let mut parts = vec![
        ("KV cache", kv),
        ("activations and workspace", reserve - kv),
    ];
    if extra > 0 {
        parts.push(("caller's reservation", extra));
    }
    rt.declare_reservation(&parts)
}

/// The bytes `limit` gives `device` (resolved against a GPU's total memory); without a limit,
/// the memory free on a GPU, no limit of ours on a CPU.
pub(super) fn device_budget(
    device: &Device,
    limit: Option<MemoryLimit>,
) -> std::result::Result<u64, ModelError> {
    let name = candle_offload::diag::device_label(device);
    let info = if device.is_cpu() {
        None
    } else {
        Some(candle_offload::diag::device_info(device)?)
    };
    Ok(match (limit, info) {
        (Some(l), info) => l.resolve(&name, info.map(|i| i.total_bytes))?,
        (None, Some(info)) => info.free_bytes,
        (None, None) => u64::MAX / 4,
    })
}

#[cfg(test)]
mod tests {
    use super::{phase_reserves, DECODE_ROWS, MIN_PROMPT_CHUNK};

    /// A near fit sizes its passes with the slack left out of both the check and the
    /// reservation it keeps; the whole prompt's check takes none, and a prompt that fits whole
    /// keeps its whole reservation.
    #[test]
    fn near_fit_passes_leave_the_slack_out() {
        let at = |rows: usize| 1000 + 10 * rows as u64;
        let slack = |rows: usize| 4 * rows as u64;
        let run = |budget: u64, slack: &dyn Fn(usize) -> u64| {
            phase_reserves(at, 7, 512, slack, |rows, s| {
                Ok(at(rows).saturating_sub(s) <= budget)
            })
            .unwrap()
        };
        let budget = at(189) + 5;
        let (reserve, share, chunk) = run(budget, &|_| 0);
        assert_eq!(
            (reserve, share, chunk),
            (at(189) - 7, at(189) - at(DECODE_ROWS), Some(189))
        );
        let (reserve, share, chunk) = run(budget, &slack);
        // 1000 + 6 rows <= 2895: 315 rows.
        let pass = at(315) - slack(315);
        assert_eq!(
            (reserve, share, chunk),
            (pass - 7, pass - at(DECODE_ROWS), Some(315))
        );
        // The whole prompt: no slack taken, even where the slack would make it fit.
        let budget = at(512) - slack(512);
        let (reserve, _, chunk) = run(budget, &slack);
        assert_eq!(chunk, Some(511));
        assert!(reserve < at(512) - 7);
        let (reserve, share, chunk) = run(at(512), &slack);
        assert_eq!(
            (reserve, share, chunk),
            (at(512) - 7, at(512) - at(DECODE_ROWS), None)
        );
    }

    proptest::proptest! {
        /// For any reservation growing with the rows faster than its slack, the passes are
        /// the most rows whose reservation less the slack fits, the kept reservation is that
        /// (never below a decode step's) and fits the budget, and the whole prompt is checked
        /// without the slack; what is given back while decoding leaves a decode step's.
        #[test]
        fn near_fit_passes_are_the_most_that_fit(
            base in 0u64..1 << 30,
            per_row in 1u64..1 << 20,
            slack_share in 0u64..100,
            saving in 0u64..1 << 20,
            prompt_len in 1usize..2048,
            budget in 0u64..(1 << 31),
        ) {
            let at = |rows: usize| base + saving + per_row * rows as u64;
            let slack = |rows: usize| per_row * slack_share / 100 * rows as u64;
            let fits = |rows: usize, s: u64| at(rows) - saving - s <= budget;
            let (reserve, share, chunk) = phase_reserves(
                at,
                saving,
                prompt_len,
                slack,
                |rows, s| Ok(fits(rows, s)),
            )
            .unwrap();
            let decode = at(DECODE_ROWS) - saving;
            match chunk {
                None if fits(prompt_len, 0) => {
                    proptest::prop_assert_eq!(reserve, at(prompt_len) - saving);
                }
                None => {
                    // Streams: no pass of MIN_PROMPT_CHUNK rows fits either.
                    proptest::prop_assert!(
                        prompt_len <= MIN_PROMPT_CHUNK
                            || !fits(MIN_PROMPT_CHUNK, slack(MIN_PROMPT_CHUNK))
                    );
                    // A stage that streams takes no resident saving.
                    proptest::prop_assert_eq!(reserve, at(prompt_len));
                    proptest::prop_assert_eq!(reserve - share, at(DECODE_ROWS));
                    return Ok(());
                }
                Some(rows) => {
                    proptest::prop_assert!(!fits(prompt_len, 0));
                    proptest::prop_assert!((MIN_PROMPT_CHUNK..prompt_len).contains(&rows));
                    proptest::prop_assert!(fits(rows, slack(rows)));
                    let more = rows + 1;
                    proptest::prop_assert!(more == prompt_len || !fits(more, slack(more)));
                    let pass = (at(rows) - slack(rows)).max(at(DECODE_ROWS));
                    proptest::prop_assert_eq!(reserve, pass - saving);
                    proptest::prop_assert!(reserve >= decode && reserve <= budget.max(decode));
                }
            }
            proptest::prop_assert_eq!(reserve + saving - share, at(DECODE_ROWS));
        }
    }
}
