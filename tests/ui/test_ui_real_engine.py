"""The app with the real engine on a tiny random model (tests/conftest.py `tiny_model_dir`), on CPU."""

import pytest
from uitools import answers, ask, chat, idle, send, wait_for

from sparkchat.ui.prefs import ChatSettings

SIZE = (110, 40)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from sparkchat.engine import Engine

    return Engine.load(tiny_model_dir, device="cpu", max_context=512)


async def test_real_engine_streams_an_answer_with_stats(make_app, tiny_engine):
    app = make_app(tiny_engine)
    app.prefs.chat = ChatSettings(max_tokens=12, thinking=False)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hello", timeout=120)
        view = answers(app)[-1]
        (conv,) = app.history.list()
        row = app.history.messages(conv.id)[-1]
        assert row.status == "complete" and row.content == view.raw
        assert row.stats["finish_reason"] in ("stop", "length")
        assert 1 <= row.stats["generated_tokens"] <= 12
        summary = str(view.query_one(".summary").render())
        assert "tok/s" in summary and "TTFT" in summary
        if tiny_engine.switch_states()["mtp"].on:
            assert "accept" in summary
        await ask(pilot, "and again", timeout=120)
        assert [m.role for m in app.history.messages(conv.id)] == ["user", "assistant"] * 2
        assert app.history.messages(conv.id)[-1].status == "complete"


async def test_real_engine_stop(make_app, tiny_engine):
    app = make_app(tiny_engine)
    app.prefs.chat = ChatSettings(max_tokens=400, thinking=False)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go on")
        await pilot.press("escape")
        await wait_for(pilot, lambda: idle(app), timeout=120)
        view = answers(app)[-1]
        assert view.finish_reason in ("cancelled", "stop")  # a random model may stop by itself first
        if view.finish_reason == "cancelled":
            (conv,) = app.history.list()
            assert app.history.messages(conv.id)[-1].status == "interrupted"


async def test_real_engine_loads_through_the_factory(make_app, tiny_model_dir):
    from sparkchat.engine import Engine

    app = make_app(engine_factory=lambda: Engine.load(tiny_model_dir, device="cpu", max_context=256),
                   model_label=tiny_model_dir.name)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=120)
        assert chat(app).sub_title.startswith(tiny_model_dir.name)
        app.prefs.chat = ChatSettings(max_tokens=4, thinking=False)
        chat(app).settings = app.prefs.chat
        await ask(pilot, "hi", timeout=120)
        assert app.history.messages(app.history.list()[0].id)[-1].status == "complete"
