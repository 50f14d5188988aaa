import asyncio
import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from sparkchat.history import History  # noqa: E402
from sparkchat.ui.app import SparkchatApp  # noqa: E402


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "data"
    monkeypatch.setenv("SPARKCHAT_DATA_DIR", str(path))
    monkeypatch.setenv("SPARKCHAT_CONFIG_DIR", str(tmp_path / "config"))
    # Dates in the history sidebar are local time: pin the zone so snapshots agree everywhere.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield path
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def make_app(data_dir) -> Callable[..., SparkchatApp]:
    histories: list[History] = []

    def make(engine: object | None = None, **kwargs) -> SparkchatApp:
        history = kwargs.pop("history", None) or History(data_dir / "history.db")
        histories.append(history)
        return SparkchatApp(engine, history=history, **kwargs)

    yield make
    for history in histories:
        history.close()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests here with asyncio.run (no asyncio plugin needed)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
        asyncio.run(pyfuncitem.obj(**args))
        return True
    return None
