"""`sparkchat serve`: the OpenAI-compatible API on a real loopback socket.

The tiny random model checks that answers are the engine's own (greedy, token for token); a scripted fake
engine makes the queue and disconnect tests exact and fast (it decodes "x" tokens until cancelled)."""

from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
import threading
import time
from typing import Any

import pytest

from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams
from sparkchat.server import ChatServer
from sparkchat.server_protocol import AnswerSplitter, RequestError, parse_chat_request

HELLO = [{"role": "user", "content": "hello"}]
TIMEOUT = 30


# -- helpers -----------------------------------------------------------------------------------------


def request(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            timeout: float = TIMEOUT) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def chat(url: str, body: dict[str, Any], **kw: Any) -> tuple[int, dict[str, Any]]:
    status, _, raw = request(url, "POST", "/v1/chat/completions", body, **kw)
    return status, json.loads(raw)


def stream(url: str, body: dict[str, Any]) -> list[Any]:
    status, headers, raw = request(url, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200 and headers["Content-Type"] == "text/event-stream", raw
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def greedy(engine: Any, messages: list[dict[str, str]], max_tokens: int, thinking: bool = True):
    """The engine's own answer (text, token ids, finish reason), called directly."""
    text, ids, finish = "", [], None
    for ev in engine.generate(messages, SamplingParams(max_tokens=max_tokens), enable_thinking=thinking):
        text += ev.text
        ids += ev.token_ids
        finish = ev.finish_reason
    return text, ids, finish


def split(text: str) -> tuple[str, str]:
    reasoning, _, answer = text.partition("</think>")
    return reasoning, answer


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


class FakeEngine:
    """Decodes one "x" per `step_s` until max_tokens or cancel; holds until `release` is set."""

    name = "fake"
    max_context = 4096

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.tokenizer = self
        self.release = threading.Event()
        self.release.set()
        self.steps = 0
        self.finishes: list[str] = []

    def encode_chat(self, messages: list[dict[str, str]], enable_thinking: bool = True) -> list[int]:
        return [2] * (1 + len(messages[-1]["content"]))

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams, cancel=None):
        return self._gen(len(prompt_ids), params, cancel)

    def _gen(self, n_prompt: int, params: SamplingParams, cancel):
        assert self.release.wait(TIMEOUT)
        stats = GenerationStats(prompt_tokens=n_prompt, prefilled_tokens=n_prompt)
        for i in range(params.max_tokens):
            if cancel is not None and cancel.is_set():
                self.finishes.append("cancelled")
                yield ResponseEvent("", [], "cancelled", stats)
                return
            time.sleep(self.step_s)
            self.steps += 1
            stats.generated_tokens = i + 1
            yield ResponseEvent("x", [7], "length" if i + 1 == params.max_tokens else None, stats)
        self.finishes.append("length")


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    import torch

    from sparkchat.engine.session import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and a busy CPU stalls thread teams
    eng = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    eng.switches.mtp = False  # plain decoding is faster on CPU; MTP's greedy output is the same
    yield eng
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine):
    with ChatServer(engine, port=0, queue=8).start() as srv:
        yield srv


@pytest.fixture
def fake():
    eng = FakeEngine()
    with ChatServer(eng, port=0, queue=8, enable_thinking=False).start() as srv:
        yield eng, srv


# -- the engine's answers ----------------------------------------------------------------------------


def test_models_and_health(server, engine):
    status, _, raw = request(server.url, "GET", "/v1/models")
    body = json.loads(raw)
    assert status == 200 and body["data"][0]["id"] == engine.name
    assert body["data"][0]["max_model_len"] == 512
    status, _, raw = request(server.url, "GET", "/health")
    health = json.loads(raw)
    assert status == 200 and health["status"] == "ok" and health["busy"] is False and health["queue"] == 8


def test_non_streaming_equals_engine_greedy(server, engine):
    text, ids, finish = greedy(engine, HELLO, 12)
    status, body = chat(server.url, {"model": engine.name, "messages": HELLO, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    reasoning, answer = split(text)
    assert choice["message"].get("reasoning_content", "") == reasoning
    assert choice["message"]["content"] == answer
    assert choice["finish_reason"] == finish
    assert body["sparkchat"]["token_ids"] == ids
    prompt = len(engine.tokenizer.encode_chat(HELLO))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    stats = body["sparkchat"]["stats"]
    assert stats["generated_tokens"] == len(ids) and stats["ttft_s"] > 0


def test_streaming_equals_engine_greedy(server, engine):
    text, ids, finish = greedy(engine, HELLO, 12, thinking=False)
    chunks = stream(server.url, {"messages": HELLO, "max_completion_tokens": 12,
                                 "stream_options": {"include_usage": True},
                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    streamed_ids = [t for c in chunks for t in c.get("sparkchat", {}).get("token_ids", [])]
    assert content == text and streamed_ids == ids
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == finish
    assert finals[0]["sparkchat"]["stats"]["generated_tokens"] == len(ids)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)


def test_streaming_raw_text_with_thinking(server, engine):
    text, _, _ = greedy(engine, HELLO, 10)
    chunks = stream(server.url, {"messages": HELLO, "max_tokens": 10, "separate_reasoning": False})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks)


def test_stop_string_cuts_the_answer(server, engine):
    text, _, _ = greedy(engine, HELLO, 16, thinking=False)
    stop = text[4:6]
    body = {"messages": HELLO, "max_tokens": 16, "stop": [stop], "chat_template_kwargs": {"enable_thinking": False}}
    status, out = chat(server.url, body)
    assert status == 200
    assert out["choices"][0]["message"]["content"] == text[:text.find(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    chunks = stream(server.url, body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[:text.find(stop)]


def test_a_few_concurrent_clients_get_the_same_greedy_answer(server, engine):
    text, ids, _ = greedy(engine, HELLO, 6)
    results: list[Any] = []

    def one() -> None:
        results.append(chat(server.url, {"messages": HELLO, "max_tokens": 6}))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == 5
    for status, body in results:
        assert status == 200 and body["sparkchat"]["token_ids"] == ids


def test_disconnect_mid_stream_then_next_answer_is_right(server, engine):
    text, ids, _ = greedy(engine, HELLO, 8)
    before = server.counters.cancelled
    sock = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    body = json.dumps({"messages": HELLO, "max_tokens": 400, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while got.count(b"token_ids") < 2:
        got += sock.recv(4096)
    sock.close()
    wait_for(lambda: not server.gate.busy)
    status, out = chat(server.url, {"messages": HELLO, "max_tokens": 8})
    assert status == 200 and out["sparkchat"]["token_ids"] == ids
    # the tiny model may end its answer on its own before the server notices; else it was cancelled
    assert server.counters.cancelled - before in (0, 1)


# -- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, code, needle", [
    (b"{not json", 400, "invalid_json", "not valid JSON"),
    (b"[1, 2]", 400, "invalid_json", "JSON object"),
    ({"model": "gpt-4", "messages": HELLO}, 404, "model_not_found", "'gpt-4' is not served here"),
    ({"messages": []}, 400, "invalid_messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported_content", "text"),
    ({"messages": HELLO, "temperature": "hot"}, 400, "invalid_value", "temperature"),
    ({"messages": HELLO, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"messages": HELLO, "n": 2}, 400, "invalid_value", "n=1"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "context_length_exceeded", "context holds 512"),
    # JSON's NaN and Infinity (Python's json reads them) and out-of-range values: 400, never a 500
    ({"messages": HELLO, "temperature": math.nan}, 400, "invalid_value", "'temperature' must be a number, not nan"),
    ({"messages": HELLO, "temperature": math.inf}, 400, "invalid_value", "'temperature' must be a number"),
    ({"messages": HELLO, "top_p": math.nan}, 400, "invalid_value", "'top_p' must be a number"),
    ({"messages": HELLO, "temperature": 10**400}, 400, "invalid_value", "'temperature' must be a number"),
    ({"messages": HELLO, "temperature": 1, "seed": 99999999999999999999999}, 400, "invalid_value", "seed must be"),
    ({"messages": HELLO, "seed": -1}, 400, "invalid_value", "seed must be from 0 to"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "invalid_value", "messages[0].content must be a string"),
    ({"messages": [{"role": "user"}]}, 400, "invalid_value", "messages[0].content must be a string"),
    ({"messages": [{"role": "assistant", "content": None}, *HELLO]}, 400, "invalid_value", "messages[0].content"),
    pytest.param(b'{"messages": [], "seed": 1' + b"0" * 5000 + b"}", 400, "invalid_json", "not valid JSON",
                 id="5000-digit-int"),
    pytest.param(b"[" * 100_000, 400, "invalid_json", "not valid JSON", id="deep-nesting"),
])
def test_bad_requests_get_a_readable_json_error(server, body, status, code, needle):
    got, headers, raw = request(server.url, "POST", "/v1/chat/completions", body)
    err = json.loads(raw)["error"]
    assert got == status and headers["Content-Type"] == "application/json"
    assert err["code"] == code and needle in err["message"] and err["type"]
    assert "\n" not in err["message"]


@pytest.mark.parametrize("length", [b"-1", b"+5", b"1_0", b"abc", "\u0661".encode()])
def test_bad_content_length_is_refused_at_once(length):
    """Content-Length: -1 used to read until the client closed, then log a BrokenPipeError traceback."""
    lines: list[str] = []
    with ChatServer(FakeEngine(), port=0, enable_thinking=False, log=lines.append).start() as srv:
        sock = socket.create_connection((srv.host, srv.port), timeout=5)
        body = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n%s" % (length, body))
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)  # a server still reading the body times this out
            if not chunk:
                break
            got += chunk
        sock.close()
        head, _, raw = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), got
        err = json.loads(raw)["error"]
        assert err["code"] == "invalid_request" and "Content-Length" in err["message"]
        wait_for(lambda: lines)
    assert len(lines) == 1 and "400" in lines[0]


def test_a_client_gone_mid_write_is_one_log_line(capsys):
    """Whatever escapes a handler (a client that left while we wrote) is one line in the log, no traceback."""
    lines: list[str] = []
    with ChatServer(FakeEngine(), port=0, log=lines.append) as srv:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            srv.httpd.handle_error(None, ("10.0.0.7", 5555))
    assert lines == ["10.0.0.7 client went away: BrokenPipeError: [Errno 32] Broken pipe"]
    assert "Traceback" not in capsys.readouterr().err


def test_unknown_routes_are_json_404(server):
    for method, path in (("GET", "/nope"), ("POST", "/v1/completions"), ("GET", "/v1/models/other")):
        status, _, raw = request(server.url, method, path, {} if method == "POST" else None)
        assert status == 404 and json.loads(raw)["error"]["message"]


def test_api_key():
    eng = FakeEngine()
    with ChatServer(eng, port=0, api_key="sekrit", enable_thinking=False).start() as srv:
        body = {"messages": HELLO, "max_tokens": 2}
        status, out = chat(srv.url, body)
        assert status == 401 and out["error"]["code"] == "invalid_api_key" and "missing" in out["error"]["message"]
        status, out = chat(srv.url, body, headers={"Authorization": "Bearer wrong"})
        assert status == 401 and out["error"]["message"] == "invalid API key"
        assert request(srv.url, "GET", "/v1/models")[0] == 401
        assert request(srv.url, "GET", "/health")[0] == 200
        status, out = chat(srv.url, body, headers={"Authorization": "Bearer sekrit"})
        assert status == 200 and out["choices"][0]["message"]["content"] == "xx"


# -- the queue and disconnects (fake engine) ---------------------------------------------------------


def test_fifty_clients_answered_or_refused_none_lost(fake):
    eng, srv = fake
    eng.release.clear()  # the first request holds the engine until every client is in line or refused
    results: list[tuple[int, dict[str, str], bytes]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            r = request(srv.url, "POST", "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3})
        except BaseException as e:  # noqa: BLE001
            with lock:
                errors.append(e)
            return
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    wait_for(lambda: srv.counters.rejected_busy == 41 and srv.gate.waiting == 8 and srv.gate.busy)
    eng.release.set()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads) and not errors
    assert len(results) == 50
    ok = [json.loads(raw) for status, _, raw in results if status == 200]
    busy = [(h, json.loads(raw)) for status, h, raw in results if status == 503]
    assert len(ok) == 9 and len(busy) == 41
    assert all(b["choices"][0]["message"]["content"] == "xxx" for b in ok)
    assert all(h["Retry-After"] == "1" and b["error"]["code"] == "queue_full" and "busy" in b["error"]["message"]
               for h, b in busy)
    assert srv.counters.answered == 9
    wait_for(lambda: not srv.gate.busy and srv.gate.waiting == 0, timeout=3)


def test_disconnect_mid_stream_stops_generation(fake):
    eng, srv = fake
    eng.step_s = 0.02  # 1000 tokens would take 20 s
    sock = socket.create_connection((srv.host, srv.port), timeout=TIMEOUT)
    body = json.dumps({"messages": HELLO, "max_tokens": 1000, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b'"content": "x"' not in got:
        got += sock.recv(4096)
    sock.close()
    t0 = time.monotonic()
    wait_for(lambda: not srv.gate.busy, timeout=3)
    assert eng.finishes == ["cancelled"] and eng.steps < 200
    assert srv.counters.cancelled == 1 and srv.counters.answered == 0
    eng.step_s = 0.001
    status, out = chat(srv.url, {"messages": HELLO, "max_tokens": 2})
    assert status == 200 and out["choices"][0]["message"]["content"] == "xx"
    assert time.monotonic() - t0 < 3


def test_disconnect_while_waiting_leaves_the_queue(fake):
    eng, srv = fake
    eng.release.clear()
    first: list[Any] = []
    holder = threading.Thread(target=lambda: first.append(chat(srv.url, {"messages": HELLO, "max_tokens": 1})))
    holder.start()
    wait_for(lambda: srv.gate.busy)
    sock = socket.create_connection((srv.host, srv.port), timeout=TIMEOUT)
    body = json.dumps({"messages": HELLO, "max_tokens": 5}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: srv.gate.waiting == 1)
    sock.close()
    wait_for(lambda: srv.gate.waiting == 0 and srv.counters.cancelled == 1, timeout=3)
    eng.release.set()
    holder.join(TIMEOUT)
    assert first[0][0] == 200 and eng.finishes == ["length"]


def test_engine_failure_is_a_json_500(fake):
    eng, srv = fake

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nmore detail")
        yield

    eng._gen = broken
    status, out = chat(srv.url, {"messages": HELLO, "max_tokens": 2})
    assert status == 500 and out["error"]["message"] == "RuntimeError: CUDA error: out of memory more detail"
    chunks = stream(srv.url, {"messages": HELLO, "max_tokens": 2})
    assert chunks[-1]["error"]["code"] == "engine_error"
    assert srv.counters.failed == 2
    wait_for(lambda: not srv.gate.busy, timeout=3)  # released right after the last byte


# -- protocol pieces ---------------------------------------------------------------------------------


def test_answer_splitter_holds_back_partial_markers():
    s = AnswerSplitter(thinking=True, stops=["STOP"])
    pieces = [s.push(t) for t in ("I think", " so</th", "ink>The an", "swer ST", "OPand more")]
    assert pieces == [("I think", ""), (" so", ""), ("", "The an"), ("", "swer "), ("", "")]
    assert s.stopped and s.flush() == ("", "")
    s = AnswerSplitter(thinking=True)
    assert s.push("no end </th") == ("no end ", "") and s.flush() == ("</th", "")
    s = AnswerSplitter(thinking=False, stops=["ab"])
    assert s.push("xxa") == ("", "xx") and s.push("c") == ("", "ac") and s.flush() == ("", "")


def test_parse_chat_request_checks_what_the_engine_needs():
    from sparkchat.engine.events import MAX_SEED

    def refused(body: dict[str, Any]) -> str:
        with pytest.raises(RequestError) as e:
            parse_chat_request(json.dumps(body).encode())
        assert e.value.status == 400
        return e.value.message

    assert parse_chat_request(json.dumps({"messages": HELLO, "seed": MAX_SEED}).encode()).params.seed
    assert "seed" in refused({"messages": HELLO, "seed": MAX_SEED + 1})
    assert "'max_tokens' must be an integer, not nan" in refused({"messages": HELLO, "max_tokens": math.nan})
    assert "'top_k' must be an integer" in refused({"messages": HELLO, "top_k": math.inf})
    assert "messages[1].content" in refused({"messages": [*HELLO, {"role": "user", "content": None}]})


def test_parse_chat_request_defaults_and_aliases():
    defaults = SamplingParams(max_tokens=99, temperature=0.5)
    req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}],
                                         "top_k": -1, "seed": 3, "stop": "END"}).encode(), defaults)
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert (req.params.max_tokens, req.params.temperature, req.params.top_k, req.params.seed) == (99, 0.5, 0, 3)
    assert req.stop == ["END"] and req.stream is False and defaults.seed is None
    with pytest.raises(RequestError, match="top_p"):
        parse_chat_request(b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}')


def test_serve_command_flags(tiny_model_dir):
    from sparkchat.cli import EXIT_USAGE, serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", str(tiny_model_dir), "--port", "0", "--queue", "2",
                              "--api-key", "k", "--served-model-name", "ling", "--max-tokens", "64"])
    assert (args.host, args.port, args.queue, args.api_key, args.served_model_name) == ("127.0.0.1", 0, 2, "k", "ling")
    args.queue = -1
    assert args.func(args) == EXIT_USAGE
    assert serve._is_loopback("127.0.0.1") and serve._is_loopback("::1") and not serve._is_loopback("0.0.0.0")
