"""CPU-only SASS probe (no GPU): would 16-byte weight loads cut the one-token MXFP4 MoE's instructions?

    python benchmarks/moe_vec_sass_probe.py

A stage-1-like k loop over one expert's rows where each thread loads 4 consecutive words (16 bytes) of a
row, one E8M0 byte per 4 words (applied once to their summed products), and the activations as int32
bf16 pairs (one PRMT + one bf16x2 multiply by 2^100 per pair, shared by the rows), compiled for sm_90
and counted per weight, against the engine kernel's k loop (`sass_stats.py`: 3.57 per weight). Answer
(docs/benchmarks.md, session 8): 3.4-4.1 per weight — no cut. The loads were never the bulk: decoding
the E2M1 pairs (shifts and masks, ~18 integer instructions a word) is.
"""
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton.language as tl  # noqa: E402
import triton  # noqa: E402,F401
import sass_stats as st  # noqa: E402
from sparkchat.engine.kernels.mxfp4_moe import _WORD_DOT_ASM, _e8m0_scale  # noqa: E402

_PAIR_ASM = tl.constexpr("""
{
.reg .b32 t, c;
mov.b32 c, c;
prmt.b32 t, $4, $6, 0x5410; mul.rn.bf16x2 $0, t, c;
prmt.b32 t, $4, $6, 0x7632; mul.rn.bf16x2 $1, t, c;
prmt.b32 t, $5, $7, 0x5410; mul.rn.bf16x2 $2, t, c;
prmt.b32 t, $5, $7, 0x7632; mul.rn.bf16x2 $3, t, c;
}
""")


@triton.jit
def _xpairs(x32, k0, BKW: tl.constexpr):
    xw = tl.load(x32 + (k0 + tl.arange(0, BKW))[:, None] * 4 + tl.arange(0, 4)[None, :])  # [BKW, 4]
    e, o = tl.split(tl.reshape(xw, [BKW, 2, 2]))  # e: x32[4w + 2p], o: x32[4w + 2p + 1]
    a0, a2 = tl.split(e)
    a1, a3 = tl.split(o)
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,=r,=r,=r,r,r,r,r", [a0, a1, a2, a3],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def vec_kernel(x_ptr, w_ptr, s_ptr, y_ptr, KW: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
               UNROLL: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BN, BKW // 4], dtype=tl.float32)
    for k0 in tl.range(0, KW, BKW, loop_unroll_factor=UNROLL):
        w = tl.load(w_ptr + rows[:, None] * KW + (k0 + tl.arange(0, BKW))[None, :])
        s = tl.load(s_ptr + rows[:, None] * (KW // 4) + (k0 // 4 + tl.arange(0, BKW // 4))[None, :])
        p0, p1, p2, p3 = _xpairs(x32, k0, BKW)
        d = tl.inline_asm_elementwise(_WORD_DOT_ASM, "=r,r,r,r,r,r",
                                      [w, p0[None, :], p1[None, :], p2[None, :], p3[None, :]],
                                      dtype=tl.float32, is_pure=True, pack=1)
        g = tl.sum(tl.reshape(d, [BN, BKW // 4, 4]), axis=2)
        acc += g * _e8m0_scale(s)
    tl.store(y_ptr + rows, tl.sum(acc, axis=1))


def main() -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*fp32"}
    for bn, bkw, warps, unroll in [(16, 64, 4, 2), (32, 64, 4, 1), (16, 64, 2, 2), (8, 64, 2, 2), (16, 128, 4, 1)]:
        k = st.compile_kernel(vec_kernel, sig, dict(KW=320, BN=bn, BKW=bkw, UNROLL=unroll), warps, 90)
        ttg = k.asm["ttgir"]
        sass = st.disassemble(k, "vec")
        body = st.loop_body(sass)
        per = bn * bkw * 8 * (unroll if len(body) else 1) / (32 * warps)
        c = Counter(st._op(i) for i in body)
        print(f"bn{bn} bkw{bkw} w{warps} u{unroll}: regs {st.registers(k, 'vec')}, converts {ttg.count('convert_layout')}, "
              f"loop {len(body)} instr, {len(body) / per:.2f}/weight, LDG {c['LDG']} STS {c['STS']} LDS {c['LDS']} BAR {c['BAR']}")
        print("   ", c.most_common(12))


if __name__ == "__main__":
    main()
