"""Token choice: greedy, temperature / top-k / top-p sampling, and the speculative acceptance rule."""

from __future__ import annotations

import torch

from sparkchat.engine.events import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    if params.temperature <= 0:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: logits [..., V] → probs [..., V] fp32 after temperature,
    top-k and top-p. Speculative sampling compares these for the target and the draft."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop tokens once the mass before them already reaches top_p (the first always stays)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [T, V] → token ids [T] (greedy when temperature is 0)."""
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator).squeeze(-1)


def race_draw(q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from q [V] given uniforms u [V] in [0, 1), with no host sync (a CUDA graph can hold it):
    the exponential race, argmax q_i / E_i over E_i = -log u_i ~ Exp(1), picks i with probability q_i.
    u_i = 0 gives E_i = inf, never a zero division or a NaN; a zero q_i is never picked."""
    return (q / -torch.log(u)).argmax()


def speculative_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """The standard speculative-sampling rule, which keeps the target distribution exactly.

    target_probs: [k+1, V] for the k drafted positions and the bonus one; draft_probs: [k, V];
    draft_tokens: [k]. Accept draft i with prob min(1, p/q); at the first rejection resample from
    (p − q)+; if all are accepted, sample the bonus token from p[k]. Returns (accepted count, next token).
    """
    k = draft_tokens.shape[0]
    idx = torch.arange(k, device=draft_tokens.device)
    p = target_probs[idx, draft_tokens]
    q = draft_probs[idx, draft_tokens]
    u = torch.rand(k, generator=generator, device=draft_tokens.device)
    ok = (u * q <= p).tolist()  # u < p/q without dividing by a zero q
    for i in range(k):
        if not ok[i]:
            residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
            if residual.sum() <= 0:  # p == q: any draw from p is exact
                residual = target_probs[i]
            tok = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return i, int(tok)
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))
