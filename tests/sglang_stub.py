"""A minimal HTTP server on 127.0.0.1 that answers like SGLang's OpenAI-compatible API, for client tests.

The shapes follow SGLang's `entrypoints/openai` (protocol.py, serving_chat.py, sse_utils.py):
  GET  /v1/models             {"object": "list", "data": [{"id", "object": "model", "owned_by": "sglang",
                              "root", "parent", "max_model_len"}]}
  POST /v1/chat/completions   streamed: a role chunk, `reasoning_content` / `content` deltas (a speculative
                              server sends several tokens per chunk), a finish chunk (`finish_reason`,
                              `matched_stop`), with `stream_options.include_usage` a usage chunk with
                              `"choices": []`, then `data: [DONE]`. No `meta_info` in streamed chunks.
                              Not streamed: one object; with `"return_meta_info": true` the choice carries
                              `meta_info` (prompt/completion tokens, `spec_verify_ct`, `spec_accept_length`).
  Errors                      {"object": "error", "message", "type", "param", "code"} (SGLang's
                              ErrorResponse); a wrong key gets 401 {"error": "Unauthorized"} (assumed).

The "model" answers `reasoning` (unless `chat_template_kwargs.enable_thinking` is false) and then
`You said: <last user message>`, one token per word, `tokens_per_step` tokens per chunk.
"""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "inclusionAI/Ling-3.0-flash"
REASONING = "The user says something. I should repeat it."


def words(text: str) -> list[str]:
    """Text cut into 'tokens': each word with the space before it."""
    out = []
    for i, w in enumerate(text.split(" ")):
        out.append(w if i == 0 else " " + w)
    return out


class SGLangStub:
    def __init__(self, api_key: str | None = None, tokens_per_step: int = 3, prompt_tokens: int = 17) -> None:
        self.api_key = api_key
        self.tokens_per_step = tokens_per_step
        self.prompt_tokens = prompt_tokens
        self.requests: list[dict[str, Any]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.stub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> SGLangStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self._thread.join()
        self.httpd.server_close()

    def answer(self, body: dict[str, Any]) -> tuple[list[str], list[str]]:
        """(reasoning tokens, answer tokens) for a request."""
        user = next((m["content"] for m in reversed(body["messages"]) if m.get("role") == "user"), "")
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking", True)
        return (words(REASONING) if thinking else []), words(f"You said: {user}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes, as uvicorn may do

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    @property
    def stub(self) -> SGLangStub:
        return self.server.stub  # type: ignore[attr-defined]

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, type_: str = "BadRequestError") -> None:
        self._json(status, {"object": "error", "message": message, "type": type_, "param": None, "code": status})

    def _authorized(self) -> bool:
        if self.stub.api_key is None or self.headers.get("Authorization") == f"Bearer {self.stub.api_key}":
            return True
        self._json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 1,
                                                         "owned_by": "sglang", "root": MODEL, "parent": None,
                                                         "max_model_len": 8192}]})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.stub.requests.append(body)
        if not self._authorized():
            return
        if self.path != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        max_tokens = body.get("max_tokens", 128)
        if max_tokens is not None and max_tokens <= 0:
            self._error(400, "max_tokens must be positive")
            return
        reasoning, answer = self.stub.answer(body)
        tokens = [("r", t) for t in reasoning] + [("c", t) for t in answer]
        finish = "stop"
        if len(tokens) > max_tokens:
            tokens, finish = tokens[:max_tokens], "length"
        steps = [tokens[i:i + self.stub.tokens_per_step] for i in range(0, len(tokens), self.stub.tokens_per_step)]
        n, prompt = len(tokens), self.stub.prompt_tokens
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                 "prompt_tokens_details": None, "reasoning_tokens": 0}
        if body.get("stream"):
            self._stream(body, steps, finish, usage)
        else:
            self._whole(body, tokens, steps, finish, usage)

    def _whole(self, body: dict[str, Any], tokens: list[tuple[str, str]], steps: list[Any], finish: str,
               usage: dict[str, Any]) -> None:
        reasoning = "".join(t for k, t in tokens if k == "r")
        content = "".join(t for k, t in tokens if k == "c")
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": content,
                                    "reasoning_content": reasoning or None, "tool_calls": None},
            "logprobs": None, "finish_reason": finish, "matched_stop": 1 if finish == "stop" else None,
        }
        if body.get("return_meta_info"):
            verify = len(steps)
            choice["meta_info"] = {
                "id": "stub", "finish_reason": {"type": finish}, "prompt_tokens": usage["prompt_tokens"],
                "completion_tokens": len(tokens), "cached_tokens": 0, "spec_verify_ct": verify,
                "spec_accept_length": len(tokens) / verify if verify else 0,
                "spec_accept_rate": 0.5, "e2e_latency": 0.01,
            }
        self._json(200, {"id": "stub", "object": "chat.completion", "created": 1, "model": body.get("model"),
                         "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"}})

    def _stream(self, body: dict[str, Any], steps: list[Any], finish: str, usage: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        model = body.get("model")

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                      "matched_stop": extra.pop("matched_stop", None)}
            obj = {"id": "stub", "object": "chat.completion.chunk", "created": 1, "model": model,
                   "choices": [choice], **extra}
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        chunk({"role": "assistant", "content": ""})
        for step in steps:
            reasoning = "".join(t for k, t in step if k == "r")
            content = "".join(t for k, t in step if k == "c")
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            chunk(delta)
        chunk({}, finish, matched_stop=1 if finish == "stop" else None)
        if (body.get("stream_options") or {}).get("include_usage"):
            obj = {"id": "stub", "object": "chat.completion.chunk", "created": 1, "model": model,
                   "choices": [], "usage": usage}
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def expected_text(stub: SGLangStub, user: str, thinking: bool = True) -> str:
    """The text the client should rebuild: `reasoning</think>answer`, as the embedded engine writes it."""
    answer = "".join(words(f"You said: {user}"))
    return f"{REASONING}</think>{answer}" if thinking else answer


def accept_length(n_tokens: int, tokens_per_step: int) -> float:
    return n_tokens / math.ceil(n_tokens / tokens_per_step)
