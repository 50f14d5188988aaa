"""engine/config.py: a config.json with a wrong type, a value out of range or sizes that do not fit
together is one ModelError naming the key, before any weight loads; the real Ling-3.0-flash config passes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.errors import ModelError
from sparkchat.engine.synthetic import LING3_FLASH  # the official config, as the release writes it

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 131072}
QUANT = LING3_FLASH["quantization_config"]


def refused(raw: dict[str, Any]) -> str:
    with pytest.raises(ModelError) as e:
        ModelConfig.from_dict(raw)
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_the_real_config_passes():
    cfg = ModelConfig.from_dict(dict(LING3_FLASH, rope_scaling=YARN, expert_swiglu_limit_list=[0] * 35 + [4] * 7,
                                     share_expert_swiglu_limit_list=[0] * 34 + [5] * 6 + [7] * 2))
    assert cfg.num_experts_per_tok == 8 and cfg.quantization.weight_block_size == (128, 128)
    assert cfg.eos_token_id == [156895] and cfg.rope_scaling == YARN


@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", "64", 'hidden_size must be a positive integer, not "64"'),
    ("hidden_size", None, "hidden_size must be a positive integer, not null"),
    ("hidden_size", True, "hidden_size must be a positive integer, not true"),
    ("hidden_size", 2560.5, "hidden_size must be a positive integer"),
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
    ("num_hidden_layers", "42", "num_hidden_layers must be a positive integer"),
    ("num_local_experts", "512", "num_experts (or num_local_experts) must be a positive integer"),
    ("num_shared_experts", -1, "num_shared_experts (or n_shared_experts) must be an integer >= 0"),
    ("rms_norm_eps", math.nan, "rms_norm_eps must be a positive number, not NaN"),
    ("rope_theta", "6e6", "rope_theta must be a positive number"),
    ("routed_scaling_factor", math.inf, "routed_scaling_factor must be a positive number"),
    ("kda_lower_bound", None, "kda_lower_bound must be a finite number"),
    ("norm_topk_prob", "yes", "norm_topk_prob (or moe_renormalize) must be true or false"),
    ("eos_token_id", "156895", "eos_token_id must be a token id or a list of them"),
    ("pad_token_id", -1, "pad_token_id must be an integer >= 0"),
    ("layer_types", [5, 11], "layer_types must be a list of strings"),
    ("expert_swiglu_limit_list", ["4"] * 42, "expert_swiglu_limit_list must be a list of numbers"),
    ("quantization_config", "fp8", 'quantization_config must be a JSON object, not "fp8"'),
    ("quantization_config", dict(QUANT, weight_block_size=[128]), "weight_block_size must hold 2 sizes"),
    ("quantization_config", dict(QUANT, weight_block_size="128"), "weight_block_size must be a list of positive"),
    ("quantization_config", dict(QUANT, routed_experts_group_size="32"), "routed_experts_group_size must be a pos"),
    ("rope_parameters", "x", 'rope_parameters must be a JSON object, not "x"'),
    ("rope_scaling", "yarn", "rope_scaling must be a JSON object"),
    ("rope_scaling", {"rope_type": "yarn"}, "rope_scaling.factor must be a positive number, not null"),
    ("rope_scaling", dict(YARN, original_max_position_embeddings="131072"), "original_max_position_embeddings"),
])
def test_wrong_types_name_the_key(key, value, needle):
    raw = {k: v for k, v in LING3_FLASH.items() if k != "num_experts" or key != "num_local_experts"}
    assert needle in refused(dict(raw, **{key: value}))


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": 600}, "num_experts_per_tok 600 is more than the 256 experts the router keeps"),
    ({"num_experts_per_tok": 257}, "num_experts_per_tok 257"),  # more than the kept groups hold
    ({"topk_group": 9}, "topk_group 9 is more than n_group 8"),
    ({"n_group": 7}, "num_experts 512 is not divisible by n_group 7"),
    ({"n_group": 512, "topk_group": 4}, "fewer than 2 of 512 experts per group"),  # groups score their top 2
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim 63 must be even"),  # interleaved pairs
    ({"mlp_layer_types": ["dense"] * 41 + ["moe"]}, "unknown mlp layer types ['moe']"),
])
def test_sizes_the_engine_relies_on(changes, needle):
    assert needle in refused(dict(LING3_FLASH, **changes))


def test_json_nan_in_a_file(tmp_path: Path):
    text = json.dumps(LING3_FLASH).replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelError, match="rms_norm_eps must be a positive number, not NaN"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("key, value, needle", [
    ("num_experts_per_token", 99, "num_experts_per_tok 99"),  # was a RuntimeError in the first answer
    ("hidden_size", "64", "hidden_size must be a positive integer"),  # was a TypeError in nn/norm.py
])
def test_engine_load_refuses_before_any_weight(tiny_model_dir: Path, tmp_path: Path, key, value, needle):
    from sparkchat.engine.session import Engine

    model = shutil.copytree(tiny_model_dir, tmp_path / "m")
    raw = json.loads((model / "config.json").read_text())
    assert key in raw  # the tiny config is transformers-written: its alias
    (model / "config.json").write_text(json.dumps(dict(raw, **{key: value})))
    with pytest.raises(ModelError, match=needle):
        Engine.load(model, device="cpu", max_context=64)
