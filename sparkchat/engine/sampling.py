"""Token choice: greedy, temperature / top-k / top-p sampling, and the speculative acceptance rule."""

from __future__ import annotations

import torch

from sparkchat.engine.errors import SparkchatError
from sparkchat.engine.events import SamplingParams


class SamplingError(SparkchatError, ValueError):
    """Sampling values the engine cannot use. A ValueError too, as SamplingParams.validate raises."""


def check_sampling(params: SamplingParams) -> SamplingParams:
    """The engine's one check of sampling values: the shared range rules (NaN and inf temperature or
    top-p refused, seeds torch cannot take). Raises SamplingError, one line; returns params."""
    try:
        params.validate()
    except ValueError as e:
        raise SamplingError(str(e)) from None
    return params


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    check_sampling(params)
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


def speculative_accept_on_device(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                                 generator: torch.Generator | None) -> torch.Tensor:
    """The standard speculative-sampling rule, which keeps the target distribution exactly, with no host
    sync: returns [accepted count, next token] on the device, for the caller to read with everything
    else it needs from the cycle in one wait.

    target_probs: [k+1, V] for the k drafted positions and the bonus one; draft_probs: [k, V];
    draft_tokens: [k]. Accept draft i with prob min(1, p/q); at the first rejection draw from (p − q)+;
    if all are accepted, draw the bonus token from p[k]. Every row's draw is made (an exponential race,
    race_draw) and the one the acceptances reach is picked: a few more kernels instead of a host round
    trip per decision."""
    k = draft_tokens.shape[0]
    device = draft_tokens.device
    idx = torch.arange(k, device=device)
    p = target_probs[idx, draft_tokens]
    q = draft_probs[idx, draft_tokens]
    u = torch.rand(k, generator=generator, device=device)
    accepted = (u * q <= p).long().cumprod(0).sum().view(1)  # the leading run; u < p/q without dividing by 0
    residual = (target_probs[:k] - draft_probs).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:k])  # p == q: draw from p
    weights = torch.cat([residual, target_probs[k:k + 1]])  # row i: a rejection at i; row k: the bonus
    e = -torch.log(torch.rand(weights.shape, generator=generator, device=device))
    picks = (weights / e).argmax(-1)
    return torch.cat([accepted, picks.gather(0, accepted)])


def speculative_accept(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None) -> tuple[int, int]:
    """speculative_accept_on_device, read back: (accepted count, next token)."""
    accepted, token = speculative_accept_on_device(target_probs, draft_probs, draft_tokens, generator).tolist()
    return accepted, token
