//! Gradient checkpointing: keep segment boundaries, recompute segments in the backward pass.
//!
//! [`Checkpointer::checkpoint`] runs a segment on a detached copy of its input, so the
//! segment's graph (its activations, and with an offload runtime its weights) is freed as soon
//! as the segment returns; only the output is kept. The output is tied back to the input by a
//! custom op whose backward re-runs the segment with the graph on, back-propagates the incoming
//! gradient through it (the vector-Jacobian product, as `sum(segment(x) * grad)`), hands the
//! parameter gradients to a [`GradSink`] (by default a side store merged by
//! [`Checkpointer::backward`]) and returns the input's gradient. Gradients equal those of plain
//! backprop exactly in F32: the recompute runs the same ops on the same inputs.
//!
//! Why a custom op: Candle's backward walks one graph and offers no hook to re-enter it, and a
//! custom op has at most three tensor inputs, so the parameters cannot be its inputs (there may be
//! hundreds); their
//! gradients leave through the sink instead. The op's forward is an identity on the
//! precomputed output (one activation-sized copy per segment, the price of attaching a graph
//! node to an existing tensor; the precomputed output is dropped once copied).
//!
//! A segment must be deterministic (no dropout without re-seeding) and must use differentiable
//! ops (see the [module docs](super)). Unlike PyTorch's `checkpoint_sequential`, every segment
//! is checkpointed, the last one too: Candle frees a graph only when its root drops, so an
//! un-checkpointed last segment would hold its activations through the whole backward pass.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Module, Tensor, Var};

use super::grad::attach_precomputed;

type SegmentFn = dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// Receives the parameter gradients of one recomputed segment, right after its backward pass
/// (e.g. to move them off the device while the next segment recomputes).
pub type GradSink = Arc<dyn Fn(GradStore) -> candle_core::Result<()> + Send + Sync>;

struct Inner {
    side: Mutex<GradStore>,
    sink: Option<GradSink>,
    recomputes: AtomicUsize,
}

/// Runs checkpointed segments and collects their parameter gradients. Use one per step.
#[derive(Clone)]
pub struct Checkpointer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointer")
            .field("recomputes", &self.recomputed_segments())
            .field("sink", &self.inner.sink.is_some())
            .finish()
    }
}

impl Default for Checkpointer {
    fn default() -> Self {
        Self::new()
    }
}

/// `n_blocks` blocks cut into `n_segments` contiguous ranges whose lengths differ by at most
/// one (the first ranges get the extra block). `n_segments` is clamped to `1..=n_blocks`.
pub fn segment_ranges(n_blocks: usize, n_segments: usize) -> Vec<Range<usize>> {
    if n_blocks == 0 {
        return Vec::new();
    }
    let n = n_segments.clamp(1, n_blocks);
    let (base, extra) = (n_blocks / n, n_blocks % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

impl Checkpointer {
    /// Parameter gradients of segments are kept in a side store that
    /// [`backward`](Self::backward) merges.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                side: Mutex::new(GradStore::default()),
                sink: None,
                recomputes: AtomicUsize::new(0),
            }),
        }
    }

    /// Parameter gradients of segments go to `sink` as each segment's backward pass ends.
    pub fn with_sink(sink: GradSink) -> Self {
        Self {
            inner: Arc::new(Inner {
                side: Mutex::new(GradStore::default()),
                sink: Some(sink),
                recomputes: AtomicUsize::new(0),
            }),
        }
    }

    /// Segments recomputed so far (one per checkpoint in each backward pass).
    pub fn recomputed_segments(&self) -> usize {
        self.inner.recomputes.load(Ordering::Relaxed)
    }

    /// `segment(xs)`, keeping only its output: the backward pass recomputes it.
    pub fn checkpoint<F>(&self, segment: F, xs: &Tensor) -> candle_core::Result<Tensor>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        self.checkpoint_arc(Arc::new(segment), xs)
    }

    fn checkpoint_arc(&self, f: Arc<SegmentFn>, xs: &Tensor) -> candle_core::Result<Tensor> {
        let _span = tracing::trace_span!("checkpoint.forward").entered();
        // The segment's graph dies with the temporary: only the detached output survives.
        let ys = f(&xs.detach())?.detach();
        // An input without a graph would make the node untracked and lose the parameters'
        // gradients: give it a leaf of its own.
        let xs = if xs.track_op() {
            xs.clone()
        } else {
            Var::from_tensor(xs)?.into_inner()
        };
        let inner = self.inner.clone();
        attach_precomputed(
            &xs,
            ys,
            "checkpoint",
            Arc::new(move |xs, grad| recompute(&f, &inner, xs, grad)),
        )
    }

    /// `blocks` run in order, cut into `n_segments` checkpointed segments
    /// ([`segment_ranges`]).
    pub fn checkpoint_sequential(
        &self,
        blocks: &[Arc<dyn Module + Send + Sync>],
        n_segments: usize,
        xs: &Tensor,
    ) -> candle_core::Result<Tensor> {
        if n_segments == 0 {
            candle_core::bail!("checkpoint_sequential needs at least one segment");
        }
        let mut xs = xs.clone();
        for range in segment_ranges(blocks.len(), n_segments) {
            let seg: Vec<_> = blocks[range].to_vec();
            xs = self.checkpoint(
                move |x| {
                    let mut x = x.clone();
                    for b in &seg {
                        x = b.forward(&x)?;
                    }
                    Ok(x)
                },
                &xs,
            )?;
        }
        Ok(xs)
    }

    /// `loss.backward()` plus the parameter gradients the segments left in the side store.
    pub fn backward(&self, loss: &Tensor) -> candle_core::Result<GradStore> {
        let mut grads = {
            let _span = tracing::trace_span!("checkpoint.graph_backward").entered();
            loss.backward()?
        };
        let side = std::mem::take(&mut *self.side()?);
        grads.extend(side)?;
        Ok(grads)
    }

    /// Adds `grad` to the gradient of `t` that [`backward`](Self::backward) returns: how a
    /// block that computes its own backward pass (outside Candle's graph walk) hands its
    /// weights' gradients over. Contributions for one tensor are summed.
    pub fn add_gradient(&self, t: &Tensor, grad: Tensor) -> candle_core::Result<()> {
        let mut side = self.side()?;
        let sum = match side.remove(t) {
            Some(g) => (g + grad)?,
            None => grad,
        };
        side.insert(t, sum);
        Ok(())
    }

    fn side(&self) -> candle_core::Result<std::sync::MutexGuard<'_, GradStore>> {
        self.inner
            .side
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint gradient store poisoned".into()))
    }
}

/// The backward pass of a checkpoint: re-runs the segment on its input with the graph on,
/// back-propagates the incoming gradient through it, hands the parameters' gradients on, and
/// returns the input's.
fn recompute(
    f: &Arc<SegmentFn>,
    inner: &Inner,
    xs: &Tensor,
    grad: &Tensor,
) -> candle_core::Result<Option<Tensor>> {
    let _span = tracing::trace_span!("checkpoint.recompute").entered();
    let input = Var::from_tensor(&xs.detach())?;
    let ys = f(input.as_tensor())?;
    // d/dθ sum(ys ⊙ grad) = Jᵀ grad: the vector-Jacobian product for inputs and parameters.
    // Rows first: Candle reduces a whole tensor in one GPU block (milliseconds for a
    // segment's 4096 x 2048 output); a sum per row runs on every multiprocessor.
    let prod = (ys * grad.detach())?;
    let surrogate = if prod.rank() >= 2 {
        prod.sum(candle_core::D::Minus1)?.sum_all()?
    } else {
        prod.sum_all()?
    };
    let vars: Vec<Tensor> = surrogate
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable())
        .cloned()
        .collect();
    let mut all = surrogate.backward()?;
    // The recomputed graph goes before the gradients go anywhere.
    drop(surrogate);
    let dx = all.remove(input.as_tensor());
    // Candle's backward also leaves gradients for every constant operand (the incoming
    // gradient itself, masks, rotary tables), activation-sized and never read: keep only
    // the variables', or every segment's leftovers would live until the outer pass ends.
    let mut grads = GradStore::default();
    for v in &vars {
        if let Some(g) = all.remove(v) {
            grads.insert(v, g);
        }
    }
    drop(all);
    inner.recomputes.fetch_add(1, Ordering::Relaxed);
    match &inner.sink {
        Some(sink) => sink(grads)?,
        None => inner
            .side
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint gradient store poisoned".into()))?
            .extend(grads)?,
    }
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, D};

    #[test]
    fn ranges_are_even_and_cover_everything() {
        assert_eq!(segment_ranges(5, 2), vec![0..3, 3..5]);
        assert_eq!(segment_ranges(4, 4), vec![0..1, 1..2, 2..3, 3..4]);
        assert_eq!(segment_ranges(3, 9), vec![0..1, 1..2, 2..3]);
        assert_eq!(segment_ranges(3, 0), vec![0..3]);
        assert!(segment_ranges(0, 2).is_empty());
    }

    /// Gradients through checkpointed segments equal plain backprop exactly, for parameters
    /// inside the segments and upstream of them.
    #[test]
    fn checkpointed_gradients_equal_plain_ones() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let w0 = Var::randn(0f32, 1., (6, 6), &dev)?;
        let ws: Vec<Var> = (0..4)
            .map(|_| Var::randn(0f32, 0.5, (6, 6), &dev))
            .collect::<candle_core::Result<_>>()?;
        let x = Tensor::randn(0f32, 1., (3, 6), &dev)?;
        let blocks: Vec<Arc<dyn Module + Send + Sync>> = ws
            .iter()
            .map(|w| {
                let w = w.as_tensor().clone();
                Arc::new(move |x: &Tensor| {
                    let h = x.matmul(&w)?;
                    candle_nn::ops::softmax(&h.tanh()?, D::Minus1)? + x
                }) as Arc<dyn Module + Send + Sync>
            })
            .collect();
        let head = |y: &Tensor| y.sqr()?.sum_all();
        let plain = {
            let mut h = x.matmul(w0.as_tensor())?;
            for b in &blocks {
                h = b.forward(&h)?;
            }
            head(&h)?.backward()?
        };
        for n in [1, 2, 4] {
            let ck = Checkpointer::new();
            let h = x.matmul(w0.as_tensor())?;
            let y = ck.checkpoint_sequential(&blocks, n, &h)?;
            let grads = ck.backward(&head(&y)?)?;
            assert_eq!(ck.recomputed_segments(), n);
            for v in std::iter::once(&w0).chain(&ws) {
                let a = plain
                    .get(v.as_tensor())
                    .unwrap()
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let b = grads
                    .get(v.as_tensor())
                    .unwrap()
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                assert_eq!(a, b, "{n} segments");
            }
        }
        Ok(())
    }
}
