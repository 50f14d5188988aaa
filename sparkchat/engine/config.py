"""ModelConfig for Ling-3.0-flash (`model_type: bailing_hybrid`).

Accepts the official release's key names and the aliases transformers writes; derives the per-layer
attention and MLP kinds once, here, so the model code never re-derives them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from sparkchat.engine.errors import ModelError

SUPPORTED = "Ling-3.0-flash (model_type 'bailing_hybrid' with KDA short convs)"

# transformers alias -> official key
_ALIASES = {
    "num_local_experts": "num_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "n_shared_experts": "num_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "num_mtp_layers": "num_nextn_predict_layers",
    "model_max_length": "max_position_embeddings",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}
_REQUIRED = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim",
)
_ALIAS_OF = {official: alias for alias, official in _ALIASES.items()}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no layer count


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# kind -> (test, what a value must be); the fields of each kind are in _FIELD_KINDS
_KINDS: dict[str, tuple[Any, str]] = {
    "pos_int": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "count": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "pos_num": (lambda v: _is_num(v) and v > 0, "a positive number"),
    "num": (_is_num, "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "nums": (lambda v: isinstance(v, list) and all(_is_num(x) for x in v), "a list of numbers"),
    "ids": (lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v), "a token id or a list of them"),
    "pos_ints": (lambda v: isinstance(v, list) and all(_is_int(x) and x > 0 for x in v), "a list of positive integers"),
}
# field -> kind; a trailing "?" allows null (the field's default then applies, or the feature is off)
_FIELD_KINDS: dict[str, str] = {
    **dict.fromkeys((
        "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "intermediate_size", "head_dim", "n_group", "topk_group", "layer_group_size", "short_conv_kernel_size",
        "max_position_embeddings"), "pos_int"),
    **dict.fromkeys(("num_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"), "count"),
    **dict.fromkeys(("rope_theta", "rms_norm_eps", "routed_scaling_factor"), "pos_num"),
    "kda_lower_bound": "num",
    **dict.fromkeys(("norm_topk_prob", "rope_interleave", "kda_safe_gate", "tie_word_embeddings"), "bool"),
    "score_function": "str",
    "num_key_value_heads": "pos_int?", "pad_token_id": "count?", "eos_token_id": "ids",
    "layer_types": "strs?", "mlp_layer_types": "strs?", "rope_scaling": "dict?",
    "expert_swiglu_limit_list": "nums?", "share_expert_swiglu_limit_list": "nums?",
}


def _check_kind(name: str, value: Any, kind: str) -> None:
    """ModelError naming the key (and the alias it may have come from) unless `value` is of `kind`."""
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    test, what = _KINDS[kind]
    if not test(value):
        alias = f" (or {_ALIAS_OF[name]})" if name in _ALIAS_OF else ""
        shown = _shown(value)
        raise ModelError(f"config.json: {name}{alias} must be {what}, not {shown}")


def _shown(value: Any) -> str:
    """A value as config.json spells it (null, "64", true), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_QUANT_KINDS = {"fmt": "str?", "scale_fmt": "str?", "weight_block_size": "pos_ints?",
                "routed_experts_group_size": "pos_int?", "modules_to_not_convert": "strs?", "ignored_layers": "strs?"}


@dataclass
class QuantConfig:
    """The release's `quantization_config` (fp8 block linears + MXFP4 routed experts)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    routed_experts_quant_method: str | None = None
    routed_experts_group_size: int = 32
    modules_to_not_convert: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantConfig":
        for key, kind in _QUANT_KINDS.items():
            if key in d:
                _check_kind(f"quantization_config.{key}", d[key], kind)
        block = d.get("weight_block_size") or [128, 128]
        if len(block) != 2:
            raise ModelError(f"config.json: quantization_config.weight_block_size must hold 2 sizes, not {block!r}")
        method = d.get("quant_method")
        if method != "fp8":
            raise ModelError(f"unsupported quantization_config.quant_method {method!r} (supported: 'fp8')")
        experts = d.get("routed_experts_quant_method")
        if experts not in (None, "mxfp4"):
            raise ModelError(f"unsupported routed_experts_quant_method {experts!r} (supported: 'mxfp4')")
        return cls(
            quant_method=method,
            fmt=d.get("fmt") or "e4m3",
            weight_block_size=(block[0], block[1]),
            scale_fmt=d.get("scale_fmt"),
            routed_experts_quant_method=experts,
            routed_experts_group_size=d.get("routed_experts_group_size") or 32,
            modules_to_not_convert=list(d.get("modules_to_not_convert") or d.get("ignored_layers") or []),
        )


@dataclass
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int = 6144
    head_dim: int = 128  # KDA head dim
    num_key_value_heads: int | None = None
    num_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    first_k_dense_replace: int = 2
    layer_group_size: int = 6
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    q_lora_rank: int | None = None
    rope_theta: float = 6e6
    rope_interleave: bool = True
    rope_scaling: dict[str, Any] | None = None
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    short_conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 131072
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    expert_swiglu_limit_list: list[float] | None = None
    share_expert_swiglu_limit_list: list[float] | None = None
    tie_word_embeddings: bool = False
    quantization: QuantConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if raw.get("model_type") != "bailing_hybrid":
            raise ModelError(f"unsupported model_type {raw.get('model_type')!r}: sparkchat runs {SUPPORTED}")
        d = dict(raw)
        for alias, official in _ALIASES.items():
            if alias in d and official not in d:
                d[official] = d[alias]
        if "short_conv_kernel_size" not in d:
            raise ModelError(f"this bailing_hybrid config has no short convs (Ling-2.6?); sparkchat runs {SUPPORTED}")
        # transformers writes the MLA rope dim into head_dim and the KDA dim into linear_head_dim.
        if "linear_head_dim" in d:
            d["head_dim"] = d["linear_head_dim"]
        for key in ("rope_parameters", "quantization_config"):
            _check_kind(key, d.get(key), "dict?")
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = rope
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ModelError(f"config.json is missing required keys: {', '.join(missing)}")
        eos = d.get("eos_token_id")
        d["eos_token_id"] = [] if eos is None else ([eos] if _is_int(eos) else eos)
        q = d.get("quantization_config")
        d["quantization"] = QuantConfig.from_dict(q) if q else None
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelError(f"model directory not found: {model_dir}")
        if not path.is_file():
            raise ModelError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw)

    def __post_init__(self) -> None:
        for name, kind in _FIELD_KINDS.items():
            _check_kind(name, getattr(self, name), kind)
        n = self.num_hidden_layers
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                "full_attention" if (i + 1) % self.layer_group_size == 0 else "linear_attention" for i in range(n)
            ]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)]
        if len(self.layer_types) != n or len(self.mlp_layer_types) != n:
            raise ModelError("layer_types / mlp_layer_types must have one entry per hidden layer")
        bad = set(self.layer_types) - {"full_attention", "linear_attention"}
        if bad:
            raise ModelError(f"unknown layer types {sorted(bad)}")
        bad = set(self.mlp_layer_types) - {"dense", "sparse"}
        if bad:
            raise ModelError(f"unknown mlp layer types {sorted(bad)}")
        self.expert_swiglu_limit_list = self._limits(self.expert_swiglu_limit_list, "expert_swiglu_limit_list")
        self.share_expert_swiglu_limit_list = self._limits(
            self.share_expert_swiglu_limit_list, "share_expert_swiglu_limit_list"
        )
        self._check_shapes()
        if self.q_lora_rank is not None:
            raise ModelError("q_lora_rank is set; Ling-3.0-flash uses a plain q_proj (q_lora_rank null)")
        if self.score_function != "sigmoid":
            raise ModelError(f"unsupported router score_function {self.score_function!r} (supported: sigmoid)")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("yarn", "default", None):
                raise ModelError(f"unsupported rope_scaling type {kind!r} (supported: yarn)")
            if kind == "yarn":  # the rope tables read these two
                for key in ("factor", "original_max_position_embeddings"):
                    _check_kind(f"rope_scaling.{key}", self.rope_scaling.get(key), "pos_num")

    def _check_shapes(self) -> None:
        """What the router and the rope tables rely on, each a one-line ModelError (the real config,
        512 experts in 8 groups, top-4 groups, 8 per token, rope dim 64, passes)."""
        per_group = self.num_experts // self.n_group
        rules = (
            (self.num_experts % self.n_group == 0,
             f"num_experts {self.num_experts} is not divisible by n_group {self.n_group}"),
            # a group's score is the sum of its two best experts
            (per_group >= 2, f"n_group {self.n_group} leaves fewer than 2 of {self.num_experts} experts per group"),
            (self.topk_group <= self.n_group, f"topk_group {self.topk_group} is more than n_group {self.n_group}"),
            (self.num_experts_per_tok <= self.topk_group * per_group,
             (f"num_experts_per_tok {self.num_experts_per_tok} is more than the {self.topk_group * per_group} "
              f"experts the router keeps (topk_group {self.topk_group} groups of {per_group})")),
            # interleaved RoPE rotates pairs of dims
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim {self.qk_rope_head_dim} must be even"),
        )
        for ok, message in rules:
            if not ok:
                raise ModelError(f"config.json: {message}")

    def _limits(self, values: list[float] | None, name: str) -> list[float]:
        if values is None:
            return [0.0] * self.num_hidden_layers
        if len(values) < self.num_hidden_layers:
            raise ModelError(f"{name} has {len(values)} entries for {self.num_hidden_layers} layers")
        return [float(v) for v in values[: self.num_hidden_layers]]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0
