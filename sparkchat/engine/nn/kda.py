"""Kimi Delta Attention (KDA): the linear-attention layer of 35 of Ling-3.0-flash's 42 layers.

Per head, a fp32 state S ∈ R^{dk×dv} is decayed per key channel, corrected by the delta rule and
read by q. Decode runs the recurrence token by token; prefill uses the chunked form (kda_chunked).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparkchat.engine.kernels.kda_prefill import FLA_HEAD_DIMS, fla_chunk_kda, kda_prefill
from sparkchat.engine.nn.linear import FusedLinear, Linear, project
from sparkchat.engine.nn.norm import gated_rms_norm
from sparkchat.engine.nn.ops import ops, register


@dataclass
class KDAState:
    conv: torch.Tensor  # [K-1, 3D]: the last K-1 pre-conv q|k|v inputs
    recurrent: torch.Tensor  # [heads, dk, dv] fp32


@dataclass
class KDASteps:
    """What a verify keeps so the recurrent state can be advanced to any of its positions afterwards.

    A step with keep_steps leaves the layer's recurrent state as it found it; committing (ConversationState
    .commit_kda) then runs the delta rule from it over the kept inputs of the positions accepted. Keeping
    the inputs rather than a state per position spares a verify its largest writes (a 4-token verify wrote
    three 2 MiB states a layer; the inputs are 8 KiB a position)."""

    window: torch.Tensor  # [K-1+T, 3D] conv inputs: the old conv state then the T new inputs
    # [T, heads, 4, d] fp32: each position's delta-rule inputs, k (L2-normed), v (after the conv), the
    # gate g and beta (repeated along the last axis), exactly as the recurrence used them
    inputs: torch.Tensor


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One position of the recurrence: S [h, dk, dv] decayed by e^g per key channel, then corrected
    toward v along k. k, g: [h, dk]; v: [h, dv]; beta: [h]. The verify and the commit both run this."""
    S = S * g.exp().unsqueeze(-1)
    kv_mem = torch.einsum("hkv,hk->hv", S, k)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return S + k.unsqueeze(-1) * delta.unsqueeze(-2)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, keep_steps: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The delta-rule recurrence, in fp32. q,k,g: [T, h, dk] (q,k already L2-normed, q scaled);
    v: [T, h, dv]; beta: [T, h]; state: [h, dk, dv]. Returns (o [T, h, dv], final state, with keep_steps
    the inputs [T, h, 4, d] as KDASteps keeps them; dk == dv then)."""
    T = q.shape[0]
    o = q.new_empty(T, q.shape[1], v.shape[-1])
    S = state
    for t in range(T):
        S = delta_rule_step(S, k[t], v[t], g[t], beta[t])
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    if not keep_steps:
        return o, S, None
    inputs = torch.stack([k, v, g, beta.unsqueeze(-1).expand_as(k)], dim=2).float().contiguous()
    return o, S, inputs


def commit_steps(recurrent: torch.Tensor, inputs: torch.Tensor, last: int) -> None:
    """Advance `recurrent` [h, dk, dv] in place over kept positions 0 .. last (KDASteps.inputs): the state a
    step of last + 1 tokens would have left. The twin of kernels/kda_commit.py."""
    S = recurrent
    for t in range(last + 1):
        k, v, g, beta = inputs[t].unbind(1)
        S = delta_rule_step(S, k, v, g, beta[:, 0])
    recurrent.copy_(S)


def chunk_group(device: torch.device, heads: int, dk: int, chunk: int = 32) -> int:
    """Chunks kda_chunked handles at once: as many as keep one group's decays [heads, chunk, chunk, dk] fp32
    within ~256 MB on a GPU (16 at Ling's 32 heads × 128: fewer launches is what counts there) and ~8 MB
    on a CPU (cache-sized tensors are what counts there). SPARKCHAT_KDA_CHUNK_GROUP overrides (A/B)."""
    forced = os.environ.get("SPARKCHAT_KDA_CHUNK_GROUP")
    if forced:
        return max(1, int(forced))
    budget = (256 if device.type == "cuda" else 8) << 20
    return max(1, min(64, budget // (heads * chunk * chunk * dk * 4)))


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = 32, group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence computed chunk by chunk (matrix products inside a chunk), for prefill.

    Within a chunk, with cumulative log-decays G_t (per key channel), the delta rule becomes a unit
    lower-triangular system (I + A) U = β ⊙ (V − (K⊙e^G) S0), A_ts = β_t Σ_c k_tc k_sc e^{G_tc − G_sc} (s < t).
    Decays enter only as differences G_t − G_s ≤ 0, so nothing overflows however long the chunk.
    The system is linear in S0: U = U_v − W S0 with U_v = (I + A)⁻¹ β V and W = (I + A)⁻¹ β (K⊙e^G), and
    neither depends on the state — so everything but the state's pass from chunk to chunk (four small
    matrix products a chunk) can be computed for `group` chunks at once: on a GPU ~15 launches a chunk
    become a few a group (chunk_group() sizes the groups).
    """
    T, h, dk = k.shape
    dv = v.shape[-1]
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, h, ...] -> [h, n, chunk, ...]; zero rows change nothing
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x
        return x.reshape(n, chunk, h, *x.shape[2:]).transpose(0, 2).transpose(1, 2)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)  # [h, n, C, d]
    bc = chunks(beta.unsqueeze(-1))  # [h, n, C, 1]
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device))
    strict = torch.eye(chunk, dtype=torch.bool, device=q.device)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    parts = []
    for c0 in range(0, n, group):  # the state-free work, `group` chunks at a time (bounded memory)
        sl = slice(c0, min(c0 + group, n))
        qg, kg, vg, bg = qc[:, sl], kc[:, sl], vc[:, sl], bc[:, sl]
        G = gc[:, sl].cumsum(2)  # [h, m, C, dk]
        diff = G.unsqueeze(3) - G.unsqueeze(2)  # [h, m, t, s, dk] = G_t - G_s
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()  # zero above the diagonal
        A = torch.einsum("hmtc,hmsc,hmtsc->hmts", kg, kg, decay).masked_fill(strict, 0) * bg
        P = torch.einsum("hmtc,hmsc,hmtsc->hmts", qg, kg, decay)  # s <= t
        eG = G.exp()
        # W and U_v from one solve: their right-hand sides side by side
        WU = torch.linalg.solve_triangular(eye + A, torch.cat([bg * (kg * eG), bg * vg], dim=-1), upper=False,
                                           unitriangular=True)
        G_end = G[:, :, -1:, :]  # [h, m, 1, dk]
        parts.append((qg * eG, P, WU[..., :dk], WU[..., dk:], (kg * (G_end - G).exp()).transpose(-1, -2),
                      G_end.exp().transpose(-1, -2)))
    Qg, P, W, Uv, Kt, D = (torch.cat(x, dim=1) for x in zip(*parts))
    o = q.new_empty(h, n, chunk, dv)
    S = state
    for i in range(n):  # the state's pass: its only sequential part
        U = Uv[:, i] - W[:, i] @ S
        o[:, i] = Qg[:, i] @ S + P[:, i] @ U
        S = S * D[:, i] + Kt[:, i] @ U
    return o.reshape(h, n * chunk, dv).transpose(0, 1)[:T], S


class KimiDeltaAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, conv_size: int, safe_gate: bool,
                 lower_bound: float, eps: float) -> None:
        super().__init__()
        D = heads * head_dim
        self.heads, self.head_dim, self.conv_size = heads, head_dim, conv_size
        self.safe_gate, self.lower_bound, self.eps = safe_gate, lower_bound, eps
        for name in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
            setattr(self, name, Linear(hidden, D))
        self.b_proj = Linear(hidden, heads)
        self.o_proj = Linear(D, hidden)
        self.conv_weight = nn.Parameter(torch.zeros(3 * D, conv_size), requires_grad=False)  # fp32
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(D), requires_grad=False)
        self.o_norm_weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)
        self.fused: FusedLinear | None = None  # q|k|v|f|g in one weight, set at load time
        # kda_core's signature, plus beta_x/beta_w keywords to compute beta itself (fastpath sets it)
        self.fast_core: Callable | None = None

    def input_projections(self) -> list[Linear]:
        return [self.q_proj, self.k_proj, self.v_proj, self.f_proj, self.g_proj]

    @property
    def out_proj(self) -> Linear:
        return self.o_proj

    def forward(self, x: torch.Tensor, state: KDAState, keep_steps: bool = False,
                chunked: bool = False, project_out: bool = True) -> tuple[torch.Tensor, KDASteps | None]:
        """(output [T, hidden], kept steps); with project_out=False the output is out_proj's input."""
        q, k, v, f, out_gate = project(self.fused, self.input_projections(), x)
        if self.fast_core is not None and not (chunked and keep_steps):
            core = self.fast_core  # a prompt: in windows when short, else through the uncompiled twin
        elif chunked:
            core = kda_core if not keep_steps else ops.kda_core  # prefill lengths vary: not compiled
        else:
            core = ops.kda_core
        # the fused kernel computes beta's logits from x and b_proj's (plain) weight itself
        fold = core is self.fast_core and not self.b_proj.is_fp8 and self.b_proj.weight.dtype == x.dtype
        extra = {"beta_x": x, "beta_w": self.b_proj.weight} if fold else {}
        o, window, rec_steps = core(q, k, v, f, None if fold else self.b_proj(x), out_gate, state.conv,
                                    state.recurrent, self.conv_weight, self.A_log, self.dt_bias,
                                    self.o_norm_weight, self.heads, self.head_dim, self.safe_gate,
                                    self.lower_bound, self.eps, keep_steps, chunked and not keep_steps, **extra)
        return self.o_proj(o) if project_out else o, (KDASteps(window, rec_steps) if keep_steps else None)


@register
def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logit: torch.Tensor,
             out_gate: torch.Tensor,
             conv_state: torch.Tensor, recurrent: torch.Tensor, conv_w: torch.Tensor, A_log: torch.Tensor,
             dt_bias: torch.Tensor, o_norm_w: torch.Tensor, heads: int, head_dim: int, safe_gate: bool,
             lower_bound: float, eps: float, keep_steps: bool,
             chunked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Everything of a KDA layer between its input projections and o_proj, updating the conv and
    recurrent states in place (with keep_steps the recurrent one is left as it was: KDASteps).
    q, k, v, f, out_gate: [T, D] projections; beta_logit: [T, heads].
    Returns (o [T, D] normed and gated, the conv window [K-1+T, 3D], the kept inputs or None)."""
    T, dtype = q.shape[0], q.dtype
    h, d = heads, head_dim
    window = torch.cat([conv_state.to(dtype), torch.cat([q, k, v], dim=-1)], dim=0)  # [K-1+T, 3D]
    win32 = window.float()
    conv = sum(win32[j:j + T] * conv_w[:, j] for j in range(conv_w.shape[1]))  # causal depthwise conv
    qkv = F.silu(conv).to(dtype)
    conv_state.copy_(window[T:])
    q, k, v = (t.reshape(T, h, d) for t in qkv.split(h * d, dim=-1))  # after the conv
    f = f.float().view(T, h, d) + dt_bias.view(h, d)
    rate = A_log.exp().view(1, h, 1)
    g = lower_bound * torch.sigmoid(rate * f) if safe_gate else -rate * F.softplus(f)
    g = g.to(dtype)  # the reference rounds the gate to the model dtype
    beta = torch.sigmoid(beta_logit)
    steps = None
    fla = fla_chunk_kda() if chunked and q.is_cuda and d in FLA_HEAD_DIMS else None
    done = None
    if fla is not None:  # a prompt on the GPU: fla-core's chunked kernels (kernels/kda_prefill.py), if they run here
        done = kda_prefill(l2norm(q.float()).to(dtype), l2norm(k.float()).to(dtype), v, g, beta, recurrent, fla)
    if done is not None:
        o, S = done
    else:
        q = l2norm(q.float()) * d ** -0.5
        k = l2norm(k.float())
        v, g, beta = v.float(), g.float(), beta.float()
        if chunked:
            o, S = kda_chunked(q, k, v, g, beta, recurrent, group=chunk_group(q.device, h, d))
        else:
            o, S, steps = kda_recurrent(q, k, v, g, beta, recurrent, keep_steps)
    if not keep_steps:  # a verify leaves the state for commit_steps to advance to the accepted position
        recurrent.copy_(S)
    o = gated_rms_norm(o.to(dtype), out_gate.reshape(T, h, d), o_norm_w, eps).reshape(T, h * d)
    return o, window, steps
