"""A whole KDA layer core for decode/verify windows (T ≤ 8) in one Triton launch (the twin is nn.kda.kda_core).

One program per head (default), holding the head's dk×dv fp32 state in registers for all T positions:
causal conv update of the head's q|k|v channels, silu, L2 norms, gate, beta, delta-rule recurrence, gated
output RMSNorm, and the in-place conv/recurrent state updates (plus, with keep_steps, the conv window and
the per-position states a verify rolls back to). It rounds exactly where kda_core rounds: the conv output,
the gate and beta to the model dtype, o to the model dtype before the norm.

dv_blocks > 1 spreads each head's value columns over that many programs (more SMs for the state's
bytes); the head's last program to finish then applies the output norm, which needs the whole o.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait

MAX_TOKENS = 8  # longer non-chunked steps go to the torch twin
# Programs per head and warps (H200 sweep, docs/benchmarks.md): each head's value columns spread over
# 4 programs of 4 warps — one token 6.0 µs a layer (one program of 8 warps: 8.4 µs), a verify window
# of 5 with its per-position states 21.8 µs (57 µs; one program of 4 warps spills: 186 µs).
LAUNCH = (4, 4)


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for tiny x (no log1p in plain tl): the rounding error of 1 + x cancels.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype (nearest even), kept in fp32. bf16 by bit arithmetic: Triton's CPU
    interpreter truncates fp32->bf16 casts, and this is the same RTNE as the GPU's cvt.rn."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _window(in_ptr, s_in, s_inc, conv_ptr, s_cv, s_cvc, c0, r, valid, ch, dtype: tl.constexpr,
            KC: tl.constexpr):
    """Conv window rows r (where valid) of channels c0+ch: the old state's K-1 rows, then the T inputs
    (in_ptr already at column c0 of its projection). [R, DH] fp32 holding model-dtype values."""
    old = r < KC - 1
    a = tl.load(conv_ptr + r[:, None] * s_cv + (c0 + ch)[None, :] * s_cvc, mask=(valid & old)[:, None], other=0.0)
    b = tl.load(in_ptr + (r - (KC - 1))[:, None] * s_in + ch[None, :] * s_inc, mask=(valid & ~old)[:, None],
                other=0.0)
    return tl.where(old[:, None], _round(a.to(tl.float32), dtype), b.to(tl.float32))


@triton.jit
def _conv(in_ptr, s_in, s_inc, conv_ptr, s_cv, s_cvc, w_ptr, s_w, s_wc, win_ptr, wmask, c0, ch, dtype: tl.constexpr,
          T: tl.constexpr, KC: tl.constexpr, TP: tl.constexpr, WP: tl.constexpr, KP: tl.constexpr,
          W3: tl.constexpr):
    """One of q|k|v for this head's channels c0+ch: stores its window slice (if wmask); returns silu(causal conv)
    rounded to the model dtype at the T positions [TP, DH], and the new conv state rows [KP, DH].
    Small 2-D tiles (re-read from cache) rather than per-row vectors: they stay out of the registers
    the state needs."""
    rw = tl.arange(0, WP)
    x = _window(in_ptr, s_in, s_inc, conv_ptr, s_cv, s_cvc, c0, rw, rw < KC - 1 + T, ch, dtype, KC)
    tl.store(win_ptr + rw[:, None] * W3 + (c0 + ch)[None, :], x.to(dtype), mask=(rw < KC - 1 + T)[:, None] & wmask)
    t = tl.arange(0, TP)
    acc = tl.zeros((TP, ch.shape[0]), dtype=tl.float32)
    for j in tl.static_range(KC):
        w = tl.load(w_ptr + (c0 + ch) * s_w + j * s_wc).to(tl.float32)
        x = _window(in_ptr, s_in, s_inc, conv_ptr, s_cv, s_cvc, c0, t + j, t < T, ch, dtype, KC)
        acc = acc + x * w[None, :]  # the twin's left-to-right sum (0 + x0*w0 + x1*w1 ...)
    rn = tl.arange(0, KP)
    new = _window(in_ptr, s_in, s_inc, conv_ptr, s_cv, s_cvc, c0, T + rn, rn < KC - 1, ch, dtype, KC)
    return _round(acc * tl.sigmoid(acc), dtype), new


@triton.jit
def _row(x, t):
    """Row t of a [TP, DH] tile, as a [DH] vector (exact: the other rows add zeros)."""
    rows = tl.arange(0, x.shape[0])
    return tl.sum(tl.where(rows[:, None] == t, x, 0.0), axis=0)


@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, og_ptr,  # projections [T, D] ([T, H] for b), any strides
    conv_ptr, rec_ptr,  # states, updated in place: conv [K-1, 3D], recurrent [H, DH, DH] fp32 contiguous
    cw_ptr, alog_ptr, dtb_ptr, onw_ptr,  # conv weight [3D, K], A_log [H], dt_bias [D], o_norm weight [DH]
    o_ptr, win_ptr, steps_ptr,  # outputs: o [T, D], window [K-1+T, 3D], steps [T, H, DH, DH] (KEEP only)
    cnt_ptr,  # [H] int32 arrival counters, zero between launches (NB > 1 only)
    s_q, s_qc, s_k, s_kc, s_v, s_vc, s_f, s_fc, s_b, s_bc, s_og, s_ogc, s_cv, s_cvc, s_w, s_wc,
    q_scale, lower_bound, eps,
    T: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, KC: tl.constexpr, NB: tl.constexpr,
    TP: tl.constexpr, WP: tl.constexpr, KP: tl.constexpr, SAFE_GATE: tl.constexpr, KEEP: tl.constexpr,
    bx_ptr=None, bw_ptr=None,  # FOLD_B: the layer input [T, HID] and b_proj's weight [H, HID], contiguous
    FOLD_B: tl.constexpr = False, HID: tl.constexpr = 1, BKH: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """Program (h, b): head h, value columns [b*DH/NB, (b+1)*DH/NB) of its state (the delta rule never
    mixes value columns). The output norm needs the head's whole o: with NB > 1 each program stores its
    o columns (rounded, unnormalized) and the head's last program to arrive normalizes them all."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    BV: tl.constexpr = DH // NB
    D: tl.constexpr = H * DH
    dtype = q_ptr.dtype.element_ty
    i = tl.arange(0, DH)  # along dk (rows of S)
    j = vb * BV + tl.arange(0, BV)  # along dv (columns of S)
    sp = rec_ptr + h * DH * DH + i[:, None] * DH + j[None, :]
    S = tl.load(sp)  # issued first: the state is most of the bytes
    # The state was last written a whole step ago: its load may overlap the previous kernel (pdl.py).
    pdl_wait(PDL)

    # conv: this head's channels of q, k (all of them, in every program) and v (this program's block)
    c = h * DH
    first = vb == 0  # writes the q/k window slices
    qs, nq = _conv(q_ptr + c * s_qc, s_q, s_qc, conv_ptr, s_cv, s_cvc, cw_ptr, s_w, s_wc, win_ptr, first, c, i,
                   dtype, T, KC, TP, WP, KP, 3 * D)
    ks, nk = _conv(k_ptr + c * s_kc, s_k, s_kc, conv_ptr, s_cv, s_cvc, cw_ptr, s_w, s_wc, win_ptr, first, D + c, i,
                   dtype, T, KC, TP, WP, KP, 3 * D)
    vs, nv = _conv(v_ptr + c * s_vc, s_v, s_vc, conv_ptr, s_cv, s_cvc, cw_ptr, s_w, s_wc, win_ptr, True, 2 * D + c,
                   j, dtype, T, KC, TP, WP, KP, 3 * D)
    # every thread's reads of the old conv/recurrent values are done before any in-place write
    tl.debug_barrier()
    rn = tl.arange(0, KP)[:, None]
    cdt = conv_ptr.dtype.element_ty  # (the model dtype in the engine: then exact)
    nq, nk, nv = _round(nq, cdt).to(cdt), _round(nk, cdt).to(cdt), _round(nv, cdt).to(cdt)
    tl.store(conv_ptr + rn * s_cv + (2 * D + c + j)[None, :] * s_cvc, nv, mask=rn < KC - 1)
    if NB == 1:  # else the other programs of this head still read the old q/k state: the last one writes it
        tl.store(conv_ptr + rn * s_cv + (c + i)[None, :] * s_cvc, nq, mask=rn < KC - 1)
        tl.store(conv_ptr + rn * s_cv + (D + c + i)[None, :] * s_cvc, nk, mask=rn < KC - 1)

    # gate, beta and the output gate for all T positions at once, as small tiles
    t2 = tl.arange(0, TP)
    tm = (t2 < T)[:, None]
    f = tl.load(f_ptr + t2[:, None] * s_f + (c + i)[None, :] * s_fc, mask=tm, other=0.0).to(tl.float32)
    f = f + tl.load(dtb_ptr + c + i).to(tl.float32)[None, :]
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if SAFE_GATE:
        G = lower_bound * tl.sigmoid(rate * f)
    else:
        G = -rate * tl.where(f > 20.0, f, _log1p(tl.exp(tl.minimum(f, 20.0))))  # softplus, torch's threshold
    G = _round(G, dtype)  # the twin rounds the gate to the model dtype
    if FOLD_B:
        # beta's logit is one row of b_proj per head: computed here rather than by a separate GEMV
        # launch, rounded to the model dtype as the linear's output would be
        acc = tl.zeros([TP], dtype=tl.float32)
        for k0 in tl.static_range(0, HID, BKH):
            kk = k0 + tl.arange(0, BKH)
            km = kk < HID
            xw = tl.load(bx_ptr + t2[:, None] * HID + kk[None, :], mask=(t2 < T)[:, None] & km[None, :], other=0.0)
            wv = tl.load(bw_ptr + h * HID + kk, mask=km, other=0.0)
            acc += tl.sum(xw.to(tl.float32) * wv.to(tl.float32)[None, :], axis=1)
        B = _round(tl.sigmoid(_round(acc, dtype)), dtype)
    else:
        bl = tl.load(b_ptr + t2 * s_b + h * s_bc, mask=t2 < T, other=0.0)
        B = _round(tl.sigmoid(bl.to(tl.float32)), bl.dtype)  # sigmoid in beta_logit's dtype
    odt = o_ptr.dtype.element_ty
    if NB == 1:
        og = tl.load(og_ptr + t2[:, None] * s_og + (c + j)[None, :] * s_ogc, mask=tm, other=0.0).to(tl.float32)
        OG = tl.sigmoid(og)
        onw = tl.load(onw_ptr + j).to(tl.float32)

    for t in tl.static_range(T):
        q = _row(qs, t)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = _row(ks, t)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = _row(G, t)
        beta = tl.sum(tl.where(t2 == t, B, 0.0), axis=0)

        S = S * tl.exp(g)[:, None]
        delta = (_row(vs, t) - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = _round(tl.sum(S * q[:, None], axis=0), dtype)  # the twin rounds o before the norm
        if KEEP:
            tl.store(steps_ptr + t * H * DH * DH + h * DH * DH + i[:, None] * DH + j[None, :], S)
        if NB == 1:  # gated RMSNorm over the whole head, in the twin's order; round first: the cast is exact
            o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DH + eps))
            tl.store(o_ptr + t * D + c + j, _round(onw * o * _row(OG, t), odt).to(odt))
        else:
            tl.store(o_ptr + t * D + c + j, o.to(odt))  # exact, normalized below

    tl.store(sp, S)
    if NB > 1:
        # the CUTLASS semaphore pattern: CTA barrier, one release atomic; the last arrival's acquire
        # makes every program's o columns visible, and all of them are past their old-state reads
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel", scope="gpu") == NB - 1:
            tl.store(conv_ptr + rn * s_cv + (c + i)[None, :] * s_cvc, nq, mask=rn < KC - 1)
            tl.store(conv_ptr + rn * s_cv + (D + c + i)[None, :] * s_cvc, nk, mask=rn < KC - 1)
            jj = tl.arange(0, DH)
            op = o_ptr + t2[:, None] * D + (c + jj)[None, :]
            O = tl.load(op, mask=tm, other=0.0, cache_modifier=".cg").to(tl.float32)
            O = O * (1.0 / tl.sqrt(tl.sum(O * O, axis=1) / DH + eps))[:, None]
            og = tl.load(og_ptr + t2[:, None] * s_og + (c + jj)[None, :] * s_ogc, mask=tm, other=0.0)
            y = tl.load(onw_ptr + jj).to(tl.float32)[None, :] * O * tl.sigmoid(og.to(tl.float32))
            tl.store(op, _round(y, odt).to(odt), mask=tm)
            tl.atomic_xchg(cnt_ptr + h, 0)  # ready for the next launch


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logit: torch.Tensor,
               out_gate: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor, conv_w: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, o_norm_w: torch.Tensor, heads: int, head_dim: int,
               safe_gate: bool, lower_bound: float, eps: float, keep_steps: bool, chunked: bool, *,
               dv_blocks: int | None = None, num_warps: int | None = None, beta_x: torch.Tensor | None = None,
               beta_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """kda_core's signature and results, in one launch for T ≤ MAX_TOKENS (else, or chunked, the twin).
    dv_blocks > 1 splits each head's value columns over that many programs (heads × dv_blocks of them).
    With beta_x (the layer's input [T, HID]) and beta_w (b_proj's plain weight [heads, HID]) and
    beta_logit None, the kernel computes beta's logits itself."""
    T, D = q.shape
    K = conv_w.shape[1]
    nb, nw = LAUNCH
    dv_blocks, num_warps = dv_blocks or nb, num_warps or nw
    if beta_logit is None:
        assert beta_x is not None and beta_w is not None
        fold = dict(bx_ptr=beta_x.contiguous(), bw_ptr=beta_w.contiguous(), FOLD_B=True, HID=beta_x.shape[1],
                    BKH=min(512, triton.next_power_of_2(beta_x.shape[1])))
    else:
        fold = {}
    if (chunked or T > MAX_TOKENS or head_dim & (head_dim - 1) or head_dim % dv_blocks
            or not recurrent.is_contiguous()):
        from sparkchat.engine.nn.kda import kda_core
        from sparkchat.engine.nn.ops import ops

        core = ops.kda_core if ops.kda_core is not kda_decode else kda_core
        if beta_logit is None:
            beta_logit = torch.nn.functional.linear(beta_x, beta_w)
        return core(q, k, v, f, beta_logit, out_gate, conv_state, recurrent, conv_w, A_log, dt_bias, o_norm_w,
                    heads, head_dim, safe_gate, lower_bound, eps, keep_steps, chunked)
    assert D == heads * head_dim and recurrent.dtype == torch.float32 and conv_state.shape == (K - 1, 3 * D)
    assert dt_bias.is_contiguous() and o_norm_w.is_contiguous() and A_log.is_contiguous()
    o = torch.empty(T, D, dtype=q.dtype, device=q.device)
    window = torch.empty(K - 1 + T, 3 * D, dtype=q.dtype, device=q.device)
    steps = (torch.empty(T, heads, head_dim, head_dim, dtype=torch.float32, device=q.device) if keep_steps
             else None)
    cnt = arrival_counters("kda_decode", q.device, heads) if dv_blocks > 1 else o
    b = beta_logit if beta_logit is not None else o  # (unread when folded)
    kda_decode_kernel[(heads, dv_blocks)](
        q, k, v, f, b, out_gate, conv_state, recurrent, conv_w, A_log, dt_bias, o_norm_w,
        o, window, steps if keep_steps else o, cnt,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), f.stride(0), f.stride(1),
        b.stride(0), b.stride(1), out_gate.stride(0), out_gate.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_w.stride(0), conv_w.stride(1),
        float(head_dim ** -0.5), float(lower_bound), float(eps),
        T=T, H=heads, DH=head_dim, KC=K, NB=dv_blocks, TP=triton.next_power_of_2(T),
        WP=triton.next_power_of_2(K - 1 + T), KP=triton.next_power_of_2(K - 1), SAFE_GATE=bool(safe_gate),
        KEEP=bool(keep_steps), num_warps=num_warps, **fold, **pdl_args(q.device))
    return o, window, steps
