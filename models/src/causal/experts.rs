//! The experts of mixture-of-experts layers as units of their own
//! ([`Layout::experts`](crate::Layout::experts)): a block routed to one acquires it here from
//! the runtime of the stage that runs the layer, and gets the expert's MLP built once per
//! residency (kept with the unit, as a layer's block is).

use std::sync::Arc;

use candle_core::{DType, Result};
use candle_offload::OffloadRuntime;

use crate::family::{Layout, UnitWeights};
use crate::layers::{BuildExpert, Expert, ExpertUnits, GatedMlp};

/// One runtime's expert units (see the module docs).
pub(crate) struct RuntimeExperts<'a> {
    pub(crate) rt: &'a OffloadRuntime,
    pub(crate) layout: &'a Layout,
    /// The compute dtype of the stage.
    pub(crate) dtype: DType,
}

/// An expert's MLP kept with its unit, with the dtype it was built in.
struct BuiltExpert(DType, Arc<GatedMlp>);

impl ExpertUnits for RuntimeExperts<'_> {
    fn expert(&self, layer: usize, expert: usize, build: BuildExpert<'_>) -> Result<Expert> {
        let Some(name) = self.layout.expert(layer, expert) else {
            candle_core::bail!("layer {layer}: the model's layout has no expert units");
        };
        let unit = self.rt.acquire_named(&name)?;
        let dtype = self.dtype;
        let make = || -> Result<BuiltExpert> {
            let w = UnitWeights::new(unit.var_builder(dtype), Some(&unit));
            Ok(BuiltExpert(dtype, Arc::new(build(w.pp(&name))?)))
        };
        // Kept with the unit where it holds nothing but the unit's tensors (no conversion).
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
    }
}
