"""`sparkchat serve`: an OpenAI-compatible HTTP API over the embedded engine, standard library only.

    server = ChatServer(engine, port=0).start()      # a background thread; server.url is http://127.0.0.1:PORT
    ...                                             # POST {server.url}/v1/chat/completions
    server.close()

Endpoints: POST /v1/chat/completions (SSE when "stream": true, else one JSON object), GET /v1/models,
GET /health. Answers are decoded one at a time at batch size 1: one request holds the engine, up to
`queue` more wait their turn in arrival order, and the rest are refused at once with 503 and a JSON error.
A client that closes its connection (mid-stream, mid-answer or while waiting) cancels its request, so the
engine is free again within one decode step. Each request is an independent conversation; the engine's
kept state still makes a follow-up turn prefill only its new tokens.
"""

from __future__ import annotations

import hmac
import json
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sparkchat.engine.errors import ContextOverflowError, SparkchatError
from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams
from sparkchat.server_protocol import (
    AnswerSplitter, ChatRequest, RequestError, chunk_body, completion_body, completion_id, error_body,
    models_body, parse_chat_request, sparkchat_body, usage_chunk_body,
)

MAX_BODY_BYTES = 16 * 1024 * 1024
POLL_S = 0.05  # how often a waiting or running request checks that its client is still there


@dataclass
class Counters:
    """What the server did since it started (read by /health and the tests)."""

    answered: int = 0  # answers delivered in full (finish "stop" or "length")
    cancelled: int = 0  # requests whose client went away before the answer was complete
    rejected_busy: int = 0  # refused with 503 because the queue was full
    refused: int = 0  # refused with another 4xx (bad request, key, model, context)
    failed: int = 0  # engine errors (500, or an error event mid-stream)
    generated_tokens: int = 0  # tokens decoded, cancelled answers included


class EngineGate:
    """First come, first served access to the one engine: a holder plus at most `queue` waiters."""

    def __init__(self, queue: int) -> None:
        if queue < 0:
            raise ValueError("the queue length must be 0 or more")
        self.queue = queue
        self._line: deque[object] = deque()  # line[0] holds the engine once it has acquired
        self._holding = False
        self._cond = threading.Condition()

    def admit(self) -> object | None:
        """A place in line, or None when the line is full."""
        with self._cond:
            if len(self._line) >= 1 + self.queue:
                return None
            ticket = object()
            self._line.append(ticket)
            return ticket

    def acquire(self, ticket: object, abandoned: Callable[[], bool]) -> bool:
        """Wait for our turn; False (and out of line) if `abandoned()` turns true while waiting."""
        with self._cond:
            while not (self._line[0] is ticket and not self._holding):
                if abandoned():
                    self._line.remove(ticket)
                    self._cond.notify_all()
                    return False
                self._cond.wait(POLL_S)
            self._holding = True
            return True

    def release(self, ticket: object) -> None:
        with self._cond:
            if self._line and self._line[0] is ticket:
                self._line.popleft()
                self._holding = False
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        return self._holding

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._line) - (1 if self._holding else 0)


class DisconnectWatch:
    """Calls `on_gone` once the client closes its connection: its socket reads end-of-file.

    Bytes the client sends meanwhile (a pipelined next request) stay in the socket for the handler."""

    def __init__(self, sock: socket.socket, on_gone: Callable[[], None]) -> None:
        self.sock, self.on_gone = sock, on_gone
        self.gone = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkchat-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], POLL_S)
                if readable and self.sock.recv(1, socket.MSG_PEEK) == b"":
                    break
            except (OSError, ValueError):
                break
            if readable:
                self._stop.wait(POLL_S)  # data waiting, not a close: look again later
        else:  # stopped by the handler: the client stayed
            return
        self.gone = True
        self.on_gone()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class ChatServer:
    """The HTTP server around one engine (`Engine` or anything with its generate_ids/tokenizer/name)."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 queue: int = 8, model_name: str | None = None, defaults: SamplingParams | None = None,
                 system: str | None = None, enable_thinking: bool = True,
                 log: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.name
        self.api_key = api_key or None
        self.gate = EngineGate(queue)
        self.defaults = defaults or SamplingParams()
        self.system = system
        self.enable_thinking = enable_thinking
        self.log = log
        self.counters = Counters()
        self.created = int(time.time())
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.app = self

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> ChatServer:
        """Serve from a background thread."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="sparkchat-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + d)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model_name, "busy": self.gate.busy, "waiting": self.gate.waiting,
                "queue": self.gate.queue, "counters": asdict(self.counters)}

    def prompt_ids(self, req: ChatRequest) -> list[int]:
        messages = req.messages
        if self.system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system}] + messages
        try:
            ids = self.engine.tokenizer.encode_chat(messages, enable_thinking=req.enable_thinking)
        except SparkchatError as e:  # the chat template refused the conversation
            raise RequestError(400, str(e), code="invalid_messages") from None
        limit = self.engine.max_context
        if len(ids) >= limit:
            raise RequestError(400, f"the prompt is {len(ids)} tokens but the context holds {limit}; "
                                    "shorten the conversation", code="context_length_exceeded")
        return ids


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # 50 clients connecting at once must not overflow the listen backlog
    app: ChatServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One log line, never a traceback: most often a client that left while we wrote to it."""
        e = sys.exc_info()[1]
        if self.app.log and e is not None:
            what = "client went away" if isinstance(e, ConnectionError) else "request failed"
            self.app.log(f"{client_address[0]} {what}: {_one_line(e)}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sparkchat"
    timeout = 600  # an idle keep-alive connection is closed after this long
    server: _HTTPServer

    # -- plumbing -------------------------------------------------------------------------------
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.app.log:
            self.server.app.log(f"{self.address_string()} {format % args}")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's errors (bad request line, unsupported method, ...) as JSON too."""
        self.close_connection = True
        text = message or explain or "bad request"
        try:
            if self.command == "HEAD":  # a HEAD answer carries no body
                self.send_response(code)
                self.send_header("Connection", "close")
                self.end_headers()
            else:
                self._send_json(code, error_body(text, "invalid_request_error", "bad_http_request"),
                                {"Connection": "close"})
        except OSError:
            pass

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: RequestError, headers: dict[str, str] | None = None) -> None:
        self.server.app.count(refused=1)
        self._send_json(err.status, err.body(), headers)

    def _authorized(self) -> bool:
        key = self.server.app.api_key
        if key is None:
            return True
        auth = self.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            return True
        msg = "missing API key: send 'Authorization: Bearer KEY'" if not auth else "invalid API key"
        if self.command == "POST":
            self._discard_body()
        self._send_error(RequestError(401, msg, "authentication_error", "invalid_api_key"),
                         {"WWW-Authenticate": "Bearer"})
        return False

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise RequestError(411, "send the request body with a Content-Length header", code="length_required")
        n = _content_length(length)
        if n is None:  # read(-1) would wait for the client to close: refuse at once
            self.close_connection = True
            raise RequestError(400, f"bad Content-Length header {length[:20]!r}: expected a byte count",
                               code="invalid_request")
        if n > MAX_BODY_BYTES:
            self.close_connection = True
            raise RequestError(413, f"the request body is over {MAX_BODY_BYTES // (1024 * 1024)} MiB",
                               code="request_too_large")
        return self.rfile.read(n)

    def _discard_body(self) -> None:
        """Read a body we will not use, so the connection can go on (or at least close cleanly: closing
        with unread bytes makes the kernel reset it, and the client may lose our answer)."""
        n = _content_length(self.headers.get("Content-Length") or "0")
        if n is not None and n <= MAX_BODY_BYTES and self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _not_found(self) -> None:
        self._send_error(RequestError(404, f"no route for {self.command} {self.path}", "not_found_error",
                                      "unknown_route"))

    # -- routes ---------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        app = self.server.app
        if path == "/health":
            self._send_json(200, app.health())
        elif path in ("/v1/models", f"/v1/models/{app.model_name}"):
            if self._authorized():
                body = models_body(app.model_name, app.engine.max_context, app.created)
                self._send_json(200, body if path == "/v1/models" else body["data"][0])
        elif path.startswith("/v1/models/"):
            if self._authorized():
                self._send_error(_unknown_model(path.removeprefix("/v1/models/"), app.model_name))
        else:
            self._not_found()

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/chat/completions":
            self._discard_body()
            self._not_found()
            return
        if not self._authorized():
            return
        try:
            self._chat()
        except RequestError as e:
            self._send_error(e)

    def _chat(self) -> None:
        app = self.server.app
        req = parse_chat_request(self._read_body(), app.defaults, app.enable_thinking)
        if req.model is not None and req.model != app.model_name:
            raise _unknown_model(req.model, app.model_name)
        prompt_ids = app.prompt_ids(req)
        cancel = threading.Event()
        watch = DisconnectWatch(self.connection, cancel.set)
        try:
            t_arrive = time.perf_counter()
            ticket = app.gate.admit()
            if ticket is None:
                app.count(rejected_busy=1)
                self._send_json(503, error_body(f"the server is busy: one answer is being decoded and "
                                                f"{app.gate.queue} more are waiting; try again shortly",
                                                "server_busy", "queue_full"), {"Retry-After": "1"})
                return
            try:
                if not app.gate.acquire(ticket, cancel.is_set):
                    app.count(cancelled=1)
                    self.close_connection = True
                    return
                queue_s = time.perf_counter() - t_arrive
                try:
                    events = app.engine.generate_ids(prompt_ids, req.params, cancel=cancel)
                except ContextOverflowError as e:
                    raise RequestError(400, str(e), code="context_length_exceeded") from None
                except SparkchatError as e:  # e.g. a tokenizer that does not fit the model
                    app.count(failed=1)
                    self._send_json(500, error_body(str(e), "server_error", "engine_error"))
                    return
                if req.stream:
                    self._stream(req, prompt_ids, events, cancel, watch, queue_s)
                else:
                    self._complete(req, prompt_ids, events, cancel, watch, queue_s)
            finally:
                app.gate.release(ticket)
        finally:
            watch.stop()

    # -- answers --------------------------------------------------------------------------------
    def _run(self, req: ChatRequest, events: Iterator[ResponseEvent], cancel: threading.Event,
             on_piece: Callable[[str, str, list[int]], None]) -> tuple[str, GenerationStats, list[int]]:
        """Drive the engine to the end, passing (reasoning, answer, token ids) pieces on. A stop string
        or a vanished client sets `cancel`; the engine then ends within one step, its state consistent."""
        splitter = AnswerSplitter(req.enable_thinking, req.separate_reasoning, req.stop)
        finish, stats, ids = "stop", GenerationStats(), []
        for event in events:
            stats = event.stats
            ids.extend(event.token_ids)
            reasoning, answer = splitter.push(event.text)
            if event.finish_reason:
                r2, a2 = splitter.flush()
                reasoning, answer = reasoning + r2, answer + a2
                finish = event.finish_reason
            if splitter.stopped:
                cancel.set()
            if reasoning or answer or event.token_ids:
                on_piece(reasoning, answer, event.token_ids)
        if splitter.stopped:
            finish = "stop"
        self.server.app.count(generated_tokens=stats.generated_tokens)
        return finish, stats, ids

    def _complete(self, req: ChatRequest, prompt_ids: list[int], events: Iterator[ResponseEvent],
                  cancel: threading.Event, watch: DisconnectWatch, queue_s: float) -> None:
        app = self.server.app
        parts: dict[str, list[str]] = {"reasoning": [], "answer": []}

        def collect(reasoning: str, answer: str, _ids: list[int]) -> None:
            parts["reasoning"].append(reasoning)
            parts["answer"].append(answer)

        try:
            finish, stats, ids = self._run(req, events, cancel, collect)
        except Exception as e:  # noqa: BLE001 (any engine failure becomes a JSON 500, never a dropped socket)
            app.count(failed=1)
            self._send_json(500, error_body(_one_line(e), "server_error", "engine_error"))
            return
        if watch.gone:
            app.count(cancelled=1)
            self.close_connection = True
            return
        app.count(answered=1)
        self._send_json(200, completion_body(completion_id(), app.model_name, "".join(parts["reasoning"]),
                                             "".join(parts["answer"]), finish, ids, stats, len(prompt_ids),
                                             queue_s))

    def _stream(self, req: ChatRequest, prompt_ids: list[int], events: Iterator[ResponseEvent],
                cancel: threading.Event, watch: DisconnectWatch, queue_s: float) -> None:
        app = self.server.app
        cid, model = completion_id(), app.model_name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()
        broken = False

        def send(obj: dict[str, Any] | str) -> None:
            nonlocal broken
            if broken:
                return
            text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
            data = f"data: {text}\n\n".encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:  # the client went away; stop the engine, write nothing more
                broken = True
                cancel.set()

        def piece(reasoning: str, answer: str, ids: list[int]) -> None:
            delta: dict[str, Any] = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if answer:
                delta["content"] = answer
            send(chunk_body(cid, model, delta, sparkchat=sparkchat_body(ids)))

        send(chunk_body(cid, model, {"role": "assistant", "content": ""}))
        try:
            finish, stats, _ids = self._run(req, events, cancel, piece)
        except Exception as e:  # noqa: BLE001 (the status is sent already: the error goes in the stream)
            app.count(failed=1)
            send(error_body(_one_line(e), "server_error", "engine_error"))
            send("[DONE]")
            self._end_chunks()
            return
        if broken or watch.gone:
            app.count(cancelled=1)
            self.close_connection = True
            return
        app.count(answered=1)
        send(chunk_body(cid, model, {}, finish, sparkchat_body([], stats, queue_s)))
        if req.include_usage:
            send(usage_chunk_body(cid, model, stats, len(prompt_ids)))
        send("[DONE]")
        self._end_chunks()

    def _end_chunks(self) -> None:
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True


def _content_length(value: str) -> int | None:
    """A Content-Length header's byte count; None unless it is plain ASCII digits (int() would take
    "-1", "+5", "1_000" and other scripts' digits)."""
    value = value.strip()
    return int(value) if value.isascii() and value.isdigit() else None


def _one_line(e: BaseException) -> str:
    if isinstance(e, SparkchatError):
        return str(e)
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _unknown_model(given: str, served: str) -> RequestError:
    return RequestError(404, f"model {given!r} is not served here; this server serves {served!r}",
                        "not_found_error", "model_not_found")
