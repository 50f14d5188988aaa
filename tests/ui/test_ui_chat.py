"""Pilot tests of the chat screen with the deterministic fake engine."""

import threading
import time

from fake_engine import FakeEngine
from textual.command import CommandList
from textual.widgets import Collapsible, Markdown, Sparkline
from textual.widgets.markdown import MarkdownFence
from uitools import answers, ask, chat, idle, notifications, send, static_text, wait_for

from sparkchat.engine.errors import ContextOverflowError, ModelError
from sparkchat.history import History
from sparkchat.settings import load_settings
from sparkchat.ui.widgets.message import UserMessage
from sparkchat.ui.widgets.prompt import PromptInput
from sparkchat.ui.widgets.stats_bar import StatsBar

SIZE = (110, 40)


def db_messages(app):
    (conv,) = app.history.list()
    return app.history.messages(conv.id)


async def test_starts_without_a_model(make_app):
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        assert "No model loaded" in static_text(screen.query_one("#empty"))
        assert screen.sub_title == "no model loaded"
        await send(pilot, "hello?")
        await wait_for(pilot, lambda: any("No model loaded" in n for n in notifications(app)))
        assert app.history.list() == []
        assert screen.query_one(PromptInput).text == "hello?"  # kept, not lost
    app = make_app(None, no_model_reason="Ling-3.0-flash is not downloaded yet: run `sparkchat download`")
    async with app.run_test(size=SIZE):
        assert "run `sparkchat download`" in static_text(chat(app).query_one("#empty"))


async def test_answer_streams_with_reasoning_apart(make_app, fake_engine):
    app = make_app(fake_engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "square a list")
        screen = chat(app)
        (user,) = screen.query(UserMessage)
        assert user.raw == "square a list"
        (view,) = answers(app)
        thinking = view.query_one(".thinking", Collapsible)
        assert thinking.display and thinking.collapsed
        assert view.query_one(".thinking-body", Markdown).source.startswith("The user wants a quick example")
        body = view.query_one(".body", Markdown).source
        assert body.startswith("Here is the idiomatic way") and "<think>" not in body and "The user wants" not in body
        assert view.query(MarkdownFence)  # the code block is rendered as code
        summary = static_text(view.query_one(".summary"))
        assert summary.startswith("200.0 tok/s · 163 tok · TTFT 50 ms")
        assert "accept 2.75" in summary and summary.endswith("done")
        assert screen.title == "square a list"
        # stored: the prompt and the whole reply (reasoning included), with stats
        user_row, answer_row = db_messages(app)
        assert (user_row.role, user_row.content) == ("user", "square a list")
        assert answer_row.status == "complete" and answer_row.content == view.raw
        assert answer_row.stats["finish_reason"] == "stop" and answer_row.stats["generated_tokens"] == 163
        call = fake_engine.calls[0]
        assert call["messages"] == [{"role": "user", "content": "square a list"}]
        assert call["enable_thinking"] is True
        assert call["params"] == app.prefs.chat.sampling()


async def test_live_stats_while_streaming(make_app):
    engine = FakeEngine(gate_after=40, token_delay=0.004)  # several UI refreshes before the pause
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "go")
        await wait_for(pilot, engine.gated.is_set)
        bar = chat(app).query_one(StatsBar)
        # everything produced before the engine paused is on screen
        await wait_for(pilot, lambda: "│ 40 tok" in static_text(bar.query_one("#stats-latency")))
        assert answers(app)[-1].raw == "".join(engine.replies[0][i:i + 3] for i in range(0, 120, 3))
        detail = static_text(bar.query_one("#stats-detail"))
        assert "MTP accept 2.75 (last 3) · per draft 90% 70% 45%" in detail
        assert "peak 41.5 GiB" in detail and "streaming…" in detail
        assert "21% of limit 936.7 tok/s · 4.42 GB/tok" in detail  # how close to the memory's limit
        assert "200.0 tok/s" in static_text(bar.query_one("#stats-rate"))
        latency = static_text(bar.query_one("#stats-latency"))
        assert "TTFT 50 ms" in latency and "prefill 1,500 tok/s" in latency and "TPOT 5.0 ms" in latency
        assert answers(app)[-1]._streaming
        engine.gate.set()
        await wait_for(pilot, lambda: idle(app))
        assert bar.query_one("#stats-spark", Sparkline).data  # tok/s over the answer
        assert "done" in static_text(bar.query_one("#stats-detail"))


async def test_no_accept_length_without_mtp(make_app):
    engine = FakeEngine(["short reply"], unavailable={"mtp": "this checkpoint has no MTP layer"})
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "hi")
        assert "accept" not in static_text(answers(app)[-1].query_one(".summary"))
        detail = static_text(chat(app).query_one("#stats-detail"))
        assert "MTP off" in detail and "accept" not in detail
        assert "MTP" not in chat(app).sub_title


async def test_escape_stops_at_once(make_app):
    engine = FakeEngine(["word " * 500], chunk=5, gate_after=20)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "talk a lot")
        await wait_for(pilot, engine.gated.is_set)
        t0 = time.monotonic()
        await pilot.press("escape")
        await wait_for(pilot, lambda: idle(app), timeout=5)
        assert time.monotonic() - t0 < 2.0
        assert engine.finished == ["cancelled"]
        view = answers(app)[-1]
        assert view.finish_reason == "cancelled"
        assert view.raw == "word " * 20
        assert static_text(view.query_one(".summary")).endswith("stopped")
        row = db_messages(app)[-1]
        assert (row.status, row.content) == ("interrupted", "word " * 20)
        # the app is ready for the next prompt right away
        engine.gate_after = None
        await ask(pilot, "shorter please")
        assert engine.finished == ["cancelled", "stop"]


async def test_escape_when_idle_does_not_stop_anything(make_app, fake_engine):
    app = make_app(fake_engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+b")
        assert chat(app).query_one("#sidebar").display
        await pilot.press("escape")  # closes the sidebar instead
        assert not chat(app).query_one("#sidebar").display
        assert app.focused is chat(app).query_one(PromptInput)


async def test_regenerate_replaces_the_last_answer(make_app):
    engine = FakeEngine(["first answer", "second answer"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "question")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(engine.finished) == 2 and idle(app))
        (view,) = answers(app)
        assert view.answer == "second answer"
        assert [(m.role, m.content) for m in db_messages(app)] == [("user", "question"), ("assistant", "second answer")]
        assert engine.calls[1]["messages"] == engine.calls[0]["messages"] == [{"role": "user", "content": "question"}]


async def test_edit_and_resend_last_prompt(make_app):
    engine = FakeEngine(["one", "two"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "frist prompt")
        prompt = chat(app).query_one(PromptInput)
        prompt.focus()
        await pilot.press("up")  # in an empty prompt: bring back the last one
        await wait_for(pilot, lambda: prompt.text == "frist prompt")
        assert db_messages(app) == [] and not answers(app) and not chat(app).query(UserMessage)
        assert prompt.cursor_location == (0, len("frist prompt"))
        prompt.text = "first prompt"
        await pilot.press("enter")
        await wait_for(pilot, lambda: idle(app))
        assert [(m.role, m.content) for m in db_messages(app)] == [("user", "first prompt"), ("assistant", "two")]
        assert engine.calls[1]["messages"] == [{"role": "user", "content": "first prompt"}]


async def test_multi_line_prompt_and_context(make_app):
    engine = FakeEngine(["<think>hmm</think>A", "B"])
    app = make_app(engine)
    app.prefs.chat.system_prompt = "Be brief."
    async with app.run_test(size=SIZE) as pilot:
        prompt = chat(app).query_one(PromptInput)
        prompt.focus()
        await pilot.press("l", "i", "n", "e", "ctrl+j", "t", "w", "o")
        assert prompt.text == "line\ntwo"
        await pilot.press("enter")
        await wait_for(pilot, lambda: idle(app))
        await ask(pilot, "again")
        assert engine.calls[1]["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "line\ntwo"},
            {"role": "assistant", "content": "<think>hmm</think>A"},
            {"role": "user", "content": "again"},
        ]
        assert engine.resets == 0  # same conversation: the engine keeps its state


async def test_newline_keys_keep_their_place_in_a_burst(make_app):
    from textual import events

    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        prompt = chat(app).query_one(PromptInput)
        prompt.focus()
        await pilot.pause()
        # keys that arrive in one read (fast typing over ssh) are queued before any is handled
        for key, char in [("a", "a"), ("ctrl+j", None), ("b", "b"), ("shift+enter", None), ("c", "c")]:
            app.post_message(events.Key(key, char))
        await wait_for(pilot, lambda: prompt.text == "a\nb\nc")
        assert not app.history.list()  # a new line, not a send


async def test_copy_answer_message_and_code(make_app, fake_engine):
    app = make_app(fake_engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "code please")
        view = answers(app)[-1]
        await pilot.press("ctrl+o")
        assert app.clipboard == view.answer and app.clipboard.startswith("Here is")
        await pilot.press("ctrl+l")
        assert app.clipboard == ("numbers = [1, 2, 3, 4]\nsquares = [n * n for n in numbers]\n"
                                 "print(squares)  # [1, 4, 9, 16]")
        app.copy_to_clipboard("")
        view.focus()
        await pilot.press("c")
        assert app.clipboard == view.answer
        await pilot.press("1")
        assert app.clipboard.startswith("numbers = [1, 2, 3, 4]")
        await pilot.press("2")
        assert any("1 code block" in n for n in notifications(app))
        # by mouse: the copy label, and a code block
        app.copy_to_clipboard("")
        (user,) = chat(app).query(UserMessage)
        await pilot.click(user.query_one(".copy"))
        assert app.clipboard == "code please"
        view.scroll_visible(animate=False)
        await pilot.pause()
        await pilot.click(view.query_one(MarkdownFence))
        assert app.clipboard.startswith("numbers = [1, 2, 3, 4]")


async def test_pinned_to_bottom_unless_scrolled_up(make_app):
    engine = FakeEngine(["line\n\n" * 100], chunk=6, gate_after=60)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "long")
        await wait_for(pilot, engine.gated.is_set)
        log = chat(app).log_view
        await wait_for(pilot, lambda: log.max_scroll_y > 10 and log.scroll_y == log.max_scroll_y)
        log.scroll_home(animate=False, immediate=True)  # the user scrolls up to read
        engine.gate.set()
        await wait_for(pilot, lambda: idle(app))
        await pilot.pause()
        assert log.scroll_y == 0
        await ask(pilot, "next")  # sending jumps back to the bottom
        await pilot.pause()
        assert log.scroll_y == log.max_scroll_y


async def test_reopened_app_finds_the_chat(make_app, data_dir):
    engine = FakeEngine(["remember me"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "first session")
    engine2 = FakeEngine(["new answer"])
    app2 = make_app(engine2, history=History(data_dir / "history.db"))
    async with app2.run_test(size=SIZE) as pilot:
        screen = chat(app2)
        assert not answers(app2)  # starts on an empty chat
        await pilot.press("ctrl+b")
        olist = screen.query_one("#history-list")
        assert olist.option_count == 1 and "first session" in str(olist.get_option_at_index(0).prompt)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(answers(app2)) == 1)
        assert answers(app2)[0].answer == "remember me"
        assert screen.conversation.title == "first session"
        await ask(pilot, "and now?")
        assert engine2.resets == 1  # another conversation than the engine's kept state
        assert engine2.calls[0]["messages"][:2] == [{"role": "user", "content": "first session"},
                                                    {"role": "assistant", "content": "remember me"}]


async def test_answer_cut_by_a_crash_is_kept_as_interrupted(make_app, data_dir):
    h = History(data_dir / "history.db")
    conv = h.create("crashed chat")
    h.append(conv.id, "user", "tell me")
    row = h.append(conv.id, "assistant", "", status="streaming")
    h.update_message(row.id, "It was a dark and")
    h.close()
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await chat(app).open_conversation(conv.id)
        await wait_for(pilot, lambda: len(answers(app)) == 1)
        view = answers(app)[0]
        assert view.answer == "It was a dark and"
        assert static_text(view.query_one(".summary")) == "interrupted"


async def test_engine_error_is_shown_and_app_survives(make_app):
    engine = FakeEngine(["fine"])
    calls = {"n": 0}
    real_generate = engine.generate

    def generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ContextOverflowError("the prompt is longer than the 8192-token context")
        return real_generate(*args, **kwargs)

    engine.generate = generate
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "huge prompt")
        view = answers(app)[-1]
        assert "8192-token context" in static_text(view.query_one(".summary"))
        assert any("8192-token context" in n for n in notifications(app))
        assert db_messages(app)[-1].status == "interrupted"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: idle(app) and answers(app)[-1].answer == "fine")


async def test_fast_stream_is_rendered_at_most_every_50ms(make_app):
    text = "".join(f"token{i}" + ("\n\n" if i % 25 == 24 else " ") for i in range(1000))
    engine = FakeEngine([text], chunk=4, token_delay=0.0002)  # ~5000 deltas/s for about 0.4 s
    app = make_app(engine)
    app.prefs.chat.max_tokens = 10_000
    drains = []
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        original = screen._drain

        async def timed_drain():
            drains.append(time.monotonic())
            await original()

        screen._drain = timed_drain
        await ask(pilot, "flood", timeout=30)
        assert answers(app)[-1].query_one(".body", Markdown).source == text
        assert len(drains) >= 3
        gaps = [b - a for a, b in zip(drains, drains[1:])]
        assert min(gaps) >= 0.045, gaps  # coalesced: one render per 50 ms however fast the engine


async def test_engine_loads_in_the_background(make_app):
    release = threading.Event()
    loaded = FakeEngine(["hi"])

    def factory():
        release.wait(10)
        return loaded

    app = make_app(engine_factory=factory, model_label="Ling-3.0-flash")
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        assert "Loading Ling-3.0-flash" in static_text(screen.query_one("#empty"))
        await send(pilot, "too early")
        await wait_for(pilot, lambda: any("still loading" in n for n in notifications(app)))
        release.set()
        await wait_for(pilot, lambda: app.engine is loaded)
        await wait_for(pilot, lambda: "is ready" in static_text(screen.query_one("#empty")))
        await pilot.press("enter")  # the prompt kept "too early"
        await wait_for(pilot, lambda: idle(app))
        assert loaded.set_switches_calls == [app.prefs.switches]  # saved switches reach the engine


async def test_the_chat_shows_the_bytes_read_while_the_model_loads(make_app):
    release = threading.Event()
    loaded = FakeEngine(["hi"])

    def factory(progress, stage):
        progress(31_200_000_000, 68_900_000_000)
        release.wait(10)
        return loaded

    app = make_app(engine_factory=factory, model_label="Ling-3.0-flash-fp4")
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await wait_for(pilot, lambda: "31.2 GB of 68.9 GB read" in static_text(screen.query_one("#empty")))
        release.set()
        await wait_for(pilot, lambda: "is ready" in static_text(screen.query_one("#empty")))
        assert "GB" not in static_text(screen.query_one("#empty"))


async def test_a_slow_load_step_is_named_while_it_runs(make_app):
    """After the layers, Engine.load may compile kernels for a while (a minute or two the first time):
    the chat says so, and forgets it once the model is in."""
    from sparkchat.engine.kernels.kda_prefill import WARM_UP_STAGE

    release = threading.Event()
    loaded = FakeEngine(["hi"])

    def factory(progress, stage):
        progress(4, 4)
        stage(WARM_UP_STAGE)
        release.wait(10)
        return loaded

    app = make_app(engine_factory=factory, model_label="Ling-3.0-flash")
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await wait_for(pilot, lambda: WARM_UP_STAGE in static_text(screen.query_one("#empty")))
        assert screen.sub_title == f"loading model… {WARM_UP_STAGE}"
        release.set()
        await wait_for(pilot, lambda: app.engine is loaded)
        await wait_for(pilot, lambda: "is ready" in static_text(screen.query_one("#empty")))
        assert app.load_stage is None
        assert WARM_UP_STAGE not in screen.sub_title


async def test_engine_load_failure_is_shown(make_app):
    def factory():
        raise ModelError("no config.json in /models/x")

    app = make_app(engine_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await wait_for(pilot, lambda: app.engine_status == "failed")
        assert "no config.json in /models/x" in static_text(screen.query_one("#empty"))
        assert screen.sub_title == "model failed to load"


async def test_new_chat(make_app):
    engine = FakeEngine(["a", "b"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "one")
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: not answers(app))
        assert chat(app).conversation is None
        assert chat(app).query_one("#empty").display
        await ask(pilot, "two")
        assert [c.title for c in app.history.list()] == ["two", "one"]
        assert engine.resets == 1
        assert engine.calls[1]["messages"] == [{"role": "user", "content": "two"}]


async def test_theme_is_remembered(make_app, data_dir):
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        app.theme = "nord"
        await pilot.pause()
    assert load_settings().theme == "nord"
    app2 = make_app(FakeEngine())
    async with app2.run_test(size=SIZE):
        assert app2.theme == "nord"


async def test_command_palette_entries(make_app):
    app = make_app(FakeEngine(["x"]))
    async with app.run_test(size=SIZE) as pilot:
        titles = {c.title for c in app.get_system_commands(app.screen)}
        for title in ["New chat", "Settings", "History", "Regenerate", "Edit last prompt", "Stop", "Copy answer",
                      "Copy code block", "Export chat", "Help", "Theme", "Quit"]:
            assert title in titles
        await ask(pilot, "first")
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "CommandPalette")
        await pilot.press(*"new chat")

        def top_hit() -> str:
            results = app.screen.query_one(CommandList)
            return str(results.get_option_at_index(0).prompt) if results.option_count else ""

        await wait_for(pilot, lambda: top_hit().startswith("New chat"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: chat(app).conversation is None and not answers(app))


async def test_the_demo_model_says_so_with_how_to_get_the_real_one(make_app):
    from sparkchat.cli.resolve import DEMO_DIR, DEMO_GET, DEMO_HINT
    from sparkchat.ui.app import engine_loader

    app = make_app(engine_factory=engine_loader(DEMO_DIR, device="cpu", max_context=512))
    app.model_dir = DEMO_DIR  # as run_app sets it
    async with app.run_test(size=SIZE) as pilot:
        notice = chat(app).query_one("#notice")
        assert notice.display  # already while it loads
        await wait_for(pilot, lambda: app.engine is not None, timeout=120, what="the demo model")
        text = static_text(notice)
        assert "demo model" in text and DEMO_GET in text and DEMO_GET in DEMO_HINT  # the hint `ask` prints
        await ask(pilot, "What does str.split do?", timeout=120)
        assert notice.display
    app = make_app(FakeEngine())  # any other model: no notice
    async with app.run_test(size=SIZE):
        assert not chat(app).query_one("#notice").display
