"""A deterministic stand-in for sparkchat.engine.Engine, for UI tests and for looking at the app.

Same API as the real engine (name, switches, switch_states, set_switches, generate, reset); replies
are canned text cut into small deltas, stats are fixed numbers, so screens are reproducible.

    python tests/ui/fake_engine.py            # the app with this engine (history in the usual data dir)
    python tests/ui/fake_engine.py --delay 0.005 --data /tmp/sparkchat-dev
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from sparkchat.engine.events import GenerationStats, ResponseEvent, SamplingParams, Switches, SwitchState

SWITCH_NAMES = ("mtp", "fp8_head", "mxfp4_kernels", "cuda_graphs", "truncated_draft_head")

DEMO_REPLIES = [
    "<think>The user wants a quick example. A list comprehension is the idiomatic answer; "
    "I should show it with a short explanation.</think>"
    "Here is the idiomatic way to **square a list** in Python:\n\n"
    "```python\nnumbers = [1, 2, 3, 4]\nsquares = [n * n for n in numbers]\nprint(squares)  # [1, 4, 9, 16]\n```\n\n"
    "| approach | speed | readability |\n|---|---|---|\n| comprehension | fast | high |\n"
    "| `map` + lambda | fast | medium |\n| for loop | slower | high |\n\nA comprehension builds the list in one pass.",
    "Sure. Speculative decoding with **MTP** works like this:\n\n1. the MTP layer *drafts* a few tokens;\n"
    "2. the main model *verifies* all of them in one forward pass;\n3. the longest accepted prefix is kept.\n\n"
    "With an accept length of about 3, each step yields ~3 tokens for little more than the cost of one.",
]


def chunks(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


class FakeEngine:
    name = "Fake-Ling"

    def __init__(self, replies: list[str] | Callable[[int, list[dict[str, str]]], str] | None = None, *,
                 token_delay: float = 0.0, unavailable: dict[str, str] | None = None, chunk: int = 3,
                 gate_after: int | None = None) -> None:
        self.replies = replies if replies is not None else DEMO_REPLIES
        self.token_delay = token_delay
        self.unavailable = dict(unavailable or {})
        self.chunk = chunk
        self.gate_after = gate_after  # block after this many tokens until `gate` or cancel is set
        self.gate = threading.Event()
        self.gated = threading.Event()  # set when generation is blocked at the gate
        self.switches = Switches()
        self.set_switches_calls: list[Switches] = []
        self.calls: list[dict[str, Any]] = []
        self.resets = 0
        self.finished: list[str] = []

    def switch_states(self) -> dict[str, SwitchState]:
        states = {}
        for name in SWITCH_NAMES:
            reason = self.unavailable.get(name)
            states[name] = SwitchState(on=bool(getattr(self.switches, name)) and reason is None,
                                       available=reason is None, reason=reason)
        return states

    def set_switches(self, switches: Switches) -> None:
        self.switches = replace(switches)
        self.set_switches_calls.append(replace(switches))

    def reset(self) -> None:
        self.resets += 1

    def _reply(self, messages: list[dict[str, str]]) -> str:
        n = len(self.calls) - 1
        if callable(self.replies):
            return self.replies(n, messages)
        return self.replies[n % len(self.replies)]

    def generate(self, messages: list[dict[str, str]], params: SamplingParams, *, enable_thinking: bool = True,
                 cancel: threading.Event | None = None) -> Iterator[ResponseEvent]:
        self.calls.append({"messages": [dict(m) for m in messages], "params": replace(params),
                           "enable_thinking": enable_thinking})
        reply = self._reply(messages)
        if not enable_thinking and "</think>" in reply:
            reply = reply.split("</think>", 1)[1]
        pieces = chunks(reply, self.chunk)
        mtp = self.switches.mtp and "mtp" not in self.unavailable
        prompt_tokens = sum(len(m["content"]) for m in messages) // 4 + 8
        stats = GenerationStats(prompt_tokens=prompt_tokens, prefilled_tokens=prompt_tokens, prefill_s=0.02,
                                ttft_s=0.05, prefill_tok_s=1500.0, peak_memory_bytes=41 * (1 << 30) + (1 << 29),
                                bytes_per_token=4_420_000_000, read_bw_bytes_s=4.14e12,  # as on the H200
                                switches={"mtp": mtp, "draft_steps": self.switches.draft_steps})
        finish = None
        debt = 0.0
        for i, piece in enumerate(pieces):
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            if i >= params.max_tokens:
                finish = "length"
                break
            if self.gate_after is not None and i == self.gate_after:
                self.gated.set()
                while not self.gate.is_set() and not (cancel is not None and cancel.is_set()):
                    time.sleep(0.002)
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
            if self.token_delay:  # sleeps batched to >= 2 ms so short delays keep their average rate
                debt += self.token_delay
                if debt >= 0.002:
                    time.sleep(debt)
                    debt = 0.0
            stats.generated_tokens = i + 1
            stats.decode_s = 0.005 * (i + 1)
            stats.decode_tok_s = 200.0
            stats.tpot_ms = 5.0
            if mtp:
                stats.accept_length_mean = 2.75
                stats.accept_length_last = 3
                stats.accept_rate_per_position = [0.9, 0.7, 0.45, 0.3][: self.switches.draft_steps]
            yield ResponseEvent(piece, [i], None, stats)
        if finish is None:
            finish = "stop"
        self.finished.append(finish)
        yield ResponseEvent("", [], finish, stats)


def main() -> None:
    import argparse
    import os

    parser = argparse.ArgumentParser(description="sparkchat with a fake engine")
    parser.add_argument("--delay", type=float, default=0.01, help="seconds per delta")
    parser.add_argument("--data", help="data dir (history, settings)")
    parser.add_argument("--no-engine", action="store_true", help="start in the 'no model loaded' state")
    parser.add_argument("--load-delay", type=float, default=0.0, help="load through a factory that takes this long")
    args = parser.parse_args()
    if args.data:
        os.environ["SPARKCHAT_DATA_DIR"] = args.data
    from sparkchat.ui.app import SparkchatApp

    engine = None if args.no_engine else FakeEngine(token_delay=args.delay)
    factory = None
    if engine is not None and args.load_delay:
        def slow_load() -> FakeEngine:
            time.sleep(args.load_delay)
            return FakeEngine(token_delay=args.delay)

        engine, factory = None, slow_load
    SparkchatApp(engine, engine_factory=factory, model_label="fake model").run()


if __name__ == "__main__":
    main()
