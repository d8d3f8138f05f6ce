//! OpenAI's error object: every refusal and failure of the server as `{"error": {"message",
//! "type", "param", "code"}}` with its HTTP status (and `Retry-After` where waiting helps).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A request the server refuses or cannot serve, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type: `invalid_request_error`, `authentication_error`,
    /// `not_found_error`, `unavailable_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, where there is one (`max_tokens`, `messages[1].role`).
    pub param: Option<String>,
    /// A machine-readable code (`model_not_found`, `context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// Seconds after which the client may try again (the `Retry-After` header).
    pub retry_after_s: Option<u64>,
}

/// The body of an error response.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// The error.
    pub error: ErrorObject<'a>,
}

/// OpenAI's error object.
#[derive(Debug, Serialize)]
pub struct ErrorObject<'a> {
    /// What went wrong.
    pub message: &'a str,
    /// The error type.
    #[serde(rename = "type")]
    pub kind: &'a str,
    /// The field at fault.
    pub param: Option<&'a str>,
    /// The code.
    pub code: Option<&'a str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after_s: None,
        }
    }

    /// With `param` named.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// With a code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).param(param)
    }

    /// 400 `invalid_request_error` about the request as a whole (malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: parameters present that this server does not implement, each named.
    pub fn unsupported(params: &[&str]) -> Self {
        let list = params.join(", ");
        Self::invalid(
            params.first().copied().unwrap_or_default(),
            format!("unsupported parameter(s): {list} (not implemented by this server)"),
        )
        .code("unsupported_parameter")
    }

    /// 400 `context_length_exceeded`: the prompt and the tokens asked for do not fit.
    pub fn context_length(param: &str, message: impl Into<String>) -> Self {
        Self::invalid(param, message).code("context_length_exceeded")
    }

    /// 401: no or a wrong API key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key (send `Authorization: Bearer KEY`)",
        )
        .code("invalid_api_key")
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("the model `{asked}` does not exist; this server serves `{served}`"),
        )
        .param("model")
        .code("model_not_found")
    }

    /// 404: no such route.
    pub fn no_route(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("no route {method} {path}"),
        )
    }

    /// 405: the route exists but not with this method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not take {method}"),
        )
    }

    /// 413: the body is larger than the server takes.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than this server's limit of {limit} bytes"),
        )
        .code("request_too_large")
    }

    /// 415: not JSON.
    pub fn unsupported_media_type() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "expected a JSON body with `Content-Type: application/json`",
        )
        .code("unsupported_media_type")
    }

    /// 503 with `Retry-After`: the queue of waiting requests is full.
    pub fn queue_full(limit: usize, retry_after_s: u64) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            format!("the server is busy: {limit} requests already wait to start; retry later"),
        )
        .code("queue_full");
        e.retry_after_s = Some(retry_after_s);
        e
    }

    /// 503 with `Retry-After`: the model is still loading.
    pub fn loading(retry_after_s: u64) -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            "the model is loading; retry later",
        )
        .code("loading");
        e.retry_after_s = Some(retry_after_s);
        e
    }

    /// 500: the server failed (a failed step, the engine gone).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorObject {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        }
    }

    /// The JSON body as text (an SSE event's data when a stream fails).
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.body()).unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#
                .to_string()
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.kind,
            self.message
        )
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (
            self.status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            self.to_json(),
        )
            .into_response();
        if let Some(s) = self.retry_after_s {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        res
    }
}

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    /// axum's refusal of a body (its own text) as OpenAI's error object.
    fn from(r: axum::extract::rejection::JsonRejection) -> Self {
        use axum::extract::rejection::JsonRejection as J;
        match r {
            J::MissingJsonContentType(_) => Self::unsupported_media_type(),
            J::JsonSyntaxError(e) => {
                Self::bad_request(format!("malformed JSON: {}", e.body_text()))
            }
            J::JsonDataError(e) => Self::bad_request(format!("invalid JSON: {}", e.body_text())),
            other if other.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                // The limit is in the message axum builds; the server sets ours in the state.
                Self::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "the request body is larger than this server's limit",
                )
                .code("request_too_large")
            }
            other => Self::bad_request(format!("cannot read the body: {}", other.body_text())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_openais_error_object() {
        let e = ApiError::invalid("max_tokens", "must be at least 1");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(v["error"]["message"], "must be at least 1");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "max_tokens");
        assert!(v["error"]["code"].is_null());
        let r = ApiError::queue_full(4, 2).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
    }
}
