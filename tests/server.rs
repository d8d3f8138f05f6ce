//! The OpenAI-compatible server end to end over a real model: a tiny random LLaMA GGUF with
//! its own vocabulary (`tests/fixtures/gguf_families.tar.xz`), loaded through the flags
//! `serve` uses (`LoadArgs`), batched by the real `Batcher`, asked over the router. Greedy
//! answers of requests sent together equal their answers alone.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use candle_core::{DType, Device};
use candle_offload_models::batching::{BatchOptions, Batcher};
use candle_offload_server::{App, Loaded, ModelInfo, ServerConfig};
use candle_offload_suite::load::LoadArgs;
use clap::Parser as _;
use http_body_util::BodyExt as _;
use rand::Rng as _;
use serde_json::{json, Value};
use tower::ServiceExt as _;

/// Positions per request.
const CTX: usize = 96;

#[derive(clap::Parser, Debug)]
struct Flags {
    #[command(flatten)]
    load: LoadArgs,
}

fn fixtures() -> anyhow::Result<std::path::PathBuf> {
    static DIR: std::sync::OnceLock<Result<std::path::PathBuf, String>> =
        std::sync::OnceLock::new();
    crate::util::unpacked_fixture("gguf_families", &DIR)
}

/// What `serve` loads for `--model FILE --cpu`, with 4 sequences at once.
fn load(path: &std::path::Path) -> anyhow::Result<Loaded> {
    let flags = Flags::try_parse_from([
        "serve".as_ref(),
        "--model".as_ref(),
        path.as_os_str(),
        "--cpu".as_ref(),
    ])?;
    let device = Device::Cpu;
    let plan = flags.load.memory(std::slice::from_ref(&device))?;
    let files = flags.load.model.resolve()?;
    let tokenizer = flags.load.tokenizer(&files)?;
    // As `serve` builds it (F32 on the CPU).
    let kv_bytes = files.config.kv_cache_bytes(CTX, DType::F32) * 4;
    let model = Arc::new(
        flags
            .load
            .build_batched(&files, &plan, &device, CTX, kv_bytes, None)?,
    );
    let mut opts = BatchOptions::new(&model, 4, CTX);
    // Prompt chunks of 8: a long prompt is read over several steps beside the others.
    opts.prompt_chunk = 8;
    let mut end_tokens = files.config.eos_token_ids.clone();
    end_tokens.extend(tokenizer.end_of_generation());
    Ok(Loaded {
        backend: Box::new(Batcher::new(model, opts)),
        info: ModelInfo {
            codec: Arc::new(tokenizer),
            chat_template: None,
            end_tokens,
            context: CTX,
            vocab_size: files.config.vocab_size,
        },
        max_running: 4,
        memory: None,
    })
}

async fn post(app: &axum::Router, path: &str, body: Value) -> anyhow::Result<(StatusCode, String)> {
    let req = Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))?;
    let r = app.clone().oneshot(req).await?;
    let status = r.status();
    let bytes = r.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8(bytes.to_vec())?))
}

/// The text and completion tokens of a non-streamed completion.
async fn completion(app: &axum::Router, body: Value) -> anyhow::Result<(String, u64)> {
    let (status, text) = post(app, "/v1/completions", body).await?;
    anyhow::ensure!(status == StatusCode::OK, "{status}: {text}");
    let v: Value = serde_json::from_str(&text)?;
    Ok((
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
    ))
}

#[test]
fn greedy_answers_in_a_batch_equal_their_answers_alone() -> anyhow::Result<()> {
    let path = fixtures()?.join("llama.f32.gguf");
    let config = ServerConfig {
        model_name: "tiny".into(),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let p = path.clone();
        let mut server = App::start(config, move || Ok(load(&p)?))?;
        server.loaded().await?;
        let app = server.router();
        // Token prompts of mixed lengths (one longer than a prompt chunk several times over),
        // and text prompts through the GGUF's own tokenizer.
        let mut rng = candle_offload_suite::rng(11);
        let mut bodies = Vec::new();
        for len in [3usize, 9, 17, 40, 5] {
            let ids: Vec<u32> = (0..len).map(|_| rng.random_range(3..100)).collect();
            bodies.push(json!({"prompt": ids, "max_tokens": 12, "temperature": 0,
                               "ignore_eos": true}));
        }
        for text in ["Hello world", "The quick brown fox"] {
            bodies.push(json!({"model": "tiny", "prompt": text, "max_tokens": 10,
                               "temperature": 0}));
        }
        let mut alone = Vec::new();
        for b in &bodies {
            alone.push(completion(&app, b.clone()).await?);
        }
        for (b, (_, n)) in bodies.iter().zip(&alone) {
            if b["ignore_eos"] == true {
                anyhow::ensure!(*n == 12, "{b}: {n} tokens, not 12");
            }
        }
        // All at once, twice over.
        let mut set = tokio::task::JoinSet::new();
        for round in 0..2 {
            for (i, b) in bodies.iter().enumerate() {
                let (app, b) = (app.clone(), b.clone());
                set.spawn(async move { (round, i, completion(&app, b).await) });
            }
        }
        while let Some(done) = set.join_next().await {
            let (round, i, got) = done?;
            let got = got?;
            anyhow::ensure!(
                got == alone[i],
                "request {i} (round {round}) in a batch: {got:?}, alone: {:?}",
                alone[i]
            );
        }
        // A stream says what the one answer says.
        let (status, sse) = post(
            &app,
            "/v1/completions",
            json!({"prompt": "Hello world", "max_tokens": 10, "temperature": 0, "stream": true}),
        )
        .await?;
        anyhow::ensure!(status == StatusCode::OK, "{status}: {sse}");
        let streamed: String = sse
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(String::from))
            .collect();
        anyhow::ensure!(streamed == alone[5].0, "{streamed:?} != {:?}", alone[5].0);
        anyhow::ensure!(sse.trim_end().ends_with("data: [DONE]"), "{sse}");
        // Bad requests against the real model.
        let (status, text) = post(&app, "/v1/completions", json!({"prompt": [5, 100000]})).await?;
        anyhow::ensure!(status == StatusCode::BAD_REQUEST, "{status}: {text}");
        let (status, text) = post(
            &app,
            "/v1/completions",
            json!({"prompt": vec![7; CTX], "max_tokens": 1}),
        )
        .await?;
        anyhow::ensure!(
            status == StatusCode::BAD_REQUEST && text.contains("context_length_exceeded"),
            "{status}: {text}"
        );
        // Everything finished: no KV memory held, nothing running.
        let g = &server.metrics().gauges;
        for _ in 0..200 {
            if g.kv_bytes.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        anyhow::ensure!(g.kv_bytes.load(std::sync::atomic::Ordering::SeqCst) == 0);
        anyhow::ensure!(g.running.load(std::sync::atomic::Ordering::SeqCst) == 0);
        server.shutdown();
        Ok(())
    })
}
