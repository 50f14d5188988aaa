"""Snapshots of the models and bench screens (pytest-textual-snapshot), with fixed data so they do not
depend on this machine. Update with `pytest --snapshot-update` after a deliberate change, and look at the
SVGs before committing them."""

from pathlib import Path

import pytest
from fake_engine import FakeEngine
from uitools import wait_for

from sparkchat import hub
from sparkchat.hub import FP4_RELEASE, LocalModel

SIZE = (120, 40)
GB = 1000**3


@pytest.fixture
def fixed_models(monkeypatch):
    free = 112 * GB
    models = [
        LocalModel("inclusionAI/Ling-3.0-flash", Path("/models/hub/Ling-3.0-flash"), 248 * GB, "bf16", 256 * GB, free,
                   "hf-cache", "4d1c0ffee0", True),
        LocalModel("inclusionAI/Ling-3.0-flash-fp4", Path("/models/hub/Ling-3.0-flash-fp4"), 66 * GB, FP4_RELEASE,
                   68 * GB, free, "hf-cache", "9a2b7c3d4e", True),
        LocalModel("ling-tiny-demo", Path("/models/ling-tiny-demo"), 48 * 1000**2, "bf16", 1 << 30, free, "sparkchat",
                   None, False),
    ]
    monkeypatch.setattr(hub, "list_local_models", lambda **kwargs: list(models))
    return models


def test_models_screen(snap_compare, make_app, fixed_models):
    engine = FakeEngine()
    engine.name = "Ling-3.0-flash-fp4"
    engine.model_dir = Path("/models/hub/Ling-3.0-flash-fp4")

    async def run_before(pilot):
        await pilot.press("f3")
        await wait_for(pilot, lambda: pilot.app.screen.__class__.__name__ == "ModelsScreen"
                       and not pilot.app.screen.listing)
        await pilot.pause()

    assert snap_compare(make_app(engine), terminal_size=SIZE, run_before=run_before)


def test_bench_screen_published(snap_compare, make_app):
    async def run_before(pilot):
        await pilot.press("f4")
        await wait_for(pilot, lambda: getattr(pilot.app.screen, "cuda", None) is not None)
        await pilot.pause()

    assert snap_compare(make_app(FakeEngine()), terminal_size=(120, 44), run_before=run_before)


def canned_result():
    from sparkchat.engine.bench import BenchResult, BenchRow, project_spark

    def row(name, ms, nbytes, gbs, pct):
        return BenchRow(name, ms, 1000 / ms, nbytes, gbs, pct, 1 / project_spark(ms / 1000, nbytes, 4140e9, 0.98))

    rows = [row("baseline (dequantize-then-matmul experts, BF16 head) [eager]", 9.84, 4_820_000_000, 490, 11.8),
            row("+ MXFP4 expert kernels [CUDA graph]", 1.71, 4_820_000_000, 2819, 68.1),
            row("+ FP8 LM head [CUDA graph]", 1.58, 4_420_000_000, 2797, 67.6),
            BenchRow("+ MTP (3 draft steps)", 1.02, 980.4, None, None, None, 78.4,
                     "per token at accept length 2.68 (assumed (NVIDIA's published 2.68))")]
    return BenchResult("NVIDIA H200", 1024, 4140.0, True, rows, verify_decode_ratio=1.62, draft_step_ms=0.21,
                       verify_ms=2.56, accept_length=2.68, accept_length_source="assumed (NVIDIA's published 2.68)",
                       first_step_s=41.3, stream_efficiency_pct=98.0, spark_latency_ms=0.49, spark_scaled_tok_s=35.8)


def test_bench_screen_result(snap_compare, make_app):
    async def run_before(pilot):
        await pilot.press("f4")
        await wait_for(pilot, lambda: getattr(pilot.app.screen, "cuda", None) is not None)
        pilot.app.screen.show_result(canned_result(), "synthetic weights, Ling-3.0-flash-fp4 shapes, 42 layers")
        await pilot.pause()

    assert snap_compare(make_app(FakeEngine()), terminal_size=(120, 50), run_before=run_before)
