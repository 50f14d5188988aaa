"""Which model directory a command uses: --model (a directory, or a local/downloaded model's name or
Hub repo id), else the settings' default model."""

from __future__ import annotations

from pathlib import Path

from sparkchat.engine.errors import ModelError


def resolve_model(model: str | None) -> Path:
    if model is None:
        from sparkchat.settings import load_settings

        model = load_settings().model or None
    if model is None:
        raise ModelError("no model given: pass --model DIR or a downloaded repo id "
                         "(`sparkchat download inclusionAI/Ling-3.0-flash-fp4`)")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{model} is not a directory")
    if "/" in model and not model.startswith((".", "/", "~")) and model.count("/") == 1:
        from sparkchat.hub import resolve_model as resolve_local

        return resolve_local(model)
    raise ModelError(f"model directory not found: {model}")
