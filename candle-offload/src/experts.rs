//! Mixture-of-experts residency, pure: a per-layer cache of experts (each expert one unit:
//! its gate, up and down as stored) with LRU or LFU-with-ageing eviction and hit/miss counters
//! per layer, the slots a byte budget gives each layer, and the price of a missing expert
//! computed on the host CPU against fetched over the link and computed on the GPU.
//!
//! The runtime asks, the cache answers; nothing here touches a device. Which experts a token
//! uses changes from token to token, so the periodic sweep Belady relies on
//! ([`crate::cache`]) does not exist for them: recency and frequency are what is left.

/// How an [`ExpertCache`] chooses the expert to evict.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ExpertPolicy {
    /// Least recently used.
    #[default]
    Lru,
    /// Least frequently used, each use's weight halving every `half_life` accesses of the
    /// layer (so that popularity follows the text); ties go to the least recent.
    Lfu {
        /// Accesses of the layer after which a use counts half.
        half_life: f64,
    },
}

/// What an access did: a hit, or a miss that admitted the expert (evicting `evicted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertAccess {
    /// The expert was resident.
    Hit,
    /// It was not; it is now, in place of `evicted` when the layer was full.
    Miss {
        /// The expert it replaced.
        evicted: Option<usize>,
    },
}

/// One layer's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayerCounters {
    /// Accesses that found the expert resident.
    pub hits: u64,
    /// Accesses that did not.
    pub misses: u64,
    /// Experts evicted.
    pub evictions: u64,
}

impl LayerCounters {
    /// Hits over accesses (0 without accesses).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

#[derive(Debug, Clone)]
struct Slot {
    expert: usize,
    last_use: u64,
    /// Ageing use count at `scored_at`.
    score: f64,
    scored_at: u64,
}

#[derive(Debug, Clone)]
struct Layer {
    slots: usize,
    resident: Vec<Slot>,
    clock: u64,
    counters: LayerCounters,
}

/// Per layer, which experts are resident in that layer's slots. See the module docs.
#[derive(Debug, Clone)]
pub struct ExpertCache {
    policy: ExpertPolicy,
    experts: usize,
    layers: Vec<Layer>,
}

impl ExpertCache {
    /// A cache of `slots[l]` experts for each layer `l` of `experts` experts.
    pub fn new(policy: ExpertPolicy, experts: usize, slots: &[usize]) -> Self {
        Self {
            policy,
            experts,
            layers: slots
                .iter()
                .map(|&s| Layer {
                    slots: s.min(experts),
                    resident: Vec::new(),
                    clock: 0,
                    counters: LayerCounters::default(),
                })
                .collect(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> ExpertPolicy {
        self.policy
    }

    /// Slots of layer `l`.
    pub fn slots(&self, l: usize) -> usize {
        self.layers.get(l).map_or(0, |x| x.slots)
    }

    /// Whether expert `e` of layer `l` is resident.
    pub fn contains(&self, l: usize, e: usize) -> bool {
        self.layers
            .get(l)
            .is_some_and(|x| x.resident.iter().any(|s| s.expert == e))
    }

    /// Whether every expert of layer `l` is resident (a layer of as many slots as experts,
    /// each used once since).
    pub fn all_resident(&self, l: usize) -> bool {
        self.layers
            .get(l)
            .is_some_and(|x| x.slots > 0 && x.resident.len() >= self.experts)
    }

    /// The resident experts of layer `l`, in no particular order.
    pub fn resident(&self, l: usize) -> Vec<usize> {
        self.layers
            .get(l)
            .map(|x| x.resident.iter().map(|s| s.expert).collect())
            .unwrap_or_default()
    }

    /// The counters of layer `l`.
    pub fn counters(&self, l: usize) -> LayerCounters {
        self.layers.get(l).map(|x| x.counters).unwrap_or_default()
    }

    /// All layers' counters summed.
    pub fn total(&self) -> LayerCounters {
        self.layers
            .iter()
            .fold(LayerCounters::default(), |a, x| LayerCounters {
                hits: a.hits + x.counters.hits,
                misses: a.misses + x.counters.misses,
                evictions: a.evictions + x.counters.evictions,
            })
    }

    fn decayed(policy: ExpertPolicy, s: &Slot, now: u64) -> f64 {
        match policy {
            ExpertPolicy::Lru => 0.0,
            ExpertPolicy::Lfu { half_life } => {
                let age = (now - s.scored_at) as f64;
                s.score * (-age / half_life.max(f64::MIN_POSITIVE)).exp2()
            }
        }
    }

    /// A use of expert `e` of layer `l`: a hit, or a miss that admits it (evicting the
    /// policy's victim when the layer is full). A layer of no slots admits nothing (its
    /// experts always miss). An expert or layer out of range is a miss that admits nothing.
    pub fn access(&mut self, l: usize, e: usize) -> ExpertAccess {
        if self.lookup(l, e) {
            return ExpertAccess::Hit;
        }
        ExpertAccess::Miss {
            evicted: self.admit(l, e, &[]).flatten(),
        }
    }

    /// A use of expert `e` of layer `l` that admits nothing: counted as a hit (and scored as a
    /// use) when it is resident, as a miss otherwise. Returns whether it was a hit. With
    /// [`admit`](Self::admit) on a miss, this is [`access`](Self::access); apart, a miss
    /// can be served from elsewhere (the host CPU) without taking a slot.
    pub fn lookup(&mut self, l: usize, e: usize) -> bool {
        let policy = self.policy;
        let Some(layer) = self.layers.get_mut(l) else {
            return false;
        };
        layer.clock += 1;
        let now = layer.clock;
        if let Some(s) = layer.resident.iter_mut().find(|s| s.expert == e) {
            s.score = Self::decayed(policy, s, now) + 1.0;
            s.scored_at = now;
            s.last_use = now;
            layer.counters.hits += 1;
            return true;
        }
        layer.counters.misses += 1;
        false
    }

    /// Admits expert `e` of layer `l` after a [`lookup`](Self::lookup) missed, evicting the
    /// policy's victim when the layer is full, never one of `protect` (experts a step is
    /// using): `Some(victim)` (`Some(None)` when a slot was free), or `None` when nothing was
    /// admitted (a layer of no slots, an expert or layer out of range, one already resident,
    /// or a full layer whose residents are all protected).
    pub fn admit(&mut self, l: usize, e: usize, protect: &[usize]) -> Option<Option<usize>> {
        let policy = self.policy;
        let experts = self.experts;
        let layer = self.layers.get_mut(l)?;
        if layer.slots == 0 || e >= experts || layer.resident.iter().any(|s| s.expert == e) {
            return None;
        }
        let now = layer.clock;
        let mut evicted = None;
        if layer.resident.len() >= layer.slots {
            let victim = layer
                .resident
                .iter()
                .enumerate()
                .filter(|(_, s)| !protect.contains(&s.expert))
                .min_by(|(_, a), (_, b)| {
                    let (sa, sb) = (Self::decayed(policy, a, now), Self::decayed(policy, b, now));
                    sa.total_cmp(&sb).then(a.last_use.cmp(&b.last_use))
                })
                .map(|(i, _)| i)?;
            evicted = Some(layer.resident.swap_remove(victim).expert);
            layer.counters.evictions += 1;
        }
        layer.resident.push(Slot {
            expert: e,
            last_use: now,
            score: 1.0,
            scored_at: now,
        });
        Some(evicted)
    }
}

/// Expert slots per sparse layer that `budget_bytes` (what the budget leaves after the dense
/// part) holds for `layers` layers of experts of `expert_bytes` each, spread evenly, at most
/// `experts` per layer.
pub fn slots_for_budget(
    budget_bytes: u64,
    expert_bytes: u64,
    layers: usize,
    experts: usize,
) -> usize {
    if expert_bytes == 0 || layers == 0 {
        return experts;
    }
    let per_layer = budget_bytes / layers as u64 / expert_bytes;
    (per_layer as usize).min(experts)
}

/// How an expert cache's slots are spread over the sparse layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertSlots {
    /// The same number in every sparse layer (for experts of one size, [`slots_for_budget`]):
    /// each layer's cache keeps its popular experts, so a skewed routing hits in every layer.
    #[default]
    Spread,
    /// Whole layers, the last sparse layers first (as llama.cpp's `--n-cpu-moe` keeps the
    /// experts of the last layers on the GPU), the rest in the next layer down and none below:
    /// under a uniform routing the hits are as many as spread, but the layers with every
    /// expert resident leave no work to the host and the others leave it a layer's whole
    /// share at once.
    Layers,
}

impl ExpertSlots {
    /// Slots per decoder layer that `budget_bytes` holds, where `expert_bytes[l]` is the size
    /// of layer `l`'s largest expert (`None` for a dense layer, which gets none), at most
    /// `experts` per layer. Layers may differ in size (a K-quant mix stores some layers' down
    /// projections in more bits). The slots' bytes never pass `budget_bytes`.
    pub fn per_layer(
        self,
        budget_bytes: u64,
        expert_bytes: &[Option<u64>],
        experts: usize,
    ) -> Vec<usize> {
        match self {
            Self::Spread => {
                // The same number everywhere: n slots of every sparse layer cost n times the
                // sum of their experts' sizes.
                let per_slot: u64 = expert_bytes.iter().flatten().sum();
                let n = fitting(budget_bytes, per_slot, experts);
                expert_bytes
                    .iter()
                    .map(|b| if b.is_some() { n } else { 0 })
                    .collect()
            }
            Self::Layers => {
                let mut left = budget_bytes;
                let mut slots = vec![0; expert_bytes.len()];
                for (slot, bytes) in slots.iter_mut().zip(expert_bytes).rev() {
                    let Some(bytes) = *bytes else { continue };
                    *slot = fitting(left, bytes, experts);
                    left -= *slot as u64 * bytes;
                    if *slot < experts {
                        // Whole layers from the last, then one partial, none below it.
                        left = 0;
                    }
                }
                slots
            }
        }
    }
}

/// How many of `each` bytes `room` holds, at most `at_most` (all of them where `each` is 0).
fn fitting(room: u64, each: u64, at_most: usize) -> usize {
    room.checked_div(each).map_or(at_most, |n| {
        usize::try_from(n).unwrap_or(usize::MAX).min(at_most)
    })
}

keyword_enum!(ExpertSlots, "expert_slots", crate::Error, [crate::Error::InvalidConfig], {
    Spread => "spread",
    Layers => "layers",
});

/// Measured rates a missing expert's price is made of (bytes and FLOPs per second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertRates {
    /// The host CPU reading weights for its quantized matmuls.
    pub cpu_read: f64,
    /// The host CPU's arithmetic on those matmuls.
    pub cpu_flops: f64,
    /// Host-to-device copies over the link.
    pub link: f64,
    /// The GPU reading weights from its memory.
    pub gpu_read: f64,
    /// The GPU's arithmetic.
    pub gpu_flops: f64,
}

/// Where a missing expert runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPlace {
    /// On the host CPU, from host memory.
    Cpu,
    /// Fetched over the link, then on the GPU.
    Fetch,
}

/// The seconds a missing expert of `bytes` (as stored) costs for `tokens` tokens of
/// `flops_per_token` each: on the CPU (the slower of reading its bytes and computing), and
/// fetched and computed on the GPU (the copy, then the slower of reading and computing).
pub fn missing_expert_seconds(
    bytes: u64,
    flops_per_token: f64,
    tokens: usize,
    r: &ExpertRates,
) -> (f64, f64) {
    let b = bytes as f64;
    let flops = flops_per_token * tokens as f64;
    let cpu = (b / r.cpu_read).max(flops / r.cpu_flops);
    let gpu = b / r.link + (b / r.gpu_read).max(flops / r.gpu_flops);
    (cpu, gpu)
}

/// The cheaper place for a missing expert ([`missing_expert_seconds`]); the CPU on a tie.
pub fn place_missing_expert(
    bytes: u64,
    flops_per_token: f64,
    tokens: usize,
    r: &ExpertRates,
) -> ExpertPlace {
    let (cpu, gpu) = missing_expert_seconds(bytes, flops_per_token, tokens, r);
    if gpu < cpu {
        ExpertPlace::Fetch
    } else {
        ExpertPlace::Cpu
    }
}

/// Which of a layer's missing experts to fetch over the link (and compute on the GPU) while
/// the host CPU computes the others at the same time: `costs[i]` is expert `i`'s seconds on
/// the CPU and fetched ([`missing_expert_seconds`]); `link_busy` is the seconds of copies
/// already queued on the link before them (prefetched experts still on their way);
/// `enqueue` is the host's seconds to enqueue one fetched expert's copy and work, which the
/// thread that then computes the CPU's experts spends first (so the CPU side is its experts'
/// seconds plus `enqueue` a fetched one). Greedy on the two sides: from all on the CPU, the
/// experts whose CPU seconds past `enqueue` are largest relative to the link move to the
/// fetch side while that shortens the slower side. `true`: fetch. Never slower than all on
/// one side; with equal costs, the best split.
pub fn split_missing(costs: &[(f64, f64)], link_busy: f64, enqueue: f64) -> Vec<bool> {
    let mut fetch = vec![false; costs.len()];
    let valid = |x: f64| x.is_finite() && x >= 0.0;
    let enqueue = if valid(enqueue) { enqueue } else { 0.0 };
    let mut order: Vec<usize> = (0..costs.len())
        .filter(|&i| valid(costs[i].0) && valid(costs[i].1))
        .collect();
    // Most CPU seconds saved per fetched second first; ties by index.
    order.sort_by(|&a, &b| {
        let r = |i: usize| (costs[i].0 - enqueue) / costs[i].1.max(f64::MIN_POSITIVE);
        r(b).total_cmp(&r(a)).then(a.cmp(&b))
    });
    let mut cpu: f64 = order.iter().map(|&i| costs[i].0).sum();
    let mut link = if valid(link_busy) { link_busy } else { 0.0 };
    for i in order {
        let (c, f) = costs[i];
        if (cpu - c + enqueue).max(link + f) < cpu.max(link) {
            cpu += enqueue - c;
            link += f;
            fetch[i] = true;
        }
    }
    fetch
}

/// What a mixture-of-experts model's expert cache does ([`OffloadConfig::experts`](crate::OffloadConfig::experts)).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ExpertOptions {
    /// How the cache chooses the expert to evict.
    pub policy: ExpertPolicy,
    /// Where missing experts run.
    pub split: ExpertSplit,
    /// In a decode step, the copy stream prefetches the experts the next mixture-of-experts
    /// layer's router picks for the current layer's input (they take slots, the policy's
    /// victims evicted), so that the guesses that come true are hits. On in
    /// [`Default`](ExpertOptions::default), off in [`new`](ExpertOptions::new).
    pub prefetch: bool,
    /// With [`Self::prefetch`], how many of the next mixture-of-experts layers a decode step
    /// guesses for, each router on the current layer's rows (at least 1): further guesses keep
    /// the link busy while the device and the host work, and come true less often.
    pub guess_layers: usize,
    /// Who chooses a decode row's experts on a GPU.
    pub route: ExpertRoute,
    /// Which experts a decode step read from host memory the cache takes a slot for.
    pub admission: ExpertAdmission,
    /// How the cache's slots are spread over the layers.
    pub slots: ExpertSlots,
}

impl Default for ExpertOptions {
    /// The default policy and split, with prefetch.
    fn default() -> Self {
        Self::new(ExpertPolicy::default(), ExpertSplit::default()).with_prefetch(true)
    }
}

impl ExpertOptions {
    /// Options with `policy` and `split`, without prefetch (one layer guessed when it is on).
    pub fn new(policy: ExpertPolicy, split: ExpertSplit) -> Self {
        Self {
            policy,
            split,
            prefetch: false,
            guess_layers: 1,
            route: ExpertRoute::default(),
            admission: ExpertAdmission::default(),
            slots: ExpertSlots::default(),
        }
    }

    /// These options with the cache's slots spread over the layers as `slots` says.
    pub fn with_slots(mut self, slots: ExpertSlots) -> Self {
        self.slots = slots;
        self
    }

    /// These options with `admission` for the experts a decode step read from host memory.
    pub fn with_admission(mut self, admission: ExpertAdmission) -> Self {
        self.admission = admission;
        self
    }

    /// These options with a decode row's experts chosen as `route` says.
    pub fn with_route(mut self, route: ExpertRoute) -> Self {
        self.route = route;
        self
    }

    /// These options with the next layer's experts prefetched or not.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// These options with the next `n` mixture-of-experts layers guessed (at least 1).
    pub fn with_guess_layers(mut self, n: usize) -> Self {
        self.guess_layers = n.max(1);
        self
    }
}

/// Which of the experts a decode step on the device route read from host memory (its misses)
/// the cache takes a slot for, fetching it for the next steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertAdmission {
    /// Every one.
    #[default]
    Always,
    /// One its layer missed before among its last misses ([`RepeatMisses`], as many as the
    /// layer has slots: an expert that comes back within them would have been a hit had it
    /// been admitted). An expert used once is read from host memory and not also copied, so
    /// the link carries less beside the step's own reads (TinyLFU's doorkeeper, over a window).
    Repeat,
}

keyword_enum!(ExpertAdmission, "expert_admission", crate::Error, [crate::Error::InvalidConfig], {
    Always => "always",
    Repeat => "repeat",
});

/// Per layer, the last misses an [`ExpertAdmission::Repeat`] cache remembers. Pure.
#[derive(Debug, Clone, PartialEq)]
pub struct RepeatMisses {
    recent: Vec<std::collections::VecDeque<usize>>,
    window: Vec<usize>,
}

impl RepeatMisses {
    /// For layers of `window[l]` remembered misses each (a layer of 0 admits nothing).
    pub fn new(window: &[usize]) -> Self {
        Self {
            recent: window.iter().map(|_| Default::default()).collect(),
            window: window.to_vec(),
        }
    }

    /// `layer` missed `expert`: whether it is among the layer's remembered misses (then
    /// forgotten: it is admitted); otherwise it is remembered, the oldest forgotten past the
    /// window.
    pub fn missed(&mut self, layer: usize, expert: usize) -> bool {
        let (Some(recent), Some(&window)) = (self.recent.get_mut(layer), self.window.get(layer))
        else {
            return false;
        };
        if let Some(i) = recent.iter().position(|&e| e == expert) {
            recent.remove(i);
            return true;
        }
        if window > 0 {
            if recent.len() == window {
                recent.pop_front();
            }
            recent.push_back(expert);
        }
        false
    }
}

/// Keeps the host's measured rate for missing experts from going stale. The rate is measured
/// only where the host computes experts; once it reads too low (one slow measurement),
/// [`split_missing`] fetches every miss and the rate is never measured again. After
/// `every` placements in a row that left nothing on the host, the next puts one miss there.
/// Pure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRateProbe {
    every: u32,
    idle: u32,
}

impl HostRateProbe {
    /// A probe after `every` placements without host work.
    pub fn new(every: u32) -> Self {
        Self { every, idle: 0 }
    }

    /// A layer's placement of its misses (`fetch[i]`: miss `i` fetched, else on the host),
    /// changed to put its last miss on the host where it is time to probe.
    pub fn place(&mut self, fetch: &mut [bool]) {
        if fetch.is_empty() {
            return;
        }
        if fetch.iter().any(|&f| !f) {
            self.idle = 0;
        } else if self.idle >= self.every {
            self.idle = 0;
            if let Some(f) = fetch.last_mut() {
                *f = false;
            }
        } else {
            self.idle += 1;
        }
    }
}

/// Who chooses a decode row's experts on a GPU with an expert cache.
///
/// On the host, each layer's routers' choice is read back before its experts are placed (a
/// wait for the device a layer), and the missing experts split between the host CPU and the
/// link. On the device, a kernel chooses them and the grouped kernels read each one where a
/// table says it is: its slot, or its host copy through the mapped address (no wait; a miss
/// costs its bytes over the link on the device's time); the host reads the choice back once a
/// step, to count it and fetch the misses for the next steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertRoute {
    /// The faster of the two by the decode steps' measured times ([`RouteChooser`]).
    #[default]
    Auto,
    /// On the host wherever an expert may be missing: a layer with every expert resident is
    /// routed on the device (its rows read nothing from host memory).
    Host,
    /// On the device wherever the experts' blocks allow it.
    Device,
}

keyword_enum!(ExpertRoute, "expert_route", crate::Error, [crate::Error::InvalidConfig], {
    Auto => "auto",
    Host => "host",
    Device => "device",
});

/// Decode steps a [`RouteChooser`] keeps on the faster route between two probes of the other,
/// at the least.
pub const ROUTE_PROBE_STEPS: u64 = 64;

/// A probe that finds the other route at least this many times slower than the faster one
/// doubles a [`RouteChooser`]'s steps to its next probe (up to [`ROUTE_PROBE_MAX_STEPS`]).
pub const ROUTE_PROBE_BACKOFF: f64 = 1.5;

/// The most decode steps a [`RouteChooser`] keeps on the faster route between two probes.
pub const ROUTE_PROBE_MAX_STEPS: u64 = 1024;

/// Step times a [`RouteChooser`] keeps per route; its estimate of a route is their median.
pub const ROUTE_TIME_WINDOW: usize = 9;

/// A step time over this many times its route's estimate is dropped (an idle gap between
/// requests, a hiccup of the host), not kept.
pub const ROUTE_TIME_OUTLIER: f64 = 3.0;

/// A [`RouteChooser`] leaves the route it is on only for one whose estimate is under this
/// share of its own.
pub const ROUTE_SWITCH_MARGIN: f64 = 0.9;

/// Chooses who routes each decode step under [`ExpertRoute::Auto`] by the decode steps' times
/// on each route: which one wins depends on the cache's hit rate under each (the device reads
/// its misses from host memory as they come; the host fetches the next layer's guess ahead
/// and splits its misses with the host CPU), on the link, the host CPU and the device, so
/// it is measured rather than priced. The device route goes first, then the host's; then the
/// faster one, with a probe of the other every [`ROUTE_PROBE_STEPS`] steps, twice as many after
/// each probe that finds it [`ROUTE_PROBE_BACKOFF`] times slower (at most
/// [`ROUTE_PROBE_MAX_STEPS`]; back to the least after one that does not). A route's estimate
/// is the median of its last [`ROUTE_TIME_WINDOW`] step times (a decode step's time varies
/// with its misses), and the chooser leaves its route only for one faster by a margin
/// ([`ROUTE_SWITCH_MARGIN`]). A step counts only after a decode step on the same route (the
/// first after a switch carries the switch: a table to fill, experts to adopt), and the tier
/// leaves out a step that captured a CUDA graph (its time is the capture's). Pure: the tier
/// times the steps and tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteChooser {
    /// The last step times, seconds, on the host route and on the device route.
    times: [std::collections::VecDeque<f64>; 2],
    /// The route the chooser is on, once both were measured.
    on_device: Option<bool>,
    /// Steps on the faster route since the other was last probed.
    since_probe: u64,
    /// Steps on the faster route from one probe to the next.
    probe_every: u64,
    /// Steps left in a probe (the first of them carries the switch).
    probing: u32,
    /// A probe ended: the next choice compares the routes for the next probe's spacing.
    probed: bool,
}

impl Default for RouteChooser {
    fn default() -> Self {
        Self {
            times: Default::default(),
            on_device: None,
            since_probe: 0,
            probe_every: ROUTE_PROBE_STEPS,
            probing: 0,
            probed: false,
        }
    }
}

impl RouteChooser {
    /// A decode step on the device (`on_device`) or the host route took `seconds`, after a
    /// decode step on the same route.
    pub fn record(&mut self, on_device: bool, seconds: f64) {
        if !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if self
            .estimate(on_device)
            .is_some_and(|t| seconds > ROUTE_TIME_OUTLIER * t)
        {
            return;
        }
        let times = &mut self.times[usize::from(on_device)];
        if times.len() == ROUTE_TIME_WINDOW {
            times.pop_front();
        }
        times.push_back(seconds);
    }

    /// The estimate of a decode step on a route, where one was measured: the median of its
    /// last step times.
    pub fn estimate(&self, on_device: bool) -> Option<f64> {
        let mut v: Vec<f64> = self.times[usize::from(on_device)].iter().copied().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// Whether the next decode step is routed on the device.
    pub fn choose(&mut self) -> bool {
        let (Some(host), Some(device)) = (self.estimate(false), self.estimate(true)) else {
            // The device first, then the host, each until it has a step time.
            return self.times[1].is_empty();
        };
        let faster = match self.on_device {
            Some(true) => host >= ROUTE_SWITCH_MARGIN * device,
            Some(false) => device < ROUTE_SWITCH_MARGIN * host,
            None => device <= host,
        };
        if self.probing > 0 {
            self.probing -= 1;
            self.probed = self.probing == 0;
            return !faster;
        }
        if std::mem::take(&mut self.probed) {
            // The probed route's time is in: the further it is behind, the rarer its probes.
            let (fast, slow) = if faster {
                (device, host)
            } else {
                (host, device)
            };
            self.probe_every = if slow >= ROUTE_PROBE_BACKOFF * fast {
                (2 * self.probe_every).min(ROUTE_PROBE_MAX_STEPS)
            } else {
                ROUTE_PROBE_STEPS
            };
        }
        self.on_device = Some(faster);
        self.since_probe += 1;
        if self.since_probe > self.probe_every {
            self.since_probe = 0;
            // Two steps: the switch, then one that counts.
            self.probing = 1;
            return !faster;
        }
        faster
    }
}

/// Whether a mixture-of-experts layer's missing experts may run on the host CPU, beside the
/// device's expert cache, instead of all being fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertSplit {
    /// On a GPU whose budget does not hold every expert beside the rest of the model, or
    /// where a decode row's experts of GGML blocks may be chosen on the device ([`ExpertRoute`]
    /// other than host: the tier keeps the table, with a slot for every expert where they all
    /// fit, all fetched with the load).
    #[default]
    Auto,
    /// Always where the experts are units of their own (on a CPU device too: the tests' way
    /// to run the split where there is no GPU).
    On,
    /// Never: every routed expert is fetched to the device.
    Off,
    /// The expert cache as for `On`, with every missing expert fetched (or streamed) to the
    /// device and none computed on the host CPU: the split's fetch side alone, to measure the
    /// split against.
    Fetch,
}

keyword_enum!(ExpertSplit, "expert_split", crate::Error, [crate::Error::InvalidConfig], {
    Auto => "auto",
    On => "on",
    Off => "off",
    Fetch => "fetch",
});

impl std::str::FromStr for ExpertPolicy {
    type Err = crate::Error;
    /// `lru`, or `lfu` / `lfu:HALF_LIFE` (accesses of a layer; 256 by default).
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "lfu" => Ok(Self::Lfu {
                half_life: DEFAULT_LFU_HALF_LIFE,
            }),
            other => match other.strip_prefix("lfu:").map(|h| h.parse::<f64>()) {
                Some(Ok(h)) if h > 0.0 && h.is_finite() => Ok(Self::Lfu { half_life: h }),
                _ => Err(crate::Error::InvalidConfig {
                    field: "expert_policy".into(),
                    reason: format!(
                        "{:?} is not one of lru, lfu, lfu:HALF_LIFE (a positive number of accesses)",
                        s.trim()
                    ),
                }),
            },
        }
    }
}

/// The half-life of [`ExpertPolicy::Lfu`] given as `lfu`, in accesses of a layer.
pub const DEFAULT_LFU_HALF_LIFE: f64 = 256.0;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn slot_plans_stay_within_the_budget(
            layers in prop::collection::vec(prop::option::of(1u64..4), 0..64),
            budget in 0u64..(1 << 34),
            expert in 1u64..(16 << 20),
            experts in 1usize..256,
        ) {
            // Experts of up to 3 sizes (a K-quant mix), `None` for a dense layer.
            let bytes: Vec<Option<u64>> = layers.iter().map(|m| m.map(|m| m * expert)).collect();
            for plan in [ExpertSlots::Spread, ExpertSlots::Layers] {
                let slots = plan.per_layer(budget, &bytes, experts);
                prop_assert_eq!(slots.len(), bytes.len());
                let used: u64 = slots.iter().zip(&bytes).map(|(&n, b)| n as u64 * b.unwrap_or(0)).sum();
                prop_assert!(used <= budget);
                for (&n, b) in slots.iter().zip(&bytes) {
                    prop_assert!(n <= experts && (b.is_some() || n == 0));
                }
                let all: u64 = bytes.iter().flatten().map(|b| b * experts as u64).sum();
                if budget >= all {
                    // Room for every expert: every sparse layer holds them all.
                    for (&n, b) in slots.iter().zip(&bytes) {
                        prop_assert_eq!(n, if b.is_some() { experts } else { 0 });
                    }
                }
                match plan {
                    ExpertSlots::Spread => {
                        let sparse: Vec<usize> = slots.iter().zip(&bytes)
                            .filter(|(_, b)| b.is_some()).map(|(&n, _)| n).collect();
                        prop_assert!(sparse.windows(2).all(|w| w[0] == w[1]));
                        // One more slot in each would not fit.
                        if let Some(&n) = sparse.first() {
                            let per_slot: u64 = bytes.iter().flatten().sum();
                            prop_assert!(n == experts || (n as u64 + 1) * per_slot > budget);
                        }
                    }
                    ExpertSlots::Layers => {
                        // Whole layers from the last, then at most one partial, none below;
                        // the partial one as full as its room allows.
                        let mut left = budget;
                        let mut short = false;
                        for (&n, b) in slots.iter().zip(&bytes).rev() {
                            let Some(b) = *b else { continue };
                            if short {
                                prop_assert_eq!(n, 0);
                                continue;
                            }
                            if n < experts {
                                prop_assert!((n as u64 + 1) * b > left);
                                short = true;
                            }
                            left -= n as u64 * b;
                        }
                    }
                }
            }
        }

        #[test]
        fn the_split_beats_either_side_alone(
            costs in prop::collection::vec((0.0f64..5.0, 0.0f64..5.0), 0..24),
            busy in prop_oneof![Just(0.0f64), 0.0f64..20.0],
            enqueue in prop_oneof![Just(0.0f64), 0.0f64..2.0],
        ) {
            let fetch = split_missing(&costs, busy, enqueue);
            prop_assert_eq!(fetch.len(), costs.len());
            let span = |f: &[bool]| {
                let cpu: f64 = costs.iter().zip(f).filter(|(_, &x)| !x).map(|(c, _)| c.0).sum();
                let fetched = f.iter().filter(|&&x| x).count() as f64;
                let link: f64 = costs.iter().zip(f).filter(|(_, &x)| x).map(|(c, _)| c.1).sum();
                (cpu + enqueue * fetched).max(busy + link)
            };
            let got = span(&fetch);
            prop_assert!(got <= span(&vec![false; costs.len()]) + 1e-9);
            prop_assert!(got <= span(&vec![true; costs.len()]) + 1e-9);
        }

        #[test]
        fn equal_costs_split_at_the_best_count(
            m in 0usize..40, c in 0.01f64..10.0, f in 0.01f64..10.0, busy in 0.0f64..40.0,
            enqueue in prop_oneof![Just(0.0f64), 0.0f64..12.0],
        ) {
            let fetch = split_missing(&vec![(c, f); m], busy, enqueue);
            let k = fetch.iter().filter(|&&x| x).count();
            let cost = |k: usize| ((m - k) as f64 * c + k as f64 * enqueue).max(busy + k as f64 * f);
            let best = (0..=m).map(cost).fold(f64::INFINITY, f64::min);
            prop_assert!(cost(k) <= best + 1e-9, "k {} costs {} > best {}", k, cost(k), best);
        }
    }

    /// A link already busy with prefetched copies leaves more of the misses to the CPU.
    #[test]
    fn a_busy_link_takes_fewer_misses() {
        let costs = vec![(1.0, 1.0); 8];
        let fetched = |busy: f64| {
            split_missing(&costs, busy, 0.0)
                .iter()
                .filter(|&&f| f)
                .count()
        };
        assert_eq!(fetched(0.0), 4);
        assert_eq!(fetched(2.0), 3);
        assert_eq!(fetched(8.0), 0);
    }

    /// A fetched expert's enqueue on the thread that computes the CPU's share keeps the
    /// experts the CPU does in less than it there (a prompt's few-row experts), and moves
    /// the ones it is slower at.
    #[test]
    fn the_enqueue_keeps_cheap_experts_on_the_cpu() {
        // Four experts the CPU does in 0.05 and four in 1.0; a fetch takes 0.01 of the link
        // and its enqueue 0.1 of the CPU side's thread.
        let costs: Vec<(f64, f64)> = [0.05, 1.0, 0.05, 1.0, 0.05, 1.0, 0.05, 1.0]
            .iter()
            .map(|&c| (c, 0.01))
            .collect();
        let fetch = split_missing(&costs, 0.0, 0.1);
        assert_eq!(fetch, [false, true, false, true, false, true, false, true]);
        // Without the enqueue, the cheap ones go to the link too, all but the last that
        // would make it the slower side.
        let free = split_missing(&costs, 0.0, 0.0);
        assert_eq!(free.iter().filter(|&&f| f).count(), 7);
    }

    #[test]
    fn the_probe_puts_a_miss_on_the_host_after_idle_placements() {
        let mut p = HostRateProbe::new(3);
        let mut placed = Vec::new();
        for _ in 0..9 {
            let mut fetch = vec![true; 4];
            p.place(&mut fetch);
            placed.push(fetch.iter().filter(|&&f| !f).count());
        }
        assert_eq!(placed, [0, 0, 0, 1, 0, 0, 0, 1, 0]);
        // Host work of the split's own resets the count; empty placements do not count.
        let mut p = HostRateProbe::new(1);
        p.place(&mut [true, true]);
        p.place(&mut []);
        let mut split = [true, false];
        p.place(&mut split);
        assert_eq!(split, [true, false]);
        let mut all = [true, true];
        p.place(&mut all);
        assert_eq!(all, [true, true]);
        p.place(&mut all);
        assert_eq!(all, [true, false]);
    }

    #[test]
    fn lookup_and_admit_make_an_access() {
        let mut a = ExpertCache::new(ExpertPolicy::Lru, 8, &[2]);
        let mut b = a.clone();
        for e in [1, 2, 1, 3, 4, 1] {
            let got = if b.lookup(0, e) {
                ExpertAccess::Hit
            } else {
                ExpertAccess::Miss {
                    evicted: b.admit(0, e, &[]).flatten(),
                }
            };
            assert_eq!(a.access(0, e), got);
        }
        assert_eq!(a.counters(0), b.counters(0));
        // A miss served elsewhere takes no slot.
        assert!(!b.lookup(0, 7));
        assert!(!b.contains(0, 7));
        assert_eq!(b.admit(0, 1, &[]), None, "already resident");
        // A protected resident is never the victim; all protected, nothing is admitted.
        let mut c = ExpertCache::new(ExpertPolicy::Lru, 8, &[2]);
        c.access(0, 1);
        c.access(0, 2);
        assert_eq!(c.admit(0, 3, &[1]), Some(Some(2)));
        assert_eq!(c.admit(0, 4, &[1, 3]), None);
        assert!(c.contains(0, 1) && c.contains(0, 3) && !c.contains(0, 4));
    }

    #[test]
    fn lru_evicts_the_least_recent() {
        let mut c = ExpertCache::new(ExpertPolicy::Lru, 8, &[2]);
        assert_eq!(c.access(0, 1), ExpertAccess::Miss { evicted: None });
        assert_eq!(c.access(0, 2), ExpertAccess::Miss { evicted: None });
        assert_eq!(c.access(0, 1), ExpertAccess::Hit);
        assert_eq!(c.access(0, 3), ExpertAccess::Miss { evicted: Some(2) });
        assert_eq!(
            c.counters(0),
            LayerCounters {
                hits: 1,
                misses: 3,
                evictions: 1
            }
        );
        assert!((c.counters(0).hit_rate() - 0.25).abs() < 1e-12);
    }

    #[test]
    fn lfu_keeps_the_popular_and_forgets_with_age() {
        let mut c = ExpertCache::new(ExpertPolicy::Lfu { half_life: 1e9 }, 8, &[2]);
        for _ in 0..5 {
            c.access(0, 0);
        }
        c.access(0, 1);
        // 1 is used once, 0 five times: the newcomer replaces 1, not 0.
        assert_eq!(c.access(0, 2), ExpertAccess::Miss { evicted: Some(1) });
        assert!(c.contains(0, 0));
        // With a short half-life, old popularity fades: 0's five uses long ago weigh less
        // than 3's two recent ones.
        let mut c = ExpertCache::new(ExpertPolicy::Lfu { half_life: 2.0 }, 8, &[2]);
        for _ in 0..5 {
            c.access(0, 0);
        }
        for _ in 0..20 {
            c.access(0, 3);
        }
        c.access(0, 4);
        assert!(!c.contains(0, 0));
    }

    #[test]
    fn layers_without_slots_admit_nothing() {
        let mut c = ExpertCache::new(ExpertPolicy::Lru, 4, &[0, 9]);
        assert_eq!(c.slots(1), 4);
        assert_eq!(c.access(0, 1), ExpertAccess::Miss { evicted: None });
        assert_eq!(c.access(0, 1), ExpertAccess::Miss { evicted: None });
        assert!(c.resident(0).is_empty());
        assert_eq!(c.access(5, 1), ExpertAccess::Miss { evicted: None });
        assert_eq!(c.access(1, 7), ExpertAccess::Miss { evicted: None });
        assert!(c.resident(1).is_empty());
        assert!(!c.all_resident(0) && !c.all_resident(1) && !c.all_resident(5));
        for e in 0..4 {
            c.access(1, e);
        }
        assert!(c.all_resident(1) && !c.all_resident(0));
    }

    #[test]
    fn slots_follow_the_budget() {
        // 4 GiB left for 48 layers of 3 MiB experts: 28 per layer.
        assert_eq!(slots_for_budget(4 << 30, 3 << 20, 48, 128), 28);
        assert_eq!(slots_for_budget(u64::MAX, 3 << 20, 48, 128), 128);
        assert_eq!(slots_for_budget(0, 3 << 20, 48, 128), 0);
    }

    #[test]
    fn whole_layers_fill_from_the_last() {
        // Room for 2.5 layers of 4 experts; layer 2 is dense.
        let mib = Some(1 << 20);
        let bytes = [mib, mib, None, mib, mib];
        assert_eq!(
            ExpertSlots::Layers.per_layer(10 << 20, &bytes, 4),
            vec![0, 2, 0, 4, 4]
        );
        assert_eq!(
            ExpertSlots::Spread.per_layer(10 << 20, &bytes, 4),
            vec![2, 2, 0, 2, 2]
        );
        assert_eq!(
            ExpertSlots::Layers.per_layer(u64::MAX, &bytes, 4),
            vec![4, 4, 0, 4, 4]
        );
    }

    #[test]
    fn slots_follow_each_layers_expert_size() {
        // A K-quant mix: layers 0 and 3 store their experts in 1.5 MiB, the others in 1 MiB;
        // 4 experts a layer, 20 MiB in all, and exactly that much room.
        let (small, big) = (Some(1 << 20), Some(3 << 19));
        let bytes = [big, small, small, big];
        for plan in [ExpertSlots::Spread, ExpertSlots::Layers] {
            assert_eq!(plan.per_layer(20 << 20, &bytes, 4), vec![4; 4], "{plan}");
        }
        // 10 MiB: 2 in each (2 x 5 MiB), or the last layer (6 MiB) and 4 of 1 MiB.
        assert_eq!(
            ExpertSlots::Spread.per_layer(10 << 20, &bytes, 4),
            vec![2; 4]
        );
        assert_eq!(
            ExpertSlots::Layers.per_layer(10 << 20, &bytes, 4),
            vec![0, 0, 4, 4]
        );
    }

    /// An H200 host: the CPU reads ~60 GB/s and computes ~1 TFLOP/s; the link moves ~25 GB/s;
    /// the GPU reads ~4 TB/s and computes ~400 TFLOP/s. A Qwen3-30B-A3B expert in Q8_0: 3
    /// matrices of 2048 x 768, 1.0625 bytes a weight, 2 FLOPs a weight per token.
    #[test]
    fn one_token_stays_on_the_cpu_a_prompt_fetches() {
        let r = ExpertRates {
            cpu_read: 60e9,
            cpu_flops: 1e12,
            link: 25e9,
            gpu_read: 4e12,
            gpu_flops: 400e12,
        };
        let weights = 3.0 * 2048.0 * 768.0;
        let bytes = (weights * 1.0625) as u64;
        let flops = 2.0 * weights;
        assert_eq!(place_missing_expert(bytes, flops, 1, &r), ExpertPlace::Cpu);
        assert_eq!(
            place_missing_expert(bytes, flops, 32, &r),
            ExpertPlace::Fetch
        );
        let (cpu, gpu) = missing_expert_seconds(bytes, flops, 1, &r);
        assert!((cpu - bytes as f64 / 60e9).abs() < 1e-12);
        assert!((gpu - (bytes as f64 / 25e9 + bytes as f64 / 4e12)).abs() < 1e-12);
        // A slow link keeps even a prompt's experts on the CPU.
        let slow = ExpertRates { link: 1e9, ..r };
        assert_eq!(
            place_missing_expert(bytes, flops, 32, &slow),
            ExpertPlace::Cpu
        );
    }

    /// A reference LRU: a list, most recent last.
    fn reference_lru(slots: usize, trace: &[usize]) -> Vec<ExpertAccess> {
        let mut list: Vec<usize> = Vec::new();
        trace
            .iter()
            .map(|&e| {
                if let Some(i) = list.iter().position(|&x| x == e) {
                    list.remove(i);
                    list.push(e);
                    return ExpertAccess::Hit;
                }
                let evicted = (list.len() >= slots).then(|| list.remove(0));
                list.push(e);
                ExpertAccess::Miss { evicted }
            })
            .collect()
    }

    /// The device first, then the host (a step past the switch each), then the faster of the
    /// two with a two-step probe of the other every ROUTE_PROBE_STEPS steps; the faster one
    /// follows the measurements.
    #[test]
    fn the_chooser_takes_the_faster_route_and_probes_the_other() {
        let mut c = RouteChooser::default();
        assert!(c.choose());
        c.record(true, 0.015);
        assert!(!c.choose());
        assert!(!c.choose());
        c.record(false, 0.010);
        // The host's is faster: kept, but for a probe of two steps.
        let picks: Vec<bool> = (0..ROUTE_PROBE_STEPS + 3).map(|_| c.choose()).collect();
        assert_eq!(picks.iter().filter(|&&p| p).count(), 2, "{picks:?}");
        assert!(picks[ROUTE_PROBE_STEPS as usize] && picks[ROUTE_PROBE_STEPS as usize + 1]);
        // The device's steps get faster (the cache warmed): the device from now on.
        for _ in 0..8 {
            c.record(true, 0.006);
        }
        assert!(c.estimate(true).unwrap() < 0.010);
        assert!((0..10).all(|_| c.choose()));
        // An idle gap is no step time.
        let before = c.estimate(true);
        c.record(true, 5.0);
        assert_eq!(c.estimate(true), before);
        c.record(true, f64::NAN);
        assert_eq!(c.estimate(true), before);
    }

    /// A route that stays far behind is probed ever more rarely, up to the longest spacing; one
    /// that comes close is probed at the least spacing again.
    #[test]
    fn probes_of_a_far_slower_route_back_off() {
        let mut c = RouteChooser::default();
        c.record(true, 0.030);
        c.record(false, 0.010);
        let slow = |c: &mut RouteChooser, n: usize| (0..n).filter(|_| c.choose()).count();
        // Probes (two steps each) after 64, 128, 256, 512 and 1024 steps, then every 1024.
        let n = [64, 128, 256, 512, 1024, 1024].iter().map(|s| s + 2).sum();
        assert_eq!(slow(&mut c, n), 2 * 6);
        assert_eq!(c.probe_every, ROUTE_PROBE_MAX_STEPS);
        // The device comes within 1.5x: after its next probe, every 64 steps again.
        for _ in 0..ROUTE_TIME_WINDOW {
            c.record(true, 0.012);
        }
        slow(&mut c, 1030);
        assert_eq!(c.probe_every, ROUTE_PROBE_STEPS);
        assert_eq!(slow(&mut c, 10 * 66), 2 * 10);
    }

    proptest! {
        /// Once both routes are measured, the chooser spends at most a probe's two steps in
        /// every ROUTE_PROBE_STEPS + 3 on the slower one.
        #[test]
        fn the_chooser_spends_little_on_the_slower_route(host in 1e-3f64..1.0, device in 1e-3f64..1.0, n in 0usize..500) {
            let mut c = RouteChooser::default();
            c.record(true, device);
            c.record(false, host);
            let faster = device <= host;
            let slow = (0..n).filter(|_| c.choose() != faster).count();
            prop_assert!(slow as u64 <= 2 * (n as u64 / (ROUTE_PROBE_STEPS + 1) + 1));
        }

        /// An expert is admitted exactly when it missed before within its layer's window of
        /// remembered misses (counted since that miss, admitted ones forgotten), as a direct
        /// replay of the trace computes it.
        #[test]
        fn repeat_misses_admit_the_second_miss_within_the_window(
            window in 0usize..5,
            trace in prop::collection::vec((0usize..2, 0usize..8), 0..200),
        ) {
            let mut r = RepeatMisses::new(&[window, window + 1]);
            let mut kept: Vec<Vec<usize>> = vec![Vec::new(), Vec::new()];
            for &(l, e) in &trace {
                let w = if l == 0 { window } else { window + 1 };
                let want = match kept[l].iter().position(|&x| x == e) {
                    Some(i) => { kept[l].remove(i); true }
                    None => {
                        if w > 0 {
                            if kept[l].len() == w { kept[l].remove(0); }
                            kept[l].push(e);
                        }
                        false
                    }
                };
                prop_assert_eq!(r.missed(l, e), want);
            }
            prop_assert!(!r.missed(7, 0), "a layer past the last admits nothing");
        }

        /// Device steps that vary with their misses (6 to 14 ms, every tenth a spike of
        /// twice that) against host steps of 16 to 18 ms: once both routes are measured, the
        /// chooser leaves the faster route only for its probes.
        #[test]
        fn the_chooser_holds_its_route_through_noisy_steps(
            seed in any::<u64>(),
            n in 0usize..400,
        ) {
            let mut rng = seed | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut c = RouteChooser::default();
            for _ in 0..ROUTE_TIME_WINDOW {
                c.record(true, 0.006 + 0.008 * next());
                c.record(false, 0.016 + 0.002 * next());
            }
            let mut slow = 0u64;
            for i in 0..n {
                let on_device = c.choose();
                let t = if on_device {
                    let t = 0.006 + 0.008 * next();
                    if i % 10 == 9 { 2.0 * t } else { t }
                } else {
                    slow += 1;
                    0.016 + 0.002 * next()
                };
                c.record(on_device, t);
            }
            prop_assert!(slow <= 2 * (n as u64 / (ROUTE_PROBE_STEPS + 1) + 1), "{slow} of {n}");
        }

        #[test]
        fn lru_equals_the_reference(slots in 1usize..6, trace in prop::collection::vec(0usize..10, 0..200)) {
            let mut c = ExpertCache::new(ExpertPolicy::Lru, 10, &[slots]);
            let got: Vec<_> = trace.iter().map(|&e| c.access(0, e)).collect();
            prop_assert_eq!(got, reference_lru(slots, &trace));
        }

        #[test]
        fn never_over_capacity_and_counters_add_up(
            lfu in any::<bool>(),
            half_life in 1.0f64..100.0,
            slots in prop::collection::vec(0usize..5, 1..4),
            trace in prop::collection::vec((0usize..4, 0usize..12), 0..300),
        ) {
            let policy = if lfu { ExpertPolicy::Lfu { half_life } } else { ExpertPolicy::Lru };
            let mut c = ExpertCache::new(policy, 12, &slots);
            let mut seen = vec![0u64; slots.len()];
            for &(l, e) in &trace {
                let before = c.contains(l, e);
                let a = c.access(l, e);
                prop_assert_eq!(before, a == ExpertAccess::Hit);
                if l < slots.len() {
                    seen[l] += 1;
                    prop_assert!(c.resident(l).len() <= slots[l]);
                    prop_assert_eq!(c.contains(l, e), slots[l] > 0);
                    if let ExpertAccess::Miss { evicted: Some(v) } = a {
                        prop_assert!(!c.contains(l, v));
                    }
                }
            }
            for (l, &n) in seen.iter().enumerate() {
                let k = c.counters(l);
                prop_assert_eq!(k.hits + k.misses, n);
                prop_assert!(k.evictions <= k.misses);
                prop_assert_eq!(k.misses - k.evictions, c.resident(l).len() as u64 + if slots[l] == 0 { k.misses } else { 0 });
            }
        }

        /// Without ageing, LFU evicts a resident used least often (counted since admitted).
        #[test]
        fn lfu_without_ageing_evicts_a_least_used(slots in 1usize..5, trace in prop::collection::vec(0usize..8, 0..200)) {
            let mut c = ExpertCache::new(ExpertPolicy::Lfu { half_life: 1e12 }, 8, &[slots]);
            let mut uses = [0u64; 8];
            for &e in &trace {
                let counts: Vec<(usize, u64)> = c.resident(0).iter().map(|&r| (r, uses[r])).collect();
                match c.access(0, e) {
                    ExpertAccess::Miss { evicted: Some(v) } => {
                        let least = counts.iter().map(|c| c.1).min().unwrap();
                        prop_assert_eq!(uses[v], least);
                        uses[v] = 0;
                        uses[e] = 1;
                    }
                    ExpertAccess::Miss { evicted: None } => uses[e] = 1,
                    ExpertAccess::Hit => uses[e] += 1,
                }
            }
        }
    }
}
