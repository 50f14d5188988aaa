"""CPU-only SASS probe (no GPU): how many instructions would activations stored pre-packed save the MoE?

    python benchmarks/moe_act_sass_probe.py

Each MoE k step turns every word column's 8 activations into 4 bf16x2 words (`_pack_x`: 8 loads, a
scale by 2^100, bf16 conversions and packing). If the kernel before wrote them in that form — stage 1
writing `act` for stage 2, the add+norm writing `x` for stage 1 — a column would be 4 int32 loads. This
compiles a copy of kernels/mxfp4_moe.py whose `_pack_x` does just that for both stages and counts the
k loops' sm_90 instructions per weight against the engine's, with the tuned configs on paired words.
Stage 2's half has since been built (`MoeConfig.packed_act`, counted by sass_stats.py); stage 1's x,
which the add+norm kernel would have to write, has not. Result in docs/benchmarks.md (session 9).
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import sass_stats as st  # noqa: E402
from sparkchat.engine.kernels import mxfp4_moe as engine  # noqa: E402

PREPACKED = '''def _pack_x(base, offs, INTERPRET: tl.constexpr):
    p = base.to(tl.pointer_type(tl.int32))  # 4 bf16x2 words per 8 activations, as _pack_x makes them
    out = ()
    for i in tl.static_range(4):
        out = out + (tl.load(p + offs // 2 + i),)
    return out


'''


def prepacked_module():
    src = Path(engine.__file__).read_text()
    start = src.index("def _pack_x(base, offs, INTERPRET: tl.constexpr):")
    end = src.index("@triton.jit", start)
    path = Path(tempfile.mkdtemp()) / "mxfp4_moe_prepacked.py"
    path.write_text(src[:start] + PREPACKED + src[end:])
    spec = importlib.util.spec_from_file_location("sparkchat.engine.kernels.mxfp4_moe_prepacked", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # Triton resolves the kernels' globals through the module
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    for mod, name in ((engine, "engine"), (prepacked_module(), "pre-packed activations")):
        for T in (1, 4):
            cfg = mod.moe_config(T, st.H, st.INTER)
            plan = mod._plan(T, st.K, st.H, st.INTER, cfg, True)
            stages = ((1, mod.mxfp4_moe_stage1_kernel, st._STAGE1_SIG, plan.meta1, 2 * cfg.rs1 * cfg.bn1, cfg.bkw1,
                       cfg.unroll1),
                      (2, mod.mxfp4_moe_stage2_kernel, st._STAGE2_SIG, {**plan.meta2, "HAS_ADD": True},
                       cfg.rs2 * cfg.bn2, cfg.bkw2, cfg.unroll2))
            for stage, fn, sig, meta, rows, bkw, unroll in stages:
                meta = {**meta, "PDL": True, "INTERPRET": False}
                warps = meta.pop("num_warps")
                sass = st.compile_sass(fn, sig, meta, warps, 90)
                body = st.loop_body(sass)
                per = rows * bkw * 8 * unroll / (32 * warps)
                loop = f"k loop {len(body)} instructions, {len(body) / per:.2f} per weight" if body else "k loop unrolled"
                print(f"{name:<24} T={T} stage {stage}: {loop}; whole kernel {len(sass)}")


if __name__ == "__main__":
    main()
