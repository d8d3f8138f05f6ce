//! A decode row's experts as the device chooses them
//! ([`ExpertRoute`](candle_offload::experts::ExpertRoute)): the expert tier's table of where
//! each expert of each layer is ([`ExpertTable`]), kept true to its cache.
//!
//! Invariant: an expert's entry names its device blocks exactly while [`DeviceRoutes`] holds
//! the expert (its unit's guard, so the runtime cannot move it); every other entry names its
//! host copy, page-locked, which the device reads through its mapped address. An entry goes
//! back to the host copy on the device's stream before the guard is dropped, so that the
//! unit's memory is reused only after every row that could read it.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use candle_core::{Device, Result, Tensor};
use candle_offload::kernels::linear::routed::{qtensor_addr, ExpertAddrs};
use candle_offload::kernels::linear::{ExpertTable, RoutedShape};
use candle_offload::{HostStore, WeightFormat};

use crate::family::Layout;
use crate::layers::{Expert, ExpertShape, Routing};

/// A sparse layer's experts as the table takes them: their shape and host copies.
#[derive(Debug)]
struct LayerRoute {
    shape: RoutedShape,
    /// How an expert's MLP is built from its weights (for adopting it).
    expert: ExpertShape,
    /// Per expert, its host copy's gate, up and down blocks.
    host: Vec<ExpertAddrs>,
}

#[derive(Debug)]
enum LayerState {
    /// Not looked at yet.
    Unknown,
    /// Its experts are not blocks the routed kernels take, or not page-locked.
    Off,
    On(LayerRoute),
}

/// The tier's device routing: its table, the experts it holds, the layers routed in a step
/// not yet read back. See the module docs.
#[derive(Debug)]
pub(crate) struct DeviceRoutes {
    table: Arc<ExpertTable>,
    layers: Vec<LayerState>,
    held: HashMap<(usize, usize), Expert>,
    /// Per layer, the experts its cache admitted that the table does not name yet.
    unadopted: Vec<Vec<usize>>,
    unsettled: Vec<usize>,
    /// The layers the captured step routes (each launch routes them all).
    captured: Vec<usize>,
}

impl DeviceRoutes {
    /// Routes for `layers` decoder layers of `experts` experts on `device`, the experts each
    /// layer's cache holds now (`resident`) to be adopted.
    pub(crate) fn new(device: &Device, experts: usize, resident: Vec<Vec<usize>>) -> Result<Self> {
        let layers = resident.len();
        Ok(Self {
            table: Arc::new(ExpertTable::new(device, layers, experts)?),
            layers: (0..layers).map(|_| LayerState::Unknown).collect(),
            held: HashMap::new(),
            unadopted: resident,
            unsettled: Vec::new(),
            captured: Vec::new(),
        })
    }

    /// `layer`'s cache admitted `expert`: the table names it once it is adopted.
    pub(crate) fn admitted(&mut self, layer: usize, expert: usize) {
        if let Some(v) = self.unadopted.get_mut(layer) {
            v.push(expert);
        }
    }

    /// The experts `layer`'s cache admitted since its last adoption.
    pub(crate) fn take_unadopted(&mut self, layer: usize) -> Vec<usize> {
        self.unadopted
            .get_mut(layer)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// `layer`'s routed shape, its table entries set to the host copies the first time;
    /// `None` where its experts do not allow the routed kernels on `x`.
    pub(crate) fn layer(
        &mut self,
        layer: usize,
        (store, layout): (&HostStore, &Layout),
        (shape, routing): (&ExpertShape, Routing),
        x: &Tensor,
        tuning: &candle_offload::KernelTuning,
    ) -> Result<Option<RoutedShape>> {
        let Some(state) = self.layers.get_mut(layer) else {
            return Ok(None);
        };
        if matches!(state, LayerState::Unknown) {
            *state = match host_copies(layer, store, layout, shape, routing)? {
                Some(route) => {
                    let entries: Vec<(usize, usize, ExpertAddrs)> = route
                        .host
                        .iter()
                        .enumerate()
                        .map(|(e, &a)| (layer, e, a))
                        .collect();
                    self.table.set(&entries)?;
                    LayerState::On(route)
                }
                None => LayerState::Off,
            };
        }
        self.known_layer(layer, x, tuning)
    }

    /// [`layer`](Self::layer) where the layer was looked at before; `None`, setting nothing,
    /// where it was not (a captured step's rows enqueue no change of the table).
    pub(crate) fn known_layer(
        &self,
        layer: usize,
        x: &Tensor,
        tuning: &candle_offload::KernelTuning,
    ) -> Result<Option<RoutedShape>> {
        match self.layers.get(layer) {
            Some(LayerState::On(r)) if r.shape.fits(x, tuning)? => Ok(Some(r.shape)),
            _ => Ok(None),
        }
    }

    /// How `layer`'s experts are built, where the table routes its rows.
    pub(crate) fn expert_shape(&self, layer: usize) -> Option<ExpertShape> {
        match self.layers.get(layer) {
            Some(LayerState::On(r)) => Some(r.expert),
            _ => None,
        }
    }

    /// The experts of `layer`, each acquired on the device: their entries name their blocks
    /// from now on (enqueued, in as few launches as the table takes), and each is held until
    /// [`release`](Self::release). One whose blocks are not of the layer's routed shape is
    /// let go, its entry still the host copy's.
    pub(crate) fn adopt(&mut self, layer: usize, acquired: Vec<(usize, Expert)>) -> Result<()> {
        let LayerState::On(route) = &self.layers[layer] else {
            return Ok(());
        };
        let (gt, dt) = (route.shape.gate, route.shape.down);
        let mut entries = Vec::with_capacity(acquired.len());
        let mut kept = Vec::with_capacity(acquired.len());
        for (expert, x) in acquired {
            let Some([g, u, d]) = crate::layers::separate_blocks(&x.mlp) else {
                continue;
            };
            if g.dtype() != gt || u.dtype() != gt || d.dtype() != dt {
                continue;
            }
            let addrs = [qtensor_addr(g)?, qtensor_addr(u)?, qtensor_addr(d)?];
            entries.push((layer, expert, addrs));
            kept.push((expert, x));
        }
        self.table.set(&entries)?;
        for (expert, x) in kept {
            self.held.insert((layer, expert), x);
        }
        Ok(())
    }

    /// `expert` leaves `layer`'s cache: its entry back to its host copy (enqueued), then its
    /// guard dropped, so that its unit may leave the device once the rows before have run;
    /// nothing to adopt where it was not adopted yet.
    pub(crate) fn release(&mut self, layer: usize, expert: usize) -> Result<()> {
        if let Some(v) = self.unadopted.get_mut(layer) {
            v.retain(|&e| e != expert);
        }
        let Some(held) = self.held.remove(&(layer, expert)) else {
            return Ok(());
        };
        if let LayerState::On(route) = &self.layers[layer] {
            self.table.set(&[(layer, expert, route.host[expert])])?;
        }
        drop(held);
        Ok(())
    }

    /// The table, for a row of `layer` about to be routed on the device (read back at the
    /// next [`settle`](Self::settle)).
    pub(crate) fn route(&mut self, layer: usize) -> Arc<ExpertTable> {
        if !self.unsettled.contains(&layer) {
            self.unsettled.push(layer);
        }
        self.table.clone()
    }

    /// A captured step was launched: its layers' choices are read back at the next
    /// [`settle`](Self::settle). The layers routed since the last settle are the ones a step
    /// just captured routes (its warm-up and capture asked for them); without any, it is a
    /// replay of the last capture.
    pub(crate) fn launched(&mut self) -> Result<()> {
        if self.unsettled.is_empty() {
            self.unsettled = self.captured.clone();
        } else {
            self.captured = self.unsettled.clone();
        }
        self.table.replayed()
    }

    /// Each layer routed since the last call with the experts the device chose for it: waits
    /// for the device to have written the last of them.
    pub(crate) fn settle(&mut self) -> Result<Vec<(usize, Vec<u32>)>> {
        let layers = std::mem::take(&mut self.unsettled);
        layers
            .into_iter()
            .map(|l| {
                let k = match &self.layers[l] {
                    LayerState::On(r) => r.shape.top_k,
                    _ => 0,
                };
                Ok((l, self.table.chosen(l, k)?))
            })
            .collect()
    }
}

/// `layer`'s experts' host copies and their routed shape, where each is a page-locked unit of
/// SiLU-gated GGML blocks (the gate and up of one type, the down of one type, for all), with
/// at most as many experts a token as the kernels take.
fn host_copies(
    layer: usize,
    store: &HostStore,
    layout: &Layout,
    shape: &ExpertShape,
    routing: Routing,
) -> Result<Option<LayerRoute>> {
    let mut host = Vec::with_capacity(routing.experts);
    let mut types: Option<(GgmlDType, GgmlDType)> = None;
    for e in 0..routing.experts {
        let Some(name) = layout.expert(layer, e) else {
            return Ok(None);
        };
        let Some(unit) = store.unit_id(&name).map(|id| store.unit(id)) else {
            return Ok(None);
        };
        if !unit.is_pinned() {
            return Ok(None);
        }
        let mut addrs = [0u64; 3];
        let mut got = [None; 3];
        for (j, proj) in shape.names.iter().enumerate() {
            let full = format!("{name}.{proj}.weight");
            let Some(t) = unit.tensors().iter().find(|t| t.name == full) else {
                return Ok(None);
            };
            let WeightFormat::Ggml(g) = t.format else {
                return Ok(None);
            };
            let want = if j == 2 {
                [shape.hidden, shape.intermediate]
            } else {
                [shape.intermediate, shape.hidden]
            };
            if t.shape.dims() != want {
                return Ok(None);
            }
            got[j] = Some(g);
            addrs[j] = unit.tensor_bytes(t).as_ptr() as u64;
        }
        let (Some(g), Some(u), Some(d)) = (got[0], got[1], got[2]) else {
            return Ok(None);
        };
        if g != u || types.is_some_and(|t| t != (g, d)) {
            return Ok(None);
        }
        types = Some((g, d));
        host.push(addrs);
    }
    let Some((gate, down)) = types else {
        return Ok(None);
    };
    Ok(Some(LayerRoute {
        expert: *shape,
        shape: RoutedShape {
            gate,
            down,
            hidden: shape.hidden,
            inter: shape.intermediate,
            top_k: routing.top_k,
            renormalize: routing.renormalize,
        },
        host,
    }))
}
