//! Which GPU runs which layers when several share a model: a pure placement planner.
//!
//! # The model of placement
//! A decoder is a sequence of units in execution order: `pre` units (the embeddings), `N`
//! layers, then `post` units (the final norm, the output head). With several GPUs the model runs
//! as a pipeline: each device gets one **contiguous** range of layers, the ranges follow the
//! order in which the devices are given, so the hidden state crosses between GPUs at most
//! `D - 1` times per forward. The `pre` units are kept resident on the first device that has
//! layers, the `post` units on the last one; a device with no layers holds nothing.
//!
//! On each device (a *stage*) the layers are either resident or streamed from pinned host
//! memory by that device's own offload runtime. A stage's room for weights is its budget minus
//! the reservation the caller declares for it (activations, KV cache, workspace). Its room is
//! split exactly as [`plan_capacity`] splits a single device's budget (strategy `minimal`):
//! - if its kept units and all its layers fit, every layer is resident and nothing streams;
//! - otherwise the stage streams, and needs the streaming floor: its kept units plus
//!   `depth + 1` of its largest layer (the one in use and `depth` in flight), at the deepest
//!   `depth` up to the one asked for that fits. Layers are then marked resident in order while
//!   they fit beside the floor (first fit); the others are streamed.
//!
//! # When a placement is impossible
//! A stage is *possible* when `reserve + kept + largest layer <= budget` (the floor at depth 0,
//! the same test [`plan_capacity`] refuses with). A device map is possible when every device
//! with layers is a possible stage.
//! - [`PlacementMode::Sequential`] is refused exactly when **no** contiguous assignment of the
//!   layers to the devices (in order, some devices possibly empty) has only possible stages.
//!   The error reports, per device, the MiB missing in the assignment that is cheapest to fix
//!   (least bytes added over all devices): adding them makes a placement possible.
//! - [`PlacementMode::Balanced`] fixes the layer counts, so it is refused exactly when one of
//!   its stages is not possible; each device's missing MiB are its own stage's.
//!
//! Missing MiB are what makes a placement possible at prefetch depth 0; a deeper prefetch may
//! want more, and is shallowed per device as [`plan_capacity`] does.
//!
//! # Modes
//! - **Sequential** (`device_map = "sequential"`): GPU 0 takes as many layers as it can hold
//!   resident (with the embeddings), then GPU 1, and so on. Layers that fit nowhere are
//!   streamed through the last device that has layers (its range is extended to the end),
//!   or, when that one cannot stream them, through the first device that can, tried in this
//!   order: later devices, then earlier ones from the nearest (devices after the streaming one
//!   then get nothing). A device that can stream at the depth asked for is preferred to one
//!   that would have to prefetch less. Only when no single device can stream the tail (layers
//!   of very different sizes, or a last device that holds the head beside a small last layer
//!   only), the assignment with the most resident bytes is searched for among all contiguous
//!   ones; there a middle device, or several, may stream.
//! - **Balanced** (`device_map = "balanced"`): layer counts differ by at most one, the first
//!   devices taking the extra layers (with fewer layers than devices, the last ones get none);
//!   each device streams what does not fit in its room.
//!
//! With one device both modes give one stage holding everything, with the capacity and depth
//! [`plan_capacity`] gives for it.
//!
//! A [`DeviceMap`] is printed before any weight is loaded, saved as JSON, and a map written by
//! hand can be checked and completed with [`DeviceMap::validate`].
//!
//! The planners are in `plan.rs`, the checks of hand-written maps in `validate.rs`, and JSON in
//! and out in `json.rs`; `types.rs` holds the types they share.

#[cfg(doc)]
use crate::plan::plan_capacity;

mod json;
mod plan;
#[cfg(test)]
mod testutil;
mod types;
mod validate;

pub use plan::plan_placement;
pub use types::{
    DeviceBudget, DeviceMap, DevicePlacement, PlacementError, PlacementMode, PlacementRequest,
    Residency, Result, UnitPlacement,
};
