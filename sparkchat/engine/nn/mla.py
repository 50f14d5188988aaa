"""Gated multi-head latent attention (MLA): 7 of the 42 layers, and the MTP layer's attention.

Only the latent c (kv_lora_rank values) and the shared rope key (rope dims) are cached per token.
Prefill expands the latents to per-head keys and values; decode and verify use the absorbed form,
folding kv_b_proj's key half into q and its value half after attention, so they read only the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparkchat.engine.nn.linear import FusedLinear, Linear, project
from sparkchat.engine.nn.norm import RMSNorm
from sparkchat.engine.nn.ops import ops, register, rms_norm
from sparkchat.engine.nn.rope import RotaryEmbedding, apply_rope_interleaved


@dataclass
class Span:
    """Where T new tokens sit: their positions (a device tensor, so a CUDA graph can replay the step at
    any position) and how many cache rows attention reads (fixed per graph: a context bucket)."""

    pos: torch.Tensor  # [T] int64
    attend: int
    start: int | None = None  # the first position when pos is start, start + 1, …, attend - 1 (known on the host)

    @classmethod
    def contiguous(cls, start: int, count: int, device: torch.device | str) -> "Span":
        return cls(torch.arange(start, start + count, device=device), start + count, start)


@dataclass
class MLACache:
    latent: torch.Tensor  # [max_ctx, kv_lora_rank]
    rope_key: torch.Tensor  # [max_ctx, qk_rope_head_dim]


class MultiLatentAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, nope: int, rope: int, v_dim: int, rank: int, eps: float) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.rank = heads, nope, rope, v_dim, rank
        self.q_proj = Linear(hidden, heads * (nope + rope))
        self.kv_a_proj_with_mqa = Linear(hidden, rank + rope)
        self.kv_a_layernorm = RMSNorm(rank, eps)
        self.kv_b_proj = Linear(rank, heads * (nope + v_dim))
        self.dense = Linear(heads * v_dim, hidden)
        self.g_proj = Linear(hidden, heads)
        self.softmax_scale = (nope + rope) ** -0.5
        self.fused: FusedLinear | None = None  # q_proj|kv_a_proj_with_mqa|g_proj, set at load time
        # absorbed_step's job (same arguments): the Triton kernels on CUDA (fastpath.install), else None
        self.fast_step: Callable[..., torch.Tensor] | None = None

    def input_projections(self) -> list[Linear]:
        return [self.q_proj, self.kv_a_proj_with_mqa, self.g_proj]

    @property
    def out_proj(self) -> Linear:
        return self.dense

    def forward(self, x: torch.Tensor, span: Span, cache: MLACache, rotary: RotaryEmbedding,
                absorbed: bool, project_out: bool = True) -> torch.Tensor:
        """[T, hidden]; with project_out=False, out_proj's input instead."""
        T = x.shape[0]
        h = self.heads
        q, kv_a, g = project(self.fused, self.input_projections(), x)
        norm = self.kv_a_layernorm
        scale = self.softmax_scale * rotary.softmax_mscale
        w_kv = self.kv_b_proj.dense_weight(x.dtype).view(h, self.nope + self.v_dim, self.rank)
        if absorbed:
            step = self.fast_step or absorbed_step
            o = step(q, kv_a, g, rotary.cos, rotary.sin, span.pos, cache.latent, cache.rope_key, norm.weight,
                     norm.eps, w_kv, span.attend, scale, self.nope)
            return self.dense(o) if project_out else o
        # prefill lengths vary: not compiled
        q_nope, q_rope, gate = mla_prepare(q, kv_a, g, rotary.cos, rotary.sin, span.pos, cache.latent,
                                           cache.rope_key, norm.weight, norm.eps, h, self.nope, self.rope, self.rank)
        end = span.attend
        C, KR = cache.latent[:end], cache.rope_key[:end]
        kv = (C @ w_kv.reshape(-1, self.rank).T).view(end, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, KR.unsqueeze(1).expand(end, h, self.rope)], dim=-1)
        qh = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [h, T, d]
        o = prefill_attention(qh, k.transpose(0, 1), v.transpose(0, 1), span, scale).transpose(0, 1)
        o = (o * gate.unsqueeze(-1)).reshape(T, h * self.v_dim)
        return self.dense(o) if project_out else o


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: Span, scale: float) -> torch.Tensor:
    """q [h, T, d], k [h, S, d], v [h, S, dv] -> [h, T, dv]: query t, at position span.pos[t], attends to
    keys 0 .. pos[t] (cache rows past it, stale or unused, are masked). Given 4-D, SDPA runs a fused
    kernel (3-D inputs go to its fp32 math path: 53x slower for an 8K prompt on the H200); a prompt from
    position 0 is plain causal attention, the cheapest form."""
    S = k.shape[1]
    if span.start == 0 and q.shape[1] == S:
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale)
    else:
        mask = torch.arange(S, device=q.device)[None, :] <= span.pos[:, None]
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)
    return o[0]


def absorbed_step(q: torch.Tensor, kv_a: torch.Tensor, g: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, pos: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                  norm_w: torch.Tensor, eps: float, w_kv: torch.Tensor, attend: int, scale: float,
                  nope: int) -> torch.Tensor:
    """A decode/verify step's attention after the input projections, in the absorbed form (the twin of
    kernels.mla_decode.mla_decode_step): prepare (writing the caches at pos), attend over the first
    `attend` cache rows with query t seeing rows 0..pos[t], gate. Returns out_proj's input [T, heads*v]."""
    T = q.shape[0]
    heads, rank = w_kv.shape[0], w_kv.shape[2]
    rope = rope_cache.shape[1]
    q_nope, q_rope, gate = ops.mla_prepare(q, kv_a, g, cos_table, sin_table, pos, latent_cache, rope_cache, norm_w,
                                           eps, heads, nope, rope, rank)
    mask = torch.arange(attend, device=q.device)[None, :] <= pos[:, None]
    o = ops.mla_absorbed(q_nope, q_rope, latent_cache[:attend], rope_cache[:attend], w_kv, mask, scale, nope)
    return (o * gate.unsqueeze(-1)).reshape(T, -1)


@register
def mla_prepare(q: torch.Tensor, kv_a: torch.Tensor, g: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, pos: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                norm_w: torch.Tensor, eps: float, heads: int, nope: int, rope: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything between the input projections and attention: split q, RMSNorm the latent, RoPE on
    the query's and the shared key's rope dims, write the latent and rope key into the cache at `pos`,
    and the per-head output gate. Returns (q_nope, q_rope [T, heads, ·], gate [T, heads])."""
    T = q.shape[0]
    q_nope, q_rope = q.reshape(T, heads, nope + rope).split([nope, rope], dim=-1)
    latent, k_rope = kv_a.split([rank, rope], dim=-1)
    latent = rms_norm(latent, norm_w, eps)
    cos, sin = cos_table[pos], sin_table[pos]
    q_rope = apply_rope_interleaved(q_rope, cos, sin)
    k_rope = apply_rope_interleaved(k_rope.unsqueeze(1), cos, sin).squeeze(1)
    latent_cache.index_copy_(0, pos, latent)
    rope_cache.index_copy_(0, pos, k_rope)
    gate = torch.sigmoid(g.float()).to(q.dtype)  # one gate per head
    return q_nope, q_rope, gate


@register
def mla_absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, C: torch.Tensor, KR: torch.Tensor, w_kv: torch.Tensor,
                 mask: torch.Tensor, scale: float, nope: int) -> torch.Tensor:
    """Attention over the latent cache without expanding it: fold kv_b_proj's key half into q, attend
    over c (plus the shared rope key), unfold with its value half. Returns [T, heads, v_dim]."""
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [h, nope, r], [h, v, r]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    scores = torch.einsum("thr,lr->thl", q_latent, C) + torch.einsum("thp,lp->thl", q_rope, KR)
    scores = (scores * scale).masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
    return torch.einsum("thr,hvr->thv", torch.einsum("thl,lr->thr", probs, C), w_uv)
