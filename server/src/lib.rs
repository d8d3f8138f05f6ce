//! An OpenAI-compatible HTTP server over the continuous batcher of `candle-offload-models`:
//! chat and text completions (streamed as server-sent events or not), the model list, health
//! and Prometheus metrics, on axum and tokio.
//!
//! The model is synchronous, so one thread owns it ([`worker`]); the HTTP side (tokio) sends
//! it requests and streams back their tokens. The server listens at once and answers
//! `/health` with 503 while a `load` function, run on that thread, builds the model; then 200.
//!
//! ```no_run
//! # fn load() -> Result<candle_offload_server::Loaded, candle_offload_server::BoxError> { todo!() }
//! use candle_offload_server::{run, ServerConfig};
//! let config = ServerConfig { model_name: "smollm2".into(), ..Default::default() };
//! run(config, load, |addr| eprintln!("listening on http://{addr}"))?;
//! # Ok::<(), candle_offload_server::ServerError>(())
//! ```

pub mod api;
pub mod config;
pub mod error;
pub mod metrics;
pub mod routes;
pub mod stop;
pub mod text;
pub mod worker;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use tokio::sync::oneshot;

pub use config::ServerConfig;
pub use error::ApiError;
pub use text::{Codec, ModelInfo};
pub use worker::{Backend, MemoryProbe};

use metrics::Metrics;
use routes::AppState;

/// An error from `load` or anything else the server cannot go on after.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What `load` builds: the batcher, the model's text side, and how to read device memory.
pub struct Loaded {
    /// The batcher (or a test's backend).
    pub backend: Box<dyn Backend>,
    /// The tokenizer, chat template, end tokens and context.
    pub info: ModelInfo,
    /// Sequences the backend runs at once (for the queue's bound).
    pub max_running: usize,
    /// Reads (device memory in use, budget) after each step; `None` on the CPU.
    pub memory: Option<MemoryProbe>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("info", &self.info)
            .field("max_running", &self.max_running)
            .finish()
    }
}

/// Why the server stopped or could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// `host:port`.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The model did not load.
    #[error("{0}")]
    Load(String),
    /// A setting is wrong (the CORS origin).
    #[error("{0}")]
    Config(String),
    /// Serving failed.
    #[error("the server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// An error and its causes, `: `-joined.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !s.contains(&c_text) {
            s.push_str(": ");
            s.push_str(&c_text);
        }
        cause = c.source();
    }
    s
}

/// The server's routes and its engine thread, started; no socket (tests call the router
/// directly; [`Server`] puts it on one).
#[derive(Debug)]
pub struct App {
    state: AppState,
    router: Router,
    loaded: Option<oneshot::Receiver<Result<(), String>>>,
}

impl App {
    /// Starts the engine thread, which runs `load` and then serves; until `load` returns,
    /// `/health` answers 503 and the API 503 `loading`.
    pub fn start<F>(config: ServerConfig, load: F) -> Result<Self, ServerError>
    where
        F: FnOnce() -> Result<Loaded, BoxError> + Send + 'static,
    {
        let metrics = Arc::new(Metrics::new());
        let (engine, engine_end) =
            worker::channel(metrics.clone(), config.queue, config.retry_after_s);
        let ready = Arc::new(OnceLock::new());
        let state = AppState {
            config: Arc::new(config),
            engine,
            ready: ready.clone(),
            metrics: metrics.clone(),
            created: routes::unix_now(),
        };
        let router = routes::router(state.clone()).map_err(ServerError::Config)?;
        let (tx, rx) = oneshot::channel();
        std::thread::Builder::new()
            .name("candle-offload-engine".into())
            .spawn(move || {
                let loaded = match catch_unwind(AssertUnwindSafe(load)) {
                    Ok(Ok(l)) => Ok(l),
                    Ok(Err(e)) => Err(chain(e.as_ref())),
                    Err(p) => Err(format!(
                        "loading the model panicked: {}",
                        worker::panic_text(p.as_ref())
                    )),
                };
                match loaded {
                    Ok(l) => {
                        let g = &metrics.gauges;
                        g.max_running.store(l.max_running.max(1), Ordering::SeqCst);
                        let _ = ready.set(l.info);
                        g.loaded.store(true, Ordering::SeqCst);
                        let _ = tx.send(Ok(()));
                        engine_end.run(l.backend, l.memory);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.clone()));
                        engine_end.fail(&e);
                    }
                }
            })?;
        Ok(Self {
            state,
            router,
            loaded: Some(rx),
        })
    }

    /// The routes.
    pub fn router(&self) -> Router {
        self.router.clone()
    }

    /// The counters and gauges.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.state.metrics
    }

    /// Waits until `load` has returned: its error, if it failed. Later calls return `Ok`.
    pub async fn loaded(&mut self) -> Result<(), ServerError> {
        match self.loaded.take() {
            Some(rx) => match rx.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(ServerError::Load(e)),
                Err(_) => Err(ServerError::Load("the engine thread ended".into())),
            },
            None => Ok(()),
        }
    }

    /// Fails every request in flight and stops the engine thread.
    pub fn shutdown(&self) {
        self.state.engine.shutdown();
    }
}

/// A bound socket, to serve an [`App`] on.
#[derive(Debug)]
pub struct Server {
    listener: tokio::net::TcpListener,
    config: ServerConfig,
}

impl Server {
    /// Binds `config.host:config.port` (after checking the settings that can be wrong).
    pub async fn bind(config: ServerConfig) -> Result<Self, ServerError> {
        if let Some(origin) = &config.cors_origin {
            let _checked = routes::cors_layer(origin).map_err(ServerError::Config)?;
        }
        let addr = format!("{}:{}", config.host, config.port);
        let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
            .await
            .map_err(|source| ServerError::Bind {
                addr: addr.clone(),
                source,
            })?;
        Ok(Self { listener, config })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, ServerError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until `shutdown` resolves (then requests in flight end with an error event and
    /// open connections are closed), or until `load` fails (then its error).
    pub async fn serve<F>(
        self,
        load: F,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError>
    where
        F: FnOnce() -> Result<Loaded, BoxError> + Send + 'static,
    {
        let mut app = App::start(self.config, load)?;
        let loaded = app.loaded.take();
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
        let failed_w = failed.clone();
        let engine = app.state.engine.clone();
        let signal = async move {
            let load_failed = async move {
                if let Some(Ok(Err(e))) = match loaded {
                    Some(rx) => Some(rx.await),
                    None => None,
                } {
                    if let Ok(mut f) = failed_w.lock() {
                        *f = Some(e);
                    }
                    return;
                }
                std::future::pending::<()>().await;
            };
            tokio::select! {
                _ = shutdown => {}
                _ = load_failed => {}
            }
            engine.shutdown();
        };
        axum::serve(self.listener, app.router())
            .with_graceful_shutdown(signal)
            .await?;
        let failed = failed.lock().ok().and_then(|mut f| f.take());
        match failed {
            Some(e) => Err(ServerError::Load(e)),
            None => Ok(()),
        }
    }
}

/// Ctrl-C, or on Unix SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Runs the server until Ctrl-C or SIGTERM, on a runtime of its own: binds (then calls
/// `on_listening` with the address), answers `/health` 503 while `load` runs on the engine
/// thread, then serves.
pub fn run<F>(
    config: ServerConfig,
    load: F,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), ServerError>
where
    F: FnOnce() -> Result<Loaded, BoxError> + Send + 'static,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("candle-offload-http")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let server = Server::bind(config).await?;
        on_listening(server.local_addr()?);
        server.serve(load, shutdown_signal()).await
    })
}
