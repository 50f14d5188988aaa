"""The fused KDA decode kernel (kernels.kda_decode) against its torch twin nn.kda.kda_core: under Triton's
CPU interpreter (when triton is installed) and on CUDA (when there is a GPU).

Inputs are column slices of one fused projection (non-contiguous, as the engine passes them). Both sides
round at the same points (conv output, gate, beta, o before the norm, the output), so under the
interpreter the bf16 outputs must match bit for bit (99%+: an fp32 ulp of exp/sigmoid between numpy and
torch may flip a rounding) and the fp32 states within 1e-4 of their max. On CUDA the kernel's fast exp
and FMAs flip a bf16 rounding now and then (one gate or conv channel, which moves the state ~1e-3), so
there the bound is 95% of state elements within 1e-4 and all within 1e-2. Window and conv state are pure
data movement: exact everywhere. Perturbing one gate input, one beta or one norm weight must fail.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON

# (T, heads, head_dim, safe_gate, keep_steps, dv_blocks, conv K, dtype)
CASES = [
    (1, 2, 16, True, False, 1, 4, torch.bfloat16),
    (1, 3, 32, False, True, 1, 4, torch.bfloat16),
    (2, 2, 64, True, True, 1, 4, torch.bfloat16),
    (2, 4, 16, False, False, 1, 4, torch.bfloat16),
    (5, 2, 32, False, True, 1, 4, torch.bfloat16),
    (5, 4, 16, True, False, 1, 4, torch.bfloat16),
    (8, 2, 16, True, True, 1, 4, torch.bfloat16),  # MAX_TOKENS
    (5, 2, 32, True, True, 4, 4, torch.bfloat16),  # value columns split over programs
    (1, 2, 32, False, False, 2, 4, torch.bfloat16),
    (1, 2, 32, True, False, 8, 4, torch.bfloat16),  # SPARKCHAT_KDA_LAUNCH1=8x2's split
    (5, 2, 16, False, True, 1, 2, torch.bfloat16),  # other conv sizes (T < K-1 and T > K-1)
    (3, 2, 16, True, True, 2, 3, torch.bfloat16),
    (2, 2, 32, False, True, 1, 4, torch.float32),  # no rounding at all
]
REAL = [(1, 2, 128, True, False, 1, 4, torch.bfloat16), (5, 2, 128, False, True, 1, 4, torch.bfloat16)]


def make_inputs(T, heads, head_dim, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = heads * head_dim

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    fused = rnd(T, 5 * D + 8, s=2.0).to(dtype).to(device)  # q|k|v|f|g of one projection, padded rows
    q, k, v, f, og = fused[:, :5 * D].split(D, dim=-1)
    beta_logit = rnd(T, heads + 1).to(dtype).to(device)[:, :heads]
    conv = rnd(K - 1, 3 * D).to(dtype).to(device)
    rec = rnd(heads, head_dim, head_dim, s=0.3).to(device)
    weights = (rnd(3 * D, K, s=0.5).to(device), rnd(heads, s=0.5).to(device), rnd(D).to(device),
               (1 + rnd(head_dim, s=0.1)).to(dtype).to(device))
    return [q, k, v, f, beta_logit, og], (conv, rec), weights


def compare(case, device, *, seed=0, perturb=None, fold=False) -> list[str]:
    """Kernel vs twin on one case: the list of mismatches (empty: they agree). perturb names one input
    the kernel alone gets nudged: 'gate' (one f element), 'beta' (one logit), 'norm' (one norm weight)."""
    from sparkchat.engine.kernels.counters import arrival_counters
    from sparkchat.engine.kernels.kda_decode import kda_decode
    from sparkchat.engine.nn.kda import commit_steps, kda_core

    T, H, DH, safe, keep, nb, K, dtype = case
    x, (conv, rec), (cw, alog, dtb, onw) = make_inputs(T, H, DH, K, dtype, device, seed)
    lb = -5.0 if safe else 5.0
    extra = {}
    if fold:  # the kernel computes beta's logits from the layer input and b_proj's weight
        gen = torch.Generator().manual_seed(seed + 7)
        bx = torch.randn(T, 96, generator=gen).to(dtype).to(device)
        bw = (torch.randn(H, 96, generator=gen) * 0.2).to(dtype).to(device)
        x[4] = torch.nn.functional.linear(bx, bw)
        extra = {"beta_x": bx, "beta_w": bw}
    c1, r1 = conv.clone(), rec.clone()
    o1, w1, s1 = kda_core(*x, c1, r1, cw, alog, dtb, onw, H, DH, safe, lb, 1e-6, keep, False)
    # one element on the CPU (bit-exact comparison); on the GPU the comparison allows a few ulps and a
    # few stray state elements, so the whole input is nudged
    one = device == "cpu"
    if perturb == "gate":
        x[3] = x[3].clone()
        if one:
            x[3][T - 1, DH + 1] += 0.05
        else:
            x[3] += 0.5
    elif perturb == "beta":
        x[4] = x[4].clone()
        if one:
            x[4][T - 1, 1] += 0.05
        else:
            x[4] += 0.5
    elif perturb == "norm":
        onw = onw.clone()
        if one:
            onw[3] *= 1.05
        else:
            onw *= 1.1
    c2, r2 = conv.clone(), rec.clone()
    if fold:
        x = x[:4] + [None] + x[5:]
    o2, w2, s2 = kda_decode(*x, c2, r2, cw, alog, dtb, onw, H, DH, safe, lb, 1e-6, keep, False, dv_blocks=nb,
                            **extra)

    bad = []
    strict = device == "cpu" or dtype == torch.float32
    if o2.shape != o1.shape or o2.dtype != o1.dtype or not torch.isfinite(o2).all():
        return [f"o: {o2.shape} {o2.dtype}"]
    if dtype == torch.float32:
        err = ((o2 - o1).abs().max() / o1.abs().max()).item()
        if err > 1e-4:
            bad.append(f"o off by {err:.3g}")
    else:
        same = (o2 == o1).float().mean().item()
        if strict and same < 0.99:
            bad.append(f"o: only {same:.1%} bit-identical")
        if not torch.allclose(o2.float(), o1.float(), rtol=2 ** -6, atol=2 ** -6):  # a few bf16 ulps
            bad.append(f"o off by {(o2.float() - o1.float()).abs().max().item():.3g}")
    if not torch.equal(w2, w1):
        bad.append("window differs")
    if not torch.equal(c2, c1):
        bad.append("conv state differs")
    if not keep and s2 is not None:
        bad.append("steps returned without keep_steps")
    if keep:
        # a step that keeps its inputs leaves the state alone; committing every position from the kept
        # inputs (each side its own) must give the state the step would have left
        if not (torch.equal(r1, rec) and torch.equal(r2, rec)):
            bad.append("a step with keep_steps changed the recurrent state")
        if s2.shape != s1.shape:
            return bad + [f"inputs: shape {tuple(s2.shape)}, the twin's {tuple(s1.shape)}"]
        commit_steps(r1, s1, T - 1)
        commit_steps(r2, s2, T - 1)
    states = [("recurrent", r2, r1)] + ([("inputs", s2, s1)] if keep else [])
    for name, got, want in states:
        rel = (got - want).abs() / want.abs().max()
        if strict and rel.max().item() > 1e-4:
            bad.append(f"{name} off by {rel.max().item():.3g} of its max")
        if not strict and ((rel <= 1e-4).float().mean().item() < 0.95 or rel.max().item() > 1e-2):
            bad.append(f"{name} off by {rel.max().item():.3g} of its max")
    if nb > 1 and arrival_counters("kda_decode", o2.device, 1).any():
        bad.append("arrival counters not reset")
    return bad


def run_all(device: str, real: bool = True) -> None:
    from sparkchat.engine.kernels.kda_decode import kda_decode
    from sparkchat.engine.nn.kda import kda_core

    for case in CASES + (REAL if real else []):
        bad = compare(case, device)
        assert not bad, (case, bad)
    for case in (CASES[0], CASES[2]):  # beta's logits computed in the kernel
        bad = compare(case, device, fold=True)
        assert not bad, (case, "fold", bad)
    # the check has teeth: the kernel fed a nudged gate input, beta or norm weight must not pass
    for perturb, case in (("gate", CASES[4]), ("beta", CASES[2]), ("norm", CASES[0])):
        assert compare(case, device, perturb=perturb), f"a perturbed {perturb} went unnoticed"
    # SPARKCHAT_TAIL_AT_ONCE=4: a head's last program loads every position's o before it stores any
    # (the output norm of value columns split over programs): the same outputs and states to the bit
    for case in (CASES[7], CASES[11]):
        T, H, DH, safe, keep, nb, K, dtype = case
        runs = []
        saved = os.environ.get("SPARKCHAT_TAIL_AT_ONCE")
        for bits in ("0", "4"):
            os.environ["SPARKCHAT_TAIL_AT_ONCE"] = bits
            x, (conv, rec), w = make_inputs(T, H, DH, K, dtype, device, seed=3)
            out = kda_decode(*x, conv, rec, *w, H, DH, safe, -5.0 if safe else 5.0, 1e-6, keep, False, dv_blocks=nb)
            runs.append((out[0], out[1], conv, rec))
        if saved is None:
            del os.environ["SPARKCHAT_TAIL_AT_ONCE"]
        else:
            os.environ["SPARKCHAT_TAIL_AT_ONCE"] = saved
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), case
    # past MAX_TOKENS keeping steps, past PROMPT_WINDOWS_MAX_TOKENS, and with the windows switched off,
    # it hands over to the twin: the same results exactly (the plain twin: an earlier test may have left
    # ops.kda_core compiled, which rounds differently)
    from sparkchat.engine.kernels import kda_decode as module
    from sparkchat.engine.nn.ops import ops
    ops.kda_core = kda_core
    longest = module.PROMPT_WINDOWS_MAX_TOKENS
    for T, chunked, keep, windows in ((9, False, True, "1"), (longest + 1, True, False, "1"), (4, True, False, "0"),
                                      (12, False, False, "0")):
        os.environ["SPARKCHAT_KDA_PROMPT_WINDOWS"] = windows
        x, (conv, rec), w = make_inputs(T, 2, 16, 4, torch.bfloat16, device)
        c1, r1, c2, r2 = conv.clone(), rec.clone(), conv.clone(), rec.clone()
        a = kda_core(*x, c1, r1, *w, 2, 16, True, -5.0, 1e-6, keep, chunked)
        b = kda_decode(*x, c2, r2, *w, 2, 16, True, -5.0, 1e-6, keep, chunked)
        assert torch.equal(a[0], b[0]) and torch.equal(r1, r2) and torch.equal(c1, c2), (T, chunked)
    os.environ["SPARKCHAT_KDA_PROMPT_WINDOWS"] = "1"
    # a short prompt (chunked or not) runs in windows of 8, 4, 2, 1 tokens: exactly the kernel called
    # window by window, and the twin's results within the single-window bounds
    assert module._window_sizes(15) == [8, 4, 2, 1] and module._window_sizes(16) == [8, 8]
    for T, chunked in ((15, True), (11, False)):
        x, (conv, rec), w = make_inputs(T, 2, 16, 4, torch.bfloat16, device, seed=T)
        c1, r1, c2, r2 = conv.clone(), rec.clone(), conv.clone(), rec.clone()
        o, win, steps = kda_decode(*x, c1, r1, *w, 2, 16, True, -5.0, 1e-6, False, chunked)
        assert steps is None and o.shape == (T, 32) and win.shape == (3 + T, 96)
        parts, t0 = [], 0
        for n in module._window_sizes(T):
            parts.append(kda_decode(*(t[t0:t0 + n] for t in x), c2, r2, *w, 2, 16, True, -5.0, 1e-6, False, False)[0])
            t0 += n
        assert torch.equal(o, torch.cat(parts)) and torch.equal(r1, r2) and torch.equal(c1, c2), T
        c3, r3 = conv.clone(), rec.clone()
        want, want_win, _ = kda_core(*x, c3, r3, *w, 2, 16, True, -5.0, 1e-6, False, False)
        assert torch.equal(win, want_win) and torch.equal(c1, c3), T
        assert torch.allclose(o.float(), want.float(), rtol=2 ** -6, atol=2 ** -6), T
        assert ((r1 - r3).abs().max() / r3.abs().max()).item() < 1e-2, T
    print("kda kernel ok")


def run_model(path: str) -> None:
    """The hook in KimiDeltaAttention.forward: a tiny model's decode and verify steps through fast_core
    match the twin's, and so do the states after committing part of the verify; prefill does not use it."""
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.generate import Decoder
    from sparkchat.engine.kernels.kda_decode import kda_decode
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.nn.kda import KimiDeltaAttention
    from sparkchat.engine.state import ConversationState

    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "cpu", torch.bfloat16, 64)
    seen = []

    def core(*args, **kwargs):
        seen.append(args[0].shape[0])
        assert args[4] is None and "beta_x" in kwargs  # beta's logits folded into the kernel
        return kda_decode(*args, **kwargs)

    def run(fast: bool):
        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                m.fast_core = core if fast else None
        state = ConversationState.allocate(cfg, 64, "cpu", torch.bfloat16)
        dec = Decoder(model, state)
        prompt = list(range(5, 30))
        dec.forward(prompt)  # a short prompt: the kernel, in windows (kda_decode's own choice)
        dec.commit(prompt)
        _, l1, _ = dec.forward([7])
        dec.commit([7])
        _, l2, kept = dec.forward([8, 9, 10], keep_steps=True)
        state.commit_kda(kept, 1)  # keep 8, 9
        return torch.cat([l1, l2]), state.snapshot()

    want, want_state = run(False)
    assert not seen
    got, got_state = run(True)
    assert seen and set(seen) == {25, 1, 3}, seen
    rel = ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()
    assert rel < 0.02, rel
    for name, t in want_state.items():
        if name.startswith("kda."):
            err = ((got_state[name].float() - t.float()).abs().max() / t.float().abs().max()).item()
            assert err < 0.02, (name, err)
    print("kda hook ok")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (its CPU interpreter runs these)")
def test_kda_kernel_under_triton_interpreter(tmp_path):
    from tests.interpreter import KERNEL_AND_HOOK, run_interpreted

    r = run_interpreted(KERNEL_AND_HOOK.format(module="test_kda_kernel"), str(tmp_path))
    assert r.returncode == 0 and "kda kernel ok" in r.stdout and "kda hook ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_kda_kernel_on_cuda():
    run_all("cuda")
    # the real shapes (32 heads of 128): decode, and a verify window with its kept inputs, both grid layouts
    for case in [(1, 32, 128, True, False, 1, 4, torch.bfloat16), (5, 32, 128, True, True, 1, 4, torch.bfloat16),
                 (1, 32, 128, True, False, 4, 4, torch.bfloat16), (5, 32, 128, False, True, 4, 4, torch.bfloat16)]:
        bad = compare(case, "cuda", seed=1)
        assert not bad, (case, bad)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_one_token_launch_override_applies_to_plain_one_token_steps_only(monkeypatch):
    from sparkchat.engine.kernels import kda_decode as kd

    monkeypatch.delenv("SPARKCHAT_KDA_LAUNCH1", raising=False)
    assert kd.one_token_launch() == kd.LAUNCH
    monkeypatch.setenv("SPARKCHAT_KDA_LAUNCH1", "8x2")
    assert kd.one_token_launch() == (8, 2)
    monkeypatch.setenv("SPARKCHAT_KDA_LAUNCH1", "8")
    with pytest.raises(ValueError, match="8x1"):
        kd.one_token_launch()
