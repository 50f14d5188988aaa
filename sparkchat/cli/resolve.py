"""Which model directory a command uses: --model, else the settings' default."""

from __future__ import annotations

from pathlib import Path

from sparkchat.engine.errors import ModelError


def resolve_model(model: str | None) -> Path:
    if model is None:
        raise ModelError("no model given: pass --model DIR (a directory with config.json and safetensors)")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{model} is not a directory")
    raise ModelError(f"model directory not found: {model}")
