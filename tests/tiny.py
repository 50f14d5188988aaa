"""Tiny random Ling-3.0-flash models, built with transformers' BailingHybridForCausalLM (the reference)
and saved with save_pretrained, which writes the official Ling tensor names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

BASE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, head_dim=8, num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=1, layer_group_size=2, num_mtp_layers=0, pad_token_id=0, eos_token_id=1,
    max_position_embeddings=4096,
)

# transformers alias -> the official release's key
OFFICIAL_KEYS = {
    "num_experts": "num_experts", "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "num_shared_experts", "num_expert_group": "n_group", "moe_renormalize": "norm_topk_prob",
    "num_nextn_predict_layers": "num_nextn_predict_layers", "model_max_length": "max_position_embeddings",
}


def torch_kda_reference() -> None:
    """The reference's KDA in its own torch form. transformers binds fla-core's kernels when the package
    is installed (sparkchat's GPU prefill uses it), and those cannot run on the CPU where the reference
    runs: unwrap them back to the torch functions they decorate."""
    import inspect

    try:
        from transformers.models.bailing_hybrid import modeling_bailing_hybrid as m
    except ImportError:  # a transformers without the model: the tests that need the reference say so
        return

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        setattr(m, name, inspect.unwrap(getattr(m, name)))


def build_reference(seed: int = 0, **overrides: Any):
    """A transformers BailingHybridForCausalLM with every weight randomized (norms and biases too)."""
    from transformers import BailingHybridConfig, BailingHybridForCausalLM

    torch.manual_seed(seed)
    cfg = BailingHybridConfig(**{**BASE, **overrides})
    model = BailingHybridForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "gate.weight" in name and p.dim() == 2 and p.shape[0] == cfg.num_local_experts:
                p.normal_(0, 0.3)  # a spread-out router so top-k choices are not near-ties
            else:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    return model


def save_reference(model, path: Path, official_config: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if official_config:
        raw = json.loads((path / "config.json").read_text())
        for k in ("linear_head_dim", "linear_num_heads", "qk_head_dim", "rope_parameters", "layer_types",
                  "mlp_layer_types"):
            raw.pop(k, None)
        raw["head_dim"] = model.config.linear_head_dim
        for alias, official in OFFICIAL_KEYS.items():
            if alias in raw and official != alias:
                raw[official] = raw.pop(alias)
        raw["architectures"] = ["BailingMoeV3ForCausalLM"]
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def add_mtp_layer(path: Path, seed: int = 1, agree_with: Path | None = None) -> None:
    """Append random MTP (NextN) tensors as layer `num_hidden_layers` and declare them in config.json."""
    raw = json.loads((path / "config.json").read_text())
    n = raw["num_hidden_layers"]
    H, heads = raw["hidden_size"], raw["num_attention_heads"]
    nope, rope, vd, rank = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"], raw["kv_lora_rank"]
    E = raw.get("num_experts", raw.get("num_local_experts"))
    inter = raw["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    p = f"model.layers.{n}"
    t: dict[str, torch.Tensor] = {}
    for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
        t[f"{p}.{norm}.weight"] = 1 + rnd(H, std=0.2)
    t[f"{p}.eh_proj.weight"] = rnd(H, 2 * H)
    a = f"{p}.attention"
    t[f"{a}.q_proj.weight"] = rnd(heads * (nope + rope), H)
    t[f"{a}.kv_a_proj_with_mqa.weight"] = rnd(rank + rope, H)
    t[f"{a}.kv_a_layernorm.weight"] = 1 + rnd(rank, std=0.2)
    t[f"{a}.kv_b_proj.weight"] = rnd(heads * (nope + vd), rank)
    t[f"{a}.dense.weight"] = rnd(H, heads * vd)
    t[f"{a}.g_proj.weight"] = rnd(heads, H)
    m = f"{p}.mlp"
    t[f"{m}.gate.weight"] = rnd(E, H, std=0.3)
    t[f"{m}.gate.expert_bias"] = rnd(E, std=0.1)
    for e in range(E):
        t[f"{m}.experts.{e}.gate_proj.weight"] = rnd(inter, H)
        t[f"{m}.experts.{e}.up_proj.weight"] = rnd(inter, H)
        t[f"{m}.experts.{e}.down_proj.weight"] = rnd(H, inter)
    for proj, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
        t[f"{m}.shared_experts.{proj}.weight"] = rnd(*shape)
    save_file(t, str(path / "mtp.safetensors"))
    main = path / "model.safetensors"
    if main.is_file() and not (path / "model.safetensors.index.json").exists():
        names = list(load_file(str(main)).keys())
        index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in names}}
        index["weight_map"].update({k: "mtp.safetensors" for k in t})
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    raw.pop("num_mtp_layers", None)
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=2))


def make_draft_agree(path: Path, eps: float = 0.05) -> None:
    """Turn a tiny model with an MTP layer into one whose draft mostly agrees with the target.

    Every block's output projection is scaled by `eps`, so each hidden state is close to its token's
    embedding; the MTP layer passes the next token's embedding straight through (eh_proj = [I | 0])
    and shares the main model's final norm weight. The draft then predicts almost exactly what the
    target will, giving high (but not perfect) acceptance.
    """
    main = load_file(str(path / "model.safetensors"))
    mtp = load_file(str(path / "mtp.safetensors"))
    outputs = (".attention.dense.weight", ".attention.o_proj.weight", ".down_proj.weight")
    for tensors in (main, mtp):
        for name in tensors:
            if name.endswith(outputs):
                tensors[name] = tensors[name] * eps
    raw = json.loads((path / "config.json").read_text())
    n, H = raw["num_hidden_layers"], raw["hidden_size"]
    p = f"model.layers.{n}"
    mtp[f"{p}.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    mtp[f"{p}.enorm.weight"] = torch.ones(H)
    mtp[f"{p}.final_layernorm.weight"] = main["model.norm.weight"].clone()
    save_file(main, str(path / "model.safetensors"))
    save_file(mtp, str(path / "mtp.safetensors"))
