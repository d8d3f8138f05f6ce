//! The server's settings: where it listens, who may call it, and its limits.

/// The default number of requests that may wait to start.
pub const DEFAULT_QUEUE: usize = 64;
/// The default request body limit: 4 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
/// The default number of new tokens of a request that gives no `max_tokens` (less where the
/// context leaves less room).
pub const DEFAULT_MAX_TOKENS: usize = 512;

/// How the server runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The address to listen on (`127.0.0.1`, `0.0.0.0`, a host name).
    pub host: String,
    /// The port (0: any free port).
    pub port: u16,
    /// Requests to `/v1/...` must send `Authorization: Bearer KEY` (compared in constant
    /// time); `/health` and `/metrics` stay open.
    pub api_key: Option<String>,
    /// Allow cross-origin requests from this origin (`*`: any). `None`: no CORS headers.
    pub cors_origin: Option<String>,
    /// Requests that may wait to start beyond the running ones; more get 503.
    pub queue: usize,
    /// The largest request body, in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// New tokens of a request that gives no `max_tokens` (less where the context leaves
    /// less room).
    pub max_tokens_default: usize,
    /// The model's name in `/v1/models`, and the `model` requests must give (or leave out).
    pub model_name: String,
    /// Seconds a refused client is told to wait (`Retry-After`).
    pub retry_after_s: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            cors_origin: None,
            queue: DEFAULT_QUEUE,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_tokens_default: DEFAULT_MAX_TOKENS,
            model_name: "model".into(),
            retry_after_s: 1,
        }
    }
}
