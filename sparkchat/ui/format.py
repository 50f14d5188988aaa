"""Pure text helpers for the UI: reasoning split, code blocks, stats lines. No Textual here."""

from __future__ import annotations

import re
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

FINISH_LABELS = {"stop": "done", "length": "max tokens", "cancelled": "stopped", "error": "error"}


def split_thinking(raw: str, *, final: bool = True, opened: bool = False) -> tuple[str, str, bool]:
    """Split a reply into (reasoning, answer, reasoning_still_open).

    Handles `<think>…</think>` at the start, and a bare `…</think>` when the chat template opened the
    block in the prompt. While streaming (`final=False`), a trailing half tag is held back. `opened`:
    the prompt is known to have opened the block, so text with no `</think>` yet is reasoning.
    """
    body = raw.lstrip()
    if opened and not body.startswith(THINK_OPEN) and THINK_CLOSE not in raw:
        return _hold(raw.lstrip("\n"), (THINK_CLOSE,), final), "", True
    if body.startswith(THINK_OPEN):
        inner = body[len(THINK_OPEN):]
        end = inner.find(THINK_CLOSE)
        if end < 0:
            return _hold(inner.lstrip("\n"), (THINK_CLOSE,), final), "", True
        return inner[:end].strip("\n"), _hold(inner[end + len(THINK_CLOSE):].lstrip(), (), final), False
    end = raw.find(THINK_CLOSE)
    if end >= 0:
        return raw[:end].strip("\n"), _hold(raw[end + len(THINK_CLOSE):].lstrip(), (), final), False
    if not final and THINK_OPEN.startswith(body) and body:
        return "", "", False  # may become "<think>"
    return "", _hold(raw, (THINK_CLOSE,), final), False


def opens_reasoning(engine: Any) -> bool:
    """Whether `engine`'s chat template opens the reasoning block in the prompt when thinking is on
    (Ling's does), so that a reply starts inside it. False when it cannot tell (a remote engine)."""
    render = getattr(getattr(engine, "tokenizer", None), "render", None)
    if render is None:
        return False
    try:
        prompt = render([{"role": "user", "content": "hi"}], add_generation_prompt=True, enable_thinking=True)
    except Exception:
        return False
    return isinstance(prompt, str) and prompt.rstrip().endswith(THINK_OPEN)


def _hold(text: str, tags: tuple[str, ...], final: bool) -> str:
    """Drop a trailing proper prefix of one of `tags` (it may be a tag still arriving)."""
    if final:
        return text
    for tag in tags:
        for n in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:n]):
                return text[:-n]
    return text


_FENCE = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<fence>`{3,}|~{3,})[^\n]*\n(?P<code>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                    re.MULTILINE | re.DOTALL)


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order, without their fences."""
    return [m.group("code").rstrip("\n") for m in _FENCE.finditer(markdown)]


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _get(stats: Any, name: str, default: Any = None) -> Any:
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


def accept_text(stats: Any) -> str | None:
    """'accept 3.21 (last 4) · per draft 92% 81% 66%', or None without speculative stats."""
    mean = _get(stats, "accept_length_mean")
    if mean is None:
        return None
    text = f"accept {mean:.2f}"
    last = _get(stats, "accept_length_last")
    if last is not None:
        text += f" (last {last})"
    per_position = _get(stats, "accept_rate_per_position") or []
    if per_position:
        text += " · per draft " + " ".join(f"{p * 100:.0f}%" for p in per_position)
    return text


def bandwidth_text(stats: Any) -> str | None:
    """'85% of limit 52.9 tok/s · 4.42 GB/tok': the answer's speed as a share of the fastest plain
    decoding could go at the read bandwidth measured on this machine (over 100%: speculation reads the
    weights once for several tokens), then the bytes a plain decode step reads — the share first, as
    the line's most telling part. None without the figures."""
    nbytes = _get(stats, "bytes_per_token", 0) or 0
    bw = _get(stats, "read_bw_bytes_s", 0.0) or 0.0
    if not nbytes or not bw:
        return None
    limit = bw / nbytes
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
    rate = _get(stats, "decode_tok_s", 0.0) or 0.0
    share = f"{100 * rate / limit:.0f}% of " if rate else ""
    return f"{share}limit {limit:,.1f} tok/s · {size}/tok"


def summary_line(stats: Any, finish_reason: str | None) -> str:
    """The one line kept under a finished reply."""
    parts = []
    tokens = _get(stats, "generated_tokens", 0) or 0
    rate = _get(stats, "decode_tok_s", 0.0) or 0.0
    if rate:
        parts.append(f"{rate:.1f} tok/s")
    parts.append(f"{tokens} tok")
    ttft = _get(stats, "ttft_s", 0.0) or 0.0
    if ttft:
        parts.append(f"TTFT {format_ms(ttft)}")
    prefill = _get(stats, "prefill_tok_s", 0.0) or 0.0
    if prefill:
        parts.append(f"prefill {prefill:,.0f} tok/s")
    accept = _get(stats, "accept_length_mean")
    if accept is not None:
        parts.append(f"accept {accept:.2f}")
    peak = _get(stats, "peak_memory_bytes", 0) or 0
    if peak:
        parts.append(f"peak {format_bytes(peak)}")
    if finish_reason:
        parts.append(FINISH_LABELS.get(finish_reason, finish_reason))
    return " · ".join(parts)


def switches_line(switches: Any, states: dict[str, Any] | None = None) -> str:
    """'MXFP4 · FP8 head · MTP×3 · draft top-32K · graphs': the optimizations in effect (per the engine's
    states when given, which know what is unavailable or held off by another switch)."""
    def on(name: str) -> bool:
        state = (states or {}).get(name)
        if state is not None:
            return bool(state.on)
        return bool(getattr(switches, name, False))

    parts = []
    if on("mxfp4_kernels"):
        parts.append("MXFP4")
    if on("fp8_head"):
        parts.append("FP8 head")
    if on("mtp"):
        parts.append(f"MTP×{getattr(switches, 'draft_steps', 0)}")
        # the engine's state knows whether the vocabulary is larger than N; without one, it needs MTP on
        if on("truncated_draft_head"):
            n = getattr(switches, "draft_vocab", 0) or 0
            parts.append(f"draft top-{f'{n // 1024}K' if n and n % 1024 == 0 else f'{n:,}'}")
    if on("cuda_graphs"):
        parts.append("graphs")
    return " · ".join(parts) if parts else "baseline (all optimizations off)"


def title_from(prompt: str, width: int = 48) -> str:
    line = next((ln.strip() for ln in prompt.splitlines() if ln.strip()), "New chat")
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"
