//! Decode steps captured as CUDA graphs ([`StepGraph`]) and replayed while the units they read
//! stay resident.

use super::shared::{Engine, OffloadRuntime, Resident};
use crate::cache::UnitId;
use crate::diag::device_label;

/// A decode step captured as a CUDA graph by [`OffloadRuntime::capture_step`] and launched by
/// [`OffloadRuntime::replay_step`], valid while the units resident at its capture stay.
#[derive(Debug)]
pub struct StepGraph {
    graph: crate::sys::StepGraph,
    /// The runtime's residency generation at the capture.
    generation: u64,
}

impl OffloadRuntime {
    /// Whether every unit this runtime serves, but the indirect ones
    /// ([`set_indirect`](Self::set_indirect)), is on its device with its copies done: what
    /// [`capture_step`](Self::capture_step) needs (a fully resident model after its first
    /// pass). Always false off the GPU.
    pub fn all_resident(&self) -> candle_core::Result<bool> {
        let direct: Vec<UnitId> = {
            let st = self.state()?;
            (0..self.shared.served.len())
                .filter(|&u| self.shared.served[u] && !st.indirect[u])
                .map(UnitId)
                .collect()
        };
        self.resident_all_of(direct)
    }

    /// Marks `units` indirect: a captured step reads them only through addresses its caller
    /// keeps true outside the graph (a table of where each one is, set between launches,
    /// while the caller holds the ones it names; a mixture-of-experts layer's experts). Their
    /// arrivals and departures leave a captured step valid, and a capture does not wait for
    /// them to be resident. A captured step that acquires one directly reads freed memory
    /// once it moves: the caller's to avoid.
    pub fn set_indirect(&self, units: impl IntoIterator<Item = UnitId>) -> candle_core::Result<()> {
        let mut st = self.state()?;
        for UnitId(u) in units {
            if let Some(x) = st.indirect.get_mut(u) {
                *x = true;
            }
        }
        Ok(())
    }

    /// [`all_resident`](Self::all_resident) for `units` only (a capture of part of a step,
    /// whose runtime also serves units it does not run). Always false off the GPU.
    pub fn resident_all_of(
        &self,
        units: impl IntoIterator<Item = UnitId>,
    ) -> candle_core::Result<bool> {
        let Engine::Cuda(engine) = &self.shared.engine else {
            return Ok(false);
        };
        let st = self.state()?;
        for UnitId(u) in units {
            match st.resident.get(u).and_then(Option::as_ref) {
                Some(Resident {
                    sync: Some(sync), ..
                }) if engine.is_ready(sync)? => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Captures the GPU work `f` enqueues (a decode step: its acquires, kernels and
    /// allocations) into a CUDA graph: [`replay_step`](Self::replay_step) runs it, as often as
    /// wanted, with one launch. `f` runs twice: once eagerly (a warm-up whose work is done, so
    /// `f` must give the same result when repeated), then captured, when nothing runs. While
    /// it runs, acquires neither move nor wait for units and record no uses: every unit has to
    /// be resident and ready ([`all_resident`](Self::all_resident)), or the capture is
    /// refused. `f` must leave nothing it allocated alive when it returns (write results into
    /// buffers allocated before), and everything the graph should read anew at each replay
    /// (token ids, the position) must live in such buffers too. An error from `f`, or a
    /// capture the driver refuses, is returned after the capture ended; the stream then runs
    /// as before.
    pub fn capture_step<R>(
        &self,
        f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        if self.shared.engine_is_cuda() && !self.all_resident()? {
            candle_core::bail!("a captured step needs every unit resident and ready");
        }
        self.capture_resident(f)
    }

    /// [`capture_step`](Self::capture_step) of work that acquires only `units` (each resident
    /// and ready, or the capture is refused), on a runtime that serves others too (a GPU
    /// stage that also serves host layers for prompts, capturing one run of its own layers).
    pub fn capture_step_of<R>(
        &self,
        units: &[UnitId],
        f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        if self.shared.engine_is_cuda() && !self.resident_all_of(units.iter().copied())? {
            candle_core::bail!("a captured run needs its units resident and ready");
        }
        self.capture_resident(f)
    }

    /// The capture behind [`capture_step`](Self::capture_step), once residency is checked.
    fn capture_resident<R>(
        &self,
        mut f: impl FnMut() -> candle_core::Result<R>,
    ) -> candle_core::Result<(StepGraph, R)> {
        let _span = tracing::debug_span!("offload.capture").entered();
        let Engine::Cuda(engine) = &self.shared.engine else {
            candle_core::bail!(
                "CUDA graphs need a GPU runtime, not {}",
                device_label(&self.shared.device)
            );
        };
        let generation = {
            let mut st = self.state()?;
            st.capturing = true;
            // From now on uses go unrecorded: evictions record a fresh last use (H19).
            st.replayed = true;
            st.generation
        };
        // The hand-over slot's buffer was allocated before: it must not be freed inside.
        candle_offload_kernels::forget_handover();
        let out = engine.capture(|| {
            let r = f();
            candle_offload_kernels::forget_handover();
            r
        });
        let mut st = self.state()?;
        st.capturing = false;
        let (graph, r) = out?;
        if st.generation != generation {
            candle_core::bail!("units moved while the step was captured");
        }
        drop(st);
        // The graph keeps one step's activations in memory of its own from its first launch;
        // the blocks earlier eager steps left cached in the pool go back to the driver, so the
        // two do not add up at the peak.
        engine.synchronize()?;
        crate::sys::trim_memory_pool(&self.shared.device)?;
        Ok((StepGraph { graph, generation }, r))
    }

    /// Launches `graph` on the device's compute stream (after everything enqueued there
    /// before) and returns true; returns false, launching nothing, when a unit arrived or
    /// left since the capture (the graph would read freed weights: capture again).
    pub fn replay_step(&self, graph: &StepGraph) -> candle_core::Result<bool> {
        let Engine::Cuda(engine) = &self.shared.engine else {
            candle_core::bail!("CUDA graphs need a GPU runtime");
        };
        let mut st = self.state()?;
        if st.generation != graph.generation {
            return Ok(false);
        }
        st.replayed = true;
        engine.replay(&graph.graph)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::Device;

    use super::super::config::OffloadConfig;
    use super::super::shared::OffloadRuntime;
    use super::super::testutil::zero_layers;
    use crate::cache::UnitId;

    /// A CPU runtime over two small layers.
    fn two_layers() -> anyhow::Result<OffloadRuntime> {
        let dev = Device::Cpu;
        Ok(OffloadRuntime::new(
            Arc::new(zero_layers(2, 64, &dev)?),
            &dev,
            &OffloadConfig::default(),
        )?)
    }

    /// An indirect unit's arrival and departure leave the residency generation (what a
    /// captured step's replay checks) as it was; a direct one's change it.
    #[test]
    fn indirect_units_leave_a_captured_step_valid() -> anyhow::Result<()> {
        let rt = two_layers()?;
        rt.set_indirect([UnitId(1)])?;
        let generation = || rt.state().map(|st| st.generation);
        let g0 = generation()?;
        drop(rt.acquire_layer(1)?);
        assert!(rt.evict_unit(UnitId(1))?, "layer 1 was resident");
        assert_eq!(generation()?, g0, "an indirect unit moved the generation");
        drop(rt.acquire_layer(0)?);
        assert!(
            generation()? > g0,
            "a direct unit's arrival left the generation"
        );
        Ok(())
    }

    #[test]
    fn a_cpu_runtime_captures_no_step() -> anyhow::Result<()> {
        let rt = two_layers()?;
        for i in 0..2 {
            drop(rt.acquire_layer(i)?);
        }
        assert!(
            !rt.all_resident()?,
            "only a GPU runtime holds units a graph can read"
        );
        let mut ran = false;
        let err = rt
            .capture_step(|| {
                ran = true;
                Ok(())
            })
            .unwrap_err();
        assert!(err.to_string().contains("GPU runtime"), "{err}");
        assert!(!ran, "nothing runs when the capture is refused");
        Ok(())
    }
}
