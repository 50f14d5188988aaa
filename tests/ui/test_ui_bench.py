"""The bench screen: the real `run_bench` on the tiny model (CPU, one iteration) and on the small synthetic
config; stop; answers wait while it runs; the engine's switches come back afterwards."""

import threading

import pytest
from fake_engine import FakeEngine
from textual.widgets import DataTable, Input, Select, Switch
from uitools import ask, chat, notifications, send, static_text, wait_for

from sparkchat.engine.events import Switches
from sparkchat.ui.prefs import ChatSettings
from sparkchat.ui.screens import bench as bench_screen
from sparkchat.ui.screens.bench import BenchScreen
from sparkchat.ui.widgets.bars import BarChart, bar_cells

SIZE = (140, 50)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from sparkchat.engine import Engine

    return Engine.load(tiny_model_dir, device="cpu", max_context=512)


async def open_bench(pilot) -> BenchScreen:
    await pilot.press("f4")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, BenchScreen))
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.cuda is not None, what="the device probe")
    return screen


def table_rows(screen: BenchScreen) -> list[list[str]]:
    table = screen.query_one("#bench-table", DataTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


async def test_published_table_before_any_run(make_app):
    app = make_app(FakeEngine())  # no weights of its own: only synthetic ones are offered
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_bench(pilot)
        sources = [value for _, value in screen._sources()]
        assert "loaded" not in sources and sources[-1] == "small"
        rows = table_rows(screen)
        assert [r[0] for r in rows] == ["baseline", "+ MXFP4 kernels", "+ FP8 head", "+ MTP"]
        assert [r[-1] for r in rows] == ["36.1", "39.5", "43.9", "51.8–53.9"]
        assert all(cell == "—" for r in rows for cell in r[1:-1])
        spark = screen.query_one("#bench-spark", BarChart)
        assert [b.value for b in spark.bars] == bench_screen.NVIDIA_SPARK_TOK_S
        assert not screen.query_one("#bench-measured").display
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))


async def test_bench_on_the_loaded_tiny_model(make_app, tiny_engine, monkeypatch):
    accept_calls = []

    def quick_accept(engine, draft_steps):  # the real one answers three prompts: slow for a test
        accept_calls.append(draft_steps)
        engine.set_switches(Switches(mtp=True, draft_steps=draft_steps, fp8_head=False))
        return 1.75

    monkeypatch.setattr("sparkchat.cli.bench.measure_accept_length", quick_accept)
    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE) as pilot:
        switches = tiny_engine.switches
        screen = await open_bench(pilot)
        assert screen.query_one("#bench-source", Select).value == "loaded"
        assert screen.query_one("#bench-context", Input).value == "64"  # CPU defaults
        screen.query_one("#bench-iters", Input).value = "1"
        screen.query_one("#bench-draft", Select).value = 2
        assert screen.query_one("#bench-accept", Switch).value
        steps: list[tuple[int, int]] = []
        original = BenchScreen.on_bench_progress

        def record(self, message):
            steps.append((message.index, message.steps))
            original(self, message)

        monkeypatch.setattr(BenchScreen, "on_bench_progress", record)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: screen.result is not None, timeout=120, what="the bench")
        assert not app.bench_running and accept_calls == [2]
        assert steps == [(i, 9) for i in range(1, 10)]  # accept, BW, head, 3 rows, MTP, loops
        rows = table_rows(screen)
        assert len(rows) == 4 and rows[3][0] == "+ MTP ×2"
        for row in rows:
            assert float(row[2].replace(",", "")) > 0  # tok/s
        measured = screen.query_one("#bench-measured", BarChart)
        assert measured.display and len(measured.bars) == 4 and all(b.value > 0 for b in measured.bars)
        spark = screen.query_one("#bench-spark", BarChart)
        assert len(spark.bars) == 8 and "projection" in spark.title
        notes = static_text(screen.query_one("#bench-notes"))
        assert "accept length 1.75 (measured)" in notes and "a projection, not a measurement" in notes
        assert screen.result.accept_length_source == "measured"
        # the engine is as it was: its switches, a fresh state, and it still answers
        assert tiny_engine.switches == app.prefs.switches
        assert tiny_engine.state.length == 0
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))
        chat(app).settings = ChatSettings(max_tokens=4, thinking=False)
        await ask(pilot, "hi", timeout=120)
    tiny_engine.set_switches(switches)


async def test_bench_on_small_synthetic_weights(make_app):
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_bench(pilot)
        assert screen.query_one("#bench-source", Select).value == "small"
        assert not screen.query_one("#bench-accept").display and not screen.query_one("#bench-layers").display
        screen.query_one("#bench-context", Input).value = "16"
        screen.query_one("#bench-iters", Input).value = "1"
        await pilot.click("#bench-run")
        await wait_for(pilot, lambda: screen.result is not None, timeout=120, what="the bench")
        assert len(table_rows(screen)) == 4
        assert screen.source.startswith("synthetic weights, small config")
        assert "assumed" in screen.result.accept_length_source
        assert "context 16 tokens" in static_text(screen.query_one("#bench-status"))


async def test_answers_wait_and_stop_works_while_the_bench_runs(make_app, monkeypatch):
    started = threading.Event()

    def blocking_plan(plan, say):
        say("building synthetic weights", 1, 5)
        started.set()
        plan.cancel.wait(10)
        raise bench_screen.BenchCancelled()

    monkeypatch.setattr(bench_screen, "run_plan", blocking_plan)
    engine = FakeEngine(["hello"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_bench(pilot)
        await pilot.press("ctrl+r")
        await wait_for(pilot, started.is_set)
        await wait_for(pilot, lambda: "1 of 5: building synthetic weights" in static_text(
            screen.query_one("#bench-status")))
        assert screen.query_one("#bench-run").disabled and not screen.query_one("#bench-stop").disabled
        assert app.engine_busy() == "the bench is running"
        app.switch_mode("chat")
        await send(pilot, "are you there?")
        await wait_for(pilot, lambda: any("The bench is running" in n for n in notifications(app)))
        assert engine.calls == []
        await pilot.press("f4")
        await wait_for(pilot, lambda: app.screen is screen)
        await pilot.press("escape")  # stops the bench (it does not leave the screen while running)
        await wait_for(pilot, lambda: not app.bench_running)
        assert app.screen is screen and "stopped" in static_text(screen.query_one("#bench-status"))
        assert not screen.query_one("#bench-run").disabled
        app.switch_mode("chat")
        await ask(pilot, "now?")
        assert len(engine.calls) == 1


async def test_the_plan_drafts_with_the_engines_top_n_head(make_app, monkeypatch):
    engine = FakeEngine()
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_bench(pilot)
        engine.switches = Switches(truncated_draft_head=True, draft_vocab=4096)
        assert screen.make_plan().draft_vocab == 4096
        engine.switches = Switches(truncated_draft_head=False, draft_vocab=4096)
        assert screen.make_plan().draft_vocab is None  # the full head, as the engine drafts
    calls = []

    def fake_run_bench(model, **kwargs):
        calls.append(kwargs)
        return "result"

    monkeypatch.setattr("sparkchat.engine.bench.run_bench", fake_run_bench)
    plan = bench_screen.BenchPlan(source="small", context=16, iters=1, draft_vocab=1024)
    assert bench_screen.run_plan(plan, lambda *_: None)[0] == "result"
    assert calls[0]["draft_vocab"] == 1024 and calls[0]["draft_rows"] is None


async def test_bad_fields_do_not_start(make_app):
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_bench(pilot)
        screen.query_one("#bench-iters", Input).value = "lots"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: any("Iterations" in n for n in notifications(app)))
        assert not app.bench_running


def test_bar_cells():
    assert bar_cells(10, 10, 8) == "█" * 8
    assert bar_cells(5, 10, 8) == "█" * 4
    assert bar_cells(1, 16, 8) == "▌"  # half a cell
    assert bar_cells(0, 10, 8) == "" and bar_cells(3, 0, 8) == ""


def test_synthetic_memory_estimate_is_near_the_release_size():
    from sparkchat.engine.synthetic import synthetic_config

    need = bench_screen.synthetic_bytes(synthetic_config())
    assert 60e9 < need < 80e9  # Ling-3.0-flash-fp4 is about 65 GB of MXFP4 experts plus the rest
