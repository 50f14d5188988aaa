"""Shared fixtures: tiny random Ling-3.0-flash model directories, built once per test session."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.tiny import add_mtp_layer, build_reference, save_reference, torch_kda_reference
from tests.tiny_tokenizer import write_test_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("fla") is not None:  # fla-core installed (a GPU machine): CPU references
        torch_kda_reference()


def make_model_dir(path: Path, seed: int = 0, mtp: bool = True, **overrides) -> Path:
    ref = build_reference(seed, **overrides)
    save_reference(ref, path)
    if mtp:
        add_mtp_layer(path, seed=seed + 100)
    write_test_tokenizer(path, vocab_size=ref.config.vocab_size)
    return path


@pytest.fixture(scope="session")
def agree_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose MTP layer drafts what the model then says (tests.tiny.make_draft_agree):
    real accept lengths on a random model."""
    from tests.tiny import make_draft_agree

    path = make_model_dir(tmp_path_factory.mktemp("agree") / "m", seed=3)
    make_draft_agree(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with an MTP layer and a tokenizer: what `sparkchat ask --model` can load."""
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "tiny-ling")
