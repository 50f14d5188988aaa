"""The models screen: local models and their fit, Hub downloads with byte progress (against the fake Hub
server of tests/hub_server.py), cancel, errors, delete, and switching to another model."""

import shutil
import threading

import pytest
from fake_engine import FakeEngine
from textual.widgets import Input
from uitools import ask, chat, notifications, send, static_text, wait_for

from sparkchat import hub
from sparkchat.engine.errors import DownloadError
from sparkchat.ui.app import SparkchatApp
from sparkchat.ui.messages import ModelsListed
from sparkchat.ui.prefs import ChatSettings
from sparkchat.ui.screens.dialogs import ConfirmScreen
from sparkchat.ui.screens.models import Latest, ModelsScreen, ModelTable
from sparkchat.ui.widgets.progress import RateWindow, TransferProgress, bytes_detail, format_duration, format_size
from tests.hub_server import FakeRepo, serve_fake_hub, tiny_model_files

SIZE = (120, 40)
GIB = 1 << 30


@pytest.fixture
def local_models(data_dir, tmp_path, monkeypatch, tiny_model_dir):
    """A copy of the tiny model in sparkchat's models folder, an empty HF cache, 64 GiB free."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    target = data_dir / "models" / "tiny-ling"
    shutil.copytree(tiny_model_dir, target)
    memory = {"free": 64 * GIB}
    monkeypatch.setattr("sparkchat.engine.capabilities.available_memory_bytes", lambda: memory["free"])
    return target, memory


async def open_models(pilot) -> ModelsScreen:
    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen))
    screen = pilot.app.screen
    await wait_for(pilot, lambda: not screen.listing, what="the model list")
    return screen


def rows(screen: ModelsScreen) -> list[list[str]]:
    table = screen.query_one(ModelTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)] if table.display else []


async def test_lists_local_models_with_their_fit(make_app, local_models):
    target, memory = local_models
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        (row,) = rows(screen)
        size = sum(p.stat().st_size for p in target.iterdir())
        assert row[1:] == ["tiny-ling", format_size(size), hub.weight_format(target), "yes", "yes"]
        detail = static_text(screen.query_one("#model-detail"))
        assert str(target) in detail and "68.7 GB available now" in detail
        assert app.focused is screen.query_one(ModelTable)
        # less memory than the model needs: the row says so, and loading asks first
        memory["free"] = 1000
        await pilot.press("r")
        await wait_for(pilot, lambda: rows(screen) and rows(screen)[0][5].startswith("no: needs"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is screen)
        assert app.engine_status == "ready"  # nothing was unloaded
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))


async def test_no_local_models(make_app, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        assert rows(screen) == []
        assert "No local models yet" in static_text(screen.query_one("#model-detail"))


@pytest.fixture
def fake_hub(tmp_path, monkeypatch, data_dir):
    server = serve_fake_hub(tmp_path, monkeypatch, {"org/tiny": FakeRepo(tiny_model_files())})
    monkeypatch.setattr("sparkchat.engine.capabilities.available_memory_bytes", lambda: 64 * GIB)
    yield server
    server.stop()


async def test_download_from_the_hub_with_byte_progress(make_app, fake_hub, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 512)  # many progress reports for the tiny files
    wanted = [data for name, data in tiny_model_files().items() if name.endswith((".json", ".jinja", ".safetensors"))]
    total = sum(len(data) for data in wanted)
    seen: list[tuple[int, int]] = []
    original = ModelsScreen.on_download_progress

    def record(self, message):
        original(self, message)
        bar = self.query_one("#download-progress", TransferProgress)
        seen.append((bar.done, bar.total))

    monkeypatch.setattr(ModelsScreen, "on_download_progress", record)
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        field = screen.query_one("#repo-id", Input)
        field.focus()
        await pilot.press(*"org/tiny", "enter")
        await wait_for(pilot, lambda: screen.download_repo is None and not screen.listing and rows(screen),
                       what="the download")
        bar = screen.query_one("#download-progress", TransferProgress)
        assert seen and seen[-1] == (total, total)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        assert (bar.done, bar.total) == (total, total)
        assert f"org/tiny: {format_size(total)} downloaded" in static_text(bar.query_one(".progress-detail"))
        assert not screen.query_one("#download-error").display
        (row,) = rows(screen)
        assert row[1] == "org/tiny"
        assert app.focused is screen.query_one(ModelTable)


async def test_download_error_is_one_line(make_app, fake_hub):
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        assert screen.start_download("org/missing")
        error = screen.query_one("#download-error")
        await wait_for(pilot, lambda: screen.download_repo is None)
        text = static_text(error)
        assert error.display and "\n" not in text
        assert text == f"model repo org/missing not found on {fake_hub.url}"
        assert not screen.query_one("#download-progress").display
        assert screen.query_one("#cancel-download").disabled and not screen.query_one("#download").disabled


async def test_cancel_a_download(make_app, data_dir, monkeypatch):
    started = threading.Event()

    def slow_download(repo_id, *, progress, cancel, endpoint=None, **kwargs):
        progress(0, 10_000_000)
        progress(2_500_000, 10_000_000)
        started.set()
        cancel.wait(10)
        raise DownloadError(f"download of {repo_id} cancelled; run it again to continue (finished files are kept)")

    monkeypatch.setattr(hub, "download", slow_download)
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        screen.start_download("org/big")
        await wait_for(pilot, started.is_set)
        bar = screen.query_one("#download-progress", TransferProgress)
        await wait_for(pilot, lambda: bar.done == 2_500_000)
        assert static_text(bar.query_one(".progress-detail")).startswith("2.5 MB of 10.0 MB")
        assert not screen.query_one("#cancel-download").disabled
        await pilot.press("ctrl+x")
        await wait_for(pilot, lambda: screen.download_repo is None)
        assert "cancelled" in static_text(bar.query_one(".progress-detail"))
        assert not screen.query_one("#download-error").display


async def test_switch_model_shows_load_progress_and_answers(make_app, local_models, monkeypatch):
    seen: list[tuple[int, int]] = []
    original = SparkchatApp.on_load_progress

    def record(self, message):
        seen.append((message.done, message.total))
        original(self, message)

    monkeypatch.setattr(SparkchatApp, "on_load_progress", record)
    old = FakeEngine()
    app = make_app(old, device="cpu", max_context=256)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        await pilot.press("enter")
        assert app.engine is not old  # dropped before the new one loads
        await wait_for(pilot, lambda: app.engine_status == "ready", timeout=120, what="the model load")
        assert app.engine.name == "tiny-ling" and app.engine is not old
        done, total = seen[-1]
        assert len(seen) > 1 and done == total > 1000  # bytes, layer by layer
        assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
        bar = screen.query_one("#load-progress", TransferProgress)
        assert bar.display and static_text(bar.query_one(".progress-title")) == "tiny-ling loaded"
        await wait_for(pilot, lambda: rows(screen) and rows(screen)[0][0] == "●")
        await pilot.press("enter")  # already loaded: nothing happens
        await wait_for(pilot, lambda: any("already loaded" in n for n in notifications(app)))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))
        assert chat(app).sub_title.startswith("tiny-ling")
        chat(app).settings = ChatSettings(max_tokens=4, thinking=False)
        await ask(pilot, "hi", timeout=120)


async def test_no_switch_while_answering(make_app, local_models):
    engine = FakeEngine(gate_after=3)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, engine.gated.is_set)
        await open_models(pilot)
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("Cannot switch model now" in n for n in notifications(app)))
        assert app.engine is engine
        engine.gate.set()


async def test_delete_a_model(make_app, local_models):
    target, _ = local_models
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: not target.exists() and not rows(screen) and not screen.listing)
        assert any("Deleted tiny-ling" in n for n in notifications(app))


async def test_a_listing_that_finishes_late_does_not_replace_a_newer_one(make_app, local_models):
    """Closing the delete dialog lists the models again while the delete runs; the delete then asks for
    a newer list. The older listing's thread may post last (a cancelled thread worker runs on): it must
    not bring back the deleted model."""
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        shown = rows(screen)
        assert shown
        screen.post_message(ModelsListed([], listing=screen.listings - 1))  # an older listing, late
        await pilot.pause()
        assert rows(screen) == shown
        screen.post_message(ModelsListed([], listing=screen.listings))
        await wait_for(pilot, lambda: not rows(screen))


def test_progress_text_and_latest():
    clock = iter([0.0, 1.0, 2.0])
    rates = RateWindow(clock=lambda: next(clock))
    assert rates.add(0) is None
    assert rates.add(50_000_000) == 50_000_000
    assert bytes_detail(50_000_000, 1_000_000_000, rates.rate()) == "50.0 MB of 1.0 GB · 50.0 MB/s · 19 s left"
    assert bytes_detail(3000, 0, None) == "3.0 kB"
    assert format_duration(3725) == "1 h 02 min" and format_duration(125) == "2 min 05 s"
    latest = Latest()
    assert latest.put(1, 10) and not latest.put(2, 10)  # one wake-up until the UI takes
    assert latest.take() == (2, 10)
    assert latest.put(3, 10)


async def test_a_switched_model_is_the_default_next_time(make_app, local_models, monkeypatch):
    import argparse

    from sparkchat import cli
    from sparkchat.cli.resolve import DEMO_DIR
    from sparkchat.settings import DEFAULT_MODEL, load_settings

    target, _ = local_models
    demo = FakeEngine()
    demo.model_dir = DEMO_DIR  # as if `sparkchat` had opened the demo: nothing configured
    app = make_app(demo, device="cpu", max_context=256)
    async with app.run_test(size=SIZE) as pilot:
        assert chat(app).query_one("#notice").display  # the demo says so
        await open_models(pilot)
        rows_ = rows(app.screen)
        await pilot.press(*["down"] * [r[1] for r in rows_].index("tiny-ling"), "enter")
        await wait_for(pilot, lambda: app.engine_status == "ready" and app.engine is not demo, timeout=120)
        await wait_for(pilot, lambda: any("opens it from now on" in n for n in notifications(app)))
        assert not chat(app).query_one("#notice").display  # no longer the demo
    assert load_settings().model == str(target.resolve())
    # the next `sparkchat` opens it
    opened = {}
    monkeypatch.setattr("sparkchat.ui.app.run_app", lambda model_dir=None, **kw: opened.setdefault("dir", model_dir))
    cli.open_app(argparse.Namespace(model=None, endpoint=None, device=None, max_context=256))
    assert opened["dir"] == target.resolve()
    # switching back to the demo resets the setting: the real model, once downloaded, wins again
    app = make_app(FakeEngine(), device="cpu", max_context=256)
    async with app.run_test(size=SIZE) as pilot:
        assert app.switch_model(DEMO_DIR, "demo")
        await wait_for(pilot, lambda: app.engine_status == "ready", timeout=120)
        assert chat(app).query_one("#notice").display
    assert load_settings().model == DEFAULT_MODEL


async def test_a_failed_switch_is_not_saved(make_app, local_models, tmp_path):
    from sparkchat.settings import DEFAULT_MODEL, load_settings

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    app = make_app(FakeEngine(), device="cpu")
    async with app.run_test(size=SIZE) as pilot:
        assert app.switch_model(broken, "broken")
        await wait_for(pilot, lambda: app.engine_status == "failed", timeout=60)
    assert load_settings().model == DEFAULT_MODEL
