"""The model as a whole matches transformers' BailingHybridForCausalLM on tiny random models:
prefill logits, 32+ decode steps, and identical greedy tokens, over several shapes."""

from __future__ import annotations

import pytest
import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.loader import load_model
from sparkchat.engine.state import ConversationState
from tests.tiny import build_reference, save_reference

SHAPES = {
    "base": {},
    "no-dense-mla-every-3rd": dict(first_k_dense_replace=0, layer_group_size=3, num_hidden_layers=6),
    "two-dense-8-groups": dict(first_k_dense_replace=2, n_group=8, topk_group=3, num_local_experts=32,
                               num_hidden_layers=5),
    "one-group-topk1": dict(n_group=1, topk_group=1, num_experts_per_tok=1, num_hidden_layers=3),
}


def _ours(path, max_context=512):
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "cpu", torch.float32, max_context)
    return model, ConversationState.allocate(cfg, max_context, "cpu", torch.float32)


def _compare(ref, path, prompt_len: int, steps: int = 32, seed: int = 0) -> None:
    model, state = _ours(path)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ref.config.vocab_size, (prompt_len,), generator=g)
    with torch.no_grad():
        out = ref(ids[None], use_cache=True)
    ref_logits = out.logits[0]
    hidden, _ = model(ids, 0, state)
    logits = model.lm_head(hidden)
    scale = ref_logits.abs().max().item()
    assert (logits - ref_logits).abs().max().item() <= 1e-4 * scale
    cache, pos = out.cache, prompt_len
    ref_tok = ours_tok = int(ref_logits[-1].argmax())
    for _ in range(steps):
        assert ours_tok == ref_tok
        with torch.no_grad():
            out = ref(torch.tensor([[ref_tok]]), cache=cache, use_cache=True)
        hidden, _ = model(torch.tensor([ours_tok]), pos, state)
        pos += 1
        step = model.lm_head(hidden)[0]
        assert (step - out.logits[0, -1]).abs().max().item() <= 1e-4 * out.logits.abs().max().item()
        cache = out.cache
        ref_tok, ours_tok = int(out.logits[0, -1].argmax()), int(step.argmax())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prompt_len", [1, 120])
def test_matches_transformers(tmp_path, shape, prompt_len):
    ref = build_reference(seed=3, **SHAPES[shape])
    path = save_reference(ref, tmp_path / "m")
    _compare(ref, path, prompt_len)


def test_official_config_spelling_loads_the_same(tmp_path):
    ref = build_reference(seed=5)
    path = save_reference(ref, tmp_path / "m", official_config=True)
    cfg = ModelConfig.from_dir(path)
    assert cfg.head_dim == ref.config.linear_head_dim  # the KDA dim, not the rope dim
    assert cfg.num_experts == ref.config.num_local_experts and cfg.n_group == ref.config.n_group
    _compare(ref, path, prompt_len=20, steps=8)


def test_yarn_rope_matches_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 6e6, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    ref = build_reference(seed=7, rope_parameters=rope)
    path = save_reference(ref, tmp_path / "m")
    _compare(ref, path, prompt_len=90, steps=4)
