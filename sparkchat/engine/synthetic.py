"""Synthetic weights at Ling-3.0-flash-fp4's real shapes, made directly on the device (no files):
FP8 block-scaled linears, MXFP4 routed experts, BF16 embedding and head. For speed measurements only —
the numbers they produce mean nothing, the bytes they move are the real model's."""

from __future__ import annotations

import math
from typing import Any

import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.model import LingModel
from sparkchat.engine.nn.kda import KimiDeltaAttention
from sparkchat.engine.nn.linear import Linear
from sparkchat.engine.nn.moe import Experts, Router

# The official Ling-3.0-flash-fp4 config (ling3-flash.md), as the release writes it.
LING3_FLASH: dict[str, Any] = {
    "model_type": "bailing_hybrid", "hidden_size": 2560, "num_hidden_layers": 42, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 157184, "layer_group_size": 6,
    "first_k_dense_replace": 2, "intermediate_size": 6144, "num_experts": 512, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "moe_intermediate_size": 768, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 6e6,
    "kda_safe_gate": True, "kda_lower_bound": -5.0, "short_conv_kernel_size": 4, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 131072, "eos_token_id": 156895,
    "pad_token_id": 156892,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                            "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32},
}


def synthetic_config(layers: int | None = None, base: dict[str, Any] | None = None) -> ModelConfig:
    raw = dict(base or LING3_FLASH)
    if layers is not None:
        raw["num_hidden_layers"] = layers
        raw.pop("layer_types", None)
        raw.pop("mlp_layer_types", None)
    return ModelConfig.from_dict(raw)


def _fill_linear(lin: Linear, g: torch.Generator, device: torch.device, dtype: torch.dtype, fp8: bool) -> None:
    out, inp = lin.out_features, lin.in_features
    w = torch.randn(out, inp, device=device, dtype=torch.bfloat16, generator=g)
    if not fp8:
        lin.set_weight((w * inp ** -0.5).to(dtype))
        return
    scale = 2.0 ** -round(math.log2(math.sqrt(inp)))  # keeps activations O(1) layer after layer
    grid = (-(-out // 128), -(-inp // 128))
    lin.set_weight(w.to(torch.float8_e4m3fn), torch.full(grid, scale, device=device))


def _fill_experts(ex: Experts, g: torch.Generator, device: torch.device) -> None:
    E, H, I = ex.num_experts, ex.hidden, ex.inter
    ex.w13 = torch.randint(0, 256, (E, 2 * I, H // 2), device=device, dtype=torch.uint8, generator=g)
    ex.w2 = torch.randint(0, 256, (E, H, I // 2), device=device, dtype=torch.uint8, generator=g)
    # E2M1 magnitudes average ~2.3: a scale of 2^-(log2(sqrt(in)) + 1) keeps outputs O(1)
    ex.w13_scale = torch.full((E, 2 * I, H // 32), 127 - round(math.log2(math.sqrt(H))) - 1, device=device,
                              dtype=torch.uint8)
    ex.w2_scale = torch.full((E, H, I // 32), 127 - round(math.log2(math.sqrt(I))) - 1, device=device,
                             dtype=torch.uint8)


@torch.inference_mode()
def build_synthetic(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                    max_context: int = 4096, seed: int = 0) -> LingModel:
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    model = LingModel(cfg, max_context, device).to(device)
    H, V = cfg.hidden_size, cfg.vocab_size
    model.embed = (torch.randn(V, H, device=device, dtype=torch.bfloat16, generator=g)).to(dtype)
    model.lm_head.weight = (torch.randn(V, H, device=device, dtype=torch.bfloat16, generator=g) * H ** -0.5).to(dtype)
    from sparkchat.engine.nn.norm import RMSNorm

    b_projs = {id(m.b_proj) for m in model.modules() if isinstance(m, KimiDeltaAttention)}
    for m in model.modules():
        if isinstance(m, Linear):
            _fill_linear(m, g, device, dtype, fp8=id(m) not in b_projs)  # the release keeps b_proj BF16
        elif isinstance(m, Experts):
            _fill_experts(m, g, device)
        elif isinstance(m, Router):
            m.weight.data = torch.randn(m.weight.shape, device=device, generator=g).mul_(H ** -0.5).to(
                torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)  # the release's routers are BF16
            m.expert_bias.zero_()
        elif isinstance(m, KimiDeltaAttention):
            m.A_log.copy_(torch.empty_like(m.A_log).uniform_(1, 16, generator=g).log())
            m.dt_bias.normal_(-4, 1, generator=g)
            m.conv_weight.normal_(0, 0.5, generator=g)
            m.o_norm_weight.data = torch.ones_like(m.o_norm_weight, dtype=dtype)
        elif isinstance(m, RMSNorm):
            m.weight.data = torch.ones_like(m.weight, dtype=dtype)
    from sparkchat.engine.nn.mla import MultiLatentAttention

    for m in model.modules():
        if isinstance(m, MultiLatentAttention):
            m.kv_b_proj.cache_dense = True  # as the loader does
    model.fuse_projections()
    return model
