"""What keeps answering through the app as fast as `sparkchat ask` (docs/app-overhead.md): every engine
call on one thread, renders paced to a CPU budget for a CPU engine, no render work for folded reasoning
or a blinking cursor, live stats redrawn at most every LIVE_EVERY_S."""

import threading
import time
from types import SimpleNamespace

from fake_engine import FakeEngine
from pytest import approx
from uitools import ask, chat, wait_for

from sparkchat.engine.events import GenerationStats
from sparkchat.ui import streaming
from sparkchat.ui.widgets import stats_bar
from sparkchat.ui.widgets.stats_bar import StatsBar

SIZE = (110, 40)


class ThreadRecordingEngine(FakeEngine):
    def __init__(self, threads: list[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.threads = threads

    def generate(self, *args, **kwargs):
        self.threads.append(threading.get_ident())
        yield from super().generate(*args, **kwargs)


async def test_load_and_answers_run_on_one_engine_thread(make_app):
    threads: list[int] = []

    def factory():
        threads.append(threading.get_ident())
        return ThreadRecordingEngine(threads, replies=["one", "two", "three"])

    app = make_app(engine_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None)
        for prompt in ("a", "b", "c"):
            await ask(pilot, prompt)
        assert len(threads) == 4 and len(set(threads)) == 1
        assert threads[0] != threading.get_ident()  # not the UI thread


class Clocks:
    """A wall clock and a UI-thread CPU clock that tests move by hand."""

    def __init__(self) -> None:
        self.wall, self.cpu = 0.0, 0.0

    def spend(self, wall: float, cpu: float = 0.0) -> None:
        self.wall += wall
        self.cpu += cpu


def test_render_budget_only_for_a_cpu_engine():
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert streaming.render_budget(cpu) == streaming.CPU_RENDER_BUDGET
    assert streaming.render_budget(gpu) is None
    assert streaming.render_budget(FakeEngine()) is None  # no device: a remote or fake engine


def test_pacer_spreads_what_a_render_costs_over_the_budget():
    c = Clocks()
    pacer = streaming.RenderPacer(0.02, min_s=0.05, max_s=1.0, clock=lambda: c.wall, cpu_clock=lambda: c.cpu)
    assert pacer.wait() == 0  # the first text is shown at once
    pacer.rendered()
    c.spend(0.01, cpu=0.004)  # that render cost the UI thread 4 ms
    assert pacer.wait() == approx(0.04)  # nothing measured yet: the shortest interval
    c.spend(0.04)
    pacer.rendered()  # 4 ms at 2% of a core: 0.2 s until the next
    c.spend(0.1, cpu=0.004)
    assert pacer.wait() == approx(0.1)
    c.spend(0.1)
    pacer.rendered()
    c.spend(0.0, cpu=0.05)  # a long answer: 50 ms a render; never more than max_s between renders
    c.spend(1.0)
    pacer.rendered()
    assert pacer.wait() == approx(1.0)
    c.spend(0.0, cpu=0.0001)  # cheap again
    c.spend(1.0)
    pacer.rendered()
    assert pacer.wait() == approx(0.05)
    assert pacer.renders == 5


def test_pacer_without_budget_keeps_the_shortest_interval():
    c = Clocks()
    pacer = streaming.RenderPacer(None, min_s=0.05, clock=lambda: c.wall, cpu_clock=lambda: c.cpu)
    pacer.rendered()
    c.spend(0.02, cpu=0.5)
    pacer.rendered()
    assert pacer.wait() == approx(0.05)


async def test_live_stats_are_redrawn_at_most_every_interval_with_the_latest_numbers(monkeypatch):
    from textual.app import App

    monkeypatch.setattr(stats_bar, "LIVE_EVERY_S", 0.2)

    class Host(App):
        def compose(self):
            yield StatsBar()

    app = Host()
    async with app.run_test(size=(140, 5)) as pilot:
        bar = app.query_one(StatsBar)
        latency = bar.query_one("#stats-latency")
        bar.show(GenerationStats(generated_tokens=1), [10.0])
        assert "│ 1 tok" in str(latency.render())
        t0 = time.monotonic()
        for n in range(2, 6):
            bar.show(GenerationStats(generated_tokens=n), [10.0] * n)
        assert "│ 1 tok" in str(latency.render())  # held back...
        await wait_for(pilot, lambda: "│ 5 tok" in str(latency.render()))  # ...then the latest is drawn
        assert time.monotonic() - t0 >= 0.15
        bar.show(GenerationStats(generated_tokens=6), [10.0] * 6, "stop")  # a final one is drawn at once
        assert "│ 6 tok" in str(latency.render()) and "done" in str(bar.query_one("#stats-detail").render())
        await pilot.pause(0.3)
        assert "│ 6 tok" in str(latency.render())  # no stale live numbers afterwards


async def test_chat_paces_renders_for_a_cpu_engine(make_app):
    engine = FakeEngine(token_delay=0.002)
    engine.device = SimpleNamespace(type="cpu")
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        screen = chat(app)
        seen = []
        original = screen._drain

        async def drain():
            seen.append(screen._gen.pacer.budget)
            await original()

        screen._drain = drain
        await ask(pilot, "again")
        assert seen and set(seen) == {streaming.CPU_RENDER_BUDGET}


async def test_no_render_work_for_folded_reasoning_or_a_blinking_cursor(make_app):
    from textual.widgets import Collapsible

    from sparkchat.ui.widgets.message import AssistantMessage
    from sparkchat.ui.widgets.prompt import PromptInput

    engine = FakeEngine(["<think>" + "a thought. " * 40 + "</think>The answer."], gate_after=60)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        prompt = screen.query_one(PromptInput)
        prompt.text = "go"
        prompt.focus()
        await pilot.press("enter")
        await wait_for(pilot, engine.gated.is_set)
        view = screen.query_one(AssistantMessage)
        await wait_for(pilot, lambda: view.thinking.startswith("a thought.") and screen._gen.pacer.renders)
        assert str(view.query_one(Collapsible).title) == "Reasoning…"  # no live count: no layout per render
        assert not prompt.cursor_blink  # a blink is a render
        body = view.query_one(".thinking-body")
        assert body.source == ""  # folded: nothing rendered...
        view.query_one(Collapsible).collapsed = False
        await wait_for(pilot, lambda: body.source.startswith("a thought."))  # ...until it is opened
        engine.gate.set()
        await wait_for(pilot, lambda: screen._gen is None and not view._streaming)
        assert prompt.cursor_blink
        assert view.thinking.startswith("a thought.") and view.answer == "The answer."
