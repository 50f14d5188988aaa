"""What the app's UI thread spends while an answer streams, without an engine to compete with.

    python benchmarks/ui_render_cost.py --repeat 5                  # every sample answer, 100 tok/s
    python benchmarks/ui_render_cost.py --root /tmp/wt-before        # the app of another checkout
    python benchmarks/ui_render_cost.py --answer long --rate 50 --turns 2

A fake engine (tests/ui/fake_engine.py) that costs nothing streams a canned answer at a fixed rate
(a token is a 4-character delta), with `device` set to the CPU so the app paces its renders as for a
CPU engine; a Pilot sends the prompt. Reported, one JSON line per answer: the share of one core the
UI thread used (its CPU time over the wall time) from the first streamed text to the end of the stream
(the final render after it is not included), and how many times it drew streamed text; with
--repeat, a line of medians per answer follows. Being CPU time of one thread, this moves much less
with the machine's noise than tok/s do (docs/app-overhead.md). --root imports sparkchat and the fake engine
from another checkout (e.g. a `git worktree` of an older commit), so one script measures both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CHARS_PER_TOKEN = 4  # the fake engine's delta size

THINK = ("<think>The user asks how to read a file line by line. Show the idiomatic loop, mention the "
         "encoding and stripping newlines, and compare with readlines().</think>\n\n")
SECTION = ("## Approach {n}\n\nOpen the file with `open()` in a `with` block, so it is closed even if an exception "
           "is raised. The file object is an *iterator* over its lines; each keeps its trailing newline, which "
           "`rstrip('\\n')` removes.\n\n```python\nwith open('data.txt', encoding='utf-8') as f:\n    for line in f:\n"
           "        print(line.rstrip('\\n'))\n```\n\n- memory stays flat: one line at a time\n- works on huge files\n"
           "- `readlines()` loads everything\n\n")
CLOSING = ("**In short:** iterate over the file object inside a `with` block; reach for `readlines()` only when "
           "the whole file must be in memory at once.\n")
ANSWERS = {
    "short": THINK + "Iterate over the file object:\n\n" + SECTION.format(n=1)[:400],  # ~150 tokens
    "paragraph": "A hash table maps keys to slots with a hash function; collisions are chained. " * 40,  # ~780
    "markdown": THINK + "".join(SECTION.format(n=n) for n in range(1, 7)) + CLOSING,  # ~730 tokens
    "long": THINK + "".join(SECTION.format(n=n) for n in range(1, 21)),  # ~2,200 tokens
}

MARKS: dict[str, Any] = {}


def use_checkout(root: Path) -> None:
    """Import sparkchat and tests/ui/fake_engine.py from the checkout at `root`."""
    sys.path[:0] = [str(root), str(root / "tests" / "ui")]
    import sparkchat

    if not Path(sparkchat.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"sparkchat was imported from {sparkchat.__file__}, not from {root}")


def instrument() -> None:
    """Note the first drawing of streamed text and the end of the stream (wall and UI thread CPU
    time), and count the drawings of streamed text (ChatScreen._drain, in every version of the app)."""
    from sparkchat.ui.screens import chat as chat_mod

    drain, done = chat_mod.ChatScreen._drain, chat_mod.ChatScreen.on_stream_done

    async def timed_drain(self: Any) -> None:
        if self._gen is not None and "done" not in MARKS:
            MARKS.setdefault("first", (time.monotonic(), time.thread_time()))
            MARKS["renders"] = MARKS.get("renders", 0) + 1
        await drain(self)

    async def timed_done(self: Any, message: Any) -> None:
        MARKS.setdefault("done", (time.monotonic(), time.thread_time()))
        await done(self, message)

    chat_mod.ChatScreen._drain = timed_drain  # type: ignore[method-assign]
    chat_mod.ChatScreen.on_stream_done = timed_done  # type: ignore[method-assign]


async def measure(answer: str, rate: float, turns: int, size: tuple[int, int]) -> list[dict[str, Any]]:
    """Stream `answer` `turns` times into one chat of a fresh app; one result per turn."""
    from fake_engine import FakeEngine

    from sparkchat.history import History
    from sparkchat.ui.app import SparkchatApp, engine_thread_settings
    from sparkchat.ui.prefs import ChatSettings
    from sparkchat.ui.widgets.prompt import PromptInput

    engine = FakeEngine([answer], token_delay=1.0 / rate, chunk=CHARS_PER_TOKEN)
    engine.device = SimpleNamespace(type="cpu")  # type: ignore[attr-defined]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, engine_thread_settings():
        history = History(Path(tmp) / "history.db")
        app = SparkchatApp(engine, history=history, settings_path=Path(tmp) / "settings.toml")
        app.prefs.chat = ChatSettings(max_tokens=100_000)
        async with app.run_test(size=size) as pilot:
            chat = app.chat_screen
            assert chat is not None
            await asyncio.sleep(1.0)  # the screen's start-up work (and any warm-up after it) is done
            for turn in range(turns):  # a later turn renders below the earlier answers
                MARKS.clear()
                prompt = chat.query_one(PromptInput)
                prompt.focus()
                prompt.text = "go"
                await pilot.press("enter")
                while "done" not in MARKS:
                    await asyncio.sleep(0.1)  # not pilot.pause: the harness must not add work to the UI thread
                (t0, c0), (t1, c1) = MARKS["first"], MARKS["done"]
                results.append({"turn": turn + 1, "stream_s": round(t1 - t0, 2),
                                "ui_thread_cpu_s": round(c1 - c0, 3),
                                "ui_thread_cores": round((c1 - c0) / (t1 - t0), 4), "renders": MARKS["renders"]})
                while chat.generating:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
        history.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--answer", choices=[*ANSWERS, "all"], default="all")
    p.add_argument("--rate", type=float, default=100.0, help="tokens a second (100)")
    p.add_argument("--turns", type=int, default=1, help="answers in one chat (1)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the answers, each answer in a fresh app (1)")
    p.add_argument("--size", default="120x40", help="terminal size (120x40)")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                   help="checkout whose app is measured (this one)")
    args = p.parse_args()
    w, h = (int(n) for n in args.size.split("x"))
    use_checkout(args.root.resolve())
    os.environ.setdefault("SPARKCHAT_DATA_DIR", tempfile.mkdtemp())
    os.environ.setdefault("SPARKCHAT_CONFIG_DIR", tempfile.mkdtemp())
    instrument()
    names = list(ANSWERS) if args.answer == "all" else [args.answer]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for run in range(args.repeat):
        for name in names:
            for row in asyncio.run(measure(ANSWERS[name], args.rate, args.turns, (w, h))):
                row = {"answer": name, "tokens": -(-len(ANSWERS[name]) // CHARS_PER_TOKEN), "rate": args.rate,
                       "run": run + 1, **row}
                rows[name].append(row)
                print(json.dumps(row), flush=True)
    if args.repeat > 1:
        for name, got in rows.items():
            for turn in range(1, args.turns + 1):
                mine = [r for r in got if r["turn"] == turn]
                print(json.dumps({"answer": name, "turn": turn, "median_of": len(mine),
                                  **{k: round(statistics.median(r[k] for r in mine), 4)
                                     for k in ("stream_s", "ui_thread_cpu_s", "ui_thread_cores", "renders")},
                                  "ui_thread_cores_all": [r["ui_thread_cores"] for r in mine]}))


if __name__ == "__main__":
    main()
