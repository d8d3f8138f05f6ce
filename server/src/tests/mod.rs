//! The server's tests over a backend of their own (no model, no network): requests go to
//! the router through `tower::ServiceExt::oneshot`, the engine thread runs a [`Fake`] batcher
//! that answers every prompt with a scripted reply, one token per step.

mod engine;
mod requests;
mod streaming;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::Router;
use candle_offload_models::batching::{BatchGauges, FinishReason, Rejection, SeqEvent, SeqRequest};
use http_body_util::BodyExt as _;
use tower::ServiceExt as _;

use crate::text::{Codec, ModelInfo};
use crate::worker::Backend;
use crate::{App, Loaded, ServerConfig};

/// The end-of-generation token of [`Bytes`].
pub const EOS: u32 = 256;
/// Positions a request may reach.
pub const CONTEXT: usize = 64;
/// The served model's name.
pub const MODEL: &str = "fake-model";

/// One byte per token; ids from 256 are control tokens (left out of the text).
pub struct Bytes;

impl Codec for Bytes {
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, String> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        let b: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }
}

/// The tokens of `text` (one per byte).
pub fn tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// What a [`Fake`] saw.
#[derive(Debug, Default)]
pub struct Log {
    /// Sequences submitted, with their request.
    pub submitted: Vec<(u64, SeqRequest)>,
    /// Sequences cancelled (found and dropped).
    pub cancelled: Vec<u64>,
    /// Steps run.
    pub steps: u64,
}

/// A batcher that answers every prompt with `reply` (cycled), one token per step.
pub struct Fake {
    /// Sequences at once.
    pub max_running: usize,
    /// The reply's tokens.
    pub reply: Vec<u32>,
    /// Never start a sequence (they all wait).
    pub stall: bool,
    /// Fail this step (1-based).
    pub fail_step: Option<u64>,
    /// After the failed step, say the backend is broken with this (as a multi-process model
    /// whose ranks fell apart does).
    pub broken_by_failure: Option<String>,
    broken: Option<String>,
    /// Sleep this long in every step.
    pub delay: Duration,
    /// What happened.
    pub log: Arc<Mutex<Log>>,
    /// The expert cache's hits and misses the gauges report (`None`: a dense model).
    pub experts: Option<(u64, u64)>,
    waiting: VecDeque<(u64, SeqRequest)>,
    running: Vec<(u64, SeqRequest, usize)>,
    last_batch: usize,
}

impl Fake {
    /// Replies `reply` then EOS, 4 sequences at once.
    pub fn new(reply: &str) -> Self {
        let mut r = tokens(reply);
        r.push(EOS);
        Self::tokens(r)
    }

    /// Replies these tokens (cycled).
    pub fn tokens(reply: Vec<u32>) -> Self {
        Self {
            max_running: 4,
            reply,
            stall: false,
            fail_step: None,
            broken_by_failure: None,
            broken: None,
            delay: Duration::ZERO,
            log: Arc::default(),
            experts: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            last_batch: 0,
        }
    }
}

impl Backend for Fake {
    fn broken(&self) -> Option<String> {
        self.broken.clone()
    }

    fn check(&self, req: &SeqRequest) -> Result<(), Rejection> {
        if req.prompt.is_empty() {
            return Err(Rejection::EmptyPrompt);
        }
        if req.max_new_tokens == 0 {
            return Err(Rejection::NoNewTokens);
        }
        if req.prompt.len() + req.max_new_tokens > CONTEXT {
            return Err(Rejection::TooLong {
                prompt: req.prompt.len(),
                new: req.max_new_tokens,
                max_len: CONTEXT,
            });
        }
        Ok(())
    }

    fn submit(&mut self, id: u64, req: SeqRequest) -> Result<(), Rejection> {
        self.check(&req)?;
        self.log.lock().unwrap().submitted.push((id, req.clone()));
        self.waiting.push_back((id, req));
        Ok(())
    }

    fn cancel(&mut self, id: u64) -> bool {
        let before = self.waiting.len() + self.running.len();
        self.waiting.retain(|(i, _)| *i != id);
        self.running.retain(|(i, _, _)| *i != id);
        let found = self.waiting.len() + self.running.len() < before;
        if found {
            self.log.lock().unwrap().cancelled.push(id);
        }
        found
    }

    fn step(&mut self) -> candle_core::Result<Vec<(u64, SeqEvent)>> {
        let step = {
            let mut log = self.log.lock().unwrap();
            log.steps += 1;
            log.steps
        };
        if self.fail_step == Some(step) {
            self.broken = self.broken_by_failure.clone();
            candle_core::bail!("the fake device fell over");
        }
        std::thread::sleep(self.delay);
        while !self.stall && self.running.len() < self.max_running {
            let Some((id, req)) = self.waiting.pop_front() else {
                break;
            };
            self.running.push((id, req, 0));
        }
        let mut events = Vec::new();
        for (id, req, n) in &mut self.running {
            let t = self.reply[*n % self.reply.len()];
            *n += 1;
            events.push((*id, SeqEvent::Token(t)));
            if req.end_tokens.contains(&t) {
                events.push((*id, SeqEvent::Finished(FinishReason::EndToken)));
            } else if *n >= req.max_new_tokens {
                events.push((*id, SeqEvent::Finished(FinishReason::Length)));
            }
        }
        self.last_batch = self.running.len();
        let done: Vec<u64> = events
            .iter()
            .filter(|(_, e)| matches!(e, SeqEvent::Finished(_)))
            .map(|(id, _)| *id)
            .collect();
        self.running.retain(|(i, _, _)| !done.contains(i));
        Ok(events)
    }

    fn gauges(&self) -> BatchGauges {
        let kv: u64 = self
            .running
            .iter()
            .map(|(_, r, _)| (r.prompt.len() + r.max_new_tokens) as u64 * 100)
            .sum();
        BatchGauges {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_bytes: kv,
            kv_limit_bytes: 100 * CONTEXT as u64 * self.max_running as u64,
            last_batch: self.last_batch,
            last_rows: self.last_batch,
            steps: self.log.lock().unwrap().steps,
            expert_cache: self.experts,
        }
    }

    fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn abort_all(&mut self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.running.drain(..).map(|r| r.0).collect();
        ids.extend(self.waiting.drain(..).map(|w| w.0));
        ids
    }
}

/// The model side of [`Bytes`].
pub fn info() -> ModelInfo {
    ModelInfo {
        codec: Arc::new(Bytes),
        chat_template: None,
        end_tokens: vec![EOS],
        context: CONTEXT,
        vocab_size: 257,
    }
}

/// The default settings, serving [`MODEL`].
pub fn config() -> ServerConfig {
    ServerConfig {
        model_name: MODEL.into(),
        ..Default::default()
    }
}

/// A started app over `fake`, loaded.
pub async fn app(config: ServerConfig, fake: Fake) -> App {
    let max_running = fake.max_running;
    let mut app = App::start(config, move || {
        Ok(Loaded {
            backend: Box::new(fake),
            info: info(),
            max_running,
            memory: None,
        })
    })
    .unwrap();
    app.loaded().await.unwrap();
    app
}

/// A request of `method` to `path` with a JSON body and extra headers.
pub fn request(method: &str, path: &str, body: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(path);
    if !body.is_empty() {
        b = b.header("content-type", "application/json");
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body.to_string())).unwrap()
}

/// Sends `req` through `router`.
pub async fn send(router: &Router, req: Request<Body>) -> Response {
    router.clone().oneshot(req).await.unwrap()
}

/// POSTs a JSON body.
pub async fn post(router: &Router, path: &str, body: serde_json::Value) -> Response {
    send(router, request("POST", path, &body.to_string(), &[])).await
}

/// The whole body as text.
pub async fn text(r: Response) -> String {
    let bytes = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The whole body as JSON.
pub async fn json(r: Response) -> serde_json::Value {
    let t = text(r).await;
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("not JSON ({e}): {t}"))
}

/// The `data:` payloads of an SSE body.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|s| s.to_string())
        .collect()
}

/// Asserts `r` is OpenAI's error object with `status` and `kind`; returns it.
pub async fn error(r: Response, status: StatusCode, kind: &str) -> serde_json::Value {
    assert_eq!(r.status(), status);
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "application/json"
    );
    let v = json(r).await;
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v
}

/// Polls `cond` for up to 5 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// A chat request body asking `content`.
pub fn chat_body(content: &str) -> serde_json::Value {
    serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": content}]})
}

#[tokio::test]
async fn the_module_compiles_its_helpers() {
    let a = app(config(), Fake::new("ok")).await;
    let r = send(&a.router(), request("GET", "/v1/models", "", &[])).await;
    assert_eq!(r.status(), StatusCode::OK);
    let v = json(r).await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
}
