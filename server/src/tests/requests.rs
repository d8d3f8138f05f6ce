//! Non-streaming answers and the bad-request table: each refusal's status, OpenAI error type,
//! param and code.

use axum::http::StatusCode;
use serde_json::json;

use super::*;

#[tokio::test]
async fn a_chat_answer_with_its_usage() {
    let fake = Fake::new("Paris.");
    let log = fake.log.clone();
    let a = app(config(), fake).await;
    let r = post(
        &a.router(),
        "/v1/chat/completions",
        chat_body("Capital of France?"),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    let v = json(r).await;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The plain prompt (no template): "user: ...\nassistant:".
    let prompt = "user: Capital of France?\nassistant:";
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(v["usage"]["completion_tokens"], 6, "EOS is not counted");
    assert_eq!(v["usage"]["total_tokens"], prompt.len() + 6);
    let log = log.lock().unwrap();
    let req = &log.submitted[0].1;
    assert_eq!(req.prompt, tokens(prompt));
    assert_eq!(req.end_tokens, vec![EOS]);
    // No max_tokens: what the context leaves, under the server's default.
    assert_eq!(req.max_new_tokens, CONTEXT - prompt.len());
    assert_eq!(
        req.sampling.temperature,
        Some(1.0),
        "OpenAI's default temperature"
    );
}

#[tokio::test]
async fn a_completion_of_text_or_token_ids() {
    let a = app(config(), Fake::new("abcdefgh")).await;
    let r = post(
        &a.router(),
        "/v1/completions",
        json!({"model": MODEL, "prompt": "Once", "max_tokens": 3, "temperature": 0, "seed": 5}),
    )
    .await;
    let v = json(r).await;
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "abc");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let r = post(
        &a.router(),
        "/v1/completions",
        json!({"prompt": [1, 2, 3, 4], "max_tokens": 12, "ignore_eos": true}),
    )
    .await;
    let v = json(r).await;
    // EOS ignored: the reply runs on (cycled) to max_tokens; the EOS tokens are not text.
    assert_eq!(v["choices"][0]["text"], "abcdefghabc");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 4);
}

/// A bad request: body, status, error type, param, code.
type Row = (
    String,
    StatusCode,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
);

#[tokio::test]
async fn bad_requests_get_openais_error_object() {
    let cfg = ServerConfig {
        max_body_bytes: 4096,
        ..config()
    };
    let a = app(cfg, Fake::new("ok")).await;
    let router = a.router();
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let table: Vec<Row> =
        vec![
        ("{\"messages\": [".into(), StatusCode::BAD_REQUEST, "invalid_request_error", None, None),
        ("[1, 2]".into(), StatusCode::BAD_REQUEST, "invalid_request_error", None, None),
        (json!({"model": "gpt-4", "messages": msgs}).to_string(), StatusCode::NOT_FOUND,
         "not_found_error", Some("model"), Some("model_not_found")),
        (json!({"messages": msgs, "max_tokens": -5}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("max_tokens"), None),
        (json!({"messages": msgs, "max_completion_tokens": 0}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("max_completion_tokens"), None),
        (json!({"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}).to_string(),
         StatusCode::BAD_REQUEST, "invalid_request_error", Some("stop"), None),
        (json!({"messages": msgs, "temperature": 3}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("temperature"), None),
        (json!({"messages": msgs, "top_p": 0}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("top_p"), None),
        (json!({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]})
            .to_string(), StatusCode::BAD_REQUEST, "invalid_request_error", Some("tools"),
         Some("unsupported_parameter")),
        (json!({"messages": msgs, "logprobs": true, "top_logprobs": 2}).to_string(),
         StatusCode::BAD_REQUEST, "invalid_request_error", Some("logprobs"),
         Some("unsupported_parameter")),
        (json!({"messages": msgs, "response_format": {"type": "json_object"}}).to_string(),
         StatusCode::BAD_REQUEST, "invalid_request_error", Some("response_format"),
         Some("unsupported_parameter")),
        (json!({"messages": msgs, "n": 2}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("n"), Some("unsupported_parameter")),
        (json!({"messages": []}).to_string(), StatusCode::BAD_REQUEST, "invalid_request_error",
         Some("messages"), None),
        (json!({"messages": [{"role": "robot", "content": "x"}]}).to_string(),
         StatusCode::BAD_REQUEST, "invalid_request_error", Some("messages[0].role"), None),
        // The plain prompt of 70 bytes is longer than the context of 64.
        (json!({"messages": [{"role": "user", "content": "x".repeat(70)}]}).to_string(),
         StatusCode::BAD_REQUEST, "invalid_request_error", Some("messages"),
         Some("context_length_exceeded")),
        (json!({"messages": msgs, "max_tokens": 60}).to_string(), StatusCode::BAD_REQUEST,
         "invalid_request_error", Some("max_tokens"), Some("context_length_exceeded")),
        (json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}).to_string(),
         StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", None, Some("request_too_large")),
    ];
    for (body, status, kind, param, code) in table {
        let r = send(&router, request("POST", chat, &body, &[])).await;
        let v = error(r, status, kind).await;
        assert_eq!(v["error"]["param"].as_str(), param, "{body}: {v}");
        assert_eq!(v["error"]["code"].as_str(), code, "{body}: {v}");
    }
    let r = post(&router, "/v1/completions", json!({"prompt": ["a", "b"]})).await;
    error(r, StatusCode::BAD_REQUEST, "invalid_request_error").await;
    let r = post(&router, "/v1/completions", json!({"prompt": [5, 999]})).await;
    let v = error(r, StatusCode::BAD_REQUEST, "invalid_request_error").await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("999"),
        "{v}"
    );
    // Not JSON.
    let r = send(
        &router,
        axum::http::Request::builder()
            .method("POST")
            .uri(chat)
            .header("content-type", "text/plain")
            .body(axum::body::Body::from("hi"))
            .unwrap(),
    )
    .await;
    error(
        r,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "invalid_request_error",
    )
    .await;
    let r = send(&router, request("GET", "/v1/nothing", "", &[])).await;
    error(r, StatusCode::NOT_FOUND, "not_found_error").await;
    let r = send(&router, request("GET", chat, "", &[])).await;
    error(r, StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error").await;
    // Every refusal is counted, and nothing reached the engine.
    assert!(a.metrics().requests("chat_completions", "4xx") >= 17);
    // After all that, a good request is served.
    let r = post(&router, chat, chat_body("Hi")).await;
    assert_eq!(json(r).await["choices"][0]["message"]["content"], "ok");
}

#[tokio::test]
async fn the_api_key_guards_the_api_not_health_or_metrics() {
    let cfg = ServerConfig {
        api_key: Some("sesame".into()),
        ..config()
    };
    let a = app(cfg, Fake::new("ok")).await;
    let router = a.router();
    let body = chat_body("Hi").to_string();
    for headers in [
        vec![],
        vec![("authorization", "Bearer open")],
        vec![("authorization", "Bearer sesame2")],
        vec![("authorization", "sesame")],
    ] {
        let r = send(
            &router,
            request("POST", "/v1/chat/completions", &body, &headers),
        )
        .await;
        let v = error(r, StatusCode::UNAUTHORIZED, "authentication_error").await;
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let r = send(&router, request("GET", "/v1/models", "", &[])).await;
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let ok = [("authorization", "Bearer sesame")];
    let r = send(&router, request("POST", "/v1/chat/completions", &body, &ok)).await;
    assert_eq!(r.status(), StatusCode::OK);
    for open in ["/health", "/metrics"] {
        let r = send(&router, request("GET", open, "", &[])).await;
        assert_eq!(r.status(), StatusCode::OK, "{open}");
    }
}

#[tokio::test]
async fn cors_is_off_by_default_and_on_for_the_origin_given() {
    let a = app(config(), Fake::new("ok")).await;
    let pre = |origin: &str| {
        axum::http::Request::builder()
            .method("OPTIONS")
            .uri("/v1/chat/completions")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let r = send(&a.router(), pre("http://ui.example")).await;
    assert!(r.headers().get("access-control-allow-origin").is_none());
    let cfg = ServerConfig {
        cors_origin: Some("http://ui.example".into()),
        ..config()
    };
    let a = app(cfg, Fake::new("ok")).await;
    let r = send(&a.router(), pre("http://ui.example")).await;
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "http://ui.example"
    );
    let r = send(&a.router(), pre("http://evil.example")).await;
    assert!(r.headers().get("access-control-allow-origin").is_none());
    let bad = ServerConfig {
        cors_origin: Some("bad\norigin".into()),
        ..config()
    };
    assert!(App::start(bad, || Err("unused".into())).is_err());
}
