#!/usr/bin/env python3
"""End-to-end check of `serve` with the real `openai` Python client (CI runs it on the CPU).

Usage: python scripts/server_check.py [--log FILE] PATH/TO/serve [extra serve flags...]

`--log FILE` keeps serve's output (stdout and stderr) there.

Starts `serve` with the default model (SmolLM2-135M-Instruct, as `generate` resolves it) on a
free loopback port with an API key, waits for /health 200, then checks:

1. the chat answer to "What is the capital of France?" says Paris, streamed and not (the
   stream's chunks: the role first, a finishing chunk, the usage chunk, then [DONE]);
2. a bounded load test: 32 client threads x 4 requests, mixed streaming and not, chat and
   text completions, greedy, against the single-request outputs collected first, and some
   streams closed after a few chunks: every other request completes and equals its single
   run; afterwards /metrics counts the requests and shows no KV bytes, no running sequence
   and an empty queue;
3. the bad-request table over raw HTTP: each status and OpenAI error type.

Exits non-zero with a message on the first failure; prints the load test's wall time and
tokens per second.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

try:
    import openai
except ImportError:
    sys.exit("server_check: the `openai` package is not installed (pip install openai)")

API_KEY = "server-check-key"
CTX = 512
MAX_BODY = 256 * 1024
NEW_TOKENS = 16
PROMPTS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "What is the largest planet in the solar system?",
    "Say hello in Spanish.",
    "What do bees make?",
]
CLIENTS = 32
PER_CLIENT = 4


def fail(msg):
    print(f"server_check: FAILED: {msg}", file=sys.stderr)
    raise SystemExit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base, method, path, body=None, headers=None, raw=None):
    """(status, headers, text) of a request; `raw` sends bytes as they are."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    req = urllib.request.Request(base + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics(base):
    status, _, text = http(base, "GET", "/metrics", headers={"Authorization": None})
    if status != 200:
        fail(f"/metrics answered {status}")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def start(serve, extra, log_path):
    port = free_port()
    cmd = [serve, "--port", str(port), "--api-key", API_KEY, "--ctx-size", str(CTX),
           "--max-body-bytes", str(MAX_BODY), *extra]
    print("server_check: " + " ".join(cmd), flush=True)
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    seen_loading = False
    while time.time() < deadline:
        if proc.poll() is not None:
            fail(f"serve exited with {proc.returncode} before it was ready "
                 f"(--log FILE keeps its output)")
        try:
            status, _, body = http(base, "GET", "/health", headers={"Authorization": None})
            if status == 200 and json.loads(body) == {"status": "ok"}:
                print(f"server_check: ready at {base}"
                      f"{' (was loading first)' if seen_loading else ''}", flush=True)
                return proc, base
            if status == 503:
                seen_loading = True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    proc.kill()
    fail("serve did not answer /health 200 within 300 s")


def chat(client, model, prompt, stream, max_tokens=NEW_TOKENS, close_after=None):
    """(text, completion tokens) of a greedy chat answer; with `close_after`, the stream is
    closed after that many chunks (None returned)."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=max_tokens)
        c = r.choices[0]
        if c.finish_reason not in ("stop", "length"):
            fail(f"finish_reason {c.finish_reason!r}")
        if r.usage.completion_tokens < 1 or r.usage.total_tokens != (
                r.usage.prompt_tokens + r.usage.completion_tokens):
            fail(f"bad usage {r.usage}")
        return c.message.content, r.usage.completion_tokens
    s = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=max_tokens, stream=True,
                                       stream_options={"include_usage": True})
    text, chunks, finish, usage = "", 0, None, None
    for chunk in s:
        chunks += 1
        if chunks == 1 and (not chunk.choices or chunk.choices[0].delta.role != "assistant"):
            fail(f"the first chunk carries no role: {chunk}")
        if chunk.choices:
            if chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
        if close_after is not None and chunks >= close_after:
            s.close()
            return None
    if finish not in ("stop", "length"):
        fail(f"the stream ended without a finish_reason (text {text!r})")
    if usage is None or usage.completion_tokens < 1:
        fail("the stream had no usage chunk")
    return text, usage.completion_tokens


def complete(client, model, prompt, stream, max_tokens=NEW_TOKENS):
    """(text, completion tokens) of a greedy text completion."""
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, temperature=0,
                                      max_tokens=max_tokens)
        return r.choices[0].text, r.usage.completion_tokens
    text, usage = "", None
    for chunk in client.completions.create(model=model, prompt=prompt, temperature=0,
                                           max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    if usage is None:
        fail("the completion stream had no usage chunk")
    return text, usage.completion_tokens


def check_paris(client, model):
    for stream in (False, True):
        text, _ = chat(client, model, PROMPTS[0], stream, max_tokens=24)
        if "Paris" not in text:
            fail(f"the capital question (stream={stream}) answered {text!r}")
        print(f"server_check: capital of France (stream={stream}): {text!r}", flush=True)


def load_test(client, model, base):
    jobs = [(kind, p) for p in PROMPTS for kind in ("chat", "text")]
    single = {}
    for kind, p in jobs:
        single[(kind, p)] = (chat if kind == "chat" else complete)(client, model, p, False)[0]
    before = metrics(base)
    plan = []
    for t in range(CLIENTS):
        for k in range(PER_CLIENT):
            i = t * PER_CLIENT + k
            kind, p = jobs[(i * 5 + t) % len(jobs)]
            cancel = i % 9 == 4
            plan.append((t, kind, p, i % 2 == 0, cancel))
    results = [None] * len(plan)
    tokens = [0]
    lock = threading.Lock()

    def client_thread(t):
        for idx, (owner, kind, p, stream, cancel) in enumerate(plan):
            if owner != t:
                continue
            try:
                if cancel:
                    chat(client, model, p, True, max_tokens=64, close_after=3)
                    results[idx] = "cancelled"
                    continue
                text, n = (chat if kind == "chat" else complete)(client, model, p, stream)
                results[idx] = text
                with lock:
                    tokens[0] += n
            except SystemExit:
                raise
            except Exception as e:  # noqa: BLE001: every failure is reported
                results[idx] = e

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        for f in [pool.submit(client_thread, t) for t in range(CLIENTS)]:
            f.result()
    wall = time.time() - t0
    failed = [(plan[i], r) for i, r in enumerate(results) if isinstance(r, Exception) or r is None]
    if failed:
        fail(f"{len(failed)} of {len(plan)} requests failed, e.g. {failed[0]}")
    differ = [(plan[i][1], plan[i][2], plan[i][3], r, single[(plan[i][1], plan[i][2])])
              for i, r in enumerate(results)
              if r != "cancelled" and r != single[(plan[i][1], plan[i][2])]]
    if differ:
        kind, p, stream, got, want = differ[0]
        fail(f"{len(differ)} greedy answers differ from their single-request run, e.g. "
             f"{kind} {p!r} (stream={stream}): {got!r} != {want!r}")
    cancelled = sum(1 for r in results if r == "cancelled")
    print(f"server_check: load test: {len(plan)} requests from {CLIENTS} clients "
          f"({cancelled} closed mid-stream) in {wall:.1f} s; {tokens[0]} tokens generated for "
          f"the completed ones, {tokens[0] / wall:.1f} tokens/s", flush=True)
    # The engine returns to idle: cancellations free their sequences.
    deadline = time.time() + 30
    while True:
        m = metrics(base)
        idle = (m.get("candle_offload_kv_bytes") == 0
                and m.get("candle_offload_running_sequences") == 0
                and m.get("candle_offload_queue_waiting") == 0)
        if idle or time.time() > deadline:
            break
        time.sleep(0.2)
    if not idle:
        fail("after the load test the engine is not idle: "
             + ", ".join(f"{k} {m.get(k)}" for k in ("candle_offload_kv_bytes",
                                                     "candle_offload_running_sequences",
                                                     "candle_offload_queue_waiting")))
    ok = lambda mm, r: mm.get(f'candle_offload_requests_total{{route="{r}",status="2xx"}}', 0)
    counted = ok(m, "chat_completions") + ok(m, "completions") - (
        ok(before, "chat_completions") + ok(before, "completions"))
    if counted != len(plan):
        fail(f"/metrics counted {counted} successful completions, not {len(plan)}")
    if m.get("candle_offload_cancelled_total", 0) < 1:
        fail("/metrics counted no cancelled sequence after streams were closed mid-way")
    print(f"server_check: /metrics: {counted:.0f} requests counted; KV bytes, running and "
          f"queue back at 0; {m['candle_offload_cancelled_total']:.0f} sequences cancelled; "
          f"generated {m['candle_offload_generated_tokens_total']:.0f} tokens in all",
          flush=True)


def bad_requests(base, model):
    msgs = [{"role": "user", "content": "Hi"}]
    long_prompt = " ".join(["word"] * (CTX + 50))
    table = [
        ("malformed JSON", "/v1/chat/completions", None, b'{"messages": [', {}, 400,
         "invalid_request_error"),
        ("not JSON", "/v1/chat/completions", None, b"hi", {"Content-Type": "text/plain"}, 415,
         "invalid_request_error"),
        ("unknown model", "/v1/chat/completions", {"model": "no-such-model", "messages": msgs},
         None, {}, 404, "not_found_error"),
        ("negative max_tokens", "/v1/chat/completions",
         {"model": model, "messages": msgs, "max_tokens": -1}, None, {}, 400,
         "invalid_request_error"),
        ("five stop strings", "/v1/chat/completions",
         {"model": model, "messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, None, {}, 400,
         "invalid_request_error"),
        ("tools", "/v1/chat/completions",
         {"model": model, "messages": msgs, "tools": [{"type": "function",
                                                       "function": {"name": "f"}}]},
         None, {}, 400, "invalid_request_error"),
        ("n = 2", "/v1/chat/completions", {"model": model, "messages": msgs, "n": 2}, None, {},
         400, "invalid_request_error"),
        ("prompt longer than the context", "/v1/completions",
         {"model": model, "prompt": long_prompt}, None, {}, 400, "invalid_request_error"),
        ("max_tokens past the context", "/v1/chat/completions",
         {"model": model, "messages": msgs, "max_tokens": 100000}, None, {}, 400,
         "invalid_request_error"),
        ("oversized body", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]},
         None, {}, 413, "invalid_request_error"),
        ("wrong API key", "/v1/chat/completions", {"model": model, "messages": msgs}, None,
         {"Authorization": "Bearer wrong"}, 401, "authentication_error"),
        ("no API key", "/v1/models", None, None, {"Authorization": None}, 401,
         "authentication_error"),
        ("empty messages", "/v1/chat/completions", {"model": model, "messages": []}, None, {},
         400, "invalid_request_error"),
        ("unknown role", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, None, {}, 400,
         "invalid_request_error"),
    ]
    for name, path, body, raw, headers, want_status, want_type in table:
        status, _, text = http(base, "POST" if path != "/v1/models" else "GET", path, body,
                               headers, raw)
        try:
            err = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            fail(f"{name}: not OpenAI's error object ({status}): {text[:200]!r}")
        if status != want_status or err.get("type") != want_type or not err.get("message"):
            fail(f"{name}: {status} {err}, want {want_status} {want_type}")
        if name == "prompt longer than the context" and err.get("code") != \
                "context_length_exceeded":
            fail(f"{name}: code {err.get('code')!r}, want context_length_exceeded")
        print(f"server_check: {name}: {status} {err['type']} ({err['message'][:70]})",
              flush=True)
    for path in ("/health", "/metrics"):
        status, _, _ = http(base, "GET", path, headers={"Authorization": None})
        if status != 200:
            fail(f"{path} without a key answered {status}, want 200")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    args = sys.argv[1:]
    log_path = None
    if args[:1] == ["--log"] and len(args) >= 2:
        log_path, args = args[1], args[2:]
    if not args:
        sys.exit(__doc__)
    serve, extra = args[0], args[1:]
    t0 = time.time()
    proc, base = start(serve, extra, log_path)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0,
                               timeout=300)
        models = client.models.list().data
        if len(models) != 1:
            fail(f"/v1/models lists {len(models)} models")
        model = models[0].id
        print(f"server_check: model {model!r}", flush=True)
        check_paris(client, model)
        load_test(client, model, base)
        bad_requests(base, model)
        # A bad request disturbed nothing: one more good answer.
        check_paris(client, model)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                fail("serve did not stop within 30 s of SIGTERM")
    if proc.returncode != 0:
        fail(f"serve exited with {proc.returncode} after SIGTERM")
    print(f"server_check: all checks passed in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
