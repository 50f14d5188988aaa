"""The pipelined MTP loop's handoff kernels (kernels/pipeline_handoff.py) against their torch twins in
engine/pipeline.py — under Triton's CPU interpreter and on CUDA: every accepted count, with and without
the fill of the slots past it, hidden sizes over and under one copy block."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.interpreter import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and HAS_TRITON


def kernels_against_twins(device: str) -> None:
    from sparkchat.engine.kernels.pipeline_handoff import accept_greedy, next_inputs
    from sparkchat.engine.pipeline import accept_greedy_ops, next_inputs_ops

    gen = torch.Generator().manual_seed(0)
    for k, H in [(1, 200), (3, 2560), (4, 1030)]:
        for accepted in range(k + 1):
            # the target agrees with the drafts up to `accepted`, then picks something else
            drafts = torch.randint(0, 1000, (k,), generator=gen)
            target = torch.cat([drafts, torch.randint(0, 1000, (1,), generator=gen)])
            if accepted < k:
                target[accepted] = drafts[accepted] + 1
            drafts, target = drafts.to(device), target.to(device)
            outs = [[torch.full(shape, -7, dtype=torch.long, device=device) for shape in ((1,), (1,), (k + 2,))]
                    for _ in range(2)]
            accept_greedy_ops(drafts, target, *outs[0])
            accept_greedy(drafts, target, *outs[1])
            assert int(outs[0][0]) == accepted, (k, accepted)
            for a, b in zip(*outs):
                assert torch.equal(a, b), (k, accepted, a, b)
            acc, nxt = outs[0][0], outs[0][1]
            hidden = torch.randn(k + 1, H, generator=gen).to(torch.bfloat16).to(device)
            n = int(torch.randint(0, 5000, (1,), generator=gen))
            for fill in (False, True):
                bufs = []
                for _ in range(2):
                    bufs.append([torch.full((k + 1,), -7, dtype=torch.long, device=device),  # chain ids
                                 torch.full((2 * k,), -7, dtype=torch.long, device=device),  # chain positions
                                 torch.full((1,), -7, dtype=torch.long, device=device),  # pick
                                 torch.zeros(k + 1, H, dtype=torch.bfloat16, device=device),  # hidden in
                                 torch.full((1,), -7, dtype=torch.long, device=device),  # verify's first id
                                 torch.full((k + 1,), -7, dtype=torch.long, device=device)])  # verify positions
                next_inputs_ops(drafts, acc, nxt, hidden, n, *bufs[0], fill)
                next_inputs(drafts, acc, nxt, hidden, n, *bufs[1], fill)
                for a, b in zip(*bufs):
                    assert torch.equal(a, b), (k, accepted, fill, a, b)
                ids, pos, pick, hin, vid, vpos = bufs[0]
                assert int(pick) == accepted and int(ids[accepted]) == int(nxt) == int(vid)
                assert pos.tolist()[:k + 1] == list(range(n, n + k + 1))
                assert vpos.tolist() == list(range(n + accepted + 1, n + accepted + k + 2))
                assert torch.equal(hin[:accepted + 1], hidden[:accepted + 1])
    print("handoff kernels ok")


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_handoff_kernels_under_triton_interpreter():
    r = run_interpreted("from tests.test_pipeline_handoff import kernels_against_twins; kernels_against_twins('cpu')")
    assert r.returncode == 0 and "handoff kernels ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
def test_handoff_kernels_on_cuda():
    kernels_against_twins("cuda")
