//! The engine thread and the server around it: loading (`/health`), the bounded queue, a
//! failed step, and `/metrics`.

use std::sync::atomic::Ordering;
use std::sync::mpsc;

use axum::http::StatusCode;
use serde_json::json;

use super::*;

#[tokio::test]
async fn health_is_503_while_loading_then_200() {
    let (go, wait) = mpsc::channel::<()>();
    let mut app = App::start(config(), move || {
        wait.recv().map_err(|e| e.to_string())?;
        Ok(Loaded {
            backend: Box::new(Fake::new("ok")),
            info: info(),
            max_running: 4,
            memory: None,
        })
    })
    .unwrap();
    let router = app.router();
    let r = send(&router, request("GET", "/health", "", &[])).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(json(r).await, json!({"status": "loading"}));
    let r = post(&router, "/v1/chat/completions", chat_body("Hi")).await;
    let v = error(r, StatusCode::SERVICE_UNAVAILABLE, "unavailable_error").await;
    assert_eq!(v["error"]["code"], "loading");
    let r = send(&router, request("GET", "/metrics", "", &[])).await;
    assert!(text(r).await.contains("candle_offload_model_loaded 0"));
    go.send(()).unwrap();
    app.loaded().await.unwrap();
    let r = send(&router, request("GET", "/health", "", &[])).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(json(r).await, json!({"status": "ok"}));
    let r = post(&router, "/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_failed_load_is_reported() {
    let mut app = App::start(config(), || Err("no such model".into())).unwrap();
    let e = app.loaded().await.unwrap_err();
    assert!(e.to_string().contains("no such model"), "{e}");
    let r = send(&app.router(), request("GET", "/health", "", &[])).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let mut app = App::start(config(), || panic!("boom")).unwrap();
    let e = app.loaded().await.unwrap_err();
    assert!(e.to_string().contains("boom"), "{e}");
}

#[tokio::test]
async fn a_full_queue_answers_503_with_retry_after() {
    // Nothing ever starts: one slot free, one more may wait; the third is refused.
    let mut fake = Fake::new("ok");
    fake.stall = true;
    fake.max_running = 1;
    let log = fake.log.clone();
    let cfg = ServerConfig {
        queue: 1,
        retry_after_s: 3,
        ..config()
    };
    let a = app(cfg, fake).await;
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    let first = post(&a.router(), "/v1/chat/completions", body.clone()).await;
    let second = post(&a.router(), "/v1/chat/completions", body.clone()).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(second.status(), StatusCode::OK);
    let r = post(&a.router(), "/v1/chat/completions", body.clone()).await;
    assert_eq!(r.headers()["retry-after"], "3");
    let v = error(r, StatusCode::SERVICE_UNAVAILABLE, "unavailable_error").await;
    assert_eq!(v["error"]["code"], "queue_full");
    assert_eq!(log.lock().unwrap().submitted.len(), 2);
    let metrics = text(send(&a.router(), request("GET", "/metrics", "", &[])).await).await;
    assert!(
        metrics.contains("candle_offload_queue_waiting 2"),
        "{metrics}"
    );
    // A client that leaves frees its place.
    drop(first);
    eventually("the left request is cancelled", || {
        log.lock().unwrap().cancelled.len() == 1
    })
    .await;
    eventually("the queue shrinks", || a.metrics().queue_depth() == 1).await;
    let r = post(&a.router(), "/v1/chat/completions", body).await;
    assert_eq!(r.status(), StatusCode::OK);
    drop(second);
}

#[tokio::test]
async fn a_failed_step_fails_the_running_requests_and_the_engine_goes_on() {
    let mut fake = Fake::new("abcdef");
    fake.fail_step = Some(3);
    let a = app(config(), fake).await;
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    let r = post(&a.router(), "/v1/chat/completions", body).await;
    assert_eq!(r.status(), StatusCode::OK);
    let data = sse_data(&text(r).await);
    let last: serde_json::Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error", "{data:?}");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("fell over"));
    let r = post(&a.router(), "/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(json(r).await["choices"][0]["message"]["content"], "abcdef");
    let m = text(send(&a.router(), request("GET", "/metrics", "", &[])).await).await;
    assert!(m.contains("candle_offload_step_failures_total 1"), "{m}");
}

#[tokio::test]
async fn a_backend_broken_by_a_failed_step_says_so_in_its_health() {
    let mut fake = Fake::new("abcdef");
    fake.fail_step = Some(2);
    fake.broken_by_failure = Some("rank 1 is gone".into());
    let a = app(config(), fake).await;
    let health = || async { send(&a.router(), request("GET", "/health", "", &[])).await };
    assert_eq!(health().await.status(), StatusCode::OK);
    let r = post(&a.router(), "/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let r = health().await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = json(r).await;
    assert_eq!(body["status"], "error");
    assert_eq!(body["reason"], "rank 1 is gone");
}

#[tokio::test]
async fn metrics_count_requests_tokens_and_return_to_idle() {
    let a = app(config(), Fake::new("four")).await;
    for _ in 0..3 {
        let r = post(&a.router(), "/v1/chat/completions", chat_body("Hi")).await;
        assert_eq!(r.status(), StatusCode::OK);
        text(r).await;
    }
    let r = post(&a.router(), "/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let m = text(send(&a.router(), request("GET", "/metrics", "", &[])).await).await;
    let value = |name: &str| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{m}"))
    };
    assert_eq!(
        value("candle_offload_requests_total{route=\"chat_completions\",status=\"2xx\"}"),
        3.0
    );
    assert_eq!(
        value("candle_offload_requests_total{route=\"chat_completions\",status=\"4xx\"}"),
        1.0
    );
    let prompt = "user: Hi\nassistant:".len() as f64;
    assert_eq!(value("candle_offload_prompt_tokens_total"), 3.0 * prompt);
    // Four letters and EOS per request.
    assert_eq!(value("candle_offload_generated_tokens_total"), 15.0);
    assert_eq!(
        value("candle_offload_time_to_first_token_seconds_count"),
        3.0
    );
    assert_eq!(value("candle_offload_running_sequences"), 0.0);
    assert_eq!(value("candle_offload_queue_waiting"), 0.0);
    assert_eq!(value("candle_offload_kv_bytes"), 0.0);
    assert_eq!(value("candle_offload_kv_limit_bytes"), 100.0 * 64.0 * 4.0);
    assert_eq!(value("candle_offload_model_loaded"), 1.0);
    assert!(value("candle_offload_steps_total") >= 5.0);
    assert!(a.metrics().gauges.loaded.load(Ordering::Relaxed));
}

#[tokio::test]
async fn metrics_show_the_expert_cache_where_the_model_has_one() {
    let mut fake = Fake::new("ok");
    fake.experts = Some((12, 4));
    let a = app(config(), fake).await;
    let r = post(&a.router(), "/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(r.status(), StatusCode::OK);
    text(r).await;
    let m = text(send(&a.router(), request("GET", "/metrics", "", &[])).await).await;
    assert!(
        m.contains("candle_offload_expert_cache_hits_total 12"),
        "{m}"
    );
    assert!(
        m.contains("candle_offload_expert_cache_misses_total 4"),
        "{m}"
    );
    let dense = app(config(), Fake::new("ok")).await;
    let m = text(send(&dense.router(), request("GET", "/metrics", "", &[])).await).await;
    assert!(!m.contains("expert_cache"), "{m}");
}
