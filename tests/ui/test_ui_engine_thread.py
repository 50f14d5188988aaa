"""What keeps answering through the app as fast as `sparkchat ask` (docs/app-overhead.md): every engine
call on one thread, slower renders for a CPU engine, live stats redrawn at most every LIVE_EVERY_S."""

import threading
import time
from types import SimpleNamespace

from fake_engine import FakeEngine
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


def test_flush_interval_is_longer_for_a_cpu_engine():
    cpu = SimpleNamespace(device=SimpleNamespace(type="cpu"))
    gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    assert streaming.flush_interval(cpu) == streaming.FLUSH_CPU_S > streaming.FLUSH_S
    assert streaming.flush_interval(gpu) == streaming.FLUSH_S
    assert streaming.flush_interval(FakeEngine()) == streaming.FLUSH_S  # no device: a remote or fake engine


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


async def test_chat_uses_the_engines_flush_interval(make_app):
    engine = FakeEngine()
    engine.device = SimpleNamespace(type="cpu")
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        screen = chat(app)
        assert screen._gen is None
        seen = []
        original = screen._drain

        async def drain():
            seen.append(screen._gen.flush_s)
            await original()

        screen._drain = drain
        await ask(pilot, "again")
        assert seen and set(seen) == {streaming.FLUSH_CPU_S}
