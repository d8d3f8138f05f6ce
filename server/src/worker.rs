//! The engine thread: one std thread owns the batcher (the model is synchronous), takes
//! requests and cancellations from the handlers over a channel, runs steps while anything
//! waits or runs (it blocks when idle), and sends each sequence's tokens to its request.
//!
//! - A request whose receiver is closed (its client went away, or its handler finished at a
//!   stop string) is cancelled before the next step, which frees its KV memory.
//! - A failed step (an error or a panic) ends every running request with an error event and
//!   the thread goes on serving.
//! - The queue is bounded: a request that would wait behind more than the queue's length of
//!   others is refused at once (503 with `Retry-After`).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_offload_models::batching::{
    BatchGauges, Batcher, FinishReason, Rejection, SeqEvent, SeqRequest,
};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::error::ApiError;
use crate::metrics::Metrics;

/// What the server needs of a batcher: [`Batcher`]'s methods, so that tests can run the
/// server over a backend of their own.
pub trait Backend {
    /// Whether `req` could ever run.
    fn check(&self, req: &SeqRequest) -> Result<(), Rejection>;
    /// Queues `req` as sequence `id`.
    fn submit(&mut self, id: u64, req: SeqRequest) -> Result<(), Rejection>;
    /// Drops sequence `id` and frees its memory; false if unknown.
    fn cancel(&mut self, id: u64) -> bool;
    /// One step: what happened to each sequence.
    fn step(&mut self) -> candle_core::Result<Vec<(u64, SeqEvent)>>;
    /// The current state.
    fn gauges(&self) -> BatchGauges;
    /// Nothing waits or runs.
    fn is_idle(&self) -> bool;
    /// Drops every sequence; returns their ids.
    fn abort_all(&mut self) -> Vec<u64>;
    /// Why it can no longer step (every later step would fail), if so.
    fn broken(&self) -> Option<String> {
        None
    }
}

impl Backend for Batcher {
    fn check(&self, req: &SeqRequest) -> Result<(), Rejection> {
        Batcher::check(self, req)
    }
    fn submit(&mut self, id: u64, req: SeqRequest) -> Result<(), Rejection> {
        Batcher::submit(self, id, req)
    }
    fn cancel(&mut self, id: u64) -> bool {
        Batcher::cancel(self, id)
    }
    fn step(&mut self) -> candle_core::Result<Vec<(u64, SeqEvent)>> {
        Batcher::step(self)
    }
    fn gauges(&self) -> BatchGauges {
        Batcher::gauges(self)
    }
    fn is_idle(&self) -> bool {
        Batcher::is_idle(self)
    }
    fn abort_all(&mut self) -> Vec<u64> {
        Batcher::abort_all(self)
    }
    fn broken(&self) -> Option<String> {
        Batcher::broken(self).map(str::to_string)
    }
}

/// What a request hears from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Its next token (an end token too, before `Finished`).
    Token(u32),
    /// It is done.
    Finished(FinishReason),
    /// The engine failed it (a failed step, the server shutting down).
    Failed(String),
}

/// A device memory reading: (bytes in use, budget), `None` on a CPU.
pub type MemoryProbe = Box<dyn FnMut() -> Option<(u64, u64)>>;

enum Command {
    Submit {
        id: u64,
        req: SeqRequest,
        events: tmpsc::UnboundedSender<Event>,
        admitted: oneshot::Sender<Result<(), Rejection>>,
    },
    Cancel(u64),
    Shutdown,
}

/// The handlers' end of the engine: submits requests.
#[derive(Debug, Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    metrics: Arc<Metrics>,
    next_id: Arc<AtomicU64>,
    queue: usize,
    retry_after_s: u64,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Submit { id, .. } => write!(f, "Submit({id})"),
            Self::Cancel(id) => write!(f, "Cancel({id})"),
            Self::Shutdown => write!(f, "Shutdown"),
        }
    }
}

/// A submitted request: whether the engine took it, then its events. Dropping it cancels
/// the sequence.
#[derive(Debug)]
pub struct Submitted {
    /// The sequence's id.
    pub id: u64,
    /// The engine's answer: taken, or why it can never run.
    pub admitted: oneshot::Receiver<Result<(), Rejection>>,
    /// Its tokens and end.
    pub events: tmpsc::UnboundedReceiver<Event>,
    /// Cancels the sequence when dropped.
    pub cancel: CancelOnDrop,
}

/// Cancels a sequence when dropped, unless [`CancelOnDrop::disarm`]ed (it finished).
#[derive(Debug)]
pub struct CancelOnDrop {
    id: u64,
    tx: Option<mpsc::Sender<Command>>,
}

impl CancelOnDrop {
    /// The sequence ended by itself: nothing to cancel.
    pub fn disarm(&mut self) {
        self.tx = None;
    }

    /// Cancels now.
    pub fn fire(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Command::Cancel(self.id));
        }
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.fire();
    }
}

/// The engine thread's end: the commands, and what it publishes.
pub struct EngineThread {
    rx: mpsc::Receiver<Command>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for EngineThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineThread")
    }
}

/// A channel between the handlers and the engine thread; `queue` requests may wait to start.
pub fn channel(metrics: Arc<Metrics>, queue: usize, retry_after_s: u64) -> (Engine, EngineThread) {
    let (tx, rx) = mpsc::channel();
    (
        Engine {
            tx,
            metrics: metrics.clone(),
            next_id: Arc::new(AtomicU64::new(1)),
            queue,
            retry_after_s,
        },
        EngineThread { rx, metrics },
    )
}

impl Engine {
    /// Sends `req` to the engine, unless the queue is full (503 with `Retry-After`).
    ///
    /// A request waits when every slot runs: it may go on if fewer than `queue` others
    /// would wait ahead of it once the free slots are taken.
    pub fn submit(&self, req: SeqRequest) -> Result<Submitted, ApiError> {
        let g = &self.metrics.gauges;
        let ahead = g.queued.fetch_add(1, Ordering::SeqCst) + g.waiting.load(Ordering::SeqCst);
        let free = g
            .max_running
            .load(Ordering::SeqCst)
            .saturating_sub(g.running.load(Ordering::SeqCst));
        if ahead + 1 > self.queue + free {
            g.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::queue_full(self.queue, self.retry_after_s));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = tmpsc::unbounded_channel();
        let (admitted_tx, admitted) = oneshot::channel();
        let sent = self.tx.send(Command::Submit {
            id,
            req,
            events: events_tx,
            admitted: admitted_tx,
        });
        if sent.is_err() {
            g.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::internal("the engine has stopped"));
        }
        Ok(Submitted {
            id,
            admitted,
            events,
            cancel: CancelOnDrop {
                id,
                tx: Some(self.tx.clone()),
            },
        })
    }

    /// Tells the engine thread to fail every request and stop.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

struct Worker {
    backend: Box<dyn Backend>,
    metrics: Arc<Metrics>,
    active: HashMap<u64, tmpsc::UnboundedSender<Event>>,
    probe: Option<MemoryProbe>,
    probed: Option<Instant>,
}

/// What a panic carried, as text.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".to_string())
}

impl Worker {
    /// Handles a command; false at shutdown.
    fn command(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                req,
                events,
                admitted,
            } => {
                let result = if admitted.is_closed() || events.is_closed() {
                    // Its client left before the engine took it.
                    None
                } else {
                    Some(
                        self.backend
                            .check(&req)
                            .and_then(|_| self.backend.submit(id, req)),
                    )
                };
                self.publish();
                self.metrics.gauges.queued.fetch_sub(1, Ordering::SeqCst);
                if let Some(result) = result {
                    let ok = result.is_ok();
                    if admitted.send(result).is_err() && ok {
                        self.backend.cancel(id);
                    } else if ok {
                        self.active.insert(id, events);
                    }
                }
            }
            Command::Cancel(id) => {
                if self.active.remove(&id).is_some() && self.backend.cancel(id) {
                    self.metrics.add_cancelled();
                }
            }
            Command::Shutdown => {
                self.fail_all("the server is shutting down");
                return false;
            }
        }
        true
    }

    /// Ends every sequence with `why`.
    fn fail_all(&mut self, why: &str) {
        let ids = match catch_unwind(AssertUnwindSafe(|| self.backend.abort_all())) {
            Ok(ids) => ids,
            Err(_) => self.active.keys().copied().collect(),
        };
        for id in ids {
            if let Some(tx) = self.active.remove(&id) {
                let _ = tx.send(Event::Failed(why.to_string()));
            }
        }
        for (_, tx) in self.active.drain() {
            let _ = tx.send(Event::Failed(why.to_string()));
        }
    }

    /// Cancels the sequences whose request is gone.
    fn drop_closed(&mut self) {
        let closed: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in closed {
            self.active.remove(&id);
            if self.backend.cancel(id) {
                self.metrics.add_cancelled();
            }
        }
    }

    /// Writes the backend's gauges (and the device's memory) into the metrics.
    fn publish(&mut self) {
        let b = self.backend.gauges();
        let g = &self.metrics.gauges;
        g.waiting.store(b.waiting, Ordering::SeqCst);
        g.running.store(b.running, Ordering::SeqCst);
        g.kv_bytes.store(b.kv_bytes, Ordering::Relaxed);
        g.kv_limit_bytes.store(b.kv_limit_bytes, Ordering::Relaxed);
        g.last_batch.store(b.last_batch, Ordering::Relaxed);
        g.last_rows.store(b.last_rows, Ordering::Relaxed);
        g.steps.store(b.steps, Ordering::Relaxed);
        if let Some((hits, misses)) = b.expert_cache {
            g.expert_hits.store(hits, Ordering::Relaxed);
            g.expert_misses.store(misses, Ordering::Relaxed);
            g.experts_known.store(true, Ordering::Relaxed);
        }
        // The device's memory at most every 100 ms (a driver call).
        let due = self
            .probed
            .is_none_or(|t| t.elapsed() >= Duration::from_millis(100));
        if let (Some(probe), true) = (&mut self.probe, due) {
            self.probed = Some(Instant::now());
            if let Some((used, budget)) = probe() {
                g.gpu_used_bytes.store(used, Ordering::Relaxed);
                g.gpu_budget_bytes.store(budget, Ordering::Relaxed);
                g.gpu_known.store(true, Ordering::Relaxed);
            }
        }
    }

    /// One step, its events sent; false when it did nothing.
    fn step(&mut self) -> bool {
        let events = match catch_unwind(AssertUnwindSafe(|| self.backend.step())) {
            Ok(Ok(events)) => events,
            Ok(Err(e)) => {
                tracing::error!("a batch step failed: {e}");
                self.metrics.add_step_failure();
                if let Some(why) = self.backend.broken() {
                    self.metrics.set_broken(why);
                }
                self.fail_all(&format!("the batch step failed: {e}"));
                return true;
            }
            Err(p) => {
                let why = panic_text(p.as_ref());
                tracing::error!("a batch step panicked: {why}");
                self.metrics.add_step_failure();
                self.fail_all(&format!("the batch step failed: {why}"));
                return true;
            }
        };
        let tokens = events
            .iter()
            .filter(|(_, e)| matches!(e, SeqEvent::Token(_)))
            .count();
        if tokens > 0 {
            self.metrics.add_generated(tokens as u64, Instant::now());
        }
        let did = !events.is_empty();
        for (id, e) in events {
            let (event, last) = match e {
                SeqEvent::Token(t) => (Event::Token(t), false),
                SeqEvent::Finished(r) => (Event::Finished(r), true),
            };
            let gone = match self.active.get(&id) {
                Some(tx) => tx.send(event).is_err(),
                None => !last,
            };
            if last {
                self.active.remove(&id);
            } else if gone {
                self.active.remove(&id);
                if self.backend.cancel(id) {
                    self.metrics.add_cancelled();
                }
            }
        }
        did
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        self.publish();
        loop {
            if self.backend.is_idle() {
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.command(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                if !self.command(cmd) {
                    return;
                }
            }
            self.drop_closed();
            if self.backend.is_idle() {
                self.publish();
                continue;
            }
            let did = self.step();
            self.publish();
            if !did {
                // Nothing could run (e.g. all wait for memory): wait a little for a command.
                match rx.recv_timeout(Duration::from_millis(2)) {
                    Ok(cmd) => {
                        if !self.command(cmd) {
                            return;
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
        }
    }
}

impl EngineThread {
    /// Serves requests with `backend` until shutdown or until every [`Engine`] is dropped;
    /// `probe` reads the device's memory after each step.
    pub fn run(self, backend: Box<dyn Backend>, probe: Option<MemoryProbe>) {
        let worker = Worker {
            backend,
            metrics: self.metrics,
            active: HashMap::new(),
            probe,
            probed: None,
        };
        worker.run(self.rx);
    }

    /// The model did not load: answers every request sent so far with `why`.
    pub fn fail(self, why: &str) {
        while let Ok(cmd) = self.rx.try_recv() {
            if let Command::Submit { events, .. } = cmd {
                let _ = events.send(Event::Failed(why.to_string()));
            }
        }
    }
}
