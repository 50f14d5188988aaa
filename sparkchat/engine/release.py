"""Export a plain Ling state dict to the fp4 release format, and write it as a checkpoint.

The format (see /work/shared/ling3-flash.md, "The fp4 release format"):
- routed experts `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` -> MXFP4:
  `weight` uint8 [out, in/2] + E8M0 uint8 scales [out, in/32] under `weight_scale_inv`
  (or `weight_scale`, vLLM's name);
- every other linear (`*_proj`, `kv_a_proj_with_mqa`, `dense`) -> FP8 e4m3 `weight` + one scale per
  128x128 block in `weight_scale_inv` (float32 powers of two, or uint8 E8M0 codes);
- left as they are: `lm_head`, `model.word_embeddings`, norms, the router (`mlp.gate.weight`,
  `mlp.gate.expert_bias`), `A_log`, `dt_bias`, the short convs and `b_proj`.

Used to build tiny fp4 test models and to check the loader against the format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sparkchat.engine.quant import MXFP4_GROUP, float_to_e8m0, quant_fp8_block, quant_mxfp4

FP8_BLOCK = (128, 128)
SCALE_FMTS = ("ue8m0", "e8m0_uint8", "float32")
EXPERT_SCALE_NAMES = ("weight_scale_inv", "weight_scale")

_ROUTED_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_FP8_MODULE = re.compile(r"(_proj|_proj_with_mqa|^dense)$")


def tensor_kind(name: str, shape: tuple[int, ...] | torch.Size) -> str:
    """How the release stores a tensor: "mxfp4" (routed experts), "fp8" (other linears) or "keep"."""
    if _ROUTED_EXPERT.match(name):
        return "mxfp4"
    if not name.endswith(".weight") or len(shape) != 2:
        return "keep"  # biases, A_log, dt_bias, expert_bias, 1-D norms, 3-D convs
    module = name[: -len(".weight")]
    leaf = module.rsplit(".", 1)[-1]
    if (module in ("lm_head", "model.word_embeddings") or "norm" in leaf or leaf == "b_proj"
            or leaf.endswith("_conv1d") or module.endswith(".mlp.gate")):
        return "keep"
    return "fp8" if _FP8_MODULE.search(leaf) else "keep"


def to_release_format(tensors: dict[str, Tensor], *, scale_fmt: str = "ue8m0",
                      expert_scale_name: str = "weight_scale_inv") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Plain weights (official Ling names) -> (release tensors, `quantization_config`).

    scale_fmt for the FP8 linears: "ue8m0" float32 power-of-two scales (the release), "e8m0_uint8"
    the same scales as uint8 E8M0 codes (as some ports store them), "float32" unrounded amax/448.
    expert_scale_name: "weight_scale_inv" (the release) or "weight_scale" (vLLM's naming).
    The input dict is not modified; tensors left as they are appear in the output unchanged.
    """
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if expert_scale_name not in EXPERT_SCALE_NAMES:
        raise ValueError(f"expert_scale_name must be one of {EXPERT_SCALE_NAMES}, got {expert_scale_name!r}")
    out: dict[str, Tensor] = {}
    not_converted: list[str] = []
    for name, w in tensors.items():
        kind = tensor_kind(name, w.shape)
        prefix = name[: -len("weight")]  # "....gate_proj." for the scale's name
        if kind == "mxfp4":
            if w.ndim != 2 or w.shape[-1] % MXFP4_GROUP:
                raise ValueError(f"{name}: routed-expert weight {tuple(w.shape)} needs a 2-D shape with "
                                 f"an input dim that is a multiple of {MXFP4_GROUP}")
            blocks, scales = quant_mxfp4(w)
            out[name] = blocks
            out[prefix + expert_scale_name] = scales
        elif kind == "fp8":
            q, scale = quant_fp8_block(w, FP8_BLOCK, "float32" if scale_fmt == "float32" else "ue8m0")
            out[name] = q
            out[prefix + "weight_scale_inv"] = float_to_e8m0(scale) if scale_fmt == "e8m0_uint8" else scale
        else:
            out[name] = w
            if name.endswith(".weight") and w.ndim == 2:
                not_converted.append(name[: -len(".weight")])  # lm_head, embeddings, router, b_proj
    qcfg: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
        "routed_experts_quant_method": "mxfp4",
        "routed_experts_group_size": MXFP4_GROUP,
        "modules_to_not_convert": not_converted,
    }
    if scale_fmt != "float32":
        qcfg["scale_fmt"] = "ue8m0"  # power-of-two scales, whichever way they are stored
    return out, qcfg


def save_safetensors_shards(model_dir: str | Path, tensors: dict[str, Tensor],
                            shard_max_bytes: int | None = None) -> list[Path]:
    """Write tensors as `model.safetensors`, or, with shard_max_bytes, as
    `model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json`.

    A module's tensors (`x.weight`, `x.weight_scale_inv`) stay in one shard; a module bigger than
    shard_max_bytes gets a shard of its own. Returns the files written.
    """
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    if shard_max_bytes is None:
        path = model_dir / "model.safetensors"
        save_file(host, str(path), metadata=meta)
        return [path]
    if shard_max_bytes <= 0:
        raise ValueError(f"shard_max_bytes must be positive, got {shard_max_bytes}")

    # Group names by module, in first-seen order, then pack modules greedily into shards.
    modules: dict[str, list[str]] = {}
    for name in host:
        modules.setdefault(name.rsplit(".", 1)[0], []).append(name)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for names in modules.values():
        size = sum(host[n].numel() * host[n].element_size() for n in names)
        if shards[-1] and shard_bytes + size > shard_max_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].extend(names)
        shard_bytes += size

    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: host[n] for n in names}, str(model_dir / fname), metadata=meta)
        weight_map.update({n: fname for n in names})
        paths.append(model_dir / fname)
    total = sum(t.numel() * t.element_size() for t in host.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path = model_dir / "model.safetensors.index.json"
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return [*paths, index_path]


def save_release_checkpoint(model_dir: str | Path, tensors: dict[str, Tensor], config_dict: dict[str, Any],
                            shard_max_bytes: int | None = None, *,
                            quantization_config: dict[str, Any] | None = None, scale_fmt: str = "ue8m0",
                            expert_scale_name: str = "weight_scale_inv") -> dict[str, Any]:
    """Write an fp4-release checkpoint: safetensors (sharded when shard_max_bytes is given) and
    config.json = config_dict + `quantization_config`.

    tensors: plain weights, converted here with to_release_format(scale_fmt, expert_scale_name); or,
    when quantization_config is given, tensors already in release format, written as they are.
    Returns the config written.
    """
    if quantization_config is None:
        tensors, quantization_config = to_release_format(
            tensors, scale_fmt=scale_fmt, expert_scale_name=expert_scale_name)
    save_safetensors_shards(model_dir, tensors, shard_max_bytes)
    config = {**config_dict, "quantization_config": quantization_config}
    (Path(model_dir) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
