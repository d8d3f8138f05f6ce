//! The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router (a linear layer to one
//! logit per expert), softmax, the top-k experts of each token with optional renormalisation
//! of their weights, each routed token through its experts' gated MLPs, and the weighted sum.
//!
//! The experts are either built with the layer (their weights in the layer's unit: fused
//! stacks of all experts, or a grouping that does not split them off) or units of their own,
//! acquired through [`ExpertUnits`] only when a token is routed to them: the unit a
//! residency policy caches one by one. Routing is a pure function ([`route_row`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};

use candle_core::quantized::{QMatMul, QTensor};
use candle_offload::kernels::linear::cpu_experts::{kquant_batch, Rows};
use candle_offload::kernels::linear::cpu_quant::KQUANT_MAX_ROWS;
use candle_offload::kernels::linear::{
    combine_rows, qexperts_row, qexperts_row_fits, qexperts_rows, qexperts_rows_fits, ExpertTable,
    QExpert, QExpertRows, RoutedShape, NO_SLOT,
};

mod routing;

pub use routing::{group_by_expert, route_row, route_rows, Routing, ROUTE_CHUNK_ROWS};

use super::linear::{Linear, LinearWeight};
use super::mlp::{Activation, GateUp, GatedMlp};
use crate::family::{StepCtx, UnitWeights};

/// An expert acquired for a step: its MLP and the guard that keeps its unit acquired.
#[derive(Debug)]
pub struct Expert {
    /// The expert's gated MLP.
    pub mlp: Arc<GatedMlp>,
    /// The unit's guard (`None`: the expert lives in the layer's unit).
    pub guard: Option<candle_offload::UnitGuard>,
}

/// Builds an expert's MLP from its unit's weights (rooted at the expert's prefix).
pub type BuildExpert<'a> = &'a dyn Fn(UnitWeights<'_>) -> Result<GatedMlp>;

/// Where a block finds the experts that are units of their own
/// ([`Layout::experts`](crate::Layout::experts)): a model's forward pass acquires each from
/// the runtime of the stage running the layer, builds it once per residency, and hands it
/// back with its guard. The place where a later runtime decides per expert between the GPU's
/// cache and the host CPU.
pub trait ExpertUnits: Send + Sync {
    /// Expert `expert` of decoder layer `layer`, built with `build` where it is not already.
    fn expert(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert>;

    /// The experts of `layer` a step routes rows to (`(expert, rows)`, in expert order), each
    /// with where it runs this step and, but for [`ExpertSite::Stream`], acquired there: on
    /// the step's device, or on the host CPU where the device's expert cache does not hold it
    /// and the host computes it sooner than a fetch would bring it ([`ExpertSite::Host`]).
    /// The default runs each on the device.
    fn place(
        &self,
        layer: usize,
        routed: &[(usize, usize)],
        build: BuildExpert<'_>,
    ) -> Result<Vec<(Option<Expert>, ExpertSite)>> {
        routed
            .iter()
            .map(|&(e, _)| Ok((Some(self.expert(layer, e, build)?), ExpertSite::Device)))
            .collect()
    }

    /// How many streamed experts the device holds at once: one computing while the next
    /// ones' copies land. Default: one.
    fn stream_depth(&self) -> usize {
        1
    }

    /// An expert [`place`](Self::place) streams: acquired on the device for one use, which
    /// [`streamed`](Self::streamed) ends.
    fn stream(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert> {
        self.expert(layer, expert, build)
    }

    /// `layer`'s router (with its routing), about to run on a step of `rows` rows: the routers
    /// of later layers (each layer, its router and routing, nearest first) whose experts the
    /// units would have guessed from the same rows ([`guessed`](Self::guessed)). The residual
    /// stream changes little from one layer to the next, so a later layer's router applied
    /// to this layer's input guesses its choice. Default: none.
    fn guess_routers(
        &self,
        _layer: usize,
        _router: &Linear,
        _routing: Routing,
        _rows: usize,
    ) -> Vec<(usize, Linear, Routing)> {
        Vec::new()
    }

    /// `layer`'s experts as one of [`guess_routers`](Self::guess_routers)' routers chose them
    /// for the step's row, once the step's own experts are enqueued (so that its own copies go
    /// first): the units may fetch some ahead. Default: nothing.
    fn guessed(&self, _layer: usize, _routes: &[(usize, f32)]) -> Result<()> {
        Ok(())
    }

    /// Whether [`place`](Self::place) may leave experts to the host CPU ([`ExpertSite::Host`]):
    /// a decode step then reads its rows back with the routers' logits. Default: no.
    fn host_computes(&self) -> bool {
        false
    }

    /// A streamed expert's use is enqueued and its guard dropped: the device may let it go.
    fn streamed(&self, _layer: usize, _expert: usize) -> Result<()> {
        Ok(())
    }

    /// The host CPU computed the experts [`place`](Self::place) left there for `layer` in
    /// `seconds` (the rate the next steps' split is priced at).
    fn host_done(&self, _layer: usize, _seconds: f64) {}

    /// A prompt's `experts` streamed experts took the host `seconds` to enqueue (what the
    /// next prompts' split prices a fetched expert at on the host's thread).
    fn stream_done(&self, _experts: usize, _seconds: f64) {}

    /// Whether a decode row `x` of `layer` (experts of `shape`, chosen by `routing`) goes
    /// through its experts as the device chooses them: the units' table, each expert's entry
    /// true for the row (its device slot or its host copy), and the experts' shape, or `None`
    /// for [`place`](Self::place)'s way. The units read the device's choice back later, to
    /// count it and fetch what it missed. Default: `None`.
    fn device_route(
        &self,
        _layer: usize,
        _shape: &ExpertShape,
        _routing: Routing,
        _x: &Tensor,
    ) -> Result<Option<(Arc<ExpertTable>, RoutedShape)>> {
        Ok(None)
    }
}

/// One routed expert of a step: the rows routed to it with their weights, and the expert.
type ExpertRows<'a> = (&'a (Vec<u32>, Vec<f32>), &'a Expert);

/// Where a routed expert runs in a step ([`ExpertUnits::place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSite {
    /// On the step's device.
    Device,
    /// On the host CPU, from host memory, its output added on the device.
    Host,
    /// Fetched to the device for this use only, a few at a time
    /// ([`ExpertUnits::stream_depth`]; a prompt's experts with many rows each, past what the
    /// device's cache holds at once).
    Stream,
}

/// The names of an expert's three projections under its prefix, and its widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    /// Gate, up and down projection names (`gate_proj`, `up_proj`, `down_proj`; Mixtral's
    /// `w1`, `w3`, `w2`).
    pub names: [&'static str; 3],
    /// Model width.
    pub hidden: usize,
    /// Expert MLP width.
    pub intermediate: usize,
}

impl ExpertShape {
    /// The expert's MLP from weights rooted at its prefix (each projection dense or blocks).
    pub fn load(&self, w: UnitWeights<'_>) -> Result<GatedMlp> {
        GatedMlp::load_named(
            w,
            self.names,
            self.hidden,
            self.intermediate,
            Activation::Silu,
        )
    }
}

/// Where a sparse MLP's experts are.
#[derive(Debug)]
pub enum Experts {
    /// Built with the layer, from its unit.
    InLayer(Vec<Arc<GatedMlp>>),
    /// Units of their own, acquired through [`StepCtx::experts`] when routed to.
    Units(ExpertShape),
}

/// A sparse mixture-of-experts MLP. See the module docs.
#[derive(Debug)]
pub struct SparseMoe {
    /// The router: one logit per expert, `(experts, hidden)`.
    pub router: Linear,
    /// How its logits choose experts.
    pub routing: Routing,
    /// The experts.
    pub experts: Experts,
    /// The decoder layer (for [`ExpertUnits`]).
    pub layer: usize,
    /// An expert every row goes through as well (Qwen2-MoE), with the gate of its share.
    pub shared: Option<Box<SharedExpert>>,
}

/// Qwen2-MoE's shared expert: every row through one more gated MLP, its output scaled by
/// `sigmoid(gate · x)` and added to the routed experts' sum. It lives with its layer.
#[derive(Debug)]
pub struct SharedExpert {
    /// The MLP (`shared_expert_intermediate_size` wide).
    pub mlp: GatedMlp,
    /// `(1, hidden)`: the logit of the expert's share per row.
    pub gate: Linear,
}

impl SharedExpert {
    /// `sigmoid(gate · x) · mlp(x)` over rows `x2` `(rows, hidden)`.
    fn forward(&self, x2: &Tensor, fused: bool) -> Result<Tensor> {
        let y = if fused {
            self.mlp.forward_fused(x2)?
        } else {
            self.mlp.forward(x2)?
        };
        let share = candle_nn::ops::sigmoid(&self.gate.forward(x2)?.to_dtype(DType::F32)?)?;
        y.broadcast_mul(&share.to_dtype(y.dtype())?)
    }
}

impl SparseMoe {
    /// The experts of a layer from fused stacks: `gate_up` `(experts, 2·inter, hidden)`
    /// (each expert's gate rows, then its up rows) and `down` `(experts, hidden, inter)`,
    /// as transformers 5 keeps them. Each expert is a view of the stacks.
    pub fn stacked_experts(
        gate_up: &Tensor,
        down: &Tensor,
        tuning: candle_offload::KernelTuning,
    ) -> Result<Vec<Arc<GatedMlp>>> {
        let (e, two_i, _) = gate_up.dims3()?;
        (0..e)
            .map(|i| {
                let gu = gate_up.get(i)?;
                let d = down.get(i)?;
                Ok(Arc::new(GatedMlp::from_fused_tensors(
                    gu,
                    d,
                    two_i / 2,
                    Activation::Silu,
                    tuning,
                )?))
            })
            .collect()
    }

    /// The routed experts of a step (`(expert, rows)`), each with where it runs.
    fn place(
        &self,
        routed: &[(usize, usize)],
        ctx: &StepCtx<'_>,
    ) -> Result<Vec<(Option<Expert>, ExpertSite)>> {
        match &self.experts {
            Experts::InLayer(v) => routed
                .iter()
                .map(|&(e, _)| match v.get(e) {
                    Some(m) => Ok((
                        Some(Expert {
                            mlp: m.clone(),
                            guard: None,
                        }),
                        ExpertSite::Device,
                    )),
                    None => candle_core::bail!("layer {}: no expert {e}", self.layer),
                })
                .collect(),
            Experts::Units(shape) => {
                let Some(units) = ctx.experts else {
                    candle_core::bail!(
                        "layer {}: its experts are units of their own, and this step has no \
                         ExpertUnits to acquire them from",
                        self.layer
                    );
                };
                units.place(self.layer, routed, &|w| shape.load(w))
            }
        }
    }

    /// Hands a decode step's guesses for later layers (`(layer, its routes)`, nearest first)
    /// to the units.
    fn guessed(
        &self,
        units: Option<&dyn ExpertUnits>,
        guessed: Vec<(usize, Vec<(usize, f32)>)>,
    ) -> Result<()> {
        let Some(units) = units else {
            return Ok(());
        };
        if guessed.is_empty() {
            return Ok(());
        }
        let _s = tracing::debug_span!("moe.guess").entered();
        for (layer, routes) in guessed {
            units.guessed(layer, &routes)?;
        }
        Ok(())
    }

    /// The router's choice for each row of `x2` (rows, hidden), from its logits computed in
    /// F32 whatever the model's dtype.
    pub fn route(&self, x2: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        Ok(self.read_back(x2, &[], false)?.routes)
    }

    /// [`route`](Self::route), with later layers' guessed choices from the same rows
    /// (`guess`: their routers and routings) and the rows themselves in F32 on the host
    /// (`rows_back`), all read back from the device in one copy: one wait for the device
    /// a layer, before anything else is enqueued behind the router.
    fn read_back(
        &self,
        x2: &Tensor,
        guess: &[(&Linear, Routing)],
        rows_back: bool,
    ) -> Result<Readback> {
        let mut parts = vec![router_logits(&self.router, x2)?];
        for (router, _) in guess {
            parts.push(router_logits(router, x2)?);
        }
        if rows_back {
            parts.push(x2.to_dtype(DType::F32)?);
        }
        let widths = parts
            .iter()
            .map(|p| p.dim(1))
            .collect::<Result<Vec<usize>>>()?;
        let all = if parts.len() == 1 {
            parts.remove(0)
        } else {
            Tensor::cat(&parts, 1)?
        };
        let rows = all.dim(0)?;
        // One flat copy (not a vector a row): a prompt reads back hundreds of rows.
        let all = tracing::debug_span!("moe.route.read")
            .in_scope(|| all.flatten_all()?.to_vec1::<f32>())?;
        let expected: Vec<usize> = std::iter::once(self.routing.experts)
            .chain(guess.iter().map(|(_, r)| r.experts))
            .chain(rows_back.then(|| x2.dim(1)).transpose()?)
            .collect();
        for (got, want) in widths.iter().zip(&expected) {
            if got != want {
                candle_core::bail!(
                    "layer {}: the router gives {got} logits for {want} experts",
                    self.layer
                );
            }
        }
        let stride: usize = widths.iter().sum();
        let (own, rest) = widths.split_first().expect("the router's logits");
        let mut at = *own;
        let routes = tracing::debug_span!("moe.route.rows", rows)
            .in_scope(|| route_rows(&all, stride, (0, *own), self.routing));
        let guess = guess
            .iter()
            .zip(rest)
            .map(|(&(_, routing), &w)| {
                let g = route_rows(&all, stride, (at, w), routing);
                at += w;
                g
            })
            .collect();
        let x_host = if rows_back {
            let h = x2.dim(1)?;
            let flat: Vec<f32> = all
                .chunks(stride)
                .flat_map(|r| r[at..at + h].iter().copied())
                .collect();
            Some(Tensor::from_vec(
                flat,
                (rows, h),
                &candle_core::Device::Cpu,
            )?)
        } else {
            None
        };
        Ok(Readback {
            routes,
            guess,
            x_host,
        })
    }

    /// [`forward`](Self::forward) on the CPU where every routed expert is a SiLU-gated MLP of
    /// K-quant blocks (GGUF's Q4_K_M and the like): the gate and up projections of all of them
    /// in one pass of the worker pool, each against its own rows (in groups of at most
    /// [`KQUANT_MAX_ROWS`]), then all the downs in a second pass, the weighted sum in place.
    /// Two synchronisations a layer instead of one per projection, no gathered or scattered
    /// tensors. `None` elsewhere (another device, dense or other blocks), so that the generic
    /// path runs; the result is `(rows, hidden)` in F32.
    fn forward_cpu_blocks(x2: &Tensor, groups: &[ExpertRows<'_>]) -> Result<Option<Tensor>> {
        if !x2.device().is_cpu() || groups.is_empty() {
            return Ok(None);
        }
        if groups.iter().any(|(_, e)| expert_blocks(&e.mlp).is_none()) {
            return Ok(None);
        }
        let (rows, h) = x2.dims2()?;
        let experts: Vec<&Expert> = groups.iter().map(|(_, e)| *e).collect();
        let x = x2.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        // Each expert's rows, gathered, in groups the loop takes (one input for groups of the
        // same rows: a decode row's experts all read it, quantized once); with the expert and
        // the rows' (output row, weight), and each group's input.
        let mut inputs: Vec<Vec<f32>> = Vec::new();
        let mut input_ids: Vec<&[u32]> = Vec::new();
        let mut input_of: Vec<usize> = Vec::new();
        let mut owners: Vec<(usize, Vec<(usize, f32)>)> = Vec::new();
        for (slot, ((ids, ws), _)) in groups.iter().enumerate() {
            for (ids, ws) in ids.chunks(KQUANT_MAX_ROWS).zip(ws.chunks(KQUANT_MAX_ROWS)) {
                let same = input_ids.iter().position(|&seen| seen == ids);
                input_of.push(same.unwrap_or(inputs.len()));
                if same.is_none() {
                    let mut xe = Vec::with_capacity(ids.len() * h);
                    for &r in ids {
                        xe.extend_from_slice(&x[r as usize * h..(r as usize + 1) * h]);
                    }
                    inputs.push(xe);
                    input_ids.push(ids);
                }
                owners.push((
                    slot,
                    ids.iter()
                        .map(|&r| r as usize)
                        .zip(ws.iter().copied())
                        .collect(),
                ));
            }
        }
        let blocks: Vec<[&Arc<QTensor>; 3]> = experts
            .iter()
            .map(|e| expert_blocks(&e.mlp).expect("checked above"))
            .collect();
        let tuning = experts[0].mlp.down.tuning();
        let first: Vec<(&Arc<QTensor>, usize)> = owners
            .iter()
            .enumerate()
            .flat_map(|(i, (slot, _))| {
                [
                    (blocks[*slot][0], input_of[i]),
                    (blocks[*slot][1], input_of[i]),
                ]
            })
            .collect();
        let Some(gu) = kquant_batch(&rows_of(&inputs, h), &first, tuning)? else {
            return Ok(None);
        };
        let inter = experts[0].mlp.intermediate;
        let acts: Vec<Vec<f32>> = gu
            .chunks_exact(2)
            .map(|p| candle_offload::kernels::activation::silu_mul_f32(&p[0], &p[1]))
            .collect();
        let second: Vec<(&Arc<QTensor>, usize)> = owners
            .iter()
            .enumerate()
            .map(|(i, (slot, _))| (blocks[*slot][2], i))
            .collect();
        let Some(ys) = kquant_batch(&rows_of(&acts, inter), &second, tuning)? else {
            return Ok(None);
        };
        let mut out = vec![0f32; rows * h];
        // Expert by expert in expert order, as the generic path adds them.
        for ((_, rws), y) in owners.iter().zip(&ys) {
            for (j, &(r, w)) in rws.iter().enumerate() {
                let dst = &mut out[r * h..(r + 1) * h];
                for (o, v) in dst.iter_mut().zip(&y[j * h..(j + 1) * h]) {
                    *o += v * w;
                }
            }
        }
        Ok(Some(Tensor::from_vec(out, (rows, h), x2.device())?))
    }

    /// The weighted sum over `groups` (each expert's rows and weights, and the expert) of
    /// each expert's MLP of its rows of `x2` `(rows, hidden)`, expert by expert in order:
    /// `(rows, hidden)` in the experts' output dtype, `None` without experts.
    ///
    /// A decode row's weights scale its experts' outputs as kernel arguments (`affine`);
    /// several rows' indices and weights reach the device in one copy each for all the
    /// experts, each expert's a view of them: a copy from pageable host memory waits for the
    /// device's queue to drain, so one per expert would stall it that often.
    fn sum_experts(x2: &Tensor, groups: &[ExpertRows<'_>], fused: bool) -> Result<Option<Tensor>> {
        let rows = x2.dim(0)?;
        if rows == 1 && fused {
            if let Some(out) = Self::grouped_row(x2, groups)? {
                return Ok(Some(out));
            }
        }
        // Every group's indices and weights, concatenated, on the device (several rows).
        let uploaded = if rows > 1 && !groups.is_empty() {
            let _s = tracing::debug_span!("moe.device.upload").entered();
            Some(Self::upload_routes(x2, groups.iter().map(|(g, _)| *g))?)
        } else {
            None
        };
        Self::sum_uploaded(x2, groups, uploaded, fused)
    }

    /// The row indices and weights of `groups` (each expert's), concatenated, on x2's device:
    /// `(ids (n) U32, weights (n, 1) in x2's dtype)`, in one copy each.
    fn upload_routes<'a>(
        x2: &Tensor,
        groups: impl Iterator<Item = &'a (Vec<u32>, Vec<f32>)> + Clone,
    ) -> Result<(Tensor, Tensor)> {
        let ids: Vec<u32> = groups
            .clone()
            .flat_map(|(i, _)| i.iter().copied())
            .collect();
        let ws: Vec<f32> = groups.flat_map(|(_, w)| w.iter().copied()).collect();
        let n = ids.len();
        Ok((
            Tensor::from_vec(ids, n, x2.device())?,
            Tensor::from_vec(ws, (n, 1), x2.device())?.to_dtype(x2.dtype())?,
        ))
    }

    /// [`sum_experts`](Self::sum_experts) past a decode row's grouped kernels, with the
    /// groups' indices and weights as [`upload_routes`](Self::upload_routes) made them (`None`
    /// for a single row).
    fn sum_uploaded(
        x2: &Tensor,
        groups: &[ExpertRows<'_>],
        uploaded: Option<(Tensor, Tensor)>,
        fused: bool,
    ) -> Result<Option<Tensor>> {
        let rows = x2.dim(0)?;
        if let (Some((up_ids, up_ws)), true) = (&uploaded, fused) {
            if let Some(out) = Self::grouped_rows(x2, groups, up_ids, up_ws)? {
                return Ok(Some(out));
            }
        }
        let mut at = 0usize;
        let mut out: Option<Tensor> = None;
        for ((ids, ws), expert) in groups {
            let n = ws.len();
            let start = at;
            at += n;
            let all = ids.len() == rows && ids.iter().enumerate().all(|(i, &r)| i == r as usize);
            let xe = match (&uploaded, all) {
                (Some((up_ids, _)), false) => x2.index_select(&up_ids.narrow(0, start, n)?, 0)?,
                _ => x2.clone(),
            };
            let y = if fused {
                expert.mlp.forward_fused(&xe)?
            } else {
                expert.mlp.forward(&xe)?
            };
            let y = match &uploaded {
                Some((_, up_ws)) => {
                    y.broadcast_mul(&up_ws.narrow(0, start, n)?.to_dtype(y.dtype())?)?
                }
                None => y.affine(f64::from(ws[0]), 0.0)?,
            };
            out = Some(match (out, all, &uploaded) {
                (None, true, _) => y,
                (Some(o), true, _) => (o + y)?,
                (o, false, Some((up_ids, _))) => {
                    let o = match o {
                        Some(o) => o,
                        None => x2.zeros_like()?.to_dtype(y.dtype())?,
                    };
                    o.index_add(&up_ids.narrow(0, start, n)?, &y, 0)?
                }
                (_, false, None) => {
                    candle_core::bail!("an expert's rows are not every row of a single-row step")
                }
            });
        }
        Ok(out)
    }

    /// Several rows' experts through the grouped kernels ([`qexperts_rows`]), where every one
    /// is a SiLU-gated MLP of GGML blocks they take: the rows gathered in expert order
    /// (`ids`, every group's rows concatenated), each expert's through its MLP, then each row's
    /// outputs weighted (`ws`, `(ids, 1)`) and summed back into it ([`combine_rows`]; a
    /// single expert's added into their rows); `None` otherwise.
    fn grouped_rows(
        x2: &Tensor,
        groups: &[ExpertRows<'_>],
        ids: &Tensor,
        ws: &Tensor,
    ) -> Result<Option<Tensor>> {
        if let [lone] = groups {
            // A streamed expert's, alone: its weights are already on the device (a table
            // copied from pageable memory would wait for the stream), and its rows are few
            // to add.
            return Self::lone_expert_rows(x2, *lone, ids, ws)?
                .map(|y| add_into_rows(None, x2, ids, y))
                .transpose();
        }
        let Some((experts, tuning)) = rows_experts(x2, groups)? else {
            return Ok(None);
        };
        let y = tracing::debug_span!("moe.device.experts", experts = experts.len())
            .in_scope(|| qexperts_rows(&x2.index_select(ids, 0)?, &experts, tuning))?;
        let _s = tracing::debug_span!("moe.device.combine").entered();
        let (slots, weights, k) = combine_table(x2.dim(0)?, groups.iter().map(|(g, _)| *g));
        combine_rows(&y, &slots, &weights, k).map(Some)
    }

    /// A lone expert's weighted outputs for its own rows (`ids` and `ws` its uploaded rows
    /// and weights; a streamed expert's), `(rows, hidden)` in that order, through the grouped
    /// kernels; `None` where they do not take it.
    fn lone_expert_rows(
        x2: &Tensor,
        group: ExpertRows<'_>,
        ids: &Tensor,
        ws: &Tensor,
    ) -> Result<Option<Tensor>> {
        let Some((experts, tuning)) = rows_experts(x2, &[group])? else {
            return Ok(None);
        };
        let y = qexperts_rows(&x2.index_select(ids, 0)?, &experts, tuning)?;
        y.broadcast_mul(&ws.to_dtype(y.dtype())?).map(Some)
    }

    /// One row's experts through the grouped kernels ([`qexperts_row`]), where every one is a
    /// SiLU-gated MLP of GGML blocks they take; `None` otherwise.
    fn grouped_row(x2: &Tensor, groups: &[ExpertRows<'_>]) -> Result<Option<Tensor>> {
        let Some((blocks, tuning)) = groups_blocks(groups) else {
            return Ok(None);
        };
        let experts: Vec<QExpert<'_>> = blocks
            .into_iter()
            .zip(groups)
            .map(|([gate, up, down], ((_, ws), _))| QExpert {
                gate,
                up,
                down,
                weight: ws[0],
            })
            .collect();
        if !qexperts_row_fits(x2, &experts, tuning)? {
            return Ok(None);
        }
        qexperts_row(x2, &experts, tuning).map(Some)
    }

    /// `sum` with the streamed experts' ([`ExpertSite::Stream`]) added, each acquired and
    /// its work enqueued, the oldest released before the next is acquired once the device
    /// holds [`ExpertUnits::stream_depth`] of them: with two, the next one's copy lands
    /// while one computes.
    fn add_streamed(
        &self,
        mut sum: Option<Tensor>,
        x2: &Tensor,
        by_expert: &BTreeMap<usize, (Vec<u32>, Vec<f32>)>,
        placed: &[(Option<Expert>, ExpertSite)],
        ctx: &StepCtx<'_>,
        fused: bool,
    ) -> Result<Option<Tensor>> {
        let (Experts::Units(shape), Some(units)) = (&self.experts, ctx.experts) else {
            return Ok(sum);
        };
        let streamed: Vec<_> = by_expert
            .iter()
            .zip(placed)
            .filter(|(_, p)| p.1 == ExpertSite::Stream)
            .map(|(g, _)| g)
            .collect();
        // A prompt's streamed experts' indices and weights in one copy before the first (a
        // copy from pageable memory waits for the stream: one an expert would keep the link
        // idle while each expert's work drains).
        let uploaded = if x2.dim(0)? > 1 && !streamed.is_empty() {
            Some(Self::upload_routes(x2, streamed.iter().map(|(_, g)| *g))?)
        } else {
            None
        };
        let depth = units.stream_depth().max(1);
        let mut held = std::collections::VecDeque::with_capacity(depth);
        let mut at = 0usize;
        let (t0, count) = (std::time::Instant::now(), streamed.len());
        for (&e, g) in streamed {
            while held.len() >= depth {
                if let Some(old) = held.pop_front() {
                    units.streamed(self.layer, old)?;
                }
            }
            let expert = units.stream(self.layer, e, &|w| shape.load(w))?;
            let n = g.0.len();
            let mine = match &uploaded {
                Some((ids, ws)) => Some((ids.narrow(0, at, n)?, ws.narrow(0, at, n)?)),
                None => None,
            };
            at += n;
            // Through the grouped kernels, its outputs added straight into their rows of the
            // sum; otherwise its own full-size sum, added.
            let lone = match (&mine, fused) {
                (Some((ids, ws)), true) => {
                    Self::lone_expert_rows(x2, (g, &expert), ids, ws)?.map(|y| (ids, y))
                }
                _ => None,
            };
            sum = match lone {
                Some((ids, y)) => Some(add_into_rows(sum, x2, ids, y)?),
                None => match (sum, Self::sum_uploaded(x2, &[(g, &expert)], mine, fused)?) {
                    (Some(s), Some(y)) => {
                        let y = y.to_dtype(s.dtype())?;
                        Some((s + y)?)
                    }
                    (s, None) => s,
                    (None, y) => y,
                },
            };
            drop(expert);
            held.push_back(e);
        }
        for e in held {
            units.streamed(self.layer, e)?;
        }
        if x2.dim(0)? > 1 {
            units.stream_done(count, t0.elapsed().as_secs_f64());
        }
        Ok(sum)
    }

    /// The experts left on the host CPU ([`ExpertSite::Host`]) over `x_host`, the step's rows
    /// copied to the host: the K-quant pass where every one is such an expert, otherwise each
    /// through Candle's CPU ops in F32. `(rows, hidden)` F32 on the CPU.
    fn sum_on_host(x_host: &Tensor, groups: &[ExpertRows<'_>]) -> Result<Option<Tensor>> {
        if let Some(out) = Self::forward_cpu_blocks(x_host, groups)? {
            return Ok(Some(out));
        }
        let x = x_host.to_dtype(DType::F32)?;
        Self::sum_experts(&x, groups, false)?
            .map(|t| t.to_dtype(DType::F32))
            .transpose()
    }

    /// Inference over `xs` (..., hidden): each row through its experts, weighted and summed;
    /// `fused` as [`GatedMlp::forward_fused`]. Experts placed on the host CPU
    /// ([`ExpertUnits::place`]) run there on a copy of the rows while the device runs its own
    /// (its kernels are enqueued first), and their sum is added on the device.
    pub fn forward(&self, xs: &Tensor, ctx: &StepCtx<'_>, fused: bool) -> Result<Tensor> {
        let dims = xs.dims().to_vec();
        let h = xs.dim(D::Minus1)?;
        let x2 = xs.reshape(((), h))?;
        let rows = x2.dim(0)?;
        let _layer = tracing::debug_span!("moe.layer", layer = self.layer, rows).entered();
        let units = match &self.experts {
            Experts::Units(_) => ctx.experts,
            Experts::InLayer(_) => None,
        };
        if let (Some(u), Experts::Units(shape), true) = (units, &self.experts, fused) {
            if rows == 1 && !x2.device().is_cpu() {
                if let Some((table, routed)) =
                    u.device_route(self.layer, shape, self.routing, &x2)?
                {
                    let _s = tracing::debug_span!("moe.device_route").entered();
                    let logits = router_logits(&self.router, &x2)?;
                    let mut out = table.forward(self.layer, &x2, &logits, &routed)?;
                    if let Some(shared) = &self.shared {
                        let dtype = out.dtype();
                        out = (out + shared.forward(&x2, fused)?.to_dtype(dtype)?)?;
                    }
                    return out.to_dtype(xs.dtype())?.reshape(dims);
                }
            }
        }
        traced_wait(&x2, Wait::Before)?;
        let guess = units.map_or_else(Vec::new, |u| {
            u.guess_routers(self.layer, &self.router, self.routing, rows)
        });
        // A decode step's rows come back with the routers' logits, for the experts the host
        // CPU may compute: read later, they would wait behind the fetches `place` enqueues.
        let rows_back = units.is_some_and(|u| u.host_computes())
            && !x2.device().is_cpu()
            && rows <= ROWS_BACK_WITH_ROUTES;
        // The routers' logits read back: on a device, this waits for the work before it.
        let routers: Vec<(&Linear, Routing)> = guess.iter().map(|(_, r, g)| (r, *g)).collect();
        let read = tracing::debug_span!("moe.route")
            .in_scope(|| self.read_back(&x2, &routers, rows_back))?;
        let (routes, mut read_rows) = (read.routes, read.x_host);
        // Each guessed layer and its choice for the step's row.
        let guessed: Vec<(usize, Vec<(usize, f32)>)> = guess
            .iter()
            .zip(read.guess)
            .filter_map(|(&(layer, _, _), mut g)| (g.len() == 1).then(|| (layer, g.remove(0))))
            .collect();
        let by_expert = group_by_expert(&routes);
        let routed: Vec<(usize, usize)> = by_expert.iter().map(|(&e, g)| (e, g.0.len())).collect();
        let placed = tracing::debug_span!("moe.place").in_scope(|| self.place(&routed, ctx))?;
        let on = |site: ExpertSite| -> Vec<ExpertRows<'_>> {
            by_expert
                .values()
                .zip(&placed)
                .filter(|(_, p)| p.1 == site || x2.device().is_cpu())
                .filter_map(|(g, p)| Some((g, p.0.as_ref()?)))
                .collect()
        };
        let out = if x2.device().is_cpu() {
            // One processor: every expert in one pass where they are K-quant blocks.
            let all = on(ExpertSite::Device);
            let out = match Self::forward_cpu_blocks(&x2, &all)? {
                Some(out) => Some(out),
                None => Self::sum_experts(&x2, &all, fused)?,
            };
            let out = self.add_streamed(out, &x2, &by_expert, &placed, ctx, fused)?;
            self.guessed(units, guessed)?;
            out
        } else {
            let host = on(ExpertSite::Host);
            let host_rows: Vec<&(Vec<u32>, Vec<f32>)> = host.iter().map(|(g, _)| *g).collect();
            // The rows reach the host before the device's experts are enqueued (read back with
            // the routers' logits where the step is small; a prompt's, only those the host's
            // experts read).
            let x_host = if host.is_empty() {
                None
            } else {
                match read_rows.take() {
                    Some(x) => Some(HostRows::all(x, &host_rows)),
                    None => {
                        let _s = tracing::debug_span!("moe.to_host").entered();
                        Some(HostRows::gather(&x2, &host_rows)?)
                    }
                }
            };
            let on_device = tracing::debug_span!("moe.device").in_scope(|| {
                let d = Self::sum_experts(&x2, &on(ExpertSite::Device), fused)?;
                traced_wait(&x2, Wait::Resident)?;
                let d = self.add_streamed(d, &x2, &by_expert, &placed, ctx, fused)?;
                traced_wait(&x2, Wait::Streamed)?;
                Ok::<_, candle_core::Error>(d)
            })?;
            // The guessed experts' copies queue behind this step's own.
            self.guessed(units, guessed)?;
            let on_host = match &x_host {
                Some(hr) => {
                    let _s =
                        tracing::debug_span!("moe.host", experts = host.len(), rows = hr.rows())
                            .entered();
                    let t0 = std::time::Instant::now();
                    let groups: Vec<ExpertRows<'_>> = hr
                        .groups
                        .iter()
                        .zip(&host)
                        .map(|(g, (_, e))| (g, *e))
                        .collect();
                    let out = Self::sum_on_host(&hr.x, &groups)?;
                    if let Some(units) = ctx.experts {
                        units.host_done(self.layer, t0.elapsed().as_secs_f64());
                    }
                    out
                }
                None => None,
            };
            let _merge = tracing::debug_span!("moe.merge").entered();
            let ids = x_host.as_ref().and_then(|hr| hr.ids.as_ref());
            match (on_device, on_host, ids) {
                // The host's rows, added into theirs.
                (d, Some(hst), Some(ids)) => {
                    Some(add_into_rows(d, &x2, ids, hst.to_device(x2.device())?)?)
                }
                (Some(d), Some(hst), None) => {
                    Some((&d + hst.to_device(x2.device())?.to_dtype(d.dtype())?)?)
                }
                (Some(d), None, _) => Some(d),
                (None, Some(hst), None) => Some(hst.to_device(x2.device())?),
                (None, None, _) => None,
            }
        };
        // Their work is enqueued: the units go back together.
        release(placed)?;
        traced_wait(&x2, Wait::Merge)?;
        let mut out = match out {
            Some(o) => o.to_dtype(xs.dtype())?,
            None => x2.zeros_like()?,
        };
        if let Some(shared) = &self.shared {
            out = (out + shared.forward(&x2, fused)?.to_dtype(xs.dtype())?)?;
        }
        out.reshape(dims)
    }
}

/// A step's experts dropped and their units released together
/// ([`UnitGuard::release_all`](candle_offload::UnitGuard::release_all): one hold of each
/// runtime's lock and one last-use event, where each guard's drop takes its own).
fn release(placed: Vec<(Option<Expert>, ExpertSite)>) -> Result<()> {
    let guards: Vec<candle_offload::UnitGuard> = placed
        .into_iter()
        .filter_map(|(expert, _)| expert?.guard)
        .collect();
    candle_offload::UnitGuard::release_all(guards)
}

/// `y`, rows of `x2`'s shape, added into the rows `ids` of `sum` (of zeros in `y`'s dtype
/// where there is none yet), in `sum`'s dtype.
fn add_into_rows(sum: Option<Tensor>, x2: &Tensor, ids: &Tensor, y: Tensor) -> Result<Tensor> {
    let sum = match sum {
        Some(s) => s,
        None => x2.zeros_like()?.to_dtype(y.dtype())?,
    };
    let y = y.to_dtype(sum.dtype())?;
    sum.index_add(ids, &y, 0)
}

/// What a traced layer waits for ([`traced_wait`]).
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// The work before the layer's routing (its attention, the layers before).
    Before,
    /// The resident experts' work.
    Resident,
    /// The streamed experts' copies and work.
    Streamed,
    /// The host's sum added, the layer done.
    Merge,
}

/// At TRACE level for this module, on a GPU: waits for the step's device in a span named for
/// `what` (`moe.wait.*`), so that a run's spans time the device's work of each phase as well
/// as the host's enqueue of it. A diagnostic: the waits remove the overlap between the phases
/// (the host's experts then run after the device's are done). Elsewhere nothing.
fn traced_wait(x: &Tensor, what: Wait) -> Result<()> {
    if !x.device().is_cuda() || !tracing::enabled!(tracing::Level::TRACE) {
        return Ok(());
    }
    let span = match what {
        Wait::Before => tracing::trace_span!("moe.wait.before"),
        Wait::Resident => tracing::trace_span!("moe.wait.resident"),
        Wait::Streamed => tracing::trace_span!("moe.wait.streamed"),
        Wait::Merge => tracing::trace_span!("moe.wait.merge"),
    };
    let _s = span.entered();
    x.device().synchronize()
}

/// The rows of a step that the host CPU's experts read, on the host, with those experts'
/// rows and weights renumbered into them.
struct HostRows {
    /// `(n, hidden)` on the CPU.
    x: Tensor,
    /// The step's rows they are (`u32`, on the step's device), increasing; `None`: all of
    /// them, in order.
    ids: Option<Tensor>,
    /// Each host expert's rows (into `x`) and weights, in the host's order.
    groups: Vec<(Vec<u32>, Vec<f32>)>,
}

impl HostRows {
    /// All of a step's rows, `x` already on the host, for the host's experts' rows and
    /// weights `host`.
    fn all(x: Tensor, host: &[&(Vec<u32>, Vec<f32>)]) -> Self {
        let groups = host.iter().map(|&g| g.clone()).collect();
        Self {
            x,
            ids: None,
            groups,
        }
    }

    /// The rows of `x2` (on the step's device) that the host's experts (their rows and
    /// weights, `host`) read: gathered on the
    /// device and copied, or all of them copied where they read every row. A prompt's host
    /// experts read a few of its rows; its whole `x2` is megabytes a layer each way.
    fn gather(x2: &Tensor, host: &[&(Vec<u32>, Vec<f32>)]) -> Result<Self> {
        let rows = x2.dim(0)?;
        let mut used: Vec<u32> = host
            .iter()
            .flat_map(|(ids, _)| ids.iter().copied())
            .collect();
        used.sort_unstable();
        used.dedup();
        let cpu = candle_core::Device::Cpu;
        if used.len() == rows {
            return Ok(Self::all(x2.to_device(&cpu)?, host));
        }
        let mut at = vec![u32::MAX; rows];
        for (i, &r) in used.iter().enumerate() {
            at[r as usize] = i as u32;
        }
        let groups = host
            .iter()
            .map(|(ids, ws)| (ids.iter().map(|&r| at[r as usize]).collect(), ws.clone()))
            .collect();
        let n = used.len();
        let ids = Tensor::from_vec(used, n, x2.device())?;
        Ok(Self {
            x: x2.index_select(&ids, 0)?.to_device(&cpu)?,
            ids: Some(ids),
            groups,
        })
    }

    /// The rows on the host.
    fn rows(&self) -> usize {
        self.x.dim(0).unwrap_or(0)
    }
}

/// Every group's expert's gate, up and down blocks (each a SiLU-gated MLP of separate GGML
/// blocks), and the first one's kernel tuning; `None` without groups or where one is not.
fn groups_blocks<'a>(
    groups: &[ExpertRows<'a>],
) -> Option<(Vec<[&'a QTensor; 3]>, &'a candle_offload::KernelTuning)> {
    let (_, first) = groups.first()?;
    let blocks = groups
        .iter()
        .map(|(_, e)| separate_blocks(&e.mlp).map(|[g, u, d]| [&**g, &**u, &**d]))
        .collect::<Option<Vec<_>>>()?;
    Some((blocks, first.mlp.down.tuning()))
}

/// `groups`' experts as [`qexperts_rows`] takes them (each with its rows' count) and their
/// kernels' tuning, where every one is a SiLU-gated MLP of GGML blocks those kernels take and
/// `x2` fits them; `None` otherwise.
fn rows_experts<'a>(
    x2: &Tensor,
    groups: &[ExpertRows<'a>],
) -> Result<Option<(Vec<QExpertRows<'a>>, &'a candle_offload::KernelTuning)>> {
    let Some((blocks, tuning)) = groups_blocks(groups) else {
        return Ok(None);
    };
    let experts: Vec<QExpertRows<'a>> = blocks
        .into_iter()
        .zip(groups)
        .map(|([gate, up, down], ((rows, _), _))| QExpertRows {
            gate,
            up,
            down,
            rows: rows.len(),
        })
        .collect();
    Ok(qexperts_rows_fits(x2, &experts, tuning)?.then_some((experts, tuning)))
}

/// [`combine_rows`]'s table for `rows` rows and `groups` (each expert's rows and weights, in
/// the order their outputs are stacked): each row's copies' positions and weights, as many
/// slots a row as the most copies any row has ([`NO_SLOT`] fills the rest).
fn combine_table<'a>(
    rows: usize,
    groups: impl Iterator<Item = &'a (Vec<u32>, Vec<f32>)> + Clone,
) -> (Vec<u32>, Vec<f32>, usize) {
    let mut count = vec![0usize; rows];
    for (ids, _) in groups.clone() {
        for &r in ids {
            count[r as usize] += 1;
        }
    }
    let k = count.iter().copied().max().unwrap_or(0).max(1);
    let (mut slots, mut weights) = (vec![NO_SLOT; rows * k], vec![0f32; rows * k]);
    count.iter_mut().for_each(|c| *c = 0);
    let mut at = 0u32;
    for (ids, ws) in groups {
        for (&r, &w) in ids.iter().zip(ws) {
            let r = r as usize;
            slots[r * k + count[r]] = at;
            weights[r * k + count[r]] = w;
            count[r] += 1;
            at += 1;
        }
    }
    (slots, weights, k)
}

/// The most rows a step reads back with its routers' logits for the host CPU's experts
/// (a decode step's); a larger step (a prompt's) copies them only where the host computes
/// experts.
const ROWS_BACK_WITH_ROUTES: usize = 16;

/// What [`SparseMoe::read_back`] reads back.
struct Readback {
    /// Each row's experts and weights.
    routes: Vec<Vec<(usize, f32)>>,
    /// Per guessed layer, each row's experts as its router chose them from the same rows.
    guess: Vec<Vec<Vec<(usize, f32)>>>,
    /// The rows in F32 on the host.
    x_host: Option<Tensor>,
}

/// A router's logits for the rows of `x2` (rows, hidden), computed in F32 whatever the
/// model's dtype (as llama.cpp computes them): the choice of experts is discrete, and logits
/// rounded to 16 bits tie or swap experts whose F32 logits differ by less than their spacing.
/// `(rows, experts)` F32.
fn router_logits(router: &Linear, x2: &Tensor) -> Result<Tensor> {
    match router.weight() {
        LinearWeight::Dense(w) if w.dtype() != DType::F32 || w.device().is_cpu() => {
            let logits = candle_offload::kernels::linear::router_logits(x2, w, router.tuning())?;
            match router.bias() {
                Some(b) => logits.broadcast_add(&b.to_dtype(DType::F32)?),
                None => Ok(logits),
            }
        }
        _ => router
            .forward(&x2.to_dtype(DType::F32)?)?
            .to_dtype(DType::F32),
    }
}

/// `m`-wide rows of each buffer of `v`.
fn rows_of(v: &[Vec<f32>], k: usize) -> Vec<Rows<'_>> {
    v.iter().map(|x| Rows { x, k }).collect()
}

/// An expert's gate, up and down blocks, where it is a SiLU-gated MLP with separate
/// projections of GGML blocks and no biases.
pub fn separate_blocks(mlp: &GatedMlp) -> Option<[&Arc<QTensor>; 3]> {
    fn q(l: &Linear) -> Option<&Arc<QTensor>> {
        match (l.weight(), l.bias()) {
            (LinearWeight::Quantized(QMatMul::QTensor(q)), None) => Some(q),
            _ => None,
        }
    }
    let GateUp::Separate { gate, up } = &mlp.gate_up else {
        return None;
    };
    if mlp.act != Activation::Silu {
        return None;
    }
    Some([q(gate)?, q(up)?, q(&mlp.down)?])
}

/// An expert's gate, up and down as K-quant blocks the CPU loop multiplies
/// ([`separate_blocks`] of types it takes).
fn expert_blocks(mlp: &GatedMlp) -> Option<[&Arc<QTensor>; 3]> {
    let [g, u, d] = separate_blocks(mlp)?;
    let (h, i) = (g.shape().dims().get(1).copied()?, mlp.intermediate);
    use candle_offload::kernels::linear::cpu_experts::supports;
    (supports(g, h) && supports(u, h) && supports(d, i)).then_some([g, u, d])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rows_are_the_rows_the_host_experts_read_renumbered() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let x2 = Tensor::arange(0f32, 12.0, &dev)?.reshape((6, 2))?;
        let a = (vec![1u32, 4], vec![0.5f32, 0.25]);
        let b = (vec![4u32, 5], vec![1.0f32, 2.0]);
        let hr = HostRows::gather(&x2, &[&a, &b])?;
        assert_eq!(hr.rows(), 3);
        assert_eq!(
            hr.x.to_vec2::<f32>()?,
            [[2.0, 3.0], [8.0, 9.0], [10.0, 11.0]]
        );
        let ids = hr.ids.as_ref().expect("a subset").to_vec1::<u32>()?;
        assert_eq!(ids, [1, 4, 5]);
        assert_eq!(
            hr.groups,
            [(vec![0, 1], a.1.clone()), (vec![1, 2], b.1.clone())]
        );
        // Every row read: all of them, in order, as they are.
        let c = (vec![0u32, 2, 3], vec![1.0f32; 3]);
        let all = HostRows::gather(&x2, &[&a, &b, &c])?;
        assert!(all.ids.is_none());
        assert_eq!(all.rows(), 6);
        assert_eq!(all.groups, [a, b, c]);
        Ok(())
    }

    fn r(experts: usize, top_k: usize, renormalize: bool) -> Routing {
        Routing {
            experts,
            top_k,
            renormalize,
        }
    }

    /// A half-precision model routes on F32 logits: expert 1's logit is 1 + 2^-9 against
    /// expert 0's 1, a difference below BF16's spacing at 1 (2^-7), so logits rounded to BF16
    /// would tie and the lower index win; in F32 expert 1 wins, as in the F32 model.
    #[test]
    fn half_precision_routers_choose_on_f32_logits() -> Result<()> {
        let dev = candle_core::Device::Cpu;
        let w = Tensor::new(&[[1.0f32, 0.0], [1.0, 1.0 / 512.0]], &dev)?;
        let x = Tensor::new(&[[1.0f32, 1.0]], &dev)?;
        let top1 = Routing::of(2, 1, true);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let router = Linear::from_candle(
                &candle_nn::Linear::new(w.to_dtype(dt)?, None),
                candle_offload::KernelTuning::default(),
            );
            let got = router_logits(&router, &x.to_dtype(dt)?)?;
            assert_eq!(got.dtype(), DType::F32);
            let row = got.to_vec2::<f32>()?.remove(0);
            assert_eq!(row, [1.0, 1.0 + 1.0 / 512.0], "{dt:?}");
            assert_eq!(route_row(&row, top1)[0].0, 1, "{dt:?}");
        }
        // What rounding the logits to BF16 would have done.
        let rounded = Tensor::new(&[1.0f32, 1.0 + 1.0 / 512.0], &dev)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        assert_eq!(route_row(&rounded, top1)[0].0, 0);
        Ok(())
    }

    /// The CPU's pass over K-quant experts gives the generic path's output (Candle's
    /// quantized matmul per expert, gathered and scattered) up to summation order, for a
    /// decode row and for a prompt whose experts get more rows than one group of the loop.
    #[test]
    fn cpu_block_experts_match_the_generic_path() -> Result<()> {
        use crate::layers::{Masks, Rope};
        use candle_core::quantized::GgmlDType;
        use candle_core::Device;
        let dev = Device::Cpu;
        let (h, i, e) = (256usize, 256usize, 4usize);
        let tuning = candle_offload::KernelTuning::default();
        let q = |n, k, ty| -> Result<Linear> {
            let w = (Tensor::randn(0f32, 1.0, (n, k), &dev)? * 0.1)?;
            Ok(Linear::new(
                LinearWeight::Quantized(QMatMul::from_arc(Arc::new(QTensor::quantize(&w, ty)?))?),
                None,
                tuning,
            ))
        };
        let experts = (0..e)
            .map(|j| {
                let down = if j % 2 == 0 {
                    GgmlDType::Q4K
                } else {
                    GgmlDType::Q6K
                };
                Ok(Arc::new(GatedMlp {
                    gate_up: GateUp::Separate {
                        gate: q(i, h, GgmlDType::Q4K)?,
                        up: q(i, h, GgmlDType::Q4K)?,
                    },
                    down: q(h, i, down)?,
                    act: Activation::Silu,
                    intermediate: i,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let router = Linear::from_candle(
            &candle_nn::Linear::new(Tensor::randn(0f32, 1.0, (e, h), &dev)?, None),
            tuning,
        );
        let moe = SparseMoe {
            router,
            routing: r(e, 2, true),
            experts: Experts::InLayer(experts),
            layer: 0,
            shared: None,
        };
        let rope = Rope::from_inv_freq(&[1.0; 8], 64, 1.0, DType::F32, &dev)?;
        let masks = Masks::new(1, 0, &dev);
        let ctx = StepCtx {
            index_pos: 0,
            rope: &rope,
            masks: &masks,
            fused: true,
            pos_dev: None,
            ragged_table: None,
            experts: None,
        };
        for rows in [1usize, 19] {
            let xs = Tensor::randn(0f32, 1.0, (1, rows, h), &dev)?;
            let x2 = xs.reshape((rows, h))?;
            let routes = moe.route(&x2)?;
            let by_expert = group_by_expert(&routes);
            let routed: Vec<(usize, usize)> =
                by_expert.iter().map(|(&e, g)| (e, g.0.len())).collect();
            let placed = moe.place(&routed, &ctx)?;
            let groups: Vec<_> = by_expert
                .values()
                .zip(&placed)
                .map(|(g, p)| (g, p.0.as_ref().expect("acquired")))
                .collect();
            let fast = SparseMoe::forward_cpu_blocks(&x2, &groups)?.expect("K-quant experts");
            let generic = moe.forward(&xs, &ctx, false)?.reshape((rows, h))?;
            // `forward` itself takes the fast path: compare with each expert by hand.
            let mut want = x2.zeros_like()?;
            for (ex, (ids, ws)) in group_by_expert(&routes) {
                let Experts::InLayer(v) = &moe.experts else {
                    unreachable!()
                };
                let ids = Tensor::from_vec(ids, ws.len(), &dev)?;
                let y = v[ex].forward(&x2.index_select(&ids, 0)?)?;
                let w = Tensor::from_vec(ws.clone(), (ws.len(), 1), &dev)?;
                want = want.index_add(&ids, &y.broadcast_mul(&w)?, 0)?;
            }
            let diff = (&fast - &want)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f32>()?
                .sqrt();
            let norm = want.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
            assert!(diff / norm < 1e-2, "rows {rows}: rel L2 {}", diff / norm);
            assert_eq!(fast.to_vec2::<f32>()?, generic.to_vec2::<f32>()?);
        }
        Ok(())
    }

    #[test]
    fn combine_table_gives_each_row_its_copies_positions() {
        // Rows 0-3; expert groups stacked in order: [0, 2] then [2] then [0, 1, 2].
        let groups = [
            (vec![0u32, 2], vec![0.5f32, 0.25]),
            (vec![2], vec![0.125]),
            (vec![0, 1, 2], vec![0.75, 1.0, 2.0]),
        ];
        let (slots, weights, k) = combine_table(4, groups.iter());
        // Row 2 has the most copies (3): every row gets three slots.
        assert_eq!(k, 3);
        let n = NO_SLOT;
        assert_eq!(slots, [0, 3, n, 4, n, n, 1, 2, 5, n, n, n]);
        assert_eq!(
            weights,
            [0.5, 0.75, 0.0, 1.0, 0.0, 0.0, 0.25, 0.125, 2.0, 0.0, 0.0, 0.0]
        );
        // No copies at all: one empty slot a row.
        let (slots, _, k) = combine_table(2, std::iter::empty());
        assert_eq!((k, slots), (1, vec![n, n]));
    }
}
