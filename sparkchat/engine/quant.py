"""MXFP4 and block/row FP8 packing and unpacking in pure torch.

This is the reference (and the test oracle) for the Triton kernels: every function is exact about
bit layouts and rounding, and works on CPU or GPU tensors alike.

Formats (see /work/shared/ling3-flash.md, "The fp4 release format"):
- E2M1 (FP4): 4-bit codes, bit 3 = sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
- E8M0: one uint8 per scale, value 2^(s - 127); 255 is NaN.
- MXFP4: two E2M1 codes per byte, the LOW nibble holds the EVEN input index (OCP / gpt-oss order);
  one E8M0 scale per 32 consecutive inputs.
- Block FP8: float8_e4m3fn weights, one scale per 128x128 block, w = fp8 * scale.
- Row FP8: float8_e4m3fn weights, one float32 scale per output row (the FP8 LM head).
"""

from __future__ import annotations

import torch
from torch import Tensor

# E2M1 code -> value; codes 8-15 are the negatives of codes 0-7 (code 8 is -0.0).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
MXFP4_GROUP = 32

# Midpoints between neighbouring E2M1 magnitudes. The k-th one separates code k from code k+1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Groups per chunk in quant_mxfp4: bounds the fp32 temporaries to ~128 MiB whatever the input size.
_MXFP4_CHUNK_GROUPS = 1 << 20


# ---------------------------------------------------------------------------------------------- E8M0

def e8m0_to_float(u8: Tensor) -> Tensor:
    """E8M0 codes (uint8, any shape) -> float32 2^(s - 127); 255 -> NaN. Exact, built from bits."""
    if u8.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float expects uint8, got {u8.dtype}")
    s = u8.to(torch.int32)
    # 2^(s-127) is an fp32 with biased exponent s and zero mantissa; s = 0 (2^-127) is the subnormal
    # with mantissa bit 22 set, and 255 is the quiet NaN.
    bits = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0(x: Tensor) -> Tensor:
    """Positive floats -> E8M0 codes (uint8), rounding UP to the next power of two.

    Powers of two in [2^-127, 2^127] are exact. Rounding up means a scale encoded here never
    shrinks, so w / scale cannot grow past the range it was chosen for. Values <= 2^-127 (incl. zero
    and negatives) give 0, values above 2^127 give 254, NaN and inf give 255.
    """
    x32 = x.to(torch.float32)
    mant, exp = torch.frexp(x32)  # x = mant * 2^exp, mant in [0.5, 1)
    # ceil(log2 x): exp - 1 when x is exactly a power of two (mant == 0.5), else exp.
    log2_ceil = torch.where(mant == 0.5, exp - 1, exp)
    code = (log2_ceil + 127).clamp(0, 254)
    code = torch.where(x32 > 0, code, torch.zeros_like(code))
    code = torch.where(torch.isfinite(x32), code, torch.full_like(code, 255))
    return code.to(torch.uint8)


def _floor_log2(x: Tensor) -> Tensor:
    """floor(log2 x) as int32 for finite x > 0, exact (frexp, not a float log)."""
    _, exp = torch.frexp(x)
    return exp - 1


# --------------------------------------------------------------------------------------------- MXFP4

def _e2m1_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.tensor(E2M1_VALUES, device=device, dtype=dtype)


def dequant_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """MXFP4 -> float.

    blocks: uint8 or int8 [..., out, in/2] (low nibble = even input index)
    scales: uint8 E8M0 [..., out, in/32]
    returns [..., out, in] in `dtype`. Leading dims (stacked experts) pass through.
    """
    if blocks.dtype == torch.int8:
        blocks = blocks.view(torch.uint8)  # same bytes; some releases store int8
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"dequant_mxfp4 expects uint8/int8 blocks and uint8 scales, got "
                        f"{blocks.dtype} and {scales.dtype}")
    *lead, n_out, half_in = blocks.shape
    n_in = 2 * half_in
    if n_in % MXFP4_GROUP or tuple(scales.shape) != (*lead, n_out, n_in // MXFP4_GROUP):
        raise ValueError(f"dequant_mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         f"do not match (want scales [..., out, in/{MXFP4_GROUP}])")
    # bf16 and fp32 hold every E2M1 value times every E8M0 scale exactly, so compute in them directly;
    # narrower dtypes (fp16) would overflow, so go through fp32.
    calc = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    table = _e2m1_table(blocks.device, calc)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [..., out, in/2, 2]: (even, odd)
    w = table[codes.long()].reshape(*lead, n_out, n_in // MXFP4_GROUP, MXFP4_GROUP)
    w = w * e8m0_to_float(scales).to(calc).unsqueeze(-1)
    return w.reshape(*lead, n_out, n_in).to(dtype)


def _quant_mxfp4_groups(g: Tensor) -> tuple[Tensor, Tensor]:
    """[G, 32] float -> (codes uint8 [G, 32], E8M0 scales uint8 [G])."""
    g = g.to(torch.float32)
    mag = g.abs()
    amax = mag.amax(dim=-1)  # [G]
    # OCP MX: shared exponent = floor(log2 amax) - emax(E2M1 = 2), so amax lands in [4, 8) and values
    # above 6 clamp to 6. All-zero groups take the smallest scale (any scale would do).
    exp = torch.where(amax > 0, _floor_log2(amax) - 2, torch.full_like(amax, -127, dtype=torch.int32))
    s = (exp.clamp(-127, 127) + 127).to(torch.uint8)
    # 1 / 2^(s-127) = 2^(127-s) = e8m0(254 - s): exact, no division.
    q = mag * e8m0_to_float(254 - s).unsqueeze(-1)  # |w| / scale
    # Round to the nearest E2M1 magnitude, ties to even (the code whose mantissa bit is 0): at the
    # midpoint after an even code (k even) round down, after an odd code round up. Above 5 -> 6,
    # which also clamps everything past 6.
    code = torch.zeros_like(q, dtype=torch.uint8)
    for k, mid in enumerate(_E2M1_MIDPOINTS):
        code += (q > mid) if k % 2 == 0 else (q >= mid)
    # Sign bit only for non-zero magnitudes, so zeros are always code 0 (never -0 = code 8).
    code |= ((g < 0) & (code != 0)).to(torch.uint8) << 3
    return code, s


def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [..., out, in] -> (blocks uint8 [..., out, in/2], scales uint8 E8M0 [..., out, in/32]).

    Online quantization of BF16 routed experts at load time. Shared exponent per 32 inputs as OCP MX
    chooses it (floor(log2 amax) - 2); elements round to nearest E2M1, ties to even, clamped to +-6.
    Works on the tensor's device in chunks of groups, so temporaries stay small on huge inputs.
    Non-finite inputs are not supported.
    """
    *lead, n_out, n_in = w.shape
    if n_in % MXFP4_GROUP:
        raise ValueError(f"quant_mxfp4: input dim {n_in} is not a multiple of {MXFP4_GROUP}")
    groups = w.reshape(-1, MXFP4_GROUP)  # [G, 32], a view when w is contiguous
    n_groups = groups.shape[0]
    blocks = torch.empty(n_groups, MXFP4_GROUP // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n_groups, dtype=torch.uint8, device=w.device)
    for start in range(0, n_groups, _MXFP4_CHUNK_GROUPS):
        end = min(start + _MXFP4_CHUNK_GROUPS, n_groups)
        code, s = _quant_mxfp4_groups(groups[start:end])
        # Low nibble = even input index.
        blocks[start:end] = code[:, 0::2] | (code[:, 1::2] << 4)
        scales[start:end] = s
    return blocks.reshape(*lead, n_out, n_in // 2), scales.reshape(*lead, n_out, n_in // MXFP4_GROUP)


# ----------------------------------------------------------------------------------------- block FP8

def _scale_to_float(scale: Tensor) -> Tensor:
    """A scale tensor stored as float (any width) or uint8 E8M0 -> float32."""
    if scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"scales must be floating point or uint8 E8M0, got {scale.dtype}")
    return scale.to(torch.float32)


def _pad_to_blocks(w: Tensor, b0: int, b1: int) -> Tensor:
    """Zero-pad the last two dims of w up to multiples of (b0, b1); no copy when already aligned."""
    n_out, n_in = w.shape[-2:]
    pad_out, pad_in = -n_out % b0, -n_in % b1
    if pad_out or pad_in:
        w = torch.nn.functional.pad(w, (0, pad_in, 0, pad_out))
    return w


def dequant_fp8_block(w: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Block FP8 -> float: w [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out/B0), ceil(in/B1)]
    float32 (or any float) or uint8 E8M0. Returns w * scale in `dtype`, [..., out, in]."""
    b0, b1 = block
    *lead, n_out, n_in = w.shape
    nb0, nb1 = -(-n_out // b0), -(-n_in // b1)
    if tuple(scale_inv.shape) != (*lead, nb0, nb1):
        raise ValueError(f"dequant_fp8_block: scales {tuple(scale_inv.shape)} do not match weight "
                         f"{tuple(w.shape)} with block {block} (want {(*lead, nb0, nb1)})")
    scale = _scale_to_float(scale_inv)
    # Upcast before padding: pad has no fp8 kernel everywhere, and fp32 holds every fp8 value.
    w_blk = _pad_to_blocks(w.to(torch.float32), b0, b1).reshape(*lead, nb0, b0, nb1, b1)
    out = (w_blk * scale[..., :, None, :, None]).reshape(*lead, nb0 * b0, nb1 * b1)
    return out[..., :n_out, :n_in].to(dtype)


def quant_fp8_block(w: Tensor, block: tuple[int, int] = (128, 128),
                    scale_fmt: str = "ue8m0") -> tuple[Tensor, Tensor]:
    """float [..., out, in] -> (float8_e4m3fn [..., out, in], float32 scale_inv [..., nb0, nb1]).

    scale = amax(block) / 448; with scale_fmt "ue8m0" it is rounded UP to a power of two (so every
    scaled value stays within +-448), with "float32" it is used as is. All-zero blocks get scale 1.
    """
    if scale_fmt not in ("ue8m0", "float32"):
        raise ValueError(f"quant_fp8_block: scale_fmt must be 'ue8m0' or 'float32', got {scale_fmt!r}")
    b0, b1 = block
    *lead, n_out, n_in = w.shape
    nb0, nb1 = -(-n_out // b0), -(-n_in // b1)
    w_blk = _pad_to_blocks(w.to(torch.float32), b0, b1).reshape(*lead, nb0, b0, nb1, b1)
    amax = w_blk.abs().amax(dim=(-3, -1))  # [..., nb0, nb1]
    scale = amax / FP8_E4M3_MAX
    if scale_fmt == "ue8m0":
        scale = e8m0_to_float(float_to_e8m0(scale))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    # The clamp guards float32 scales whose rounding leaves amax/scale an ulp above 448 (CUDA casts
    # out-of-range values to NaN rather than saturating).
    q = (w_blk / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.reshape(*lead, nb0 * b0, nb1 * b1)[..., :n_out, :n_in]
    return q.to(torch.float8_e4m3fn), scale


# ------------------------------------------------------------------------------------------- row FP8

def quant_fp8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], float32 scale [out]); w = fp8 * scale[:, None].

    scale = amax(row) / 448 (not rounded to a power of two); all-zero rows get scale 1.
    """
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=-1)  # [out]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w32 / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequant_fp8_rows(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Row FP8 -> float: w [out, in] float8_e4m3fn, scale [out] -> [out, in] in `dtype`."""
    if scale.shape != w.shape[:-1]:
        raise ValueError(f"dequant_fp8_rows: scale {tuple(scale.shape)} does not match weight "
                         f"{tuple(w.shape)} (want {tuple(w.shape[:-1])})")
    return (w.to(torch.float32) * _scale_to_float(scale).unsqueeze(-1)).to(dtype)
