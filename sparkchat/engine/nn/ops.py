"""The small pure-torch pieces of a decode step, gathered so they can be compiled.

Each is a plain function (the reference, run as is on the CPU). On CUDA, `enable_compile()` swaps in
torch.compile'd versions: Inductor fuses each piece's dozens of elementwise kernels into a few, which
is most of a decode step's launch count. Call sites always go through `ops.<name>`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

_REFERENCE: dict[str, object] = {}
ops = SimpleNamespace()


def register(fn):
    """Make `fn` available as ops.<name>, compilable."""
    _REFERENCE[fn.__name__] = fn
    setattr(ops, fn.__name__, fn)
    return fn


def use_persistent_cache() -> None:
    """Keep Triton's and Inductor's compiled kernels in sparkchat's cache dir, so later runs start warm
    (Inductor's default lives in /tmp). Respects cache dirs the user set."""
    from platformdirs import user_cache_dir

    root = os.environ.get("SPARKCHAT_CACHE_DIR") or user_cache_dir("sparkchat")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))


def enable_compile() -> bool:
    """Compile every registered piece (CUDA only; SPARKCHAT_COMPILE=0 turns it off). Returns whether on."""
    if os.environ.get("SPARKCHAT_COMPILE", "1") == "0":
        return False
    use_persistent_cache()
    import torch._dynamo

    # one specialization per (token count ≤ 5, context bucket, step kind): a few dozen at most
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name, fn in _REFERENCE.items():
        setattr(ops, name, torch.compile(fn, dynamic=False, fullgraph=False))
    return True


def disable_compile() -> None:
    for name, fn in _REFERENCE.items():
        setattr(ops, name, fn)


@register
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, times the weight (as the reference does)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@register
def mtp_input(token_embeds: torch.Tensor, hidden: torch.Tensor, enorm_w: torch.Tensor, hnorm_w: torch.Tensor,
              eps: float) -> torch.Tensor:
    """The MTP layer's eh_proj input [enorm(embeds) | hnorm(hidden)]: compiled, the two norms write
    straight into the concatenation (two launches, three as separate ops). Both norms share one eps."""
    return torch.cat([rms_norm(token_embeds, enorm_w, eps), rms_norm(hidden, hnorm_w, eps)], dim=-1)


@register
def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then RMSNorm of the sum: returns (x + h, norm(x + h)) in one fused step."""
    x = x + h
    return x, rms_norm(x, weight, eps)
