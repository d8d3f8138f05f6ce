//! The HTTP routes: `POST /v1/chat/completions` and `POST /v1/completions` (server-sent
//! events in OpenAI's chunk format, or one JSON answer), `GET /v1/models`, `GET /health`,
//! `GET /metrics`; the API key, CORS, the body limit and the request counts around them.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_offload_models::batching::{FinishReason, Rejection, SamplingParams, SeqRequest};
use subtle::ConstantTimeEq as _;
use tower_http::cors::{AllowOrigin, CorsLayer};

use crate::api::{self, GenParams, Prompt, Usage};
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::stop::StopMatcher;
use crate::text::{Detokenizer, ModelInfo};
use crate::worker::{CancelOnDrop, Engine, Event};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The settings.
    pub config: Arc<ServerConfig>,
    /// The engine's handle.
    pub engine: Engine,
    /// The model, once loaded.
    pub ready: Arc<OnceLock<ModelInfo>>,
    /// Counters and gauges.
    pub metrics: Arc<Metrics>,
    /// Unix seconds at start.
    pub created: u64,
}

/// Unix seconds now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    fn model(&self) -> Result<&ModelInfo, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::loading(self.config.retry_after_s))
    }

    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(m) if m != self.config.model_name => {
                Err(ApiError::model_not_found(m, &self.config.model_name))
            }
            _ => Ok(()),
        }
    }

    fn body<T>(&self, body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
        match body {
            Ok(Json(v)) => Ok(v),
            Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::too_large(self.config.max_body_bytes))
            }
            Err(r) => Err(r.into()),
        }
    }
}

/// The route's name in the request counts.
fn route_name(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/v1/models" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        _ => "other",
    }
}

/// Counts every response by route and status class.
async fn count_requests(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = route_name(req.uri().path());
    let res = next.run(req).await;
    s.metrics.count_request(route, res.status().as_u16());
    res
}

/// `Authorization: Bearer KEY`, compared in constant time, when the server has a key.
async fn require_key(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("")
            .trim();
        if !bool::from(given.as_bytes().ct_eq(key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The CORS layer for `origin` (`*`: any).
pub fn cors_layer(origin: &str) -> Result<CorsLayer, String> {
    let allow = if origin == "*" {
        AllowOrigin::any()
    } else {
        let v = HeaderValue::from_str(origin)
            .map_err(|_| format!("--cors {origin:?}: not a valid origin"))?;
        AllowOrigin::list([v])
    };
    Ok(CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
        .max_age(Duration::from_secs(600)))
}

/// The server's routes over `state`.
pub fn router(state: AppState) -> Result<Router, String> {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let mut app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(v1)
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state.clone());
    if let Some(origin) = &state.config.cors_origin {
        app = app.layer(cors_layer(origin)?);
    }
    Ok(app.layer(middleware::from_fn_with_state(state, count_requests)))
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::no_route(method.as_str(), uri.path())
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}

async fn health(State(s): State<AppState>) -> Response {
    if let Some(why) = s.metrics.broken() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "error", "reason": why})),
        )
            .into_response();
    }
    if s.ready.get().is_some() {
        (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response()
    } else {
        let mut r = (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "loading"})),
        )
            .into_response();
        r.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(s.config.retry_after_s),
        );
        r
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        s.metrics.render(Instant::now()),
    )
        .into_response()
}

async fn models(State(s): State<AppState>) -> Result<Json<api::ModelList>, ApiError> {
    s.model()?;
    Ok(Json(api::ModelList {
        object: "list",
        data: vec![api::ModelEntry {
            id: s.config.model_name.clone(),
            object: "model",
            created: s.created,
            owned_by: "candle-offload",
        }],
    }))
}

/// Which endpoint a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(
    State(s): State<AppState>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Response {
    let run = async {
        let body = s.body(body)?;
        let req = api::parse_chat(&body)?;
        s.check_model(req.model.as_deref())?;
        let info = s.model()?;
        let text = info.chat_prompt(&req.messages)?;
        let ids = info
            .codec
            .encode_prompt(&text)
            .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize: {e}")))?;
        start(&s, info, ids, req.params, Kind::Chat, "messages").await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(s): State<AppState>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Response {
    let run = async {
        let body = s.body(body)?;
        let req = api::parse_completion(&body)?;
        s.check_model(req.model.as_deref())?;
        let info = s.model()?;
        let ids = match req.prompt {
            Prompt::Text(t) => info
                .codec
                .encode_prompt(&t)
                .map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize: {e}")))?,
            Prompt::Tokens(ids) => {
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= info.vocab_size) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "token id {bad} is not in the vocabulary ({} tokens)",
                            info.vocab_size
                        ),
                    ));
                }
                ids
            }
        };
        start(&s, info, ids, req.params, Kind::Completion, "prompt").await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// A seed for a request that gives none.
fn fresh_seed(id_hint: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    // SplitMix64 of the time and the hint.
    let mut z = nanos ^ id_hint.rotate_left(32) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What the engine's answer says to the client.
fn rejection(r: Rejection, prompt_param: &str) -> ApiError {
    match r {
        r @ Rejection::TooLong { .. } => ApiError::context_length(prompt_param, r.to_string()),
        r @ (Rejection::EmptyPrompt | Rejection::NoNewTokens) => {
            ApiError::invalid(prompt_param, r.to_string())
        }
        r @ Rejection::NeverFits { .. } => ApiError::context_length(
            "max_tokens",
            format!("{r}: ask for fewer tokens (max_tokens) or send a shorter prompt"),
        ),
        other => ApiError::internal(other.to_string()),
    }
}

/// Checks the lengths, submits, and answers (a stream, or JSON at the end).
async fn start(
    s: &AppState,
    info: &ModelInfo,
    prompt: Vec<u32>,
    p: GenParams,
    kind: Kind,
    prompt_param: &str,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    if prompt.is_empty() {
        return Err(ApiError::invalid(prompt_param, "the prompt has no tokens"));
    }
    let ctx = info.context;
    if prompt.len() >= ctx {
        return Err(ApiError::context_length(
            prompt_param,
            format!(
                "the prompt ({} tokens) leaves no room for new tokens in the context of {ctx} \
                 positions",
                prompt.len()
            ),
        ));
    }
    let room = ctx - prompt.len();
    let max_new = match p.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::context_length(
                "max_tokens",
                format!(
                    "the prompt ({} tokens) and max_tokens {n} exceed the context of {ctx} \
                     positions (at most {room} new tokens)",
                    prompt.len()
                ),
            ))
        }
        Some(n) => n,
        None => room.min(s.config.max_tokens_default.max(1)),
    };
    let end_tokens = if p.ignore_eos {
        Vec::new()
    } else {
        info.end_tokens.clone()
    };
    let prompt_tokens = prompt.len();
    let req = SeqRequest {
        prompt,
        max_new_tokens: max_new,
        sampling: SamplingParams {
            temperature: Some(p.temperature.unwrap_or(1.0)),
            top_p: p.top_p,
            seed: p.seed.unwrap_or_else(|| fresh_seed(prompt_tokens as u64)),
        },
        end_tokens: end_tokens.clone(),
    };
    let mut sub = s.engine.submit(req)?;
    match (&mut sub.admitted).await {
        Ok(Ok(())) => {}
        Ok(Err(r)) => return Err(rejection(r, prompt_param)),
        Err(_) => return Err(ApiError::internal("the engine has stopped")),
    }
    s.metrics.add_prompt_tokens(prompt_tokens);
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{:x}{:08x}", s.created, sub.id),
        created: unix_now(),
        model: s.config.model_name.clone(),
        kind,
        include_usage: p.include_usage,
    };
    let gen = Generation {
        events: sub.events,
        cancel: sub.cancel,
        detok: Detokenizer::new(info.codec.clone()),
        stop: StopMatcher::new(p.stop),
        end_tokens,
        prompt_tokens,
        completion_tokens: 0,
        arrived,
        first: true,
        metrics: s.metrics.clone(),
        out: VecDeque::new(),
        done: false,
    };
    Ok(if p.stream {
        stream(gen, meta)
    } else {
        collect(gen, meta).await?
    })
}

/// What a generation produced next.
#[derive(Debug)]
enum Piece {
    Text(String),
    End { finish: &'static str, usage: Usage },
    Failed(ApiError),
}

/// A running request's tokens turned into text, stop strings applied.
struct Generation {
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    cancel: CancelOnDrop,
    detok: Detokenizer,
    stop: StopMatcher,
    end_tokens: Vec<u32>,
    prompt_tokens: usize,
    completion_tokens: usize,
    arrived: Instant,
    first: bool,
    metrics: Arc<Metrics>,
    out: VecDeque<Piece>,
    done: bool,
}

impl Generation {
    fn text(&mut self, t: String) {
        if !t.is_empty() {
            self.out.push_back(Piece::Text(t));
        }
    }

    fn end(&mut self, finish: &'static str) {
        self.out.push_back(Piece::End {
            finish,
            usage: Usage::new(self.prompt_tokens, self.completion_tokens),
        });
        self.done = true;
    }

    /// A stop string matched: the text before it, the end, and the sequence cancelled.
    fn stopped(&mut self, text: String) {
        self.text(text);
        self.end("stop");
        self.events.close();
        self.cancel.fire();
    }

    fn fail(&mut self, e: ApiError) {
        self.out.push_back(Piece::Failed(e));
        self.done = true;
    }

    async fn next(&mut self) -> Option<Piece> {
        loop {
            if let Some(p) = self.out.pop_front() {
                return Some(p);
            }
            if self.done {
                return None;
            }
            match self.events.recv().await {
                None => self.fail(ApiError::internal("the engine dropped the request")),
                Some(Event::Failed(why)) => {
                    self.cancel.disarm();
                    self.fail(ApiError::internal(why));
                }
                Some(Event::Token(t)) => {
                    if self.first {
                        self.first = false;
                        self.metrics.observe_ttft(self.arrived.elapsed());
                    }
                    if self.end_tokens.contains(&t) {
                        continue;
                    }
                    self.completion_tokens += 1;
                    match self.detok.push(t) {
                        Ok(Some(piece)) => {
                            let r = self.stop.push(&piece);
                            if r.stopped {
                                self.stopped(r.text);
                            } else {
                                self.text(r.text);
                            }
                        }
                        Ok(None) => {}
                        Err(e) => self.fail(ApiError::internal(format!("cannot decode: {e}"))),
                    }
                }
                Some(Event::Finished(reason)) => {
                    self.cancel.disarm();
                    let rest = match self.detok.rest() {
                        Ok(r) => r.unwrap_or_default(),
                        Err(e) => {
                            self.fail(ApiError::internal(format!("cannot decode: {e}")));
                            continue;
                        }
                    };
                    let r = self.stop.push(&rest);
                    if r.stopped {
                        self.text(r.text);
                        self.end("stop");
                    } else {
                        self.text(r.text);
                        let held = self.stop.finish();
                        self.text(held);
                        self.end(match reason {
                            FinishReason::Length => "length",
                            _ => "stop",
                        });
                    }
                }
            }
        }
    }
}

/// What every chunk of a response repeats.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
}

impl Meta {
    fn chat_chunk(&self, delta: api::Delta, finish: Option<&'static str>) -> api::ChatChunk {
        api::ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![api::ChunkChoice {
                index: 0,
                delta,
                finish_reason: finish,
                logprobs: None,
            }],
            usage: None,
        }
    }

    fn text_chunk(&self, text: String, finish: Option<&'static str>) -> api::TextCompletion {
        api::TextCompletion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![api::TextChoice {
                text,
                index: 0,
                finish_reason: finish,
                logprobs: None,
            }],
            usage: None,
        }
    }

    /// The SSE data of a piece of text.
    fn text_event(&self, text: String) -> String {
        match self.kind {
            Kind::Chat => json(&self.chat_chunk(
                api::Delta {
                    role: None,
                    content: Some(text),
                },
                None,
            )),
            Kind::Completion => json(&self.text_chunk(text, None)),
        }
    }

    /// The SSE data of the end: the finishing chunk, and the usage chunk if asked for.
    fn end_events(&self, finish: &'static str, usage: Usage) -> Vec<String> {
        let mut out = Vec::new();
        match self.kind {
            Kind::Chat => {
                out.push(json(&self.chat_chunk(api::Delta::default(), Some(finish))));
                if self.include_usage {
                    let mut c = self.chat_chunk(api::Delta::default(), None);
                    c.choices.clear();
                    c.usage = Some(usage);
                    out.push(json(&c));
                }
            }
            Kind::Completion => {
                out.push(json(&self.text_chunk(String::new(), Some(finish))));
                if self.include_usage {
                    let mut c = self.text_chunk(String::new(), None);
                    c.choices.clear();
                    c.usage = Some(usage);
                    out.push(json(&c));
                }
            }
        }
        out
    }
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| {
        ApiError::internal(format!("cannot serialize a response: {e}")).to_json()
    })
}

/// The answer as server-sent events: for a chat, the role first; the text as it comes; the
/// finishing chunk; the usage chunk if asked; `[DONE]`. A failure mid-stream is an error
/// object event, then the end.
fn stream(gen: Generation, meta: Meta) -> Response {
    let mut pending: VecDeque<String> = VecDeque::new();
    if meta.kind == Kind::Chat {
        pending.push_back(json(&meta.chat_chunk(
            api::Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            None,
        )));
    }
    let state = (gen, meta, pending, false);
    let events =
        futures_util::stream::unfold(state, |(mut gen, meta, mut pending, mut over)| async move {
            loop {
                if let Some(data) = pending.pop_front() {
                    let e = SseEvent::default().data(data);
                    return Some((Ok::<_, Infallible>(e), (gen, meta, pending, over)));
                }
                if over {
                    return None;
                }
                match gen.next().await {
                    Some(Piece::Text(t)) => pending.push_back(meta.text_event(t)),
                    Some(Piece::End { finish, usage }) => {
                        pending.extend(meta.end_events(finish, usage));
                        pending.push_back("[DONE]".to_string());
                        over = true;
                    }
                    Some(Piece::Failed(e)) => {
                        pending.push_back(e.to_json());
                        over = true;
                    }
                    None => over = true,
                }
            }
        });
    Sse::new(events).into_response()
}

/// The answer as one JSON object, once the generation ends.
async fn collect(mut gen: Generation, meta: Meta) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match gen.next().await {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::End { finish, usage }) => {
                let body = match meta.kind {
                    Kind::Chat => json(&api::ChatCompletion {
                        id: meta.id,
                        object: "chat.completion",
                        created: meta.created,
                        model: meta.model,
                        choices: vec![api::ChatChoice {
                            index: 0,
                            message: api::AssistantMessage {
                                role: "assistant",
                                content: text,
                            },
                            finish_reason: finish,
                            logprobs: None,
                        }],
                        usage,
                    }),
                    Kind::Completion => {
                        let mut c = meta.text_chunk(text, Some(finish));
                        c.usage = Some(usage);
                        json(&c)
                    }
                };
                return Ok((
                    [(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("application/json"),
                    )],
                    body,
                )
                    .into_response());
            }
            Some(Piece::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the generation ended without an end")),
        }
    }
}
