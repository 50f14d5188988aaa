"""Helpers for the UI tests (a module of its own so test files can import it)."""

import time

from sparkchat.history import History
from collections.abc import Callable


async def wait_for(pilot, condition: Callable[[], object], timeout: float = 30.0, what: str = "") -> None:
    """Let the app run until `condition()` is true; fail after `timeout` seconds (generous: a loaded
    2-core CI machine paces CPU-engine renders slowly)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.01)


def chat(app):
    from sparkchat.ui.screens.chat import ChatScreen

    screen = app.chat_screen
    assert isinstance(screen, ChatScreen)
    return screen


def answers(app):
    from sparkchat.ui.widgets.message import AssistantMessage

    return list(chat(app).query(AssistantMessage))


def idle(app) -> bool:
    """No answer in progress and at least one finished answer on screen."""
    views = answers(app)
    return chat(app)._gen is None and bool(views) and not views[-1]._streaming


async def send(pilot, text: str) -> None:
    from sparkchat.ui.widgets.prompt import PromptInput

    prompt = chat(pilot.app).query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")


async def ask(pilot, text: str, timeout: float = 10.0) -> None:
    """Send a prompt and wait until its answer has finished."""
    before = len(answers(pilot.app))
    await send(pilot, text)
    await wait_for(pilot, lambda: len(answers(pilot.app)) > before and idle(pilot.app), timeout,
                   f"the answer to {text!r}")


def static_text(widget) -> str:
    return str(widget.render())


def notifications(app) -> list[str]:
    return [n.message for n in app._notifications]


def seed_history(path) -> list[int]:
    clock = iter(range(1_700_000_000, 1_700_100_000, 60))
    h = History(path, clock=lambda: float(next(clock)))
    ids = []
    for title, prompt, reply in [("Pasta carbonara", "how do I make carbonara", "Eggs, pecorino, guanciale."),
                                 ("Rust lifetimes", "explain 'a", "A lifetime names a region of code."),
                                 ("DGX Spark memory", "how much memory", "128 GB of unified LPDDR5x.")]:
        c = h.create(title, model="Fake-Ling")
        h.append(c.id, "user", prompt)
        h.append(c.id, "assistant", reply, stats={"generated_tokens": 9, "decode_tok_s": 201.5,
                                                 "finish_reason": "stop"})
        ids.append(c.id)
    h.close()
    return ids
