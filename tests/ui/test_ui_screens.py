"""Settings, help, history sidebar and dialogs."""

from fake_engine import FakeEngine
from textual.widgets import DataTable, Input, Label, Select, Switch, TextArea
from uitools import answers, ask, chat, notifications, seed_history, wait_for

from sparkchat.engine.events import Switches
from sparkchat.settings import load_settings, settings_path
from sparkchat.ui.prefs import ChatSettings
from sparkchat.ui.screens.dialogs import ConfirmScreen, TextPromptScreen
from sparkchat.ui.screens.help import HelpScreen
from sparkchat.ui.screens.settings import SettingsScreen
from sparkchat.ui.widgets.sidebar import HistoryList

SIZE = (110, 44)


async def open_settings(pilot) -> SettingsScreen:
    await pilot.press("f2")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, SettingsScreen))
    return pilot.app.screen


async def test_settings_apply_to_the_next_answer_and_persist(make_app, data_dir):
    engine = FakeEngine(["one", "two"])
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await ask(pilot, "first")
        screen = await open_settings(pilot)
        screen.query_one("#temperature", Input).value = "0.2"
        screen.query_one("#top-k", Input).value = "40"
        screen.query_one("#seed", Input).value = "1234"
        screen.query_one("#sw-mtp", Switch).value = False
        screen.query_one("#sw-fp8_head", Switch).value = False
        screen.query_one("#sw-thinking", Switch).value = False
        screen.query_one("#system-prompt", TextArea).text = "You are terse."
        await pilot.pause()
        assert screen.query_one("#draft-steps", Select).disabled  # draft steps only mean something with MTP
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is chat(app))
        saved = load_settings()
        assert saved.sampling.temperature == 0.2 and saved.sampling.seed == 1234 and saved.sampling.top_k == 40
        assert saved.switches.mtp is False and saved.switches.fp8_head is False
        assert saved.system_prompt == "You are terse." and saved.thinking is False
        # the chat keeps its own copy
        assert app.history.get(chat(app).conversation.id).settings["system_prompt"] == "You are terse."
        await ask(pilot, "second")
        call = engine.calls[-1]
        assert (call["params"].temperature, call["params"].top_k, call["params"].seed) == (0.2, 40, 1234)
        assert call["enable_thinking"] is False
        assert call["messages"][0] == {"role": "system", "content": "You are terse."}
        assert engine.set_switches_calls[-1] == Switches(mtp=False, fp8_head=False)
        assert "accept" not in str(answers(app)[-1].query_one(".summary").render())
        assert "FP8 head" not in chat(app).sub_title
    app2 = make_app(FakeEngine())
    async with app2.run_test(size=SIZE) as pilot:
        screen = await open_settings(pilot)
        assert screen.query_one("#temperature", Input).value == "0.2"
        assert screen.query_one("#sw-mtp", Switch).value is False


async def test_settings_reject_bad_values(make_app):
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_settings(pilot)
        screen.query_one("#top-p", Input).value = "1.5"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: any("top-p" in n for n in notifications(app)))
        assert app.screen is screen  # still open, nothing saved
        screen.query_one("#top-p", Input).value = "0.9"
        screen.query_one("#max-tokens", Input).value = "many"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: any("Max tokens" in n for n in notifications(app)))
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))
        assert app.prefs.chat == ChatSettings() and not settings_path().exists()


async def test_unavailable_switches_are_disabled_with_the_reason(make_app):
    engine = FakeEngine(unavailable={"mxfp4_kernels": "needs an sm_100+ GPU with Triton",
                                     "cuda_graphs": "no CUDA device"})
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_settings(pilot)
        switch = screen.query_one("#sw-mxfp4_kernels", Switch)
        assert switch.disabled and switch.value is False
        reasons = [str(label.render()) for label in screen.query("#row-mxfp4_kernels Label")]
        assert any("needs an sm_100+ GPU with Triton" in r for r in reasons)
        assert screen.query_one("#sw-cuda_graphs", Switch).disabled
        assert not screen.query_one("#sw-mtp", Switch).disabled
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is chat(app))
        # the user's wish is kept for a machine where it works
        assert app.prefs.switches.mxfp4_kernels is True
        assert "MXFP4" not in chat(app).sub_title


async def test_settings_without_a_model(make_app):
    app = make_app(None)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_settings(pilot)
        assert any("No model loaded" in str(label.render()) for label in screen.query(Label))
        assert not screen.query_one("#sw-mtp", Switch).disabled
        screen.query_one("#draft-steps", Select).value = 2
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is chat(app))
        assert app.prefs.switches.draft_steps == 2


async def test_help_lists_the_keys(make_app):
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        table = app.screen.query_one(DataTable)
        rows = {(table.get_row_at(i)[1], table.get_row_at(i)[2]) for i in range(table.row_count)}
        for key, action in [("Enter", "Send"), ("Ctrl+J / Shift+Enter / Alt+Enter", "New line"),
                            ("Escape", "Stop"), ("Ctrl+R", "Regenerate"), ("Ctrl+N", "New chat"),
                            ("Ctrl+B", "History"), ("F2", "Settings"), ("F1", "Help"), ("Ctrl+O", "Copy answer"),
                            ("Ctrl+L", "Copy last code block"), ("Up", "Edit last prompt (in an empty prompt)"),
                            ("C", "Copy message"), ("1 … 9", "Copy code block n"), ("R", "Rename"),
                            ("D / Delete", "Delete"), ("E", "Export"), ("Ctrl+Q", "Quit"),
                            ("Ctrl+P", "Command palette (actions, themes)")]:
            assert (key, action) in rows, (key, action)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is chat(app))


def titles(app) -> list[str]:
    olist = chat(app).query_one(HistoryList)
    return [str(olist.get_option_at_index(i).prompt).split("\n")[0] for i in range(olist.option_count)]


async def test_history_sidebar_search_open(make_app, data_dir):
    ids = seed_history(data_dir / "history.db")
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+b")
        assert titles(app) == ["DGX Spark memory", "Rust lifetimes", "Pasta carbonara"]
        search = chat(app).query_one("#history-search", Input)
        search.focus()
        await pilot.press(*"pecor")
        await wait_for(pilot, lambda: titles(app) == ["Pasta carbonara"])
        assert "pecorino" in str(chat(app).query_one(HistoryList).get_option_at_index(0).prompt)
        await pilot.press("enter")  # to the list
        await pilot.press("enter")  # open it
        await wait_for(pilot, lambda: chat(app).conversation is not None)
        assert chat(app).conversation.id == ids[0]
        assert answers(app)[0].answer == "Eggs, pecorino, guanciale."
        assert "201.5 tok/s" in str(answers(app)[0].query_one(".summary").render())
        search.value = "nothing like this"
        await wait_for(pilot, lambda: titles(app) == ["no match"])


async def test_history_rename_delete_export(make_app, data_dir, tmp_path):
    ids = seed_history(data_dir / "history.db")
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+b")
        assert app.focused is chat(app).query_one(HistoryList)
        # rename the highlighted (newest) chat
        await pilot.press("r")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        field = app.screen.query_one(Input)
        assert field.value == "DGX Spark memory"
        field.value = "Spark unified memory"
        await pilot.press("enter")
        await wait_for(pilot, lambda: titles(app)[0] == "Spark unified memory")
        assert app.history.get(ids[2]).title == "Spark unified memory"
        # export it
        await pilot.press("e")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        target = tmp_path / "out" / "chat.md"
        app.screen.query_one(Input).value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, target.exists)
        text = target.read_text()
        assert text.startswith("# Spark unified memory") and "128 GB of unified LPDDR5x." in text
        # delete: asks first; "n" keeps it
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen is chat(app))
        assert len(app.history.list()) == 3
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: titles(app) == ["Rust lifetimes", "Pasta carbonara"])
        assert app.history.get(ids[2]) is None


async def test_deleting_the_open_chat_starts_a_new_one(make_app, data_dir):
    ids = seed_history(data_dir / "history.db")
    app = make_app(FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await chat(app).open_conversation(ids[2])
        await pilot.press("ctrl+b")
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_for(pilot, lambda: chat(app).conversation is None and not answers(app))
        assert len(app.history.list()) == 2


async def test_stats_bar_lines():
    from textual.app import App

    from sparkchat.engine.events import GenerationStats
    from sparkchat.ui.widgets.stats_bar import StatsBar

    class Host(App):
        def compose(self):
            yield StatsBar()

    app = Host()
    async with app.run_test(size=(140, 5)):
        bar = app.query_one(StatsBar)
        stats = GenerationStats(prompt_tokens=129, prefilled_tokens=9, generated_tokens=64, ttft_s=0.04,
                                prefill_tok_s=900.0, tpot_ms=4.2, decode_tok_s=238.1,
                                accept_length_mean=3.1, accept_length_last=4, accept_rate_per_position=[0.9, 0.8],
                                peak_memory_bytes=3 << 30)
        bar.show(stats, [230.0, 238.0], "length")
        latency = str(bar.query_one("#stats-latency").render())
        assert latency == "TTFT 40 ms │ prefill 900 tok/s (120 of 129 reused) │ TPOT 4.2 ms │ 64 tok"
        assert "238.1 tok/s" in str(bar.query_one("#stats-rate").render())
        detail = str(bar.query_one("#stats-detail").render())
        assert detail == "MTP accept 3.10 (last 4) · per draft 90% 80% │ peak 3.0 GiB │ max tokens"
        assert bar.query_one("#stats-spark").data == [0.0, 230.0, 238.0]
        bar.show(GenerationStats(generated_tokens=5), [], None, mtp_on=False)
        assert str(bar.query_one("#stats-detail").render()) == "MTP off │ streaming…"
        bar.show_idle("Ling · MXFP4")
        assert bar.has_class("-idle") and str(bar.query_one("#stats-detail").render()) == "Ling · MXFP4"
