"""The paired MXFP4 word layout (kernels/mxfp4_layout.py): the permutation and its inverse, the bf16x2
extraction the decode kernels do on it, the engine's one-way switch to it, and the kernels reading it —
on the CPU always, through Triton's interpreter when triton is installed, on CUDA when there is one.
Reading paired words must give bit-identical results: the same codes, products and order."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from sparkchat.engine.kernels import mxfp4_layout as layout
from sparkchat.engine.kernels import reference as ref
from tests.test_kernels import make_experts, make_routing, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON


def _words(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 4 * 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_moves_realize_the_documented_bit_positions():
    dest = {4 * j + b: layout.PAIRED_LOW_BITS[j % 4][b] + 16 * (j // 4) for j in range(8) for b in range(4)}
    assert sorted(dest.values()) == list(range(32))  # a permutation of the word's bits
    moves: dict[int, int] = {}
    for src, d in dest.items():
        moves[d - src] = moves.get(d - src, 0) | 1 << src
    assert tuple(sorted(moves.items())) == layout.MOVES
    # one code at a time lands where PAIRED_LOW_BITS says
    for j in range(8):
        for b in range(4):
            w = torch.tensor([1 << (4 * j + b)], dtype=torch.int64)
            w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).view(torch.uint8)
            got = layout.pair_words_reference(w).view(torch.int32).item() & 0xFFFFFFFF
            assert got == 1 << dest[4 * j + b], (j, b)


def test_pair_and_unpair_are_inverse():
    w = _words(50)
    p = layout.pair_words_reference(w)
    assert not torch.equal(p, w)
    assert torch.equal(layout.unpair_words_reference(p), w)
    assert torch.equal(layout.unpair_words(p), w)
    q = w.clone()
    assert layout.permute_words_(q) is q and torch.equal(q, p)


def _bf16x2_pairs_checkpoint(w: torch.Tensor) -> list[torch.Tensor]:
    """The unpaired kernels' extraction (mxfp4_moe._unpack8): pair i as an int32 of two bf16 patterns."""
    w = w.to(torch.int64)
    return [((w << 6) & 0x01C001C0) | ((w << 12) & 0x80008000), ((w << 2) & 0x01C001C0) | ((w << 8) & 0x80008000),
            ((w >> 2) & 0x01C001C0) | ((w << 4) & 0x80008000), ((w >> 6) & 0x01C001C0) | (w & 0x80008000)]


def _bf16x2_pairs_paired(w: torch.Tensor) -> list[torch.Tensor]:
    """The paired kernels' extraction (mxfp4_moe._unpack8_paired, _WORD_DOT_PAIRED_ASM)."""
    w = w.to(torch.int64) & 0xFFFFFFFF
    return [w & 0x81C081C0, (w << 6) & 0x81C081C0, (w << 3) & 0x81C081C0,
            ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)]


def test_paired_extraction_gives_the_checkpoint_codes():
    w = _words(64, seed=1)
    plain = _bf16x2_pairs_checkpoint(w.view(torch.int32))
    paired = _bf16x2_pairs_paired(layout.pair_words_reference(w).view(torch.int32))
    for i in range(4):
        assert torch.equal(plain[i] & 0xFFFFFFFF, paired[i]), i


def test_experts_paired_words_are_transparent_and_reversible():
    from sparkchat.engine.nn.moe import Experts

    gen = torch.Generator().manual_seed(2)
    w13, s13, w2, s2 = make_experts(4, 64, 32, gen=gen)
    ex = Experts(4, 64, 32)
    ex.w13, ex.w13_scale, ex.w2, ex.w2_scale = w13.clone(), s13, w2.clone(), s2
    before = [ex.expert_weights(e, torch.float32) for e in range(4)]
    ex.use_paired_words()
    assert ex.paired and not torch.equal(ex.w13, w13)
    ex.use_paired_words()  # already paired: nothing to do
    assert torch.equal(ex.w13, layout.pair_words_reference(w13))
    assert torch.equal(ex.w2, layout.pair_words_reference(w2))
    for e in range(4):
        for got, want in zip(ex.expert_weights(e, torch.float32), before[e]):
            assert torch.equal(got, want)
    ex.use_paired_words(False)
    assert not ex.paired and torch.equal(ex.w13, w13) and torch.equal(ex.w2, w2)


def run_kernels(device: str) -> None:
    """Every decode and prefill kernel configuration reads paired words to the same bits as checkpoint
    words, and the Triton permutation matches the torch one."""
    from sparkchat.engine.kernels.moe_prefill import PrefillConfig, moe_prefill
    from sparkchat.engine.kernels.mxfp4_moe import MoeConfig, moe_config, mxfp4_moe, pack_moe_x

    w = _words(300, seed=3).to(device)
    got = layout.permute_words_(w.clone())
    assert torch.equal(got.cpu(), layout.pair_words_reference(w.cpu()))
    assert torch.equal(layout.unpair_words(got).cpu(), w.cpu())
    assert torch.equal(layout.permute_words_(got, inverse=True).cpu(), w.cpu())
    big = device == "cuda"
    E, H, I, K = (512, 2560, 768, 8) if big else (6, 64, 32, 4)
    gen = torch.Generator().manual_seed(4)
    w13, s13, w2, s2 = (t.to(device) for t in make_experts(E, H, I, gen=gen))
    p13, p2 = layout.permute_words_(w13.clone()), layout.permute_words_(w2.clone())
    if big:
        cases = [(T, r, replace_cfg) for T, r in ((1, 0), (4, 0), (4, 4)) for replace_cfg in
                 (None, dict(dedupe=True, packed=False), dict(dedupe=False, packed=False, prefetch=True),
                  dict(dedupe=False, packed=True, prefetch=True), dict(dedupe=False, packed=True, packed_act=True))]
    else:
        small = dict(bn1=4, rs1=2, bkw1=8, bn2=8, rs2=2, bkw2=4)
        cases = [(T, r, dict(small, dedupe=d, prefetch=f, packed=p)) for T, r, d, f, p in
                 [(1, 0, True, False, False), (3, 2, True, True, False), (1, 0, False, False, True),
                  (3, 2, False, False, True), (2, 1, False, True, False), (1, 0, False, True, True),
                  (3, 2, False, True, True)]]
        # stage 1 writing act as stage 2's bf16x2 words: the same bits as stage 2 packing it
        cases += [(T, r, dict(small, dedupe=False, packed=True, packed_act=True, bn1=b1)) for T, r, b1 in
                  [(1, 0, 4), (3, 2, 8), (2, 1, 16)]]
    for T, repeat, over in cases:
        ids, wts = (t.to(device) for t in make_routing(T, K, E, repeat, gen))
        x = (torch.randn(T, H, generator=gen) * 2).bfloat16().to(device)
        cfg = None if over is None else MoeConfig(**{**moe_config(T, H, I).__dict__, **over})
        plain = replace(cfg or moe_config(T, H, I), packed_act=False)  # stage 2 packs act itself
        a = mxfp4_moe(x, ids, wts, w13, s13, w2, s2, 4.0, config=plain)
        b = mxfp4_moe(x, ids, wts, p13, s13, p2, s2, 4.0, config=cfg, paired=True)
        assert torch.equal(a, b), (T, repeat, over)
        # x handed over already packed (as the add+norm kernel writes it): the same bits where it is read
        c = mxfp4_moe(x, ids, wts, p13, s13, p2, s2, 4.0, config=cfg, paired=True, x_packed=pack_moe_x(x))
        assert torch.equal(c, b), (T, repeat, over)
        if (cfg or moe_config(T, H, I)).packed:  # ... and it is read there
            c = mxfp4_moe(x, ids, wts, p13, s13, p2, s2, 4.0, config=cfg, paired=True, x_packed=pack_moe_x(-x))
            assert not torch.equal(c, b), (T, repeat, over)
        assert rel_err(a, ref.mxfp4_moe_reference(x, ids, wts, w13, s13, w2, s2, 4.0)) < 1e-2, (T, repeat, over)
    pre = None if big else PrefillConfig(bm=16, bn1=16, bk1=32, bn2=32, bk2=32)
    for T in (9, 40) if not big else (9, 300):
        ids, wts = (t.to(device) for t in make_routing(T, K, E, 1, gen))
        x = (torch.randn(T, H, generator=gen) * 2).bfloat16().to(device)
        a = moe_prefill(x, ids, wts, w13, s13, w2, s2, 4.0, config=pre)
        b = moe_prefill(x, ids, wts, p13, s13, p2, s2, 4.0, config=pre, paired=True)
        assert torch.equal(a, b), T
    print("paired ok")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_paired_kernels_under_triton_interpreter():
    from tests.interpreter import run_interpreted

    r = run_interpreted("from tests.test_mxfp4_layout import run_kernels\nrun_kernels('cpu')\n", timeout=300)
    assert r.returncode == 0 and "paired ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and triton")
def test_paired_kernels_on_cuda():
    run_kernels("cuda")
