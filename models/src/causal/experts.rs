//! The experts of mixture-of-experts layers as units of their own
//! ([`Layout::experts`](crate::Layout::experts)): a block routed to one acquires it here from
//! the runtime of the stage that runs the layer, and gets the expert's MLP built once per
//! residency (kept with the unit, as a layer's block is).
//!
//! On a device whose budget does not hold every expert, an [`ExpertTier`] splits each layer's
//! routed experts between the device and the host CPU: the experts its cache
//! ([`candle_offload::experts::ExpertCache`], one slot per expert, slots per layer from what
//! the budget leaves beside the dense part) holds run on the device; of the others, the ones
//! the cost model gives the link are fetched (taking a slot, the policy's victim evicted) and
//! the rest run on the host CPU from host memory at the same time
//! ([`candle_offload::experts::split_missing`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result};
use candle_offload::experts::{
    split_missing, ExpertAdmission, ExpertCache, ExpertOptions, ExpertRoute, ExpertSplit,
    HostRateProbe, LayerCounters, RepeatMisses, RouteChooser,
};
use candle_offload::kernels::linear::{ExpertTable, RoutedShape};
use candle_offload::{HostStore, OffloadConfig, OffloadRuntime, UnitId, WeightFormat};

use super::routed::DeviceRoutes;
use crate::family::{Layout, UnitWeights};
use crate::layers::{BuildExpert, Expert, ExpertShape, ExpertSite, ExpertUnits, GatedMlp, Routing};
use candle_offload::kernels::linear::Linear;

/// Rows the host's K-quant pass computes per read of an expert's weights
/// ([`candle_offload::kernels::linear::cpu_quant::KQUANT_MAX_ROWS`]): an expert with more rows
/// reads its weights once per group.
const HOST_ROWS_PER_READ: usize = candle_offload::kernels::linear::cpu_quant::KQUANT_MAX_ROWS;

/// The weight of a new measurement in the running averages of the host's rates and of a
/// streamed expert's enqueue time.
const HOST_RATE_SMOOTHING: f64 = 0.1;

/// The most a streamed expert's enqueue sample counts for, as a multiple of the running
/// average: a one-off stall (a first launch's module load) moves the average by at most
/// `HOST_RATE_SMOOTHING` times this less one, and a lasting change is still learned (a
/// tenfold one in about ten layers).
const STREAM_ENQUEUE_MAX_RISE: f64 = 4.0;

/// `average` moved towards a new `sample` by [`HOST_RATE_SMOOTHING`].
fn smoothed(average: f64, sample: f64) -> f64 {
    (1.0 - HOST_RATE_SMOOTHING) * average + HOST_RATE_SMOOTHING * sample
}

/// The running average of a streamed expert's enqueue seconds after the `sample` of one
/// layer's (each sample capped at [`STREAM_ENQUEUE_MAX_RISE`] times the average).
fn enqueue_average(average: f64, sample: f64) -> f64 {
    if !(sample.is_finite() && sample > 0.0) {
        return average;
    }
    let sample = if average > 0.0 {
        sample.min(STREAM_ENQUEUE_MAX_RISE * average)
    } else {
        sample
    };
    smoothed(average, sample)
}

/// Decode placements of a layer's misses (a layer of a step each) after which, where the host
/// computed none of them, the next one puts one miss on the host to measure its rate again.
const HOST_RATE_PROBE_PLACEMENTS: u32 = 256;

/// The experts one [`ExpertUnits::place`] left to the host CPU.
#[derive(Debug, Clone, Copy, Default)]
struct HostWork {
    /// Their host bytes.
    bytes: u64,
    /// Each one's host bytes times its rows, summed.
    row_bytes: u64,
    /// A decode step's (one row each).
    decode: bool,
}

/// The host CPU's seconds for a missing expert of `bytes` with `rows` rows: a decode row's
/// read at `read_rate` (bytes a second), read again for every [`HOST_ROWS_PER_READ`] rows;
/// with more rows than one, no less than its compute at `row_rate` (bytes times rows a
/// second, measured on prompts).
fn host_seconds(bytes: u64, rows: usize, read_rate: f64, row_rate: f64) -> f64 {
    let b = bytes as f64;
    let reads = rows.div_ceil(HOST_ROWS_PER_READ).max(1) as f64;
    let read = b * reads / read_rate;
    if rows > 1 {
        read.max(b * rows as f64 / row_rate)
    } else {
        read
    }
}

/// Every expert unit's id in the store, by decoder layer and expert, found once at load: a
/// step acquires its experts by id, with no name built and no map looked up.
#[derive(Debug, Clone, Default)]
pub(crate) struct ExpertIds {
    /// Experts per layer.
    count: usize,
    /// `layer * count + expert`: the unit, `None` for a dense layer's or one the store lacks.
    ids: Vec<Option<UnitId>>,
}

impl ExpertIds {
    /// The ids of `layout`'s expert units in `store` (none without experts).
    pub(crate) fn new(layout: &Layout, store: &HostStore) -> Self {
        let Some(x) = &layout.experts else {
            return Self::default();
        };
        let ids = (0..x.sparse.len())
            .flat_map(|l| (0..x.count).map(move |e| (l, e)))
            .map(|(l, e)| {
                let sparse = x.sparse.get(l).copied().unwrap_or(false);
                sparse
                    .then(|| layout.expert(l, e))
                    .flatten()
                    .and_then(|n| store.unit_id(&n))
            })
            .collect();
        Self {
            count: x.count,
            ids,
        }
    }

    /// Every unit found, layer by layer in expert order.
    pub(crate) fn units(&self) -> impl Iterator<Item = UnitId> + '_ {
        self.ids.iter().flatten().copied()
    }

    /// Expert `e` of layer `l`.
    fn get(&self, l: usize, e: usize) -> Option<UnitId> {
        if e >= self.count {
            return None;
        }
        self.ids.get(l * self.count + e).copied().flatten()
    }
}

/// One runtime's expert units (see the module docs).
pub(crate) struct RuntimeExperts<'a> {
    pub(crate) rt: &'a OffloadRuntime,
    pub(crate) layout: &'a Layout,
    /// The experts' units in the runtime's store.
    pub(crate) ids: &'a ExpertIds,
    /// The compute dtype of the stage.
    pub(crate) dtype: DType,
}

/// An expert's MLP kept with its unit, with the dtype it was built in.
struct BuiltExpert(DType, Arc<GatedMlp>);

impl RuntimeExperts<'_> {
    /// The unit of expert `e` of `layer`.
    fn unit(&self, layer: usize, e: usize) -> Result<UnitId> {
        if let Some(id) = self.ids.get(layer, e) {
            return Ok(id);
        }
        match self.layout.expert(layer, e) {
            Some(name) => candle_core::bail!("layer {layer}: no unit {name} in the store"),
            None => candle_core::bail!("layer {layer}: the model's layout has no expert units"),
        }
    }

    /// [`expert`](ExpertUnits::expert) of each of `experts` of `layer`, their units acquired
    /// together (one hold of the runtime's lock).
    fn experts(
        &self,
        layer: usize,
        experts: &[usize],
        build: BuildExpert<'_>,
    ) -> Result<Vec<Expert>> {
        let ids = experts
            .iter()
            .map(|&e| self.unit(layer, e))
            .collect::<Result<Vec<_>>>()?;
        let guards = self.rt.acquire_many(&ids)?;
        let dtype = self.dtype;
        guards
            .into_iter()
            .zip(experts)
            .map(|(unit, &e)| {
                let make = || -> Result<BuiltExpert> {
                    let name = self.layout.expert(layer, e).unwrap_or_default();
                    let w = UnitWeights::new(unit.var_builder(dtype), Some(&unit));
                    Ok(BuiltExpert(dtype, Arc::new(build(w.pp(&name))?)))
                };
                // Kept with the unit where it holds nothing but the unit's tensors (no
                // conversion).
                let mlp = if unit.tensors().values().all(|t| t.dtype() == dtype) {
                    let kept = unit.derived(make)?;
                    if kept.0 == dtype {
                        kept.1.clone()
                    } else {
                        make()?.1
                    }
                } else {
                    make()?.1
                };
                Ok(Expert {
                    mlp,
                    guard: Some(unit),
                })
            })
            .collect()
    }
}

impl ExpertUnits for RuntimeExperts<'_> {
    fn expert(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert> {
        let mut one = self.experts(layer, &[expert], build)?;
        Ok(one.pop().expect("one expert asked for"))
    }

    fn place(
        &self,
        layer: usize,
        routed: &[(usize, usize)],
        build: BuildExpert<'_>,
    ) -> Result<Vec<(Option<Expert>, ExpertSite)>> {
        let experts: Vec<usize> = routed.iter().map(|&(e, _)| e).collect();
        Ok(self
            .experts(layer, &experts, build)?
            .into_iter()
            .map(|x| (Some(x), ExpertSite::Device))
            .collect())
    }
}

/// What a mixture-of-experts model's expert cache and the host CPU beside it did, summed over
/// the steps ([`CausalLm::expert_stats`](crate::CausalLm::expert_stats)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertStats {
    /// The cache's counters per decoder layer (zero for dense layers).
    pub layers: Vec<LayerCounters>,
    /// Slots per decoder layer.
    pub slots: Vec<usize>,
    /// Experts per mixture-of-experts layer.
    pub experts_per_layer: usize,
    /// Device bytes of the largest expert (what a slot holds).
    pub expert_bytes: u64,
    /// Device bytes of the dense part the device keeps (attention, norms, routers,
    /// embeddings and head).
    pub dense_bytes: u64,
    /// Routed experts that were resident on the device.
    pub resident: u64,
    /// Routed experts fetched over the link (each then resident).
    pub fetched: u64,
    /// Routed experts fetched for one use, without a slot (a prompt's, past the cache).
    pub streamed: u64,
    /// Experts fetched ahead of their use: on the next layer's router's guess
    /// (`ExpertOptions::prefetch`), or after the device read them from host memory
    /// ([`mapped`](Self::mapped)).
    pub prefetched: u64,
    /// Prefetched experts routed to while still resident: the guesses that came true.
    pub prefetch_used: u64,
    /// Routed experts computed on the host CPU.
    pub on_host: u64,
    /// Of those, each decoder layer's (dense layers' stay 0).
    pub on_host_by_layer: Vec<u64>,
    /// Routed experts the device chose and read from their host copies (not resident).
    pub mapped: u64,
    /// Of those, the ones the cache did not take a slot for (`ExpertAdmission::Repeat`: not
    /// missed before within the window).
    pub declined: u64,
    /// Sparse layers' decode rows whose experts the device chose.
    pub device_routed: u64,
    /// Of those, the rows of a layer with every expert resident, in a step the host routes.
    pub whole_routed: u64,
    /// The route chooser's estimates of a decode step, in seconds, on the host route and on
    /// the device route (`None` before one was measured).
    pub route_step_s: [Option<f64>; 2],
    /// Host bytes those reads and copies took: the fetched experts' and the host's.
    pub host_bytes: u64,
    /// The host CPU's rate on a decode row's experts, bytes a second (running average).
    pub host_bytes_per_s: f64,
    /// The host CPU's rate on a prompt's experts, each one's bytes times its rows, a second
    /// (running average).
    pub host_row_bytes_per_s: f64,
    /// The link's rate the split is priced at, bytes a second.
    pub link_bytes_per_s: f64,
    /// The host's seconds to enqueue one of a prompt's streamed experts (its copy and its
    /// launches; running average): the split prices a prompt's fetched experts at this much
    /// of the thread that then computes the host's experts.
    pub stream_enqueue_s: f64,
}

impl std::fmt::Display for ExpertStats {
    /// The memory summary's lines: the totals, then each sparse layer's slots and hit rate.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "expert cache: hit rate {:.1}%; routed experts resident {}, fetched {}, streamed {}, \
             on the host CPU {}, read by the device from host memory {} ({} not admitted), \
             prefetched {} ({} used); {:.2} GiB read from host memory; host {:.1} GB/s (a \
             prompt's {:.1} GB times rows a second), link {:.1} GB/s, {:.0} µs to enqueue a \
             streamed expert; {} layer rows routed on the device ({} of them in host steps, \
             every expert of their layer resident)",
            100.0 * self.hit_rate(),
            self.resident,
            self.fetched,
            self.streamed,
            self.on_host,
            self.mapped,
            self.declined,
            self.prefetched,
            self.prefetch_used,
            self.host_bytes as f64 / 2f64.powi(30),
            self.host_bytes_per_s / 1e9,
            self.host_row_bytes_per_s / 1e9,
            self.link_bytes_per_s / 1e9,
            self.stream_enqueue_s * 1e6,
            self.device_routed,
            self.whole_routed,
        )?;
        let layers: Vec<String> = self
            .layers
            .iter()
            .zip(&self.slots)
            .enumerate()
            .filter(|(_, (c, _))| c.hits + c.misses > 0)
            .map(|(l, (c, s))| format!("{l}: {s} slots {:.0}%", 100.0 * c.hit_rate()))
            .collect();
        if !layers.is_empty() {
            writeln!(f, "  per layer: {}", layers.join(", "))?;
        }
        Ok(())
    }
}

impl ExpertStats {
    /// Hits and misses over every layer.
    pub fn totals(&self) -> (u64, u64) {
        self.layers
            .iter()
            .fold((0, 0), |(h, m), c| (h + c.hits, m + c.misses))
    }

    /// Hits over accesses over every layer.
    pub fn hit_rate(&self) -> f64 {
        let (h, m) = self.totals();
        if h + m == 0 {
            0.0
        } else {
            h as f64 / (h + m) as f64
        }
    }
}

#[derive(Debug)]
struct TierState {
    cache: ExpertCache,
    /// Decoder layers (the cache's).
    layers: usize,
    /// What the tier did; its per-layer counters and slots are the cache's
    /// ([`ExpertTier::stats`]).
    stats: ExpertStats,
    /// Per layer, what the last [`ExpertUnits::place`] left to the host: the rate its time
    /// measures is a decode row's or a prompt's.
    placed_host: Vec<HostWork>,
    /// Puts a decode miss on the host now and then where the split has left none there.
    host_probe: HostRateProbe,
    /// The experts' copies issued to the device (fetches and prefetches, in the copy
    /// stream's order) not yet seen landed, with their bytes (GPU only).
    in_flight: std::collections::VecDeque<(UnitId, u64)>,
    /// Per layer, its router as last seen (for the layer before it to guess with).
    routers: Vec<Option<(Linear, Routing)>>,
    /// The prefetched experts (layer, expert) not routed to since their prefetch.
    guesses: HashSet<(usize, usize)>,
    /// The device's routing, once a decode row asked for it.
    routes: Routes,
    /// Who routes the decode steps under [`ExpertRoute::Auto`].
    chooser: RouteChooser,
    /// Whether this step's rows are routed on the device, once its first layer asked (a
    /// decode step on a GPU).
    step_on_device: Option<bool>,
    /// Whether a step ended with all its sparse layers routed on the device (so that the
    /// table knows each of them; a host step routes there only its layers with every
    /// expert resident).
    device_step_done: bool,
    /// The sparse layers (those with experts).
    sparse_layers: usize,
    /// The layers the step in progress routes on the device only because every expert of
    /// theirs is resident: counted in [`ExpertStats::whole_routed`] when their choices are
    /// read back, as [`ExpertStats::device_routed`] counts every such row.
    whole_this_step: Vec<usize>,
    /// When the step in progress reached its first sparse layer.
    step_started: Option<std::time::Instant>,
    /// The route of the decode step before the one in progress (`None`: it was no decode
    /// step on a GPU).
    prev_route: Option<bool>,
    /// The last sparse layer a step reached, and who looked at it (a lower one, or the same
    /// one looked at again but by `place` after `device_route`, starts a new step; nothing
    /// does after a step's beginning).
    last_layer: Option<(usize, Visit)>,
    /// A step replayed from a CUDA graph is under way (its capture, or its launch): every
    /// sparse layer routes on the device from the table as it is.
    in_graph: bool,
    /// The step in progress is not timed for the chooser (it captured a graph: its time is
    /// the capture's).
    untimed: bool,
    /// The misses remembered for [`ExpertAdmission::Repeat`].
    repeat: Option<RepeatMisses>,
}

/// Who looked at a layer of a step: the device route's check, or `place`; or a step began
/// ([`SplitExperts::begin_graph_step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Visit {
    Begin,
    Route,
    Place,
}

/// The tier's device routing, made when a decode row on a GPU first asks for it.
#[derive(Debug)]
enum Routes {
    Untried,
    On(DeviceRoutes),
    Off,
}

impl TierState {
    fn routes_mut(&mut self) -> Option<&mut DeviceRoutes> {
        match &mut self.routes {
            Routes::On(r) => Some(r),
            _ => None,
        }
    }
}

/// A device stage's expert cache and the host CPU beside it. See the module docs.
#[derive(Debug)]
pub(crate) struct ExpertTier {
    /// A CPU runtime over the same store, serving the expert units the host computes.
    host: OffloadRuntime,
    /// How many streamed experts the device runtime's room for copies in flight holds at once
    /// (a prefetch depth of at least 1 keeps room for some; none: nothing streams).
    stream_depth: usize,
    /// Whether a decode step prefetches the next layers' guessed experts.
    prefetch: bool,
    /// How many of the next mixture-of-experts layers a decode step guesses for.
    guess_layers: usize,
    /// Who chooses a decode row's experts.
    route: ExpertRoute,
    /// Whether some layer has a slot for each of its experts (so that it can be routed on
    /// the device in a host step).
    whole_layers: bool,
    /// Whether missing experts may run on the host CPU ([`ExpertSplit::Fetch`]: none does,
    /// but where the device can take none either).
    host_compute: bool,
    /// Each decoder layer's expert units (none for a dense layer).
    layer_units: Vec<Vec<UnitId>>,
    state: Mutex<TierState>,
}

/// How an [`ExpertTier`] is sized: the device's room for experts and their sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TierSizing {
    /// Device bytes the budget leaves for experts beside the dense part and the reservation.
    pub(crate) room: u64,
    /// Device bytes of the dense part kept beside them.
    pub(crate) dense: u64,
    /// The link's host-to-device rate, bytes a second.
    pub(crate) link_bytes_per_s: f64,
    /// How many of its largest units the room the device runtime keeps beside the cache for
    /// copies in flight holds (none: nothing streams).
    pub(crate) stream_depth: usize,
}

impl ExpertTier {
    /// Whether a model whose expert units are `ids` in `store` gets a tier on `device` under
    /// `options`, with `room` bytes of the device's budget for experts: where the experts are
    /// units of their own, and (for [`ExpertSplit::Auto`]) on a GPU whose room does not hold
    /// them all, or where a decode row's experts of GGML blocks may be chosen on the device (a
    /// route other than [`ExpertRoute::Host`]: the tier then keeps a slot for every expert, for
    /// its table).
    pub(crate) fn wanted(
        options: ExpertOptions,
        ids: &ExpertIds,
        store: &HostStore,
        device: &Device,
        room: u64,
    ) -> bool {
        if ids.units().next().is_none() {
            return false;
        }
        match options.split {
            ExpertSplit::Off => false,
            ExpertSplit::On | ExpertSplit::Fetch => true,
            _ => {
                let all: u64 = ids.units().map(|id| store.unit(id).bytes()).sum();
                // The device's choice takes experts of GGML blocks (`routed::host_copies`).
                let blocks = ids.units().all(|id| {
                    let tensors = store.unit(id).tensors();
                    !tensors.is_empty()
                        && tensors
                            .iter()
                            .all(|t| matches!(t.format, WeightFormat::Ggml(_)))
                });
                device.is_cuda() && (room < all || (options.route != ExpertRoute::Host && blocks))
            }
        }
    }

    /// The tier of a stage over `store`: slots per sparse layer from `sizing.room`, a CPU
    /// runtime for the host's experts.
    pub(crate) fn new(
        options: ExpertOptions,
        layout: &Layout,
        ids: &ExpertIds,
        store: &Arc<HostStore>,
        sizing: TierSizing,
        settings: &OffloadConfig,
    ) -> std::result::Result<Self, candle_offload::Error> {
        let units: Vec<UnitId> = ids.units().collect();
        let x = layout
            .experts
            .as_ref()
            .expect("a tier is made for a model with expert units");
        let sparse_layers = x.sparse.iter().filter(|&&s| s).count();
        // Each sparse layer's largest expert: a K-quant mix stores some layers' experts in
        // more bits than others'.
        let layer_bytes: Vec<Option<u64>> = (0..x.sparse.len())
            .map(|l| {
                (0..x.count)
                    .filter_map(|e| ids.get(l, e))
                    .map(|id| store.unit(id).bytes())
                    .max()
            })
            .collect();
        let largest = layer_bytes.iter().flatten().copied().max().unwrap_or(0);
        let slots = options.slots.per_layer(sizing.room, &layer_bytes, x.count);
        let (fewest, most) = x
            .sparse
            .iter()
            .zip(&slots)
            .filter(|(&s, _)| s)
            .fold((usize::MAX, 0), |(lo, hi), (_, &n)| (lo.min(n), hi.max(n)));
        let host = OffloadRuntime::new(
            store.clone(),
            &Device::Cpu,
            &OffloadConfig {
                gpu_memory_limit: None,
                units: Some(
                    units
                        .iter()
                        .map(|&id| store.unit(id).name().to_string())
                        .collect(),
                ),
                policy: candle_offload::PolicyChoice::Lru,
                prefetch_depth: 0,
                tuning: settings.tuning,
                ..Default::default()
            },
        )?;
        tracing::info!(
            plan = %options.slots,
            slots_fewest = fewest,
            slots_most = most,
            sparse_layers,
            expert_mib = largest >> 20,
            "expert cache"
        );
        Ok(Self {
            host,
            stream_depth: sizing.stream_depth,
            prefetch: options.prefetch,
            guess_layers: options.guess_layers.max(1),
            route: options.route,
            whole_layers: most >= x.count,
            // Where every expert of every sparse layer has a slot, a miss is fetched once and
            // stays (per layer: `SplitExperts::split`).
            host_compute: options.split != ExpertSplit::Fetch && fewest < x.count,
            layer_units: (0..x.sparse.len())
                .map(|l| (0..x.count).filter_map(|e| ids.get(l, e)).collect())
                .collect(),
            state: Mutex::new(TierState {
                cache: ExpertCache::new(options.policy, x.count, &slots),
                layers: x.sparse.len(),
                stats: ExpertStats {
                    experts_per_layer: x.count,
                    on_host_by_layer: vec![0; x.sparse.len()],
                    expert_bytes: largest,
                    dense_bytes: sizing.dense,
                    // The host's rate is unknown until it has computed experts: priced as the
                    // link's, so that the first steps split evenly and measure it.
                    host_bytes_per_s: sizing.link_bytes_per_s,
                    // A prompt's expert of `HOST_ROWS_PER_READ` rows priced as its fetch.
                    host_row_bytes_per_s: sizing.link_bytes_per_s * HOST_ROWS_PER_READ as f64,
                    link_bytes_per_s: sizing.link_bytes_per_s,
                    // A streamed expert's enqueue priced as its copy until one is measured.
                    stream_enqueue_s: largest as f64 / sizing.link_bytes_per_s,
                    ..Default::default()
                },
                placed_host: vec![HostWork::default(); x.sparse.len()],
                host_probe: HostRateProbe::new(HOST_RATE_PROBE_PLACEMENTS),
                in_flight: Default::default(),
                routers: vec![None; x.sparse.len()],
                guesses: HashSet::new(),
                routes: Routes::Untried,
                chooser: RouteChooser::default(),
                step_on_device: None,
                device_step_done: false,
                sparse_layers,
                whole_this_step: Vec::new(),
                step_started: None,
                prev_route: None,
                last_layer: None,
                in_graph: false,
                untimed: false,
                repeat: (options.admission == ExpertAdmission::Repeat)
                    .then(|| RepeatMisses::new(&slots)),
            }),
        })
    }

    /// The host's copies of the experts it may compute made now, with the load, rather than
    /// in the first steps that compute them: those of the layers without a slot for every
    /// expert (a whole layer fetches its misses), none where the host computes none (every
    /// miss fetched: [`ExpertSplit::Fetch`]). Returns the bytes copied.
    pub(crate) fn warm_up(&self) -> Result<u64> {
        if !self.host_compute {
            return Ok(0);
        }
        let partial: Vec<usize> = {
            let st = self.lock()?;
            (0..st.layers)
                .filter(|&l| st.cache.slots(l) < st.stats.experts_per_layer)
                .collect()
        };
        let store = self.host.store().clone();
        let mut bytes = 0;
        for l in partial {
            for &unit in &self.layer_units[l] {
                if self.host.prefetch(unit)? {
                    bytes += store.unit(unit).bytes();
                }
            }
        }
        Ok(bytes)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, TierState>> {
        self.state
            .lock()
            .map_err(|_| candle_core::Error::Msg("the expert tier's lock is poisoned".into()))
    }

    /// What the tier did so far.
    pub(crate) fn stats(&self) -> ExpertStats {
        match self.state.lock() {
            Ok(st) => ExpertStats {
                layers: (0..st.layers).map(|l| st.cache.counters(l)).collect(),
                slots: (0..st.layers).map(|l| st.cache.slots(l)).collect(),
                route_step_s: [st.chooser.estimate(false), st.chooser.estimate(true)],
                ..st.stats.clone()
            },
            Err(_) => ExpertStats::default(),
        }
    }
}

/// A step's experts on a stage with an [`ExpertTier`]: the device's units through `device`,
/// the host's through the tier's CPU runtime.
pub(crate) struct SplitExperts<'a> {
    pub(crate) device: RuntimeExperts<'a>,
    pub(crate) tier: &'a ExpertTier,
}

impl SplitExperts<'_> {
    fn unit(&self, layer: usize, e: usize) -> Result<UnitId> {
        self.device.unit(layer, e)
    }

    /// Loading's copies of the tier's experts: the host's copies
    /// ([`ExpertTier::warm_up`]), and every expert of a whole layer (a slot for each) admitted
    /// to its cache and fetched to the device, so that the first steps find them resident
    /// (where every expert fits, all of them, as a model without a tier loads them). Returns
    /// the bytes copied.
    pub(crate) fn warm_up(&self) -> Result<u64> {
        let mut bytes = self.tier.warm_up()?;
        let store = self.device.rt.store().clone();
        let mut st = self.lock()?;
        for layer in 0..st.layers {
            if !self.whole_layer(&st, layer) {
                continue;
            }
            for e in 0..st.stats.experts_per_layer {
                if st.cache.contains(layer, e) {
                    continue;
                }
                if !self.admit(&mut st, layer, e, &[])? {
                    break;
                }
                let unit = self.unit(layer, e)?;
                if self.device.rt.prefetch(unit)? {
                    bytes += store.unit(unit).bytes();
                    self.copy_issued(&mut st, layer, e)?;
                }
            }
        }
        Ok(bytes)
    }

    /// Whether `layer` has a slot for every expert: a miss there is fetched once and stays, so
    /// that the layer comes to hold them all
    /// ([`ExpertSlots::Layers`](candle_offload::experts::ExpertSlots::Layers)).
    fn whole_layer(&self, st: &TierState, layer: usize) -> bool {
        st.cache.slots(layer) >= st.stats.experts_per_layer
    }

    /// For `missing` experts of `layer` (`(expert, rows routed to it)`): each one's host bytes
    /// and whether to fetch it, by [`split_missing`] over their prices at the tier's measured
    /// rates (the host reads an expert's weights once per [`HOST_ROWS_PER_READ`] rows); all
    /// fetched where the host computes none or the layer has a slot for every expert, none
    /// where the layer has no slot and nothing streams.
    fn split(
        &self,
        st: &mut TierState,
        layer: usize,
        missing: &[(usize, usize)],
    ) -> Result<(Vec<u64>, Vec<bool>)> {
        let store = self.device.rt.store();
        let bytes: Vec<u64> = missing
            .iter()
            .map(|&(e, _)| Ok(store.unit(self.unit(layer, e)?).host_bytes()))
            .collect::<Result<_>>()?;
        let fetch = if st.cache.slots(layer) == 0 && self.tier.stream_depth == 0 {
            vec![false; missing.len()]
        } else if !self.tier.host_compute || self.whole_layer(st, layer) {
            vec![true; missing.len()]
        } else {
            let stats = &st.stats;
            let link_rate = stats.link_bytes_per_s;
            // A prompt's fetched experts are enqueued one by one before the host's start; a
            // decode row's join the resident ones' launches.
            let decode = missing.iter().all(|&(_, rows)| rows == 1);
            let enqueue = if decode { 0.0 } else { stats.stream_enqueue_s };
            let costs: Vec<(f64, f64)> = missing
                .iter()
                .zip(&bytes)
                .map(|(&(_, rows), &b)| {
                    let host =
                        host_seconds(b, rows, stats.host_bytes_per_s, stats.host_row_bytes_per_s);
                    (host, b as f64 / link_rate)
                })
                .collect();
            let busy = self.link_queued_bytes(st)? as f64 / link_rate;
            split_missing(&costs, busy, enqueue)
        };
        Ok((bytes, fetch))
    }

    /// The bytes of the experts' copies still queued on the link: the oldest ones seen
    /// landed (or gone) are dropped first; the copy stream runs them in order.
    fn link_queued_bytes(&self, st: &mut TierState) -> Result<u64> {
        while let Some(&(unit, _)) = st.in_flight.front() {
            let rt = &self.device.rt;
            if rt.is_present(unit)? && !rt.resident_all_of([unit])? {
                break;
            }
            st.in_flight.pop_front();
        }
        Ok(st.in_flight.iter().map(|&(_, b)| b).sum())
    }

    /// A copy of `layer`'s `expert` to the device was issued (GPU only: elsewhere the fetch
    /// is done when it returns).
    fn copy_issued(&self, st: &mut TierState, layer: usize, expert: usize) -> Result<()> {
        if self.device.rt.device().is_cuda() {
            let unit = self.unit(layer, expert)?;
            let bytes = self.device.rt.store().unit(unit).host_bytes();
            st.in_flight.push_back((unit, bytes));
        }
        Ok(())
    }

    /// Takes a slot of `layer` for `expert` (its fetch is the caller's), the policy's victim
    /// (never one of `protect`) evicted from the device and dropped from the guesses; `false`
    /// where every slot is protected.
    fn admit(
        &self,
        st: &mut TierState,
        layer: usize,
        expert: usize,
        protect: &[usize],
    ) -> Result<bool> {
        let Some(victim) = st.cache.admit(layer, expert, protect) else {
            return Ok(false);
        };
        if let Some(v) = victim {
            st.guesses.remove(&(layer, v));
            if let Some(r) = st.routes_mut() {
                r.release(layer, v)?;
            }
            self.device.rt.evict_unit(self.unit(layer, v)?)?;
        }
        if let Some(r) = st.routes_mut() {
            r.admitted(layer, expert);
        }
        Ok(true)
    }

    /// At `layer` of a step (`decode`: of one row): where it starts a new step (see
    /// [`new_step`](Self::new_step)).
    fn step_at(&self, st: &mut TierState, layer: usize, visit: Visit, decode: bool) -> Result<()> {
        let new_step = st.last_layer.is_some_and(|(l, was)| {
            was != Visit::Begin
                && (layer < l || (layer == l && !(was == Visit::Route && visit == Visit::Place)))
        });
        st.last_layer = Some((layer, visit));
        if !new_step {
            st.step_started.get_or_insert_with(std::time::Instant::now);
            return Ok(());
        }
        self.new_step(st, decode)
    }

    /// A new step starts (`decode`: of one row): the step before is timed for the route
    /// chooser (a decode step after one on the same route, followed by a decode step), and
    /// the device's choices of the step before are read back and counted, and their misses
    /// admitted and fetched for the next steps.
    fn new_step(&self, st: &mut TierState, decode: bool) -> Result<()> {
        let now = std::time::Instant::now();
        match (st.step_started, st.step_on_device) {
            (Some(t0), Some(route)) => {
                if decode && st.prev_route == Some(route) && !st.untimed {
                    st.chooser.record(route, (now - t0).as_secs_f64());
                }
                st.prev_route = Some(route);
            }
            _ => st.prev_route = None,
        }
        st.untimed = false;
        st.step_started = Some(now);
        let on_device = st.step_on_device.take() == Some(true);
        let whole = std::mem::take(&mut st.whole_this_step);
        let Some(routes) = st.routes_mut() else {
            return Ok(());
        };
        let settled = routes.settle()?;
        // The table knows every sparse layer once a step routed each of them on the device (a
        // step marked so whose rows never asked, fused ops off, leaves it as it was).
        let layers_read: HashSet<usize> = settled.iter().map(|(l, _)| *l).collect();
        st.device_step_done |= on_device && layers_read.len() == st.sparse_layers;
        let store = self.device.rt.store().clone();
        for (l, chosen) in settled {
            st.stats.device_routed += 1;
            if whole.contains(&l) {
                st.stats.whole_routed += 1;
            }
            let chosen: Vec<usize> = chosen.into_iter().map(|e| e as usize).collect();
            let mut missing = Vec::new();
            for &e in &chosen {
                if st.cache.lookup(l, e) {
                    st.stats.resident += 1;
                    if st.guesses.remove(&(l, e)) {
                        st.stats.prefetch_used += 1;
                    }
                } else {
                    let unit = self.unit(l, e)?;
                    let bytes = store.unit(unit).host_bytes();
                    st.stats.mapped += 1;
                    st.stats.host_bytes += bytes;
                    missing.push((e, unit, bytes));
                }
            }
            // Fetched for the next steps, as a guess's experts are (under
            // `ExpertAdmission::Repeat`, only those missed before within the window).
            for (e, unit, bytes) in missing {
                if let Some(r) = &mut st.repeat {
                    if !r.missed(l, e) {
                        st.stats.declined += 1;
                        continue;
                    }
                }
                if self.admit(st, l, e, &chosen)? {
                    self.device.rt.prefetch(unit)?;
                    st.guesses.insert((l, e));
                    st.stats.prefetched += 1;
                    st.stats.host_bytes += bytes;
                }
            }
        }
        Ok(())
    }

    /// The experts `layer`'s cache admitted since its last adoption whose copies are done,
    /// named by the table from now on (built as `shape` says); the others wait for a later
    /// row (their entries still name their host copies), so that no row waits for a copy.
    fn adopt_ready(&self, st: &mut TierState, layer: usize, shape: &ExpertShape) -> Result<()> {
        let Some(routes) = st.routes_mut() else {
            return Ok(());
        };
        let mut acquired = Vec::new();
        let mut waiting = Vec::new();
        for e in routes.take_unadopted(layer) {
            if self.device.rt.resident_all_of([self.unit(layer, e)?])? {
                acquired.push((e, self.device.expert(layer, e, &|w| shape.load(w))?));
            } else {
                waiting.push(e);
            }
        }
        for e in waiting {
            routes.admitted(layer, e);
        }
        if !acquired.is_empty() {
            routes.adopt(layer, acquired)?;
        }
        Ok(())
    }

    /// Before a decode step that a CUDA graph may capture or replay: a new step starts, its
    /// route chosen now for all of it; where that is the device's (and a step was routed
    /// there before, so that the table knows every sparse layer), the experts admitted since
    /// whose copies are done are adopted and `Ok(Ok(()))` tells the caller to go on, every
    /// sparse layer of the step then routing on the device from the table as it is. Otherwise
    /// why the step runs eagerly. [`end_graph_step`](Self::end_graph_step) follows in both
    /// cases.
    pub(crate) fn begin_graph_step(&self) -> Result<std::result::Result<(), String>> {
        let mut st = self.lock()?;
        self.new_step(&mut st, true)?;
        st.last_layer = Some((0, Visit::Begin));
        let on_device = match self.tier.route {
            ExpertRoute::Host => false,
            ExpertRoute::Device => true,
            _ => st.chooser.choose(),
        };
        st.step_on_device = Some(on_device);
        if !on_device {
            return Ok(Err("the experts are routed on the host this step".into()));
        }
        if !st.device_step_done {
            return Ok(Err("no step was routed on the device yet".into()));
        }
        let layers = st.layers;
        let shapes: Vec<(usize, ExpertShape)> = match st.routes_mut() {
            Some(r) => (0..layers)
                .filter_map(|l| Some((l, r.expert_shape(l)?)))
                .collect(),
            None => return Ok(Err("the experts are not routed on the device".into())),
        };
        for (l, shape) in shapes {
            self.adopt_ready(&mut st, l, &shape)?;
        }
        st.in_graph = true;
        Ok(Ok(()))
    }

    /// After [`begin_graph_step`](Self::begin_graph_step): whether a captured step was
    /// `launched` (its rows' choices are read back at the next step; `captured` now, so that
    /// its time, the capture's, is not the route's), or the step runs eagerly (its layers then
    /// ask the tier as usual; it has begun).
    pub(crate) fn end_graph_step(&self, launched: bool, captured: bool) -> Result<()> {
        let mut st = self.lock()?;
        st.in_graph = false;
        st.untimed = captured;
        if launched {
            if let Some(r) = st.routes_mut() {
                r.launched()?;
            }
            // The next visit starts a new step.
            st.last_layer = Some((usize::MAX, Visit::Place));
        }
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, TierState>> {
        self.tier.lock()
    }

    fn host(&self) -> RuntimeExperts<'_> {
        RuntimeExperts {
            rt: &self.tier.host,
            layout: self.device.layout,
            ids: self.device.ids,
            // The host computes GGML blocks in F32.
            dtype: DType::F32,
        }
    }
}

impl ExpertUnits for SplitExperts<'_> {
    fn expert(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert> {
        self.device.expert(layer, expert, build)
    }

    fn place(
        &self,
        layer: usize,
        routed: &[(usize, usize)],
        build: BuildExpert<'_>,
    ) -> Result<Vec<(Option<Expert>, ExpertSite)>> {
        let mut st = self.lock()?;
        let decode = routed.iter().all(|&(_, rows)| rows == 1);
        self.step_at(&mut st, layer, Visit::Place, decode)?;
        let mut site = vec![ExpertSite::Host; routed.len()];
        let mut missing = Vec::new();
        for (i, &(e, _)) in routed.iter().enumerate() {
            if st.cache.lookup(layer, e) {
                site[i] = ExpertSite::Device;
                if st.guesses.remove(&(layer, e)) {
                    st.stats.prefetch_used += 1;
                }
            } else {
                missing.push(i);
            }
        }
        let resident = routed.len() - missing.len();
        // The missing ones: fetched (taking a slot) or on the host, priced per expert.
        let missing_routed: Vec<(usize, usize)> = missing.iter().map(|&i| routed[i]).collect();
        let (bytes, mut fetch) = tracing::debug_span!("moe.place.split")
            .in_scope(|| self.split(&mut st, layer, &missing_routed))?;
        if decode && self.tier.host_compute && !self.whole_layer(&st, layer) {
            st.host_probe.place(&mut fetch);
        }
        let can_stream = self.tier.stream_depth > 0;
        // The experts this step runs on the device are never a fetch's victim: they are all
        // resident at once while the layer runs.
        let mut protect: Vec<usize> = (0..routed.len())
            .filter(|&i| site[i] == ExpertSite::Device)
            .map(|i| routed[i].0)
            .collect();
        let (mut fetched, mut streamed) = (0u64, 0u64);
        let mut host_bytes = 0u64;
        let mut on_host = HostWork {
            decode,
            ..Default::default()
        };
        for ((&i, &f), &bytes) in missing.iter().zip(&fetch).zip(&bytes) {
            let (e, rows) = routed[i];
            host_bytes += bytes;
            if f {
                if self.admit(&mut st, layer, e, &protect)? {
                    site[i] = ExpertSite::Device;
                    protect.push(e);
                    fetched += 1;
                    self.copy_issued(&mut st, layer, e)?;
                    continue;
                }
                if can_stream {
                    // No slot to take (all in use this step): through the room the runtime
                    // keeps for copies in flight, one at a time.
                    site[i] = ExpertSite::Stream;
                    streamed += 1;
                    continue;
                }
            }
            on_host.bytes += bytes;
            on_host.row_bytes += bytes * rows as u64;
        }
        st.stats.resident += resident as u64;
        st.stats.fetched += fetched;
        st.stats.streamed += streamed;
        let host_experts = (missing.len() as u64).saturating_sub(fetched + streamed);
        st.stats.on_host += host_experts;
        if let Some(n) = st.stats.on_host_by_layer.get_mut(layer) {
            *n += host_experts;
        }
        st.stats.host_bytes += host_bytes;
        if let Some(w) = st.placed_host.get_mut(layer) {
            *w = on_host;
        }
        drop(st);
        // The device's first (their copies and kernels queue while the host works).
        let mut out: Vec<Option<Expert>> = (0..routed.len()).map(|_| None).collect();
        let acquire =
            |out: &mut Vec<Option<Expert>>, on: ExpertSite, units: &RuntimeExperts<'_>| {
                let mine: Vec<usize> = (0..routed.len()).filter(|&i| site[i] == on).collect();
                let experts: Vec<usize> = mine.iter().map(|&i| routed[i].0).collect();
                for (i, x) in mine.into_iter().zip(units.experts(layer, &experts, build)?) {
                    out[i] = Some(x);
                }
                Ok::<_, candle_core::Error>(())
            };
        tracing::debug_span!("moe.place.device")
            .in_scope(|| acquire(&mut out, ExpertSite::Device, &self.device))?;
        tracing::debug_span!("moe.place.host")
            .in_scope(|| acquire(&mut out, ExpertSite::Host, &self.host()))?;
        Ok(out.into_iter().zip(site).collect())
    }

    fn stream_depth(&self) -> usize {
        self.tier.stream_depth
    }

    fn stream(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert> {
        self.device.expert(layer, expert, build)
    }

    fn guess_routers(
        &self,
        layer: usize,
        router: &Linear,
        routing: Routing,
        rows: usize,
    ) -> Vec<(usize, Linear, Routing)> {
        if !self.tier.prefetch {
            // The routers are kept only for the guess.
            return Vec::new();
        }
        let Ok(mut st) = self.tier.state.lock() else {
            return Vec::new();
        };
        if let Some(r) = st.routers.get_mut(layer) {
            *r = Some((router.clone(), routing));
        }
        if rows != 1 {
            return Vec::new();
        }
        // A guess for a layer with no slot, or with every expert resident, fetches nothing.
        st.routers
            .iter()
            .enumerate()
            .skip(layer + 1)
            .filter_map(|(n, r)| r.clone().map(|(l, g)| (n, l, g)))
            .take(self.tier.guess_layers)
            .filter(|(n, _, _)| st.cache.slots(*n) > 0 && !st.cache.all_resident(*n))
            .collect()
    }

    /// Fetches the guessed experts that the split gives the link, as `place` would split
    /// them: the others are left to the host CPU when they are routed to (and to that
    /// step's split), so that the link and the host both read while the device runs the
    /// layers between.
    fn guessed(&self, layer: usize, routes: &[(usize, f32)]) -> Result<()> {
        let mut st = self.lock()?;
        // A decode step's row: one row each.
        let missing: Vec<(usize, usize)> = routes
            .iter()
            .map(|&(e, _)| (e, 1))
            .filter(|&(e, _)| !st.cache.contains(layer, e))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let (bytes, fetch) = self.split(&mut st, layer, &missing)?;
        // The guess's experts are never each other's victims.
        let protect: Vec<usize> = routes.iter().map(|&(e, _)| e).collect();
        for ((&(e, _), &b), f) in missing.iter().zip(&bytes).zip(fetch) {
            if !f || !self.admit(&mut st, layer, e, &protect)? {
                continue;
            }
            self.device.rt.prefetch(self.unit(layer, e)?)?;
            self.copy_issued(&mut st, layer, e)?;
            st.guesses.insert((layer, e));
            st.stats.prefetched += 1;
            st.stats.host_bytes += b;
        }
        Ok(())
    }

    fn host_computes(&self) -> bool {
        self.tier.host_compute
    }

    fn device_route(
        &self,
        layer: usize,
        shape: &ExpertShape,
        routing: Routing,
        x: &candle_core::Tensor,
    ) -> Result<Option<(Arc<ExpertTable>, RoutedShape)>> {
        // The host route with no layer that can hold every expert never routes on the device.
        let host_only = self.tier.route == ExpertRoute::Host && !self.tier.whole_layers;
        if !x.device().is_cuda() || host_only {
            return Ok(None);
        }
        let mut st = self.lock()?;
        let tuning = self.device.rt.tuning().kernels;
        if st.in_graph {
            // A step a graph captures: the table as it is, nothing adopted or acquired.
            let routes = st.routes_mut().ok_or_else(|| {
                candle_core::Error::Msg("a captured step without the device's routing".into())
            })?;
            let Some(routed) = routes.known_layer(layer, x, &tuning)? else {
                candle_core::bail!("layer {layer}'s experts are not routed on the device");
            };
            return Ok(Some((routes.route(layer), routed)));
        }
        self.step_at(&mut st, layer, Visit::Route, true)?;
        let wanted = match st.step_on_device {
            Some(w) => w,
            None => {
                let w = match self.tier.route {
                    ExpertRoute::Host => false,
                    ExpertRoute::Device => true,
                    ExpertRoute::Auto => st.chooser.choose(),
                };
                st.step_on_device = Some(w);
                w
            }
        };
        // A layer with every expert resident routes on the device in a host step too (under
        // `ExpertRoute::Host` as well): its rows read nothing from host memory, so nothing is
        // gained by the host's wait for the choice.
        let whole = !wanted && st.cache.all_resident(layer);
        if !wanted && !whole {
            return Ok(None);
        }
        if matches!(st.routes, Routes::Untried) {
            let resident = (0..st.layers).map(|l| st.cache.resident(l)).collect();
            st.routes = match DeviceRoutes::new(x.device(), routing.experts, resident) {
                Ok(r) => Routes::On(r),
                Err(e) => {
                    tracing::warn!(error = %e, "the experts stay routed on the host");
                    Routes::Off
                }
            };
        }
        let store = self.device.rt.store().clone();
        let routed = match st.routes_mut() {
            Some(routes) => routes.layer(
                layer,
                (&store, self.device.layout),
                (shape, routing),
                x,
                &tuning,
            )?,
            None => None,
        };
        let Some(routed) = routed else {
            // The host routes this step (its time is the host route's).
            if !whole {
                st.step_on_device = Some(false);
            }
            return Ok(None);
        };
        self.adopt_ready(&mut st, layer, shape)?;
        if whole {
            st.whole_this_step.push(layer);
        }
        let routes = st
            .routes_mut()
            .ok_or_else(|| candle_core::Error::Msg("the device's routing went away".into()))?;
        Ok(Some((routes.route(layer), routed)))
    }

    fn streamed(&self, layer: usize, expert: usize) -> Result<()> {
        // Out again once its use is done (the runtime's eviction waits for it), so that the
        // next one takes its room and the cache's experts stay.
        self.device.rt.evict_unit(self.unit(layer, expert)?)?;
        Ok(())
    }

    fn stream_done(&self, experts: usize, seconds: f64) {
        let Ok(mut st) = self.tier.state.lock() else {
            return;
        };
        if experts > 0 {
            let r = &mut st.stats.stream_enqueue_s;
            *r = enqueue_average(*r, seconds / experts as f64);
        }
    }

    fn host_done(&self, layer: usize, seconds: f64) {
        let Ok(mut st) = self.tier.state.lock() else {
            return;
        };
        let work = st.placed_host.get(layer).copied().unwrap_or_default();
        // A decode row's time measures the host's reads; a prompt's, its compute over rows.
        let (done, r) = if work.decode {
            (work.bytes, &mut st.stats.host_bytes_per_s)
        } else {
            (work.row_bytes, &mut st.stats.host_row_bytes_per_s)
        };
        if done > 0 && seconds > 0.0 {
            *r = smoothed(*r, done as f64 / seconds);
        }
    }
}

/// The experts a stage's steps acquire: from the stage's runtime, or split with a tier.
pub(crate) enum StageExperts<'a> {
    /// Every expert from the stage's runtime.
    Runtime(RuntimeExperts<'a>),
    /// Split between the device's cache and the host CPU.
    Split(SplitExperts<'a>),
}

impl StageExperts<'_> {
    /// The [`ExpertUnits`] of a step.
    pub(crate) fn units(&self) -> &dyn ExpertUnits {
        match self {
            Self::Runtime(r) => r,
            Self::Split(s) => s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One stall a hundred times the average raises it by 30%, not tenfold; a lasting change
    /// is learned; a sample that is no time leaves it.
    #[test]
    fn the_enqueue_average_caps_a_stall() {
        let avg = 100e-6;
        let stalled = enqueue_average(avg, 10e-3);
        assert!((stalled - 1.3 * avg).abs() < 1e-12, "{stalled}");
        let mut a = avg;
        for _ in 0..40 {
            a = enqueue_average(a, 1e-3);
        }
        assert!((a - 1e-3).abs() < 0.05e-3, "{a}");
        assert_eq!(enqueue_average(avg, 0.0), avg);
        assert_eq!(enqueue_average(avg, f64::NAN), avg);
        assert_eq!(enqueue_average(0.0, 5e-5), 0.1 * 5e-5);
    }

    #[test]
    fn a_prompts_expert_is_priced_at_the_slower_of_its_reads_and_its_rows() {
        let (b, read, row) = (1_000_000u64, 1e9, 2e9);
        // One row: a read.
        assert_eq!(host_seconds(b, 1, read, row), 1e-3);
        // Few rows on a host that computes them fast: one read still.
        assert_eq!(host_seconds(b, 2, read, 1e12), 1e-3);
        // Many rows: their compute, b * rows / row rate.
        assert_eq!(host_seconds(b, 10, read, row), 5e-3);
        // More rows than a read serves, on a fast compute: a read per group of rows.
        let groups = 17usize.div_ceil(HOST_ROWS_PER_READ) as f64;
        assert_eq!(host_seconds(b, 17, read, 1e15), groups * 1e-3);
    }
}
