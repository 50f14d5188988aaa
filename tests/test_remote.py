"""The endpoint client (`RemoteEngine`, `sparkchat ask --endpoint`) against sparkchat's own server and
against a stub that answers like SGLang."""

from __future__ import annotations

import io
import json
import socket
import threading

import pytest

from sparkchat.cli import main
from sparkchat.engine.events import SamplingParams
from sparkchat.remote import EndpointError, RemoteEngine, split_url
from sparkchat.server import ChatServer
from tests.sglang_stub import MODEL, REASONING, SGLangStub, accept_length, expected_text, words
from tests.test_server import HELLO, FakeEngine, greedy, wait_for


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    import torch

    from sparkchat.engine.session import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_server.py
    eng = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    eng.switches.mtp = False
    yield eng
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(engine):
    with ChatServer(engine, port=0).start() as srv:
        yield srv


@pytest.fixture
def stub():
    with SGLangStub() as s:
        yield s


def collect(events) -> tuple[str, list[int], str | None, object]:
    text, ids, finish, stats = "", [], None, None
    for ev in events:
        text += ev.text
        ids += ev.token_ids
        finish, stats = ev.finish_reason, ev.stats
    return text, ids, finish, stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- against sparkchat serve -------------------------------------------------------------------------


def test_remote_equals_embedded_greedy(server, engine):
    want_text, want_ids, want_finish = greedy(engine, HELLO, 12)
    remote = RemoteEngine.connect(server.url)
    assert remote.name == engine.name and remote.max_context == 512 and remote.owned_by == "sparkchat"
    text, ids, finish, stats = collect(remote.generate(HELLO, SamplingParams(max_tokens=12)))
    assert (text, ids, finish) == (want_text, want_ids, want_finish)
    assert stats.generated_tokens == len(ids)
    assert stats.prompt_tokens == len(engine.tokenizer.encode_chat(HELLO))
    assert stats.ttft_s > 0 and stats.decode_tok_s > 0 and stats.prefill_tok_s > 0
    assert stats.switches["mtp"] is False  # the server's engine settings, as it reported them
    # the server machine's memory limit: what a step reads there, and its read bandwidth
    assert stats.bytes_per_token > 0 and stats.read_bw_bytes_s > 0


def test_remote_without_thinking_and_non_streamed(server, engine):
    want_text, want_ids, _ = greedy(engine, HELLO, 8, thinking=False)
    remote = RemoteEngine.connect(server.url)
    text, ids, _, _ = collect(remote.generate(HELLO, SamplingParams(max_tokens=8), enable_thinking=False))
    assert (text, ids) == (want_text, want_ids)
    whole = RemoteEngine.connect(server.url, meta_info=True)
    text, ids, finish, stats = collect(whole.generate(HELLO, SamplingParams(max_tokens=8), enable_thinking=False))
    assert (text, ids, finish) == (want_text, want_ids, "length") and stats.generated_tokens == 8


def test_remote_reports_the_servers_accept_length(server, engine):
    engine.switches.mtp = True
    try:
        _, _, _, stats = collect(RemoteEngine.connect(server.url).generate(HELLO, SamplingParams(max_tokens=10)))
    finally:
        engine.switches.mtp = False
    assert stats.accept_length_mean is not None and stats.accept_length_mean >= 1
    assert stats.switches["mtp"] is True


def test_remote_switches_are_not_applicable(server):
    states = RemoteEngine.connect(server.url).switch_states()
    assert set(states) == {"mtp", "fp8_head", "mxfp4_kernels", "cuda_graphs", "truncated_draft_head"}
    assert all(not s.on and not s.available and s.reason == "remote endpoint" for s in states.values())


def test_remote_refusals_are_one_line_errors(server):
    remote = RemoteEngine.connect(server.url)
    with pytest.raises(EndpointError, match="answered 400: the prompt is .* tokens but the context holds 512"):
        remote.generate([{"role": "user", "content": "word " * 2000}])
    with pytest.raises(EndpointError, match="does not serve 'gpt-4'; it serves tiny-ling"):
        RemoteEngine.connect(server.url, model="gpt-4")


def test_cancel_stops_the_servers_generation():
    eng = FakeEngine(step_s=0.01)
    with ChatServer(eng, port=0, enable_thinking=False).start() as srv:
        cancel = threading.Event()
        events = RemoteEngine.connect(srv.url).generate(HELLO, SamplingParams(max_tokens=1000), cancel=cancel)
        seen = []
        for ev in events:
            seen.append(ev)
            if len(seen) == 3:
                cancel.set()
        assert seen[-1].finish_reason == "cancelled" and len(seen) <= 6
        wait_for(lambda: eng.finishes == ["cancelled"] and srv.counters.cancelled == 1, timeout=3)
        assert eng.steps < 100


def test_cancel_while_the_server_is_silent():
    eng = FakeEngine()
    eng.release.clear()  # the server holds the answer back: the client blocks reading
    with ChatServer(eng, port=0, enable_thinking=False).start() as srv:
        cancel = threading.Event()
        threading.Timer(0.3, cancel.set).start()
        text, _, finish, _ = collect(RemoteEngine.connect(srv.url).generate(HELLO, cancel=cancel))
        assert (text, finish) == ("", "cancelled")
        eng.release.set()
        wait_for(lambda: not srv.gate.busy, timeout=3)


def test_ask_endpoint_against_sparkchat(server, engine, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    want_text, want_ids, _ = greedy(engine, HELLO, 6)
    assert main(["ask", "hello", "--endpoint", server.url, "--json", "--max-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == want_text and out["token_ids"] == want_ids and out["model"] == engine.name
    assert out["prompt_token_ids"] == [] and out["switches"]["mtp"]["reason"] == "remote endpoint"


# -- against an SGLang-shaped server -----------------------------------------------------------------


def test_stub_stream_rebuilds_text_and_counts(stub):
    remote = RemoteEngine.connect(stub.url)
    assert remote.name == MODEL and remote.max_context == 8192 and remote.owned_by == "sglang"
    text, ids, finish, stats = collect(remote.generate([{"role": "user", "content": "hi there"}],
                                                       SamplingParams(max_tokens=64, seed=4)))
    assert text == expected_text(stub, "hi there") and ids == [] and finish == "stop"
    n = len(words(REASONING)) + len(words("You said: hi there"))
    assert stats.generated_tokens == n and stats.prompt_tokens == 17 and stats.prefilled_tokens == 17
    assert stats.ttft_s > 0 and stats.accept_length_mean is None  # SGLang streams no meta_info
    sent = stub.requests[-1]
    assert sent["model"] == MODEL and sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and sent["seed"] == 4
    assert "return_meta_info" not in sent and "top_k" not in sent


def test_stub_meta_info_gives_accept_length(stub):
    remote = RemoteEngine.connect(stub.url, meta_info=True)
    text, _, finish, stats = collect(remote.generate([{"role": "user", "content": "hi"}], enable_thinking=False))
    assert text == expected_text(stub, "hi", thinking=False) and finish == "stop"
    n = len(words("You said: hi"))
    assert stats.generated_tokens == n and stats.accept_length_mean == pytest.approx(accept_length(n, 3))
    assert stats.decode_tok_s > 0 and stats.ttft_s > 0
    sent = stub.requests[-1]
    assert sent["stream"] is False and sent["return_meta_info"] is True


def test_stub_length_limit_and_errors(stub):
    remote = RemoteEngine.connect(stub.url)
    _, _, finish, stats = collect(remote.generate(HELLO, SamplingParams(max_tokens=4)))
    assert finish == "length" and stats.generated_tokens == 4
    with pytest.raises(EndpointError, match="answered 400: max_tokens must be positive"):
        remote.generate(HELLO, SamplingParams(max_tokens=0))


def test_api_key_from_the_environment(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with SGLangStub(api_key="k1") as s:
        with pytest.raises(EndpointError, match="answered 401: Unauthorized"):
            RemoteEngine.connect(s.url)
        assert RemoteEngine.connect(s.url, api_key="k1").name == MODEL
        monkeypatch.setenv("SPARKCHAT_API_KEY", "k1")
        assert main(["ask", "hi", "--endpoint", s.url, "--json", "--no-think"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["text"] == out["answer"] == "You said: hi" and out["reasoning"] is None
        assert out["stats"]["generated_tokens"] == 3


def test_ask_endpoint_splits_reasoning(stub, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["ask", "hi", "--endpoint", stub.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reasoning"] == REASONING and out["answer"] == "You said: hi" and out["finish_reason"] == "stop"
    assert main(["ask", "hi", "--endpoint", stub.url, "--stats"]) == 0
    captured = capsys.readouterr()
    assert "You said: hi" in captured.out and "tok/s" in captured.err


# -- unreachable endpoints ---------------------------------------------------------------------------


def test_connection_refused_is_one_line(capsys, monkeypatch):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EndpointError, match="connection refused"):
        RemoteEngine.connect(url)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["ask", "hi", "--endpoint", url]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "connection refused" in err[0]


@pytest.mark.parametrize("url, needle", [
    ("ftp://example.com", "use http:// or https://"),
    ("http://", "no host"),
    ("http://host:notaport", "bad endpoint URL"),
])
def test_bad_urls(url, needle):
    with pytest.raises(EndpointError, match=needle):
        RemoteEngine(url)


def test_url_forms():
    assert split_url("localhost:30000") == ("http", "localhost", 30000, "/v1")
    assert split_url("http://spark-1:8000/v1/") == ("http", "spark-1", 8000, "/v1")
    assert split_url("https://gw.example/proxy") == ("https", "gw.example", 443, "/proxy/v1")


def test_not_an_openai_server():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Html(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "6")
            self.end_headers()
            self.wfile.write(b"<html>")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Html)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(EndpointError, match="did not answer JSON"):
            RemoteEngine.connect(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()
