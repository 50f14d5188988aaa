"""Safetensors → LingModel. Checkpoint names are translated here and nowhere else.

Three weight forms: plain (BF16/FP16/FP32); the fp4 release (FP8 e4m3 + 128×128 block scales for the
non-expert linears, MXFP4 routed experts); and plain experts quantized to MXFP4 while loading, one
expert at a time, so the BF16 release fits in memory. Tensors go straight to the target device.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from sparkchat.engine.checkpoint import DTYPE_BYTES, CheckpointReader
from sparkchat.engine.config import ModelConfig
from sparkchat.engine.errors import ModelError
from sparkchat.engine.model import LingModel
from sparkchat.engine.nn.kda import KimiDeltaAttention
from sparkchat.engine.nn.linear import Linear
from sparkchat.engine.nn.mla import MultiLatentAttention
from sparkchat.engine.nn.moe import MLP, Experts, MoE

Progress = Callable[[int, int], None]  # (checkpoint bytes read, bytes to read), after each layer

_FP8_DTYPES = {"F8_E4M3"}
_MXFP4_DTYPES = {"U8", "I8"}


class _Loader:
    def __init__(self, reader: CheckpointReader, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 quantize_experts: bool) -> None:
        self.r, self.cfg, self.device, self.dtype = reader, cfg, device, dtype
        self.quantize_experts = quantize_experts
        q = cfg.quantization
        self.block = tuple(q.weight_block_size) if q else (128, 128)

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.r.get(name, shape).to(dtype or self.dtype)

    def param(self, p: torch.nn.Parameter, name: str, fp32: bool = False) -> None:
        p.data = self.plain(name, tuple(p.shape), torch.float32 if fp32 else self.dtype)

    def linear(self, lin: Linear, prefix: str) -> None:
        name = f"{prefix}.weight"
        info = self.r.info(name)
        shape = (lin.out_features, lin.in_features)
        if info.dtype in _FP8_DTYPES:
            w = self.r.get(name, shape)
            scale = self._block_scale(f"{prefix}.weight_scale_inv", shape)
            lin.set_weight(w, scale, self.block)
        else:
            lin.set_weight(self.plain(name, shape))

    def _block_scale(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        b0, b1 = self.block
        grid = (-(-shape[0] // b0), -(-shape[1] // b1))
        s = self.r.get(name, grid)
        if s.dtype == torch.uint8:  # E8M0 exponents
            from sparkchat.engine.quant import e8m0_to_float

            return e8m0_to_float(s)
        return s.float()

    def norm(self, norm: torch.nn.Module, name: str) -> None:
        self.param(norm.weight, name)

    def kda(self, a: KimiDeltaAttention, p: str) -> None:
        for proj in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj"):
            self.linear(getattr(a, proj), f"{p}.{proj}")
        self.linear(a.o_proj, f"{p}.o_proj" if f"{p}.o_proj.weight" in self.r else f"{p}.dense")
        D, K = a.heads * a.head_dim, a.conv_size
        if f"{p}.conv1d.weight" in self.r:
            a.conv_weight.data = self.plain(f"{p}.conv1d.weight", (3 * D, 1, K), torch.float32).view(3 * D, K)
        else:
            a.conv_weight.data = torch.cat(
                [self.plain(f"{p}.{n}_conv1d.weight", (D, 1, K), torch.float32).view(D, K) for n in "qkv"])
        self.param(a.A_log, f"{p}.A_log", fp32=True)
        self.param(a.dt_bias, f"{p}.dt_bias", fp32=True)
        self.param(a.o_norm_weight, f"{p}.o_norm.weight")

    def mla(self, a: MultiLatentAttention, p: str) -> None:
        for proj in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "dense", "g_proj"):
            self.linear(getattr(a, proj), f"{p}.{proj}")
        self.norm(a.kv_a_layernorm, f"{p}.kv_a_layernorm.weight")
        a.kv_b_proj.cache_dense = True  # absorbed decode reads it as a plain matrix every step

    def mlp(self, m: MLP, p: str) -> None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            self.linear(getattr(m, proj), f"{p}.{proj}")

    def moe(self, m: MoE, p: str) -> None:
        # The router computes in fp32; a BF16 checkpoint's weight stays BF16 (upcast exactly as it is
        # read), halving the 105 MB per token the 40 routers stream.
        name = f"{p}.gate.weight"
        bf16 = self.r.info(name).dtype == "BF16" and self.dtype == torch.bfloat16
        m.gate.weight.data = self.plain(name, tuple(m.gate.weight.shape), torch.bfloat16 if bf16 else torch.float32)
        self.param(m.gate.expert_bias, f"{p}.gate.expert_bias", fp32=True)
        self.experts(m.experts, f"{p}.experts")
        if m.shared_experts is not None:
            self.mlp(m.shared_experts, f"{p}.shared_experts")

    def experts(self, ex: Experts, p: str) -> None:
        E, H, I = ex.num_experts, ex.hidden, ex.inter
        mxfp4_ckpt = self.r.info(f"{p}.0.gate_proj.weight").dtype in _MXFP4_DTYPES
        if mxfp4_ckpt or self.quantize_experts:
            ex.w13 = torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=self.device)
            ex.w13_scale = torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=self.device)
            ex.w2 = torch.empty(E, H, I // 2, dtype=torch.uint8, device=self.device)
            ex.w2_scale = torch.empty(E, H, I // 32, dtype=torch.uint8, device=self.device)
        else:
            ex.w13 = torch.empty(E, 2 * I, H, dtype=self.dtype, device=self.device)
            ex.w2 = torch.empty(E, H, I, dtype=self.dtype, device=self.device)
        for e in range(E):
            rows = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I)}
            for proj, shape, dst, dst_scale, sl in (
                ("gate_proj", (I, H), ex.w13, ex.w13_scale, rows["gate_proj"]),
                ("up_proj", (I, H), ex.w13, ex.w13_scale, rows["up_proj"]),
                ("down_proj", (H, I), ex.w2, ex.w2_scale, slice(0, H)),
            ):
                name = f"{p}.{e}.{proj}"
                if mxfp4_ckpt:  # straight into the expert's rows: no tensor of its own on the device
                    self._read_expert(f"{name}.weight", (shape[0], shape[1] // 2), dst[e, sl])
                    self._read_expert(self._expert_scale_name(name), (shape[0], shape[1] // 32), dst_scale[e, sl])
                elif self.quantize_experts:
                    from sparkchat.engine.quant import quant_mxfp4

                    blocks, scales = quant_mxfp4(self.r.get(f"{name}.weight", shape).to(self.device))
                    dst[e, sl], dst_scale[e, sl] = blocks, scales
                else:
                    dst[e, sl] = self.plain(f"{name}.weight", shape)

    def _expert_scale_name(self, name: str) -> str:
        return f"{name}.weight_scale_inv" if f"{name}.weight_scale_inv" in self.r else f"{name}.weight_scale"

    def _read_expert(self, name: str, shape: tuple[int, int], dst: torch.Tensor) -> None:
        info = self.r.info(name)
        if info.shape != shape or DTYPE_BYTES.get(info.dtype) != 1:
            raise ModelError(f"tensor {name} in {info.file.name} is {info.dtype} {list(info.shape)}, "
                             f"the config needs one byte per entry in {list(shape)}")
        self.r.read_into(name, dst)


def _check_expert_dims(cfg: ModelConfig) -> None:
    if cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32:
        raise ModelError("MXFP4 experts need hidden_size and moe_intermediate_size divisible by 32")


_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def resident_bytes(reader: CheckpointReader, dtype: torch.dtype, quantize_experts: bool) -> int:
    """What the loaded weights will occupy: plain tensors take the compute dtype (fp32 router and
    KDA parameters aside, which are small), FP8/MXFP4 ones stay as stored, plain experts quantized
    while loading shrink to 4.25 bits per weight."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for name, info in reader.tensors.items():
        n = 1
        for d in info.shape:
            n *= d
        stored = DTYPE_BYTES.get(info.dtype, 4)
        if info.dtype in _FP8_DTYPES or info.dtype in _MXFP4_DTYPES:
            total += n * stored
        elif quantize_experts and _EXPERT.search(name):
            total += n * 17 // 32  # 4 bits + an 8-bit scale per 32 weights
        else:
            total += n * size
    return total


def context_bytes(cfg: ModelConfig, max_context: int, dtype: torch.dtype) -> int:
    """What a conversation of max_context positions adds to the weights: its caches and states, and the
    rotary tables."""
    from sparkchat.engine.nn.rope import RotaryEmbedding
    from sparkchat.engine.state import ConversationState

    return (ConversationState.bytes_needed(cfg, max_context, dtype)
            + RotaryEmbedding.table_bytes(cfg.qk_rope_head_dim, max_context))


def check_memory(needed: int, available: int, device: torch.device, unified: bool = False,
                 context: tuple[int, int] | None = None) -> None:
    """ModelError unless `needed` bytes fit in `available`. context = (positions, bytes of them) when
    `needed` includes a conversation's caches: where they are a good part of it, the message says so."""
    if needed > available:
        where = "unified (CPU and GPU)" if unified else "GPU" if device.type == "cuda" else "system"
        part, fix = "", "close other programs or use a smaller model"
        if context is not None and 8 * context[1] >= needed:
            part = f" (a {context[0]:,}-token context: {context[1] / 2**30:.1f} GiB of it)"
            fix = "close other programs, use a smaller model or a shorter context (--max-context)"
        raise ModelError(f"the model needs {needed / 2**30:.1f} GiB{part} but only {available / 2**30:.1f} GiB of "
                         f"{where} memory is free: {fix}")


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, max_context: int = 4096,
               quantize_experts: bool = False, progress: Progress | None = None,
               available_memory: int | None = None) -> LingModel:
    """Build the model and fill it from the checkpoint, tensor by tensor, on `device`.

    If the config promises an MTP layer that the checkpoint lacks, the model loads without one
    (speculative decoding then reports itself unavailable).
    """
    from sparkchat.engine.capabilities import is_unified_memory

    device = torch.device(device)
    unified = is_unified_memory(device)
    # on shared memory the page cache of what was read is a second copy of the weights: drop it
    reader = CheckpointReader(model_dir, device, drop_page_cache=unified)
    if available_memory is None:
        from sparkchat.engine.capabilities import available_memory_bytes

        available_memory = available_memory_bytes()
    # checked before any weight moves: on the Spark's unified memory a failed load would squeeze the OS;
    # a conversation's caches count too (a config promising 10^9 positions would otherwise be OOM-killed)
    ctx = context_bytes(cfg, max_context, dtype)
    check_memory(resident_bytes(reader, dtype, quantize_experts) + ctx, available_memory, device, unified,
                 context=(max_context, ctx))
    if quantize_experts:
        _check_expert_dims(cfg)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}"
    if cfg.has_mtp and f"{mtp_prefix}.eh_proj.weight" not in reader:
        cfg.num_nextn_predict_layers = 0
    model = LingModel(cfg, max_context, device)
    ld = _Loader(reader, cfg, device, dtype, quantize_experts)
    H, V = cfg.hidden_size, cfg.vocab_size

    def report() -> None:
        if progress:
            progress(reader.bytes_read, reader.bytes_total)

    model.embed = ld.plain("model.word_embeddings.weight", (V, H))
    report()
    for layer in model.layers:
        p = f"model.layers.{layer.idx}"
        ld.norm(layer.input_layernorm, f"{p}.input_layernorm.weight")
        ld.norm(layer.post_attention_layernorm, f"{p}.post_attention_layernorm.weight")
        (ld.mla if layer.is_mla else ld.kda)(layer.attention, f"{p}.attention")
        (ld.moe if isinstance(layer.mlp, MoE) else ld.mlp)(layer.mlp, f"{p}.mlp")
        report()
    ld.norm(model.norm, "model.norm.weight")
    model.lm_head.weight = ld.plain("lm_head.weight", (V, H))
    report()
    if model.mtp is not None:
        m, p = model.mtp, mtp_prefix
        for n in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
            ld.norm(getattr(m, n), f"{p}.{n}.weight")
        ld.linear(m.eh_proj, f"{p}.eh_proj")
        ld.mla(m.attention, f"{p}.attention")
        ld.moe(m.mlp, f"{p}.mlp")
    reader.close()
    if progress:  # done: a tensor the model has no use for (an MTP layer the config leaves out) stays unread
        progress(reader.bytes_read, reader.bytes_read)
    model.fuse_projections()
    return model.to(device)
