//! Where a model's decoder layers run when they do not all fit its device: some on the host CPU
//! in front of it (the first ones, or spread evenly between the device's), the output head on
//! either, the rest on the device. Pure: the sizes and the measured rates come in, the split
//! goes out. The model crate measures (a layer's decode step on the host and on the device, the
//! link's copies), sizes its units and reservations, and builds the stages this decides.

use std::fmt;
use std::str::FromStr;

use super::{
    host_layer_split, spread_host_choice, spread_host_prices, spread_host_set, SplitPrice,
    SplitRates,
};

/// How many decoder layers run on the host CPU in front of a GPU (llama.cpp's `-ngl` split):
/// the first layers and the embeddings run on the CPU from their host memory, the rest, the
/// final norm and the output head on the GPU. Decode reads each host layer's weights at the
/// host's memory bandwidth instead of streaming them over PCIe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HostLayers {
    /// None: layers that do not fit the budget are streamed to the GPU (an embedding table of
    /// the model's own then stays on the host).
    #[default]
    None,
    /// This many (0 to the number of layers).
    Count(usize),
    /// The fewest that let the GPU hold the others resident, so that nothing streams
    /// ([`auto_split`]).
    Auto,
    /// This many, spread evenly over the layers instead of the first ones (`spread:N`): while
    /// the CPU runs a host layer, the GPU's copy stream brings the next streamed layer, so
    /// that host compute and PCIe transfers overlap when both are needed (a model too large
    /// for the budget even with the host's share of it).
    Spread(usize),
    /// Spread, with the count chosen so that the layers' compute and the link's copies
    /// balance (`spread:auto`, [`spread_auto_split`]): priced over the layers' bytes, one
    /// layer's step timed on the host and on the GPU ([`LayerSteps`]) and the link's rate
    /// measured; none when the model fits the budget, and none on a CPU device. It also weighs
    /// putting the output head (with the final norm) on the host, as llama.cpp's `-ngl` below
    /// the layer count + 1 does: the host then reads the head's bytes every step and the GPU
    /// has their room for layers.
    SpreadAuto,
    /// [`Spread`](Self::Spread) with the output head and the final norm on the host too
    /// (`spread:N+head`); for models with a head of their own (not tied to the embeddings).
    SpreadWithHead(usize),
}

impl FromStr for HostLayers {
    type Err = String;

    /// `auto`, `none`, a count, or `spread:` and a count or `auto`; `spread:N+head` also puts
    /// the output head on the host.
    fn from_str(s: &str) -> Result<Self, String> {
        let count = |n: &str| {
            n.trim().parse::<usize>().map_err(|_| {
                format!("{s:?} is not a layer count, `spread:` and a count, `auto` or `none`")
            })
        };
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "spread:auto" => Ok(Self::SpreadAuto),
            t => match t.strip_prefix("spread:") {
                Some(n) => match n.trim().strip_suffix("+head") {
                    Some(n) => count(n).map(Self::SpreadWithHead),
                    None => count(n).map(Self::Spread),
                },
                None => count(t).map(Self::Count),
            },
        }
    }
}

impl HostLayers {
    /// Which of `n` layers run on the host when `h` do: the first `h`, or for
    /// [`Spread`](Self::Spread) and [`SpreadAuto`](Self::SpreadAuto) `h` evenly apart
    /// ([`spread_host_set`]).
    pub fn host_set(&self, h: usize, n: usize) -> Vec<bool> {
        match self {
            Self::Spread(_) | Self::SpreadAuto | Self::SpreadWithHead(_) => spread_host_set(h, n),
            _ => (0..n).map(|l| l < h.min(n)).collect(),
        }
    }
}

/// One decoder layer's decode step, timed on the host CPU and on the GPU: what
/// [`HostLayers::SpreadAuto`] weighs against the link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerSteps {
    /// Seconds on the host CPU.
    pub host_s: f64,
    /// Seconds on the GPU.
    pub device_s: f64,
}

/// Where a split puts the work: host layers, and whether the head goes too.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostSplit {
    /// Decoder layers on the host (placed by [`HostLayers::host_set`]).
    pub layers: usize,
    /// The output head and the final norm run on the host.
    pub head_on_host: bool,
    /// What [`HostLayers::SpreadAuto`] timed (`None` where it timed nothing).
    pub steps: Option<LayerSteps>,
    /// Every split [`HostLayers::SpreadAuto`] weighed, priced (empty where it weighed none).
    pub prices: Vec<SplitPrice>,
}

impl HostSplit {
    /// `layers` on the host, the head on the device, nothing timed or priced.
    pub fn layers(layers: usize) -> Self {
        Self {
            layers,
            ..Self::default()
        }
    }
}

/// Why no split can be made.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SplitError {
    /// More host layers asked for than the model has.
    TooManyLayers {
        /// Host layers asked for.
        asked: usize,
        /// The model's layers.
        layers: usize,
    },
    /// `+head` for a model whose output head is its embedding matrix (tied).
    TiedHead,
    /// What the device holds whatever the split ([`SplitSizes::fixed`]) passes its budget.
    TooSmall {
        /// Bytes the device holds whatever the split.
        fixed: u64,
        /// The device's budget.
        budget: u64,
    },
}

impl fmt::Display for SplitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooManyLayers { asked, layers } => {
                write!(f, "{asked} host layers, but the model has {layers} layers")
            }
            Self::TiedHead => f.write_str(
                "`+head`: this model's output head is its embedding matrix (tied), which the \
                 GPU keeps",
            ),
            Self::TooSmall { fixed, budget } => write!(
                f,
                "the output head, final norm and reservation take {} MiB, more than the GPU \
                 budget ({} MiB)",
                fixed >> 20,
                budget >> 20
            ),
        }
    }
}

impl std::error::Error for SplitError {}

/// The split a choice names before anything is sized: `Some` for [`HostLayers::None`], a count
/// (checked against the model's `layers`) and `spread:N+head` (which needs a head of the model's
/// own, `own_head`); `None` for [`HostLayers::Auto`] and [`HostLayers::SpreadAuto`], which size
/// the split ([`auto_split`], [`spread_auto_split`]). Pure.
pub fn fixed_split(
    host: HostLayers,
    layers: usize,
    own_head: bool,
) -> Result<Option<HostSplit>, SplitError> {
    match host {
        HostLayers::None => Ok(Some(HostSplit::default())),
        HostLayers::Count(h) | HostLayers::Spread(h) | HostLayers::SpreadWithHead(h)
            if h > layers =>
        {
            Err(SplitError::TooManyLayers { asked: h, layers })
        }
        HostLayers::SpreadWithHead(_) if !own_head => Err(SplitError::TiedHead),
        HostLayers::SpreadWithHead(h) => Ok(Some(HostSplit {
            head_on_host: true,
            ..HostSplit::layers(h)
        })),
        HostLayers::Count(h) | HostLayers::Spread(h) => Ok(Some(HostSplit::layers(h))),
        HostLayers::Auto | HostLayers::SpreadAuto => Ok(None),
    }
}

/// The layers' KV caches a device stage behind host layers reserves beyond its own: a host
/// layer's cache passes through it while a prompt runs there (its copy and the new buffer).
pub const PASS_THROUGH_LAYERS: usize = 2;

/// The bytes a host split is planned with, for one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSizes {
    /// Each decoder layer's bytes on the device, in order (what the host reads a step where it
    /// runs the layer).
    pub layers: Vec<u64>,
    /// What the device keeps besides: the final norm and the output head (with tied
    /// embeddings, the embedding matrix, which is the head).
    pub kept: u64,
    /// The output head's bytes where it is the model's own (0 when tied), which the host may
    /// take instead; counted in `kept`.
    pub head: u64,
    /// The device's reservation that does not grow with its layers (activations, workspaces,
    /// the caller's extra room).
    pub reserve: u64,
    /// The reservation each device layer adds (its KV cache).
    pub kv_per_layer: u64,
    /// The device's budget.
    pub budget: u64,
    /// Streaming slots: the prefetch depth + 1.
    pub slots: usize,
}

impl SplitSizes {
    /// What the device holds whatever the split: its reservation, [`PASS_THROUGH_LAYERS`]
    /// layers' KV cache and the kept units.
    pub fn fixed(&self) -> u64 {
        self.reserve + PASS_THROUGH_LAYERS as u64 * self.kv_per_layer + self.kept
    }
}

/// What [`HostLayers::SpreadAuto`] measured on this machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpreadMeasures {
    /// One layer's decode step on the host and on the device (an eager step there).
    pub steps: LayerSteps,
    /// The link's host-to-device rate, bytes a second.
    pub link_bytes_per_s: f64,
    /// A split that streams nothing replays its decode step from a CUDA graph
    /// ([`crate::Tuning::graphs`]), faster than the eager step timed.
    pub graphs: bool,
}

/// A device layer's decode step replayed from a CUDA graph, over the same step run eagerly (what
/// [`LayerSteps::device_s`] times), for [`HostLayers::SpreadAuto`] to price splits that stream
/// nothing (measured: docs/tuning.md).
pub const GRAPH_REPLAY_FRACTION: f64 = 0.6;

/// The rates a spread split is priced at, from what was measured: the host reads the first
/// layer's bytes in [`LayerSteps::host_s`]; a device layer takes [`LayerSteps::device_s`] where
/// the split streams and, replayed from a graph, [`GRAPH_REPLAY_FRACTION`] of it where it
/// streams nothing. Pure.
pub fn spread_rates(sizes: &SplitSizes, measured: &SpreadMeasures) -> SplitRates {
    let LayerSteps { host_s, device_s } = measured.steps;
    let first = sizes.layers.first().copied().unwrap_or(0);
    SplitRates {
        host_bytes_per_s: first as f64 / host_s,
        link_bytes_per_s: measured.link_bytes_per_s,
        device_layer_s: device_s,
        resident_device_layer_s: if measured.graphs {
            device_s * GRAPH_REPLAY_FRACTION
        } else {
            device_s
        },
    }
}

/// [`HostLayers::Auto`]: the fewest first layers on the host that let the device hold the
/// others resident beside [`SplitSizes::fixed`] ([`host_layer_split`]). Pure.
pub fn auto_split(sizes: &SplitSizes) -> Result<HostSplit, SplitError> {
    let fixed = sizes.fixed();
    host_layer_split(&sizes.layers, fixed, sizes.kv_per_layer, sizes.budget)
        .map(HostSplit::layers)
        .ok_or(SplitError::TooSmall {
            fixed,
            budget: sizes.budget,
        })
}

/// [`HostLayers::SpreadAuto`]: every spread split the budget holds, priced at
/// [`spread_rates`] ([`spread_host_prices`]), and the one chosen ([`spread_host_choice`]: none
/// where every layer fits the device, otherwise the cheapest), with the head on the host where
/// that is cheaper. Pure.
pub fn spread_auto_split(
    sizes: &SplitSizes,
    measured: &SpreadMeasures,
) -> Result<HostSplit, SplitError> {
    let fixed = sizes.fixed();
    let rates = spread_rates(sizes, measured);
    let prices = spread_host_prices(
        &sizes.layers,
        fixed,
        sizes.head,
        sizes.kv_per_layer,
        sizes.budget,
        sizes.slots,
        &rates,
    );
    let (layers, head_on_host) = spread_host_choice(&prices).ok_or(SplitError::TooSmall {
        fixed,
        budget: sizes.budget,
    })?;
    Ok(HostSplit {
        layers,
        head_on_host,
        steps: Some(measured.steps),
        prices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::spread_host_split_at;
    use proptest::prelude::*;

    #[test]
    fn host_layers_parse_and_place() {
        assert_eq!("spread:3".parse::<HostLayers>(), Ok(HostLayers::Spread(3)));
        assert_eq!(" 3 ".parse::<HostLayers>(), Ok(HostLayers::Count(3)));
        assert_eq!("auto".parse::<HostLayers>(), Ok(HostLayers::Auto));
        assert_eq!(
            "spread:auto".parse::<HostLayers>(),
            Ok(HostLayers::SpreadAuto)
        );
        assert_eq!(
            "spread:2+head".parse::<HostLayers>(),
            Ok(HostLayers::SpreadWithHead(2))
        );
        let e = "spread:x".parse::<HostLayers>().unwrap_err();
        assert!(e.contains("spread:x"), "{e}");
        let e = "spread:x+head".parse::<HostLayers>().unwrap_err();
        assert!(e.contains("spread:x+head"), "{e}");
        let on = |v: Vec<bool>| -> Vec<usize> { (0..v.len()).filter(|&l| v[l]).collect() };
        assert_eq!(on(HostLayers::Count(3).host_set(3, 8)), [0, 1, 2]);
        assert_eq!(on(HostLayers::Spread(4).host_set(4, 8)), [1, 3, 5, 7]);
        assert_eq!(
            on(HostLayers::SpreadWithHead(4).host_set(4, 8)),
            [1, 3, 5, 7]
        );
        assert_eq!(on(HostLayers::SpreadAuto.host_set(4, 8)), [1, 3, 5, 7]);
        assert_eq!(on(HostLayers::Spread(3).host_set(3, 8)), [2, 5, 7]);
        assert_eq!(on(HostLayers::Spread(8).host_set(8, 8)).len(), 8);
        assert!(on(HostLayers::Spread(0).host_set(0, 8)).is_empty());
    }

    #[test]
    fn fixed_choices_are_checked_against_the_model() {
        assert_eq!(
            fixed_split(HostLayers::None, 4, true),
            Ok(Some(HostSplit::default()))
        );
        assert_eq!(
            fixed_split(HostLayers::Count(5), 4, true),
            Err(SplitError::TooManyLayers {
                asked: 5,
                layers: 4
            })
        );
        // Too many is named before a tied head.
        assert_eq!(
            fixed_split(HostLayers::SpreadWithHead(5), 4, false),
            Err(SplitError::TooManyLayers {
                asked: 5,
                layers: 4
            })
        );
        assert_eq!(
            fixed_split(HostLayers::SpreadWithHead(2), 4, false),
            Err(SplitError::TiedHead)
        );
        let head = fixed_split(HostLayers::SpreadWithHead(2), 4, true).unwrap();
        assert_eq!(head.map(|s| (s.layers, s.head_on_host)), Some((2, true)));
        assert_eq!(fixed_split(HostLayers::SpreadAuto, 4, true), Ok(None));
        assert_eq!(fixed_split(HostLayers::Auto, 4, false), Ok(None));
        let e = SplitError::TooSmall {
            fixed: 3 << 20,
            budget: 2 << 20,
        };
        assert_eq!(
            e.to_string(),
            "the output head, final norm and reservation take 3 MiB, more than the GPU budget \
             (2 MiB)"
        );
    }

    /// The 7B Q4_K_M shape at 4 GiB, prompt 512, as `plan`'s tests price it (32 layers of 118
    /// MiB, a 103 MiB head, 8.5 MiB of KV cache a layer, 300 MiB of reservation), measured as
    /// `spread:auto` measures (a host layer's step 2.1 ms, an eager device layer 0.194 ms, a
    /// 70 GB/s link): with graphs the resident splits are priced at the replay's share and the
    /// split streams nothing; without, the eager rate prices every split.
    #[test]
    fn measured_rates_price_the_7b_split() {
        let mib = 1u64 << 20;
        let sizes = SplitSizes {
            layers: vec![118 * mib; 32],
            kept: 103 * mib,
            head: 103 * mib,
            reserve: 300 * mib,
            kv_per_layer: 8 * mib + mib / 2,
            budget: 4096 * mib,
            slots: 3,
        };
        let steps = LayerSteps {
            host_s: 2.1e-3,
            device_s: 0.194e-3,
        };
        let measured = |graphs| SpreadMeasures {
            steps,
            link_bytes_per_s: 70e9,
            graphs,
        };
        let direct = |resident: f64| {
            let rates = SplitRates {
                host_bytes_per_s: 118.0 * mib as f64 / 2.1e-3,
                link_bytes_per_s: 70e9,
                device_layer_s: 0.194e-3,
                resident_device_layer_s: resident,
            };
            spread_host_split_at(
                &sizes.layers,
                sizes.fixed(),
                sizes.head,
                sizes.kv_per_layer,
                sizes.budget,
                3,
                &rates,
            )
        };
        for graphs in [false, true] {
            let split = spread_auto_split(&sizes, &measured(graphs)).unwrap();
            let resident = if graphs { 0.6 * 0.194e-3 } else { 0.194e-3 };
            assert_eq!(
                Some((split.layers, split.head_on_host)),
                direct(resident),
                "graphs {graphs}"
            );
            assert_eq!(split.steps, Some(steps));
            let chosen = split
                .prices
                .iter()
                .find(|p| (p.host_layers, p.host_head) == (split.layers, split.head_on_host))
                .expect("the chosen split is priced");
            // Replayed from graphs, the chosen split holds every layer it runs.
            assert_eq!(chosen.streamed_bytes == 0, graphs, "{chosen:?}");
        }
    }

    fn sizes() -> impl Strategy<Value = SplitSizes> {
        (
            proptest::collection::vec(1u64..50, 0..12),
            0u64..30,
            0u64..20,
            0u64..40,
            0u64..5,
            0u64..400,
            1usize..4,
        )
            .prop_map(
                |(layers, kept, head, reserve, kv_per_layer, budget, slots)| SplitSizes {
                    layers,
                    kept: kept + head,
                    head,
                    reserve,
                    kv_per_layer,
                    budget,
                    slots,
                },
            )
    }

    proptest! {
        /// `Auto` takes the fewest first layers whose removal lets the device hold the rest
        /// beside what it holds anyway, and refuses exactly where that alone passes the budget.
        #[test]
        fn auto_takes_the_fewest_that_fit(s in sizes()) {
            let n = s.layers.len();
            let need = |h: usize| {
                s.fixed()
                    + s.layers[h..].iter().sum::<u64>()
                    + s.kv_per_layer * (n - h) as u64
            };
            match auto_split(&s) {
                Err(e) => {
                    prop_assert!(s.fixed() > s.budget);
                    prop_assert_eq!(e, SplitError::TooSmall { fixed: s.fixed(), budget: s.budget });
                }
                Ok(split) => {
                    prop_assert!(need(split.layers) <= s.budget);
                    prop_assert!(split.layers == 0 || need(split.layers - 1) > s.budget);
                    prop_assert!(!split.head_on_host && split.prices.is_empty());
                }
            }
        }

        /// `SpreadAuto` prices at the measured rates: it chooses what the priced list chooses,
        /// never the head on the host without a head of the model's own, with no host layer
        /// where every layer fits; and it refuses exactly where nothing fits.
        #[test]
        fn spread_auto_chooses_from_its_prices(
            s in sizes(),
            host_s in 1e-4f64..1e-2,
            device_s in 0.0f64..1e-2,
            link in 1.0f64..100.0,
            graphs in any::<bool>(),
        ) {
            let m = SpreadMeasures {
                steps: LayerSteps { host_s, device_s },
                link_bytes_per_s: link,
                graphs,
            };
            let rates = spread_rates(&s, &m);
            let want = if graphs { device_s * GRAPH_REPLAY_FRACTION } else { device_s };
            prop_assert_eq!(rates.resident_device_layer_s, want);
            match spread_auto_split(&s, &m) {
                Err(_) => prop_assert!(s.fixed() > s.budget),
                Ok(split) => {
                    prop_assert_eq!(
                        Some((split.layers, split.head_on_host)),
                        spread_host_choice(&split.prices)
                    );
                    prop_assert!(s.head > 0 || !split.head_on_host);
                    let all = s.fixed()
                        + s.layers.iter().sum::<u64>()
                        + s.kv_per_layer * s.layers.len() as u64;
                    if all <= s.budget {
                        prop_assert_eq!((split.layers, split.head_on_host), (0, false));
                    }
                    prop_assert_eq!(split.steps, Some(m.steps));
                }
            }
        }
    }
}
