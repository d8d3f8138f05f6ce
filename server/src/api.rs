//! OpenAI's request and response types for `POST /v1/chat/completions`, `POST /v1/completions`
//! and `GET /v1/models`, and the checks of a request's parameters.
//!
//! A request body is read as JSON first and its fields one by one, so that each refusal names
//! its field (`param`): parameters this server does not implement are refused by name (a 400,
//! not silence), unknown fields are ignored, as OpenAI's clients send fields of newer versions.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// At most this many stop strings (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// The generation parameters common to both endpoints, checked.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenParams {
    /// `max_completion_tokens`, else `max_tokens` (at least 1); `None`: the server's default.
    pub max_tokens: Option<usize>,
    /// In [0, 2]; 0 is greedy. `None`: OpenAI's default, 1.
    pub temperature: Option<f64>,
    /// In (0, 1].
    pub top_p: Option<f64>,
    /// The sampling seed.
    pub seed: Option<u64>,
    /// Stop strings (at most [`MAX_STOP_STRINGS`], none empty).
    pub stop: Vec<String>,
    /// Server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with the usage.
    pub include_usage: bool,
    /// Extension (as llama-server's): generate past the end-of-generation tokens.
    pub ignore_eos: bool,
}

/// A chat message: its role (`system`, `user`, `assistant`; `developer` read as `system`)
/// and its text.
pub type Message = (String, String);

/// `POST /v1/chat/completions`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The model asked for (absent: the served one).
    pub model: Option<String>,
    /// The conversation (at least one message).
    pub messages: Vec<Message>,
    /// The rest.
    pub params: GenParams,
}

/// A completion's prompt: a text, or token ids as they are (for benchmarks over models whose
/// vocabulary is a placeholder).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A text, tokenized with the model's tokenizer (its BOS added).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    /// The model asked for (absent: the served one).
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// The rest.
    pub params: GenParams,
}

/// The body as a JSON object.
fn object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object()
        .ok_or_else(|| ApiError::bad_request("the request body must be a JSON object"))
}

/// Parameters OpenAI defines that this server does not implement, with whether a value asks
/// for them (`logprobs: false`, `n: 1`, `tools: []`, `logit_bias: {}` ask for nothing).
fn unsupported(obj: &Map<String, Value>) -> Vec<&'static str> {
    fn active(v: &Value) -> bool {
        match v {
            Value::Null | Value::Bool(false) => false,
            Value::Array(a) => !a.is_empty(),
            Value::Object(o) => !o.is_empty(),
            Value::String(s) => !s.is_empty() && s != "none",
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::Bool(true) => true,
        }
    }
    const NAMES: [&str; 16] = [
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "echo",
        "suffix",
        "audio",
        "prediction",
        "presence_penalty",
        "frequency_penalty",
        "web_search_options",
        "response_format",
        "modalities",
    ];
    let mut out = Vec::new();
    for name in NAMES {
        let Some(v) = obj.get(name) else { continue };
        let asks = match name {
            // `{"type": "text"}` is what the server does anyway.
            "response_format" => active(v) && v.get("type").and_then(Value::as_str) != Some("text"),
            "modalities" => {
                active(v) && v.as_array().is_some_and(|a| a.iter().any(|m| m != "text"))
            }
            _ => active(v),
        };
        if asks {
            out.push(name);
        }
    }
    for (name, many) in [("n", "n"), ("best_of", "best_of")] {
        if obj.get(name).and_then(Value::as_u64).is_some_and(|n| n > 1) {
            out.push(many);
        }
    }
    out
}

/// Field `name` as `T`, or `None` when absent or null; a value of the wrong type names it.
fn field<T: serde::de::DeserializeOwned>(
    obj: &Map<String, Value>,
    name: &str,
    want: &str,
) -> Result<Option<T>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|_| ApiError::invalid(name, format!("`{name}` must be {want}, not {v}"))),
    }
}

/// The common parameters of `obj`.
fn gen_params(obj: &Map<String, Value>) -> Result<GenParams, ApiError> {
    let unsupported = unsupported(obj);
    if !unsupported.is_empty() {
        return Err(ApiError::unsupported(&unsupported));
    }
    if let Some(n) = field::<i64>(obj, "n", "an integer")? {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("`n` must be 1, not {n}")));
        }
    }
    let mut max_tokens = None;
    for name in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = field::<i64>(obj, name, "an integer")? {
            if n < 1 {
                return Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be at least 1, not {n}"),
                ));
            }
            // max_completion_tokens, read second, wins (max_tokens is its older name).
            max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    let temperature = field::<f64>(obj, "temperature", "a number")?;
    if let Some(t) = temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid(
                "temperature",
                format!("`temperature` must be in [0, 2], not {t}"),
            ));
        }
    }
    let top_p = field::<f64>(obj, "top_p", "a number")?;
    if let Some(p) = top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("`top_p` must be in (0, 1], not {p}"),
            ));
        }
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|s| s as u64))
                .ok_or_else(|| {
                    ApiError::invalid("seed", format!("`seed` must be an integer, not {v}"))
                })?,
        ),
    };
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP_STRINGS {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "`stop` takes at most {MAX_STOP_STRINGS} strings, not {}",
                        a.len()
                    ),
                ));
            }
            a.iter()
                .map(|s| {
                    s.as_str().map(String::from).ok_or_else(|| {
                        ApiError::invalid("stop", format!("`stop` must hold strings, not {s}"))
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "stop",
                format!("`stop` must be a string or a list of strings, not {v}"),
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "`stop` strings must not be empty",
        ));
    }
    let stream = field::<bool>(obj, "stream", "true or false")?.unwrap_or(false);
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => field::<bool>(o, "include_usage", "true or false")
            .map_err(|e| e.param("stream_options.include_usage"))?
            .unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid(
                "stream_options",
                format!("`stream_options` must be an object, not {v}"),
            ))
        }
    };
    let ignore_eos = field::<bool>(obj, "ignore_eos", "true or false")?.unwrap_or(false);
    Ok(GenParams {
        max_tokens,
        temperature,
        top_p,
        seed,
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

/// The text of a message's `content`: a string, or a list of `{"type": "text", "text"}`
/// parts, joined.
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (k, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{k}].text"),
                            "a text part needs a `text` string",
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{k}].type"),
                            format!(
                                "content parts of type `{other}` are not supported (only `text`)"
                            ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid(
                            format!("{param}[{k}]"),
                            "a content part needs a `type`",
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(ApiError::invalid(
            param,
            format!("`content` must be a string or a list of parts, not {other}"),
        )),
    }
}

fn model(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    field::<String>(obj, "model", "a string")
}

/// Checks a chat request.
pub fn parse_chat(body: &Value) -> Result<ChatRequest, ApiError> {
    let obj = object(body)?;
    let params = gen_params(obj)?;
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must hold at least one message",
            ))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("messages", "`messages` is required"))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "messages",
                format!("`messages` must be a list, not {v}"),
            ))
        }
    };
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(ApiError::invalid(
                format!("messages[{i}]"),
                "a message must be an object with `role` and `content`",
            ));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("system" | "user" | "assistant")) => r.to_string(),
            Some("developer") => "system".to_string(),
            Some("tool" | "function") => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    "tool messages are not supported (no tool calling yet)",
                )
                .code("unsupported_parameter"))
            }
            Some(r) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    format!("unknown role `{r}` (want system, developer, user or assistant)"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role"),
                    "a message needs a `role` string",
                ))
            }
        };
        if m.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(
                ApiError::unsupported(&["tool_calls"]).param(format!("messages[{i}].tool_calls"))
            );
        }
        let content = match m.get("content") {
            Some(c) => content_text(c, &format!("messages[{i}].content"))?,
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content"),
                    "a message needs `content`",
                ))
            }
        };
        out.push((role, content));
    }
    Ok(ChatRequest {
        model: model(obj)?,
        messages: out,
        params,
    })
}

/// Checks a completion request.
pub fn parse_completion(body: &Value) -> Result<CompletionRequest, ApiError> {
    let obj = object(body)?;
    let params = gen_params(obj)?;
    let tokens = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid("prompt", "`prompt` is empty"))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => match tokens(a) {
            Some(ids) => Prompt::Tokens(ids),
            None => {
                return Err(ApiError::invalid(
                    "prompt",
                    "token ids must be whole numbers from 0 to 2^32 - 1",
                ))
            }
        },
        Some(Value::Array(a)) if a.len() > 1 => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "one prompt per request: `prompt` holds {} prompts (send them as separate \
                     requests)",
                    a.len()
                ),
            ))
        }
        Some(Value::Array(a)) => match &a[0] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(ids) if !ids.is_empty() => {
                Prompt::Tokens(tokens(ids).ok_or_else(|| {
                    ApiError::invalid(
                        "prompt",
                        "token ids must be whole numbers from 0 to 2^32 - 1",
                    )
                })?)
            }
            v => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("`prompt` must be a string or a list of token ids, not [{v}]"),
                ))
            }
        },
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("prompt", "`prompt` is required"))
        }
        Some(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("`prompt` must be a string or a list of token ids, not {v}"),
            ))
        }
    };
    Ok(CompletionRequest {
        model: model(obj)?,
        prompt,
        params,
    })
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (the end-of-generation token not counted: it is not in the text).
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// The usage of a prompt and its completion.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// An assistant's message.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// Its text.
    pub content: String,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// 0.
    pub index: usize,
    /// The answer.
    pub message: AssistantMessage,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// Always null (not supported).
    pub logprobs: Option<()>,
}

/// `chat.completion`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// A streamed chunk's delta.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Delta {
    /// `assistant`, in the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of a chunk.
#[derive(Debug, Clone, Serialize)]
pub struct ChunkChoice {
    /// 0.
    pub index: usize,
    /// What is new.
    pub delta: Delta,
    /// In the last chunk of the choice.
    pub finish_reason: Option<&'static str>,
    /// Always null.
    pub logprobs: Option<()>,
}

/// `chat.completion.chunk`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    /// The completion's id (the same in every chunk).
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// One choice, or none in the usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// In the usage chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a text completion (or of its chunk).
#[derive(Debug, Clone, Serialize)]
pub struct TextChoice {
    /// The text (new text, in a chunk).
    pub text: String,
    /// 0.
    pub index: usize,
    /// `stop` or `length` (in a chunk: the last one only).
    pub finish_reason: Option<&'static str>,
    /// Always null.
    pub logprobs: Option<()>,
}

/// `text_completion` (also its chunks, with `usage` in the usage chunk only).
#[derive(Debug, Clone, Serialize)]
pub struct TextCompletion {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// One choice (none in a usage chunk).
    pub choices: Vec<TextChoice>,
    /// Token counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// An entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelEntry {
    /// The name requests give as `model`.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds (the server's start).
    pub created: u64,
    /// `candle-offload`.
    pub owned_by: &'static str,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The one served model.
    pub data: Vec<ModelEntry>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(&v)
    }

    #[test]
    fn a_chat_request_reads_every_parameter() {
        let r = chat(json!({
            "model": "m", "messages": [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}],
            "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": -1,
            "stop": "x", "stream": true, "stream_options": {"include_usage": true}, "n": 1,
            "logprobs": false, "tools": [], "user": "u", "something_new": {"a": 1}, "ignore_eos": true,
        }))
        .unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(
            r.messages,
            vec![
                ("system".into(), "Be brief.".into()),
                ("user".into(), "Hi there".into())
            ]
        );
        let p = r.params;
        assert_eq!(p.max_tokens, Some(7));
        assert_eq!(
            (p.temperature, p.top_p, p.seed),
            (Some(0.0), Some(0.5), Some(u64::MAX))
        );
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert!(p.stream && p.include_usage && p.ignore_eos);
    }

    #[test]
    fn bad_parameters_are_named() {
        let base = || json!({"messages": [{"role": "user", "content": "Hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base();
            b[k] = v;
            chat(b).unwrap_err()
        };
        for (k, v) in [
            ("max_tokens", json!(-3)),
            ("max_tokens", json!(0)),
            ("max_completion_tokens", json!("ten")),
            ("temperature", json!(2.5)),
            ("temperature", json!(-0.1)),
            ("top_p", json!(0)),
            ("top_p", json!(1.5)),
            ("stop", json!(["a", "b", "c", "d", "e"])),
            ("stop", json!([1])),
            ("stop", json!("")),
            ("n", json!(0)),
            ("stream", json!("yes")),
            ("seed", json!(1.5)),
        ] {
            let e = with(k, v.clone());
            assert_eq!(e.status, 400, "{k}={v}");
            assert_eq!(e.param.as_deref(), Some(k), "{k}={v}: {e}");
        }
        for (k, v) in [
            ("tools", json!([{"type": "function"}])),
            ("tool_choice", json!("auto")),
            ("logprobs", json!(true)),
            ("top_logprobs", json!(3)),
            ("response_format", json!({"type": "json_object"})),
            ("n", json!(2)),
            ("logit_bias", json!({"5": 1})),
            ("functions", json!([{}])),
        ] {
            let e = with(k, v.clone());
            assert_eq!(e.code, Some("unsupported_parameter"), "{k}={v}: {e}");
            assert!(e.message.contains(k), "{e}");
        }
        let mut ok = base();
        ok["response_format"] = json!({"type": "text"});
        assert!(chat(ok).is_ok());
        assert_eq!(
            chat(json!({"messages": []})).unwrap_err().param.as_deref(),
            Some("messages")
        );
        assert_eq!(
            chat(json!({"messages": [{"role": "wizard", "content": "x"}]}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            chat(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
                .unwrap_err()
                .param
                .as_deref(),
            Some("messages[0].content[0].type")
        );
        assert!(chat(json!([1, 2])).is_err());
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Value| parse_completion(&json!({"prompt": v})).map(|r| r.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2, 3])).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(p(json!([[4, 5]])).unwrap(), Prompt::Tokens(vec![4, 5]));
        for bad in [
            json!(["a", "b"]),
            json!([]),
            json!([-1]),
            json!([1.5]),
            json!(5),
            json!(null),
            json!([[1], [2]]),
        ] {
            let e = p(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}: {e}");
        }
    }
}
