"""The paired MXFP4 word layout the decode kernels read: the 8 codes of each 32-bit word moved so that
the bf16x2 of codes (j, j+4) comes out of one shift and one mask for three of the four pairs.

The checkpoint stores code j of a word (input 8w + j) at bits 4j..4j+3 (m, e0, e1, sign). The kernels
multiply codes j and j+4 together as one bf16x2 whose halves hold sign at bit 15 and e1 e0 m at bits
8:6 (kernels/mxfp4_moe.py). From the checkpoint order each pair takes two shifts, two masks and an or.
Paired order, low half (codes 0-3; codes 4-7 sit at the same bits 16 higher):

    pair 0 (codes 0, 4)  m e0 e1 at 6 7 8, sign at 15    -> w & 0x81C081C0
    pair 1 (codes 1, 5)  m e0 e1 at 0 1 2, sign at 9     -> (w << 6) & 0x81C081C0
    pair 2 (codes 2, 6)  m e0 e1 at 3 4 5, sign at 12    -> (w << 3) & 0x81C081C0
    pair 3 (codes 3, 7)  m e0 at 10 11, e1 at 13, sign at 14: the bits left over, three shifts

No placement gives all four pairs the one-shift form (a code needs bits q, q+1, q+2, q+9 and four such
sets cannot tile 16 bits). Scales are untouched. Installing the MoE kernels pairs an engine's experts in
place (`Experts.use_paired_words`; SPARKCHAT_MOE_PAIRED=0 keeps or restores the checkpoint's order); the
dequantize-then-matmul path unpairs an expert's words before reading them. In sm_90 SASS the one-token
MoE's k loops go from 3.57 to 3.08 instructions per weight (stage 1) and 4.08 to 3.56 (stage 2).
"""

from __future__ import annotations

import os

import torch

# Paired position of each checkpoint bit 4j + b (code j, b = m, e0, e1, sign) of a word's low half.
PAIRED_LOW_BITS = {0: (6, 7, 8, 15), 1: (0, 1, 2, 9), 2: (3, 4, 5, 12), 3: (10, 11, 13, 14)}

# (shift, checkpoint-bit mask): paired = OR of (w & mask) shifted left by `shift` (right when negative).
# Derived from PAIRED_LOW_BITS (tests/test_mxfp4_layout.py checks it); the Triton kernel spells it out.
MOVES = ((-5, 0x07000700), (-4, 0x00700070), (-2, 0x30003000), (-1, 0xC000C000),
         (1, 0x08000800), (2, 0x00800080), (6, 0x00070007), (12, 0x00080008))


def _shift(v, s: int):
    return v << s if s >= 0 else v >> -s


def _permute(words: torch.Tensor, inverse: bool) -> torch.Tensor:
    assert words.dtype == torch.uint8 and words.shape[-1] % 4 == 0, "uint8 words, last dim a multiple of 4"
    w = words.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for s, mask in MOVES:
        out |= _shift(w & _shift(mask, s), -s) if inverse else _shift(w & mask, s)
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)
    return out.view(torch.uint8).view(words.shape)


def pair_words_reference(words: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order MXFP4 bytes (uint8 [..., n], n % 4 == 0) -> the same codes in paired order."""
    return _permute(words, inverse=False)


def unpair_words_reference(words: torch.Tensor) -> torch.Tensor:
    """Paired-order bytes -> checkpoint order (the inverse of pair_words_reference)."""
    return _permute(words, inverse=True)


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def permute_words_(words: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Reorder MXFP4 bytes into paired order (or back, `inverse`) in place: on the GPU one Triton pass
    and no second copy of the experts (on a DGX Spark a copy would not fit next to them). Returns `words`."""
    assert words.dtype == torch.uint8 and words.is_contiguous() and words.shape[-1] % 4 == 0
    if _on_triton(words):
        from sparkchat.engine.kernels.mxfp4_moe import permute_words

        permute_words(words, words, inverse=inverse)
    else:  # the torch twin, a slice of rows at a time: its int64 temporaries stay small
        for rows in words.view(-1, words.shape[-1]).split(4096):
            rows.copy_(_permute(rows, inverse=inverse))
    return words


def unpair_words(words: torch.Tensor) -> torch.Tensor:
    """Paired-order bytes -> a new tensor in checkpoint order (an expert at a time, to dequantize it)."""
    assert words.dtype == torch.uint8 and words.shape[-1] % 4 == 0
    if not _on_triton(words):
        return unpair_words_reference(words)
    from sparkchat.engine.kernels.mxfp4_moe import permute_words

    src = words.contiguous()
    return permute_words(src, torch.empty_like(src), inverse=True)
