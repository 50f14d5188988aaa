"""The Triton router kernel against its torch twin (nn.moe.route): on the GPU when there is one, else
under Triton's CPU interpreter when Triton is installed (CI installs no Triton: then it is skipped)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

CASES = [(512, 8, 4, 8, 1), (512, 8, 4, 8, 5), (32, 4, 2, 4, 3), (16, 1, 1, 2, 2)]

SCRIPT = """
import torch
from sparkchat.engine.nn.moe import route as ref
from sparkchat.engine.kernels.router import route
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
for E, G, TG, K, T in {cases}:
    # bf16 activations take the split-K GEMV (the model's case); fp32 ones the torch matmul
    # the router weight fp32 or BF16 (as the release stores it; computed in fp32 either way)
    for dtype, H, wdt in ((torch.float32, 64, torch.float32), (torch.bfloat16, 640, torch.float32),
                          (torch.bfloat16, 640, torch.bfloat16)):
        x = torch.randn(T, H, device=dev).to(dtype)
        W = (torch.randn(E, H, device=dev) * 0.3 * (64 / H) ** 0.5).to(wdt)
        b = torch.randn(E, device=dev) * 0.1
        for renorm in (True, False):
            i1, w1 = ref(x, W, b, G, TG, K, 2.5, renorm)
            i2, w2 = route(x, W, b, G, TG, K, 2.5, renorm)
            assert torch.equal(i1, i2), (E, G, dtype, i1, i2)
            assert torch.allclose(w1, w2, atol=1e-5), (w1, w2)
print("ok")
"""


def run_script(script: str, **env_extra: str) -> None:
    """Run a check in a fresh interpreter: on the GPU when there is one, else Triton's CPU interpreter."""
    env = dict(os.environ, **env_extra)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
def test_router_kernel_matches_torch_twin():
    run_script(SCRIPT.format(cases=CASES))


TIES_SCRIPT = """
import torch
from sparkchat.engine.nn.moe import route as ref
from sparkchat.engine.kernels.router import route
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(1)
E, G, TG, K, H = 512, 8, 4, 8, 640
for T in (1, 3, 8):  # several tokens, bf16: the split-K GEMV's partial rows (SPLIT > 1)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    # a few distinct weight rows, repeated: many experts share a logit exactly (same row, same sums)
    W = (torch.randn(6, H, device=dev) * 0.05)[torch.randint(0, 6, (E,), device=dev)]
    for b in (torch.zeros(E, device=dev), torch.randn(E, device=dev).round() * 0.25):  # ties, tied groups
        for renorm in (True, False):
            i1, w1 = ref(x, W, b, G, TG, K, 2.5, renorm)
            i2, w2 = route(x, W, b, G, TG, K, 2.5, renorm)
            c = (torch.sigmoid(x.float() @ W.float().T) + b).gather(1, i2)
            assert (c[:, 1:] <= c[:, :-1]).all(), c  # best first
            # the kernel's tie rule (tl.argmax's): equal scores -> lower expert id first
            assert ((c[:, 1:] < c[:, :-1]) | (i2[:, 1:] > i2[:, :-1])).all(), (c, i2)
            assert torch.allclose(w1, w2, atol=1e-5), (w1, w2)
            # the twin's topk may order or choose among equal scores differently: compare as sets of scores
            s1 = (torch.sigmoid(x.float() @ W.float().T) + b).gather(1, i1)
            assert torch.allclose(s1.sort(-1).values, c.sort(-1).values, atol=1e-5), (s1, c)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
def test_router_kernel_ties_and_split_tokens():
    run_script(TIES_SCRIPT)


LANE_TIES_SCRIPT = """
import torch
from sparkchat.engine.kernels.router import route
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(2)
E, G, TG, K, H = 512, 8, 4, 8, 64


def expected(b):
    # zero weights: every logit is 0, every score 0.5 + bias (exact in fp32): the tie rules decide
    c = (0.5 + b).cpu().tolist()
    gs = [sum(sorted(c[g * (E // G):(g + 1) * (E // G)])[-2:]) for g in range(G)]
    groups = sorted(range(G), key=lambda g: (-gs[g], g))[:TG]
    cand = [e for e in range(E) if e // (E // G) in groups]
    return sorted(cand, key=lambda e: (-c[e], e))[:K]


# ties inside a lane's 16 experts, between lanes' bests, between groups; all experts equal; one winner
# per lane (the first K lanes' 4 consecutive experts share a score)
biases = [torch.zeros(E), torch.randint(0, 3, (E,)).float() * 0.25, torch.randint(0, 2, (E,)).float() * 0.5]
lanes = torch.zeros(E)
lanes[torch.arange(K)[:, None] * 4 + torch.arange(4)] = 1.0
biases.append(lanes)
for b in biases:
    b = b.to(dev)
    for dtype in (torch.float32, torch.bfloat16):  # the torch matmul and the split-K GEMV paths
        x = torch.randn(2, H, device=dev).to(dtype)
        ids, w = route(x, torch.zeros(E, H, device=dev), b, G, TG, K, 2.5, True)
        want = torch.tensor(expected(b), device=dev)
        assert torch.equal(ids[0], want) and torch.equal(ids[1], want), (ids, want)
        assert torch.allclose(w, torch.full_like(w, 2.5 / K)), w
        ids1, w1 = route(x[:1], torch.zeros(E, H, device=dev), b, G, TG, K, 2.5, True)  # a single token
        assert torch.equal(ids1[0], want) and torch.allclose(w1, w[:1]), (ids1, want)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
def test_router_kernel_lane_best_ties():
    """Exact ids where only the tie rule decides: the per-lane bests must hand over the lowest index."""
    run_script(LANE_TIES_SCRIPT)


def _ling_router(seed: int) -> str:
    """A script's opening: the Ling router's shapes, its weights and expert bias drawn from `seed`."""
    return f"""
import torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed({seed})
E, G, TG, K, H = 512, 8, 4, 8, 2560
W = (torch.randn(E, H, device=dev) / 50).bfloat16()
b = torch.randn(E, device=dev) * 0.01
"""


PREFETCH_SCRIPT = _ling_router(3) + """
from sparkchat.engine.kernels.router import route
ahead = torch.randint(0, 256, (5_000_061,), device=dev, dtype=torch.uint8)  # not a whole number of lines
kept = ahead.clone()
for _ in range(3):
    x = torch.randn(1, H, device=dev).bfloat16()
    i1, w1 = route(x, W, b, G, TG, K, 2.5, True)
    # with extra programs asking L2 for `ahead` (on a GPU; the interpreter ignores it): the same routing
    i2, w2 = route(x, W, b, G, TG, K, 2.5, True, l2_prefetch=ahead)
    i3, w3 = route(x, W, b, G, TG, K, 2.5, True, l2_prefetch=ahead[:100])  # less than a line: nothing to ask
    assert torch.equal(i1, i2) and torch.equal(w1, w2) and torch.equal(i1, i3) and torch.equal(w1, w3)
assert torch.equal(ahead, kept)  # a prefetch writes nothing
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
def test_router_kernel_with_l2_prefetch_routes_the_same():
    """route's l2_prefetch (the next layer's first weight bytes asked of L2 by extra programs of the
    launch): the same experts and weights, bit for bit, and the prefetched bytes untouched."""
    run_script(PREFETCH_SCRIPT)


PRELOAD_SCRIPT = _ling_router(4) + """
import os
from sparkchat.engine.nn.moe import route as ref
from sparkchat.engine.kernels.router import _logits_config, route
# the tuned config (4 k steps a split, one loaded before the PDL wait), then gpu_queue.sh preload's, each
# program loading all its weights before the wait: 8-row tiles in one 512-column step; the tuned tiles
# with all four steps loaded first (GemvConfig.pre)
specs = {"0": (128, 1), "plain.1.512.2560.bn:8/plain.1.512.2560.bk:512/plain.1.512.2560.unroll:1": (512, 1),
         "plain.1.512.2560.pre:4": (128, 4)}
for spec, (bk, pre) in specs.items():
    os.environ["SPARKCHAT_GEMV_CONFIG"] = spec
    cfg = _logits_config(torch.device(dev), 1, E, H)
    assert (cfg.bk, cfg.split, cfg.pre) == (bk, 5, pre), cfg
    for _ in range(3):
        x = torch.randn(1, H, device=dev).bfloat16()
        i1, w1 = ref(x, W, b, G, TG, K, 2.5, True)
        i2, w2 = route(x, W, b, G, TG, K, 2.5, True)
        assert torch.equal(i1, i2), (spec, i1, i2)
        assert torch.allclose(w1, w2, atol=1e-5), (spec, w1, w2)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only CI)")
def test_router_logits_with_every_weight_loaded_before_the_wait():
    """The router logits GEMV with all of a program's weights loaded before its wait (the configs
    gpu_queue.sh's preload batch times: one k step a split, or the tuned four held) routes as the twin
    does at the Ling shape, as the tuned config does."""
    run_script(PRELOAD_SCRIPT)


def test_router_hands_its_prefetch_to_one_token_routes_only(monkeypatch):
    """Router.forward passes the GPU path's l2_prefetch bytes to the kernel route for one token (a decode
    step), never for a window, and not when the bytes are off (None)."""
    from sparkchat.engine.nn import moe
    from sparkchat.engine.nn.ops import ops

    calls = []

    def recording_route(*args, **kwargs):
        calls.append(kwargs.get("l2_prefetch"))
        return moe.route(*args)

    monkeypatch.setattr(ops, "route", recording_route)
    router = moe.Router(64, 16, 4, 4, 2, 2.5, True)
    ahead = torch.zeros(256, dtype=torch.uint8)
    wanted = [ahead]
    router.l2_prefetch = lambda: wanted[0]
    x1, x3 = torch.randn(1, 64), torch.randn(3, 64)
    ids, w = router(x1)
    assert calls[-1] is ahead and ids.shape == (1, 4)
    router(x3)
    assert calls[-1] is None  # a verify window: its MoE stages stream too much for the lines to last
    wanted[0] = None  # SPARKCHAT_L2_PREFETCH_MB=0
    router(x1)
    assert calls[-1] is None and len(calls) == 3


def test_l2_prefetch_size_defaults_to_sm90_only(monkeypatch):
    """SPARKCHAT_L2_PREFETCH_MB sets the prefetch (MB; 0 or junk: off); unset, sm_90 GPUs (where it was
    measured) prefetch 8 MB and every other device, the DGX Spark's sm_121 among them, none."""
    from sparkchat.engine import fastpath

    monkeypatch.delenv("SPARKCHAT_L2_PREFETCH_MB", raising=False)
    assert fastpath.l2_prefetch_bytes(torch.device("cpu")) == 0 and fastpath.l2_prefetch_bytes() == 0
    monkeypatch.setattr(fastpath, "is_sm90", lambda device: device.type == "cuda" and device.index == 0)
    assert fastpath.l2_prefetch_bytes(torch.device("cuda", 0)) == fastpath.DEFAULT_L2_PREFETCH == 8_000_000
    assert fastpath.l2_prefetch_bytes(torch.device("cuda", 1)) == 0  # another architecture
    for value, want in (("12", 12_000_000), ("0.5", 500_000), ("0", 0), ("junk", 0), ("-3", 0)):
        monkeypatch.setenv("SPARKCHAT_L2_PREFETCH_MB", value)
        assert fastpath.l2_prefetch_bytes(torch.device("cuda", 0)) == want, value


def test_router_logits_ask_l2_ahead_on_sm90_one_token_routes_only(monkeypatch):
    """The router logits GEMV asks L2 for all its later k steps (ROUTER_L2_AHEAD) on sm_90 at one token,
    where it was measured; not for verify windows nor on other devices (the DGX Spark's sm_121 among them);
    SPARKCHAT_GEMV_CONFIG's l2_ahead for the shape wins, 0 included."""
    from sparkchat.engine.kernels import router

    monkeypatch.delenv("SPARKCHAT_GEMV_CONFIG", raising=False)
    monkeypatch.setattr(router, "is_sm90", lambda device: device.type == "cuda" and device.index == 0)
    sm90, other = torch.device("cuda", 0), torch.device("cuda", 1)
    assert router._logits_config(sm90, 1, 512, 2560).l2_ahead == router.ROUTER_L2_AHEAD == 3
    steps = 2560 // router.gemv_config("plain", 1, 512, 2560).split // router.gemv_config("plain", 1, 512, 2560).bk
    assert router.ROUTER_L2_AHEAD == steps - 1  # every step after the one loaded before the wait
    assert router._logits_config(sm90, 4, 512, 2560).l2_ahead == 0
    assert router._logits_config(other, 1, 512, 2560).l2_ahead == 0
    assert router._logits_config(torch.device("cpu"), 1, 512, 2560).l2_ahead == 0
    monkeypatch.setenv("SPARKCHAT_GEMV_CONFIG", "plain.1.512.2560.l2_ahead:0")
    assert router._logits_config(sm90, 1, 512, 2560).l2_ahead == 0
    monkeypatch.setenv("SPARKCHAT_GEMV_CONFIG", "plain.1.512.2560.l2_ahead:1/plain.1.512.2560.split:4")
    cfg = router._logits_config(sm90, 1, 512, 2560)
    assert (cfg.l2_ahead, cfg.split) == (1, 4)
