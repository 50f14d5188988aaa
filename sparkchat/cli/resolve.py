"""Which model directory a command uses: --model (a directory, or a downloaded model's name or Hub repo
id), else the configured model, else — when nothing is configured and the real model is not here — the
small demo model shipped in assets/demo."""

from __future__ import annotations

import sys
from pathlib import Path

from sparkchat.engine.errors import ModelError

DEMO_DIR = Path(__file__).resolve().parent.parent.parent / "assets" / "demo"
DEMO_ABOUT = "Using the built-in demo model (17 MB, trained on Python's docs; it often gets them wrong)."
DEMO_GET = "For the real one: sparkchat download inclusionAI/Ling-3.0-flash-fp4"
DEMO_HINT = f"sparkchat: u{DEMO_ABOUT[1:]} {DEMO_GET}"  # what `ask` prints on stderr; the app shows both parts


def is_demo(path: str | Path | None) -> bool:
    """Whether `path` is the built-in demo model's folder."""
    if path is None:
        return False
    try:
        return Path(path).expanduser().resolve() == DEMO_DIR.resolve()
    except OSError:
        return False


def resolve_model(model: str | None, announce_demo: bool = True) -> Path:
    if model is not None:
        return _resolve(model)
    from sparkchat.settings import DEFAULT_MODEL, load_settings

    configured = load_settings().model or DEFAULT_MODEL
    if configured != DEFAULT_MODEL:
        return _resolve(configured)  # the user chose it: a missing one is an error, not the demo
    try:
        return _resolve(configured)
    except ModelError:
        if not (DEMO_DIR / "config.json").is_file():
            raise ModelError(f"no model given and {DEFAULT_MODEL} is not downloaded: pass --model DIR or run "
                             f"`sparkchat download {DEFAULT_MODEL}`") from None
        if announce_demo:
            print(DEMO_HINT, file=sys.stderr)
        return DEMO_DIR


def _resolve(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{model} is not a directory")
    if "/" in model and not model.startswith((".", "/", "~")) and model.count("/") == 1:
        from sparkchat.hub import resolve_model as resolve_local

        return resolve_local(model)
    raise ModelError(f"model directory not found: {model}")
