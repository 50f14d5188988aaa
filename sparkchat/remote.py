"""A remote OpenAI-compatible chat endpoint behind the engine's interface.

    engine = RemoteEngine.connect("http://spark-1:30000")      # sparkchat serve, SGLang, vLLM, ...
    for event in engine.generate(messages, SamplingParams(max_tokens=64)):
        print(event.text, end="")

It yields the same `ResponseEvent`s as the embedded engine. Timing (TTFT, tok/s) is measured here, from
when each chunk arrives, so it includes the network; token counts come from the server's `usage`. Accept
length comes from the server when it sends one:
  - sparkchat's own server: the `"sparkchat"` extension field (token ids per chunk, full stats at the end);
  - SGLang: `meta_info` (`spec_accept_length`, or `completion_tokens / spec_verify_ct`). SGLang attaches
    `meta_info` only to non-streamed answers asked with `"return_meta_info": true`, so `meta_info=True`
    makes this client ask for it and turns streaming off; a `meta_info` found in a streamed chunk is
    read as well.
Reasoning sent apart (`reasoning_content`, or vLLM's `reasoning`) is put back in the engine's shape,
`reasoning</think>answer`, so callers split it the same way for both.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from threading import Event
from typing import Any
from urllib.parse import urlsplit

from sparkchat.engine.errors import SparkchatError
from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams, Switches, SwitchState

API_KEY_ENV = "SPARKCHAT_API_KEY"
THINK_END = "</think>"
SWITCH_NAMES = ("mtp", "fp8_head", "mxfp4_kernels", "cuda_graphs", "truncated_draft_head")
_FINISH = {"stop": "stop", "length": "length", "abort": "cancelled", "cancelled": "cancelled"}


class EndpointError(SparkchatError):
    """A remote endpoint that cannot be reached or that refused a request (one line)."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _error_message(raw: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {...}}, SGLang/vLLM's {"message": ...}, or text."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _one_line(raw.decode("utf-8", "replace")) or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(err["message"])
        if isinstance(err, str):
            return _one_line(err)
        for key in ("message", "detail"):
            if isinstance(body.get(key), str):
                return _one_line(body[key])
    return _one_line(raw.decode("utf-8", "replace"))


def split_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, API base path ending in /v1) for `http://host:port[/prefix][/v1]`."""
    text = url.strip()
    if "://" not in text:
        text = f"http://{text}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise EndpointError(f"bad endpoint URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise EndpointError(f"bad endpoint URL {url!r}: use http:// or https://")
    if not parts.hostname:
        raise EndpointError(f"bad endpoint URL {url!r}: no host")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path


class RemoteEngine:
    """An OpenAI-compatible server with the Engine's interface: generate, switch_states, name, reset."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout: float = 300.0, connect_timeout: float = 10.0, meta_info: bool = False) -> None:
        self.scheme, self.host, self.port, self.base = split_url(url)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{self.scheme}://{host}:{self.port}{self.base}"
        self.model = model
        self.name = model or f"{self.host}:{self.port}"
        self.api_key = api_key
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.meta_info = meta_info
        self.max_context: int | None = None
        self.owned_by: str | None = None
        self.switches = Switches(mtp=False, fp8_head=False, mxfp4_kernels=False, cuda_graphs=False,
                                 truncated_draft_head=False)

    @classmethod
    def connect(cls, url: str, *, model: str | None = None, api_key: str | None = None,
                **kwargs: Any) -> RemoteEngine:
        """Check the endpoint answers and pick the model: `model`, else the first one /v1/models lists."""
        engine = cls(url, model=model, api_key=api_key, **kwargs)
        engine.refresh()
        return engine

    # -- the Engine interface ---------------------------------------------------------------------
    def switch_states(self) -> dict[str, SwitchState]:
        return {name: SwitchState(on=False, available=False, reason="remote endpoint") for name in SWITCH_NAMES}

    def set_switches(self, switches: Switches) -> None:
        """Kept for the interface; a remote server's optimizations are set where it runs."""
        self.switches = replace(switches)

    def reset(self) -> None:
        """Nothing to forget: each request carries the whole conversation."""

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "endpoint": self.url, "owned_by": self.owned_by,
                "max_context": self.max_context}

    def refresh(self) -> list[dict[str, Any]]:
        """GET /v1/models: the models the server lists (and, when unset, pick the first)."""
        status, raw = self._request("GET", "/models")
        if status == 404:  # a server without /v1/models: send no model id unless one was given
            return []
        if not 200 <= status < 300:
            raise EndpointError(f"{self.url}/models answered {status}: {_error_message(raw)}")
        try:
            data = json.loads(raw).get("data") or []
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise EndpointError(f"{self.url}/models did not answer JSON: is this an OpenAI-compatible "
                                "endpoint?") from None
        cards = [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if self.model is None and cards:
            self.model = self.name = cards[0]["id"]
        if self.model is not None:
            ids = [c["id"] for c in cards]
            if cards and self.model not in ids:
                raise EndpointError(f"{self.url} does not serve {self.model!r}; it serves {', '.join(ids)}")
            card = next((c for c in cards if c["id"] == self.model), {})
            limit = card.get("max_model_len") or card.get("context_length")
            self.max_context = limit if isinstance(limit, int) else None
            self.owned_by = card.get("owned_by")
        return cards

    def generate(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
                 enable_thinking: bool = True, cancel: Event | None = None) -> Iterator[ResponseEvent]:
        """Send the whole conversation; refusals (4xx/5xx) raise here, before any event."""
        params = params or SamplingParams()
        stream = not self.meta_info
        body: dict[str, Any] = {
            "messages": messages, "stream": stream, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "chat_template_kwargs": {"enable_thinking": enable_thinking},
        }
        if self.model is not None:
            body["model"] = self.model
        if self.owned_by == "sparkchat":  # ask for the raw `reasoning</think>answer` text: exact, no rebuild
            body["separate_reasoning"] = False
        if stream:
            body["stream_options"] = {"include_usage": True}
        else:
            body["return_meta_info"] = True
        if params.seed is not None:
            body["seed"] = params.seed
        if params.top_k > 0:
            body["top_k"] = params.top_k
        t0 = time.perf_counter()
        conn = self._connection()
        done = threading.Event()  # set when this answer's connection is finished with
        if cancel is not None:  # a cancel closes the socket, even while the server is silent (queued)
            threading.Thread(target=_close_on_cancel, args=(conn, cancel, done), daemon=True).start()
        try:
            conn.request("POST", f"{self.base}/chat/completions", body=json.dumps(body).encode(),
                         headers=self._headers({"Content-Type": "application/json",
                                                "Accept": "text/event-stream" if stream else "application/json"}))
            resp = conn.getresponse()
            if not 200 <= resp.status < 300:
                raw = resp.read()
                raise EndpointError(f"{self.url} answered {resp.status}: {_error_message(raw)}")
        except (OSError, http.client.HTTPException) as e:
            done.set()
            conn.close()
            if cancel is not None and cancel.is_set():
                return iter([ResponseEvent("", [], "cancelled", GenerationStats())])
            raise self._read_error(e) from None
        except BaseException:
            done.set()
            conn.close()
            raise
        if not stream:
            return self._whole(conn, resp, t0, cancel, done)
        return self._events(conn, resp, t0, cancel, done)

    # -- HTTP ------------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        """Connected within `connect_timeout`; reads then wait up to `timeout` of silence (a queued or
        long-prefilling request may take a while to answer)."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()
        except BaseException as e:
            conn.close()
            raise self._transport_error(e) from None
        conn.sock.settimeout(self.timeout)
        return conn

    def _headers(self, extra: dict[str, str]) -> dict[str, str]:
        headers = dict(extra)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _request(self, method: str, path: str) -> tuple[int, bytes]:
        conn = self._connection()
        try:
            conn.request(method, f"{self.base}{path}", headers=self._headers({"Accept": "application/json"}))
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise self._read_error(e) from None
        finally:
            conn.close()

    def _transport_error(self, e: BaseException) -> BaseException:
        if isinstance(e, ConnectionRefusedError):
            return EndpointError(f"cannot reach {self.url}: connection refused (is the server running?)")
        if isinstance(e, socket.gaierror):
            return EndpointError(f"cannot reach {self.url}: unknown host {self.host!r}")
        if isinstance(e, (TimeoutError, socket.timeout)):
            return EndpointError(f"cannot reach {self.url}: no answer within {self.connect_timeout:g} s")
        if isinstance(e, (OSError, http.client.HTTPException)):
            return EndpointError(f"cannot talk to {self.url}: {_one_line(e) or type(e).__name__}")
        return e  # KeyboardInterrupt and the like pass through

    # -- answers ---------------------------------------------------------------------------------
    def _whole(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, t0: float,
               cancel: Event | None, done: threading.Event) -> Iterator[ResponseEvent]:
        """A non-streamed answer as one text event and a final one."""
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            if cancel is None or not cancel.is_set():
                raise self._read_error(e) from None
            raw = b""
        finally:
            done.set()
            conn.close()
        if cancel is not None and cancel.is_set():
            yield ResponseEvent("", [], "cancelled", GenerationStats())
            return
        body = self._json(raw)
        t1 = time.perf_counter()
        tally = _Tally(t0)
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        text = tally.text(message.get("reasoning_content") or message.get("reasoning"), message.get("content"))
        tally.absorb(body, choice)
        tally.ids = _token_ids(body)
        tally.arrived(t1, len(tally.ids) or 1)
        tally.finish_stats(t1)
        st = tally.stats  # all of it arrived at once: the only rate to measure is end to end
        st.decode_s = t1 - t0
        if st.generated_tokens > 0 and st.decode_s > 0:
            st.decode_tok_s = st.generated_tokens / st.decode_s
            st.tpot_ms = 1000 * st.decode_s / st.generated_tokens
        if text or tally.ids:
            yield ResponseEvent(text, list(tally.ids), None, tally.stats)
        yield ResponseEvent("", [], _FINISH.get(choice.get("finish_reason") or "stop", "stop"), tally.stats)

    def _events(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, t0: float,
                cancel: Event | None, done: threading.Event) -> Iterator[ResponseEvent]:
        tally = _Tally(t0)
        finish: str | None = None
        try:
            for data in _sse_data(resp):
                if cancel is not None and cancel.is_set():
                    break
                if data == "[DONE]":
                    break
                chunk = self._json(data.encode())
                if "error" in chunk and not chunk.get("choices"):
                    raise EndpointError(f"{self.url} failed mid-answer: {_error_message(data.encode())}")
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    if choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta") or {}
                    text = tally.text(delta.get("reasoning_content") or delta.get("reasoning"), delta.get("content"))
                    ids = _token_ids(chunk)
                    tally.absorb(chunk, choice)
                    if text or ids:
                        tally.arrived(now, len(ids) or 1)
                        yield ResponseEvent(text, ids, None, tally.stats)
                    if choice.get("finish_reason"):
                        finish = _FINISH.get(choice["finish_reason"], "stop")
                if not chunk.get("choices"):
                    tally.absorb(chunk, {})  # the usage chunk
        except (OSError, http.client.HTTPException) as e:
            if cancel is None or not cancel.is_set():
                raise self._read_error(e) from None
        finally:
            done.set()
            conn.close()
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
        elif finish is None:
            raise EndpointError(f"{self.url} ended the answer without a finish reason (connection dropped?)")
        tally.finish_stats(time.perf_counter())
        yield ResponseEvent("", [], finish, tally.stats)

    def _read_error(self, e: BaseException) -> EndpointError:
        if isinstance(e, (TimeoutError, socket.timeout)):
            return EndpointError(f"{self.url} sent nothing for {self.timeout:g} s")
        return EndpointError(f"lost the connection to {self.url}: {_one_line(e) or type(e).__name__}")

    def _json(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise EndpointError(f"{self.url} sent something that is not JSON: "
                                f"{_one_line(raw.decode('utf-8', 'replace'), 80)}") from None
        if not isinstance(body, dict):
            raise EndpointError(f"{self.url} sent JSON that is not an object")
        return body


def _token_ids(body: dict[str, Any]) -> list[int]:
    """Token ids from sparkchat's extension field (other servers send none)."""
    ext = body.get("sparkchat")
    ids = ext.get("token_ids") if isinstance(ext, dict) else None
    return [t for t in ids if isinstance(t, int)] if isinstance(ids, list) else []


def _close_on_cancel(conn: http.client.HTTPConnection, cancel: Event, done: threading.Event) -> None:
    """Unblock a read waiting on a silent server once the caller cancels: the server sees us go."""
    while not done.is_set() and conn.sock is not None:
        if cancel.wait(0.05):
            sock = conn.sock
            if sock is not None and not done.is_set():
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return


def _sse_data(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, one per event."""
    lines: list[str] = []
    while True:
        raw = resp.readline()
        if not raw:
            if lines:
                yield "\n".join(lines)
            return
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        # comments (":") and other fields (event:, id:, retry:) carry nothing we use


class _Tally:
    """Client-side stats for one answer, filled in as chunks arrive."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last = t0
        self.count = 0  # tokens seen so far (chunks, when the server sends no token ids)
        self.ids: list[int] = []
        self.stats = GenerationStats()
        self.usage: dict[str, Any] = {}
        self.server: dict[str, Any] = {}  # sparkchat's stats
        self.meta: dict[str, Any] = {}  # SGLang's meta_info
        self._reasoning_open = False

    def text(self, reasoning: Any, answer: Any) -> str:
        out = ""
        if isinstance(reasoning, str) and reasoning:
            out += reasoning
            self._reasoning_open = True
        if isinstance(answer, str) and answer:
            if self._reasoning_open:
                out += THINK_END
                self._reasoning_open = False
            out += answer
        return out

    def absorb(self, body: dict[str, Any], choice: dict[str, Any]) -> None:
        if isinstance(body.get("usage"), dict):
            self.usage = body["usage"]
        ext = body.get("sparkchat")
        if isinstance(ext, dict) and isinstance(ext.get("stats"), dict):
            self.server = ext["stats"]
        for meta in (body.get("meta_info"), choice.get("meta_info")):
            if isinstance(meta, dict):
                self.meta.update(meta)

    def arrived(self, now: float, tokens: int) -> None:
        st = self.stats
        if self.t_first is None:
            self.t_first = now
            st.ttft_s = st.prefill_s = now - self.t0
        self.t_last = now
        self.count += tokens
        st.generated_tokens = self.count
        self._rates()

    def _rates(self) -> None:
        st = self.stats
        st.decode_s = self.t_last - (self.t_first or self.t_last)
        if st.generated_tokens > 1 and st.decode_s > 0:
            st.decode_tok_s = (st.generated_tokens - 1) / st.decode_s
            st.tpot_ms = 1000 * st.decode_s / (st.generated_tokens - 1)

    def finish_stats(self, now: float) -> None:
        st, usage, server = self.stats, self.usage, self.server
        if self.t_first is None:  # no text at all
            st.ttft_s = st.prefill_s = now - self.t0
        if isinstance(usage.get("completion_tokens"), int):
            st.generated_tokens = usage["completion_tokens"]
        elif isinstance(self.meta.get("completion_tokens"), int):
            st.generated_tokens = self.meta["completion_tokens"]
        prompt = usage.get("prompt_tokens", self.meta.get("prompt_tokens"))
        if isinstance(prompt, int):
            st.prompt_tokens = prompt
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            cached = cached if isinstance(cached, int) else self.meta.get("cached_tokens")
            st.prefilled_tokens = prompt - cached if isinstance(cached, int) else prompt
        if isinstance(server.get("prefilled_tokens"), int):
            st.prefilled_tokens = server["prefilled_tokens"]
        if st.prefill_s > 0:
            st.prefill_tok_s = st.prefilled_tokens / st.prefill_s
        self._rates()
        for name in ("accept_length_mean", "accept_length_last", "accept_rate_per_position", "verify_decode_ratio"):
            if server.get(name) is not None:
                setattr(st, name, server[name])
        for name in ("bytes_per_token", "read_bw_bytes_s"):  # the server's machine: its memory's limit
            value = server.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                setattr(st, name, value)
        if isinstance(server.get("switches"), dict):
            st.switches = dict(server["switches"])
        if st.accept_length_mean is None:
            st.accept_length_mean = _sglang_accept_length(self.meta)


def _sglang_accept_length(meta: dict[str, Any]) -> float | None:
    """SGLang's tokens per verify step: `spec_accept_length`, or completion_tokens / spec_verify_ct."""
    value = meta.get("spec_accept_length")
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    steps, done = meta.get("spec_verify_ct"), meta.get("completion_tokens")
    if isinstance(steps, int) and steps > 0 and isinstance(done, int):
        return done / steps
    return None


def connect_endpoint(url: str, model: str | None = None) -> RemoteEngine:
    """The engine for `--endpoint URL` (API key from $SPARKCHAT_API_KEY)."""
    return RemoteEngine.connect(url, model=model, api_key=os.environ.get(API_KEY_ENV) or None)
