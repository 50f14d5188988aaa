"""The OpenAI chat-completions wire format, as `sparkchat serve` speaks it: request parsing, the answer
splitter (reasoning / answer / stop strings) and the JSON shapes of responses, chunks and errors.

No sockets and no engine here, so every rule is testable on its own. sparkchat's additions ride in an
extension field `"sparkchat": {"token_ids": [...], "stats": {...}}` that other clients ignore.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from sparkchat.engine.events import GenerationStats, SamplingParams

THINK_END = "</think>"
MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant", "tool")


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code)


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


@dataclass
class ChatRequest:
    messages: list[dict[str, str]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices
    stop: list[str] = field(default_factory=list)
    enable_thinking: bool = True
    separate_reasoning: bool = True  # reasoning goes to `reasoning_content`, the answer to `content`
    model: str | None = None


def _as_number(value: Any, kind: type) -> int | float | None:
    """`value` as `kind`, or None for what is not one: bools, strings, NaN, inf, fractions where an int is
    wanted, ints too big for a float (Python's json reads NaN, Infinity and ints of any length)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and (kind is float or value.is_integer())):
        return None
    try:
        return kind(value)
    except OverflowError:
        return None


def _number(body: dict[str, Any], name: str, kind: type, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    raw = body.get(name)
    if raw is None:
        return None
    value = _as_number(raw, kind)
    if value is None:
        shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:37] + "..."
        raise RequestError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, not {shown}",
                           code="invalid_value")
    if low is not None and (value <= low if low_open else value < low):
        raise RequestError(400, f"'{name}' must be {'above' if low_open else 'at least'} {low}, not {value}",
                           code="invalid_value")
    if high is not None and value > high:
        raise RequestError(400, f"'{name}' must be at most {high}, not {value}", code="invalid_value")
    return value


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (other kinds of part are refused). OpenAI
    allows null only beside tool calls, which are not supported here."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"{where}: only text content is supported, not {kind!r}",
                                   code="unsupported_content")
        return "".join(texts)
    got = "null" if content is None else type(content).__name__
    raise RequestError(400, f"{where}.content must be a string or a list of text parts, not {got}",
                       code="invalid_value")


def parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                           code="invalid_messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object", code="invalid_messages")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(400, f"{where}: 'role' must be one of {', '.join(ROLES)}, not {role!r}",
                               code="invalid_messages")
        out.append({"role": role, "content": _content_text(m.get("content"), where)})
    return out


def parse_chat_request(raw: bytes, defaults: SamplingParams | None = None,
                       enable_thinking: bool = True) -> ChatRequest:
    """Parse and check a POST /v1/chat/completions body. Unknown fields are ignored, as OpenAI servers do."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or an int over 4300 digits
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    messages = parse_messages(body.get("messages"))
    params = replace(defaults) if defaults else SamplingParams()
    t = _number(body, "temperature", float, 0.0)
    top_p = _number(body, "top_p", float, 0.0, 1.0, low_open=True)
    top_k = _number(body, "top_k", int)
    seed = _number(body, "seed", int)
    # max_completion_tokens is the newer name; either is accepted
    max_tokens = _number(body, "max_completion_tokens", int, 1)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, 1)
    for name, value in (("temperature", t), ("top_p", top_p), ("seed", seed), ("max_tokens", max_tokens)):
        if value is not None:
            setattr(params, name, value)
    if top_k is not None:
        params.top_k = max(0, top_k)  # SGLang and vLLM use -1 for "no cut"; the engine uses 0
    _check_sampling(params)
    n = _number(body, "n", int)
    if n not in (None, 1):
        raise RequestError(400, "only n=1 is supported: answers are decoded one at a time", code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", code="invalid_value")
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "'stop' must be a string or a list of strings", code="invalid_value")
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(400, f"at most {MAX_STOP_STRINGS} stop strings", code="invalid_value")
    kwargs = body.get("chat_template_kwargs")
    thinking = enable_thinking
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        thinking = kwargs["enable_thinking"]
    separate = body.get("separate_reasoning", True)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", code="invalid_value")
    return ChatRequest(messages, params, stream, include_usage, stops, thinking, bool(separate), model or None)


def _check_sampling(params: SamplingParams) -> None:
    """The engine's own check (seed range included), as a 400 before the request waits in line."""
    from sparkchat.engine.sampling import SamplingError, check_sampling  # torch: the engine has it loaded

    try:
        check_sampling(params)
    except SamplingError as e:
        raise RequestError(400, str(e), code="invalid_value") from None


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (kept back: it may grow)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class AnswerSplitter:
    """Routes streamed text to reasoning or answer and finds stop strings, holding back only text that
    might be the start of `</think>` or of a stop string. Stop strings match the answer, not the reasoning.

    The generation prompt opens `<think>` when thinking is on, so the model's text is
    `reasoning</think>answer`; with `separate` off everything is answer, `</think>` included.
    """

    def __init__(self, thinking: bool, separate: bool = True, stops: list[str] | None = None) -> None:
        self.in_reasoning = thinking and separate
        self.stops = list(stops or [])
        self.stopped = False
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning piece, answer piece) that can be sent now."""
        if self.stopped:
            return "", ""
        self._buf += text
        reasoning = ""
        if self.in_reasoning:
            i = self._buf.find(THINK_END)
            if i < 0:
                keep = _held_prefix(self._buf, THINK_END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(THINK_END):]
            self.in_reasoning = False
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            answer, self._buf, self.stopped = self._buf[:min(hits)], "", True
            return reasoning, answer
        keep = max((_held_prefix(self._buf, s) for s in self.stops), default=0)
        answer, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the answer."""
        rest, self._buf = self._buf, ""
        if self.stopped:
            return "", ""
        return (rest, "") if self.in_reasoning else ("", rest)


# -- responses --------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def usage_body(stats: GenerationStats, prompt_tokens: int) -> dict[str, Any]:
    done = stats.generated_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": max(0, prompt_tokens - stats.prefilled_tokens)}}


def sparkchat_body(token_ids: list[int], stats: GenerationStats | None = None,
                   queue_s: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"token_ids": token_ids}
    if stats is not None:
        out["stats"] = stats.to_dict()
    if queue_s is not None:
        out["queue_s"] = round(queue_s, 6)
    return out


def completion_body(cid: str, model: str, reasoning: str, answer: str, finish: str, token_ids: list[int],
                    stats: GenerationStats, prompt_tokens: int, queue_s: float) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage_body(stats, prompt_tokens),
            "sparkchat": sparkchat_body(token_ids, stats, queue_s)}


def chunk_body(cid: str, model: str, delta: dict[str, Any], finish: str | None = None,
               sparkchat: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if sparkchat is not None:
        out["sparkchat"] = sparkchat
    return out


def usage_chunk_body(cid: str, model: str, stats: GenerationStats, prompt_tokens: int) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_body(stats, prompt_tokens)}


def models_body(name: str, max_context: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "sparkchat", "max_model_len": max_context}]}
