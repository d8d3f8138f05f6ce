//! Server-sent events: the chunk format, stop strings held back across tokens, UTF-8 split
//! between tokens, and a client that goes away mid-stream.

use std::time::Duration;

use axum::http::StatusCode;
use http_body_util::BodyExt as _;
use serde_json::{json, Value};

use super::*;

fn chunks(body: &str) -> (Vec<Value>, Vec<String>) {
    let data = sse_data(body);
    let values = data
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect();
    (values, data)
}

fn content(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

#[tokio::test]
async fn a_chat_stream_in_openais_chunk_format() {
    let a = app(config(), Fake::new("Paris is nice.")).await;
    let mut body = chat_body("Capital?");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(&a.router(), "/v1/chat/completions", body).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (c, data) = chunks(&text(r).await);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    // The role comes first, alone.
    assert_eq!(c[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(c[1..].iter().all(|c| c["choices"]
        .get(0)
        .is_none_or(|ch| ch["delta"].get("role").is_none())));
    for ch in &c {
        assert_eq!(ch["object"], "chat.completion.chunk");
        assert_eq!(ch["id"], c[0]["id"]);
        assert_eq!(ch["model"], MODEL);
    }
    assert_eq!(content(&c), "Paris is nice.");
    let n = c.len();
    // The finishing chunk, then the usage chunk with no choices.
    assert_eq!(c[n - 2]["choices"][0]["finish_reason"], "stop");
    assert!(c[..n - 2]
        .iter()
        .all(|ch| ch["choices"][0]["finish_reason"].is_null()));
    assert_eq!(c[n - 1]["choices"], json!([]));
    assert_eq!(c[n - 1]["usage"]["completion_tokens"], 14);
    assert_eq!(
        c[n - 1]["usage"]["total_tokens"],
        c[n - 1]["usage"]["prompt_tokens"].as_u64().unwrap() + 14
    );
    // Without include_usage, no usage chunk.
    let mut body = chat_body("Capital?");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(5);
    let (c, _) = chunks(&text(post(&a.router(), "/v1/chat/completions", body).await).await);
    assert!(c.iter().all(|ch| ch.get("usage").is_none()));
    assert_eq!(content(&c), "Paris");
    assert_eq!(c.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_completion_stream() {
    let a = app(config(), Fake::new("abc")).await;
    let body = json!({"prompt": "x", "stream": true, "stream_options": {"include_usage": true}});
    let (c, data) = chunks(&text(post(&a.router(), "/v1/completions", body).await).await);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let text: String = c
        .iter()
        .filter_map(|c| c["choices"].get(0)?["text"].as_str())
        .collect();
    assert_eq!(text, "abc");
    assert!(c.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(c[c.len() - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(c[c.len() - 1]["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn stop_strings_are_held_back_across_tokens_and_end_the_sequence() {
    // One byte per token: "</s>" arrives over four tokens, "<" alone first.
    let mut fake = Fake::tokens(tokens("Hi <b> there</s>never sent"));
    // Slow enough that the stop string is seen long before the sequence's own end.
    fake.delay = Duration::from_millis(5);
    let log = fake.log.clone();
    let a = app(config(), fake).await;
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    body["stop"] = json!(["</s>", "zzz"]);
    body["stream_options"] = json!({"include_usage": true});
    let (c, _) = chunks(&text(post(&a.router(), "/v1/chat/completions", body).await).await);
    assert_eq!(content(&c), "Hi <b> there");
    for ch in &c {
        let t = ch["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        assert!(!t.contains("</"), "a stop string's start was sent: {t:?}");
    }
    assert_eq!(c[c.len() - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(c[c.len() - 1]["usage"]["completion_tokens"], 16);
    // The engine cancelled the sequence when the stop string matched (it had room for more).
    eventually("the stopped sequence is cancelled", || {
        !log.lock().unwrap().cancelled.is_empty()
    })
    .await;
    // Not streamed: the same text.
    let mut body = chat_body("x");
    body["stop"] = json!("</s>");
    let v = json(post(&a.router(), "/v1/chat/completions", body).await).await;
    assert_eq!(v["choices"][0]["message"]["content"], "Hi <b> there");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // A possible start that does not go on is released: "<b>" came through above.
}

#[tokio::test]
async fn characters_split_between_tokens_arrive_whole() {
    let a = app(config(), Fake::new("é€ok")).await;
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    let (c, _) = chunks(&text(post(&a.router(), "/v1/chat/completions", body).await).await);
    for ch in &c {
        let t = ch["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        assert!(!t.contains('\u{fffd}'), "{t:?}");
    }
    assert_eq!(content(&c), "é€ok");
}

#[tokio::test]
async fn a_dropped_stream_cancels_its_sequence() {
    let mut fake = Fake::tokens(tokens("abcdefgh"));
    fake.delay = Duration::from_millis(5);
    let log = fake.log.clone();
    let a = app(config(), fake).await;
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(40);
    let r = post(&a.router(), "/v1/chat/completions", body).await;
    assert_eq!(r.status(), StatusCode::OK);
    let mut b = r.into_body();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"a") {
        let f = b.frame().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(f.data_ref().unwrap()));
    }
    drop(b);
    eventually("the dropped stream's sequence is cancelled", || {
        log.lock().unwrap().cancelled.len() == 1
    })
    .await;
    let steps = log.lock().unwrap().steps;
    assert!(steps < 40, "it ran on to {steps} steps");
    eventually("the engine is idle again", || {
        a.metrics()
            .gauges
            .running
            .load(std::sync::atomic::Ordering::SeqCst)
            == 0
    })
    .await;
    // Another request is served as usual.
    let v = json(
        post(
            &a.router(),
            "/v1/completions",
            json!({"prompt": "q", "max_tokens": 3}),
        )
        .await,
    )
    .await;
    assert_eq!(v["choices"][0]["text"], "abc");
}
