"""A whole KDA layer core for decode/verify windows (T ≤ 8) in one Triton launch (the twin is nn.kda.kda_core).

Each program holds a block of one head's dk×dv fp32 state in registers for all T positions: causal
conv update of the head's q|k|v channels, silu, L2 norms, gate, beta, delta-rule recurrence, gated output
RMSNorm, and the in-place conv/recurrent state updates, plus the conv window and (keep_steps) each
position's delta-rule inputs, from which kda_commit advances the state a verify leaves untouched. It
rounds exactly where kda_core rounds: the conv output, the gate and beta to the model dtype, o to the
model dtype before the norm.

dv_blocks (LAUNCH: 4) spreads each head's value columns over that many programs (more SMs for the
state's bytes); the head's last program to finish then applies the output norm, which needs the whole o.

A short prompt (up to PROMPT_WINDOWS_MAX_TOKENS) runs as consecutive windows of 8, 4, 2 and 1 tokens
through the same kernel, each advancing the layer's states in place: a 16-token prompt is two launches a
layer, where fla-core's chunked kernels spent ~2 ms of host time a layer (H200 host profile, docs/
benchmarks.md session 19) on launching a dozen kernels through their autotuners.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparkchat.engine.kernels.counters import arrival_counters
from sparkchat.engine.kernels.overrides import tail_at_once
from sparkchat.engine.kernels.pdl import pdl_args, pdl_wait

MAX_TOKENS = 8  # longer non-chunked steps go to the torch twin, or (no kept steps) to windows of ≤ 8
PROMPT_WINDOWS_MAX_TOKENS = 64  # prompts up to this long run in windows instead of chunked (fla-core)
# Programs per head and warps (H200 sweeps, docs/benchmarks.md): each head's value columns spread over
# 4 programs of 4 warps — one token 4.65 µs a layer (one program of 8 warps: 8.95 µs; 4 x 2 warps was
# faster alone, 4.15 µs, but not in the graphed step), a 4-token verify 9.1 µs when it kept per-position
# states (one program of 8 warps: 36.9 µs), 8.2 µs keeping its inputs. kda_commit launches the same way
# (its sums must run in the verify's order).
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
def _vectors(ptr, stride, n: tl.constexpr, dtype: tl.constexpr):
    """n rows ptr + r*stride (ptr a block of pointers) as a tuple of fp32 vectors, each rounded to dtype."""
    out = ()
    for r in tl.static_range(n):
        out = out + (_round(tl.load(ptr + r * stride).to(tl.float32), dtype),)
    return out


@triton.jit
def _win(old, new, r: tl.constexpr, KC: tl.constexpr):
    """Row r of the conv window: the K-1 old state rows, then the T inputs."""
    if r < KC - 1:
        x = old[r]
    else:
        x = new[r - (KC - 1)]
    return x


@triton.jit
def _conv(old, new, w, dtype: tl.constexpr, T: tl.constexpr, KC: tl.constexpr):
    """silu(causal depthwise conv) at the T positions, rounded to dtype: the twin's left-to-right sum
    (0 + x0*w0 + x1*w1 ...) over the window rows, all held as vectors (no reloads, no row extraction)."""
    out = ()
    for t in tl.static_range(T):
        acc = tl.zeros_like(w[0])
        for j in tl.static_range(KC):
            acc = acc + _win(old, new, t + j, KC) * w[j]
        out = out + (_round(acc * tl.sigmoid(acc), dtype),)
    return out


@triton.jit
def _store_window(win_ptr, old, new, cols, mask, T: tl.constexpr, KC: tl.constexpr, W3: tl.constexpr):
    for r in tl.static_range(KC - 1 + T):
        x = _win(old, new, r, KC)
        tl.store(win_ptr + r * W3 + cols, x.to(win_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_conv_state(conv_ptr, s_cv, cols, old, new, T: tl.constexpr, KC: tl.constexpr):
    """The new conv state: window rows T .. T+K-2, in the state's dtype (exact for the model dtype)."""
    cdt = conv_ptr.dtype.element_ty
    for r in tl.static_range(KC - 1):
        x = _win(old, new, T + r, KC)
        tl.store(conv_ptr + r * s_cv + cols, _round(x, cdt).to(cdt))


@triton.jit
def delta_rule_step(S, k, v, g, beta):
    """One position of the recurrence on a [DH, BV] state block (nn.kda.delta_rule_step): decay by e^g
    per key row, then the delta-rule correction toward v along k. The verify and kda_commit both call
    it on blocks of the same layout, so a committed state is bit for bit the one a shorter step leaves."""
    S = S * tl.exp(g)[:, None]
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    return S + k[:, None] * delta[None, :]


@triton.jit
def kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, og_ptr,  # projections [T, D] ([T, H] for b), any strides
    conv_ptr, rec_ptr,  # states, updated in place: conv [K-1, 3D], recurrent [H, DH, DH] fp32 contiguous
    cw_ptr, alog_ptr, dtb_ptr, onw_ptr,  # conv weight [3D, K], A_log [H], dt_bias [D], o_norm weight [DH]
    o_ptr, win_ptr, steps_ptr,  # outputs: o [T, D], window [K-1+T, 3D], inputs [T, H, 4, DH] fp32 (KEEP only)
    cnt_ptr,  # [H] int32 arrival counters, zero between launches (NB > 1 only)
    s_q, s_qc, s_k, s_kc, s_v, s_vc, s_f, s_fc, s_b, s_bc, s_og, s_ogc, s_cv, s_cvc, s_w, s_wc,
    q_scale, lower_bound, eps,
    T: tl.constexpr, H: tl.constexpr, DH: tl.constexpr, KC: tl.constexpr, NB: tl.constexpr,
    SAFE_GATE: tl.constexpr, KEEP: tl.constexpr,
    bx_ptr=None, bw_ptr=None,  # FOLD_B: the layer input [T, HID] and b_proj's weight [H, HID], contiguous
    FOLD_B: tl.constexpr = False, HID: tl.constexpr = 1, BKH: tl.constexpr = 1,
    PDL: tl.constexpr = False, NORM_AT_ONCE: tl.constexpr = False,
):
    """Program (h, b): head h, value columns [b*DH/NB, (b+1)*DH/NB) of its state (the delta rule never
    mixes value columns). The output norm needs the head's whole o: with NB > 1 each program stores its
    o columns (rounded, unnormalized) and the head's last program to arrive normalizes them all.

    Latency-bound (~4 MB a layer over 128 programs): every load is issued up front, in two waves —
    before the PDL wait whatever the previous kernel cannot have written (weights, the recurrent and
    conv states, written a whole step ago), after it the projections — and the conv window is kept as
    row vectors, so the kernel waits on memory twice rather than once per conv tap and tile."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    BV: tl.constexpr = DH // NB
    D: tl.constexpr = H * DH
    dtype = q_ptr.dtype.element_ty
    i = tl.arange(0, DH)  # along dk (rows of S)
    j = vb * BV + tl.arange(0, BV)  # along dv (columns of S)
    jj = tl.arange(0, DH)  # the whole head's value columns (the output norm)
    c = h * DH
    sp = rec_ptr + h * DH * DH + i[:, None] * DH + j[None, :]
    S = tl.load(sp)
    # wave 1, before the wait: states (last written a step ago, pdl.py) and constants
    cq = _vectors(conv_ptr + (c + i) * s_cvc, s_cv, KC - 1, dtype)
    ck = _vectors(conv_ptr + (D + c + i) * s_cvc, s_cv, KC - 1, dtype)
    cv = _vectors(conv_ptr + (2 * D + c + j) * s_cvc, s_cv, KC - 1, dtype)
    wq = _vectors(cw_ptr + (c + i) * s_w, s_wc, KC, tl.float32)
    wk = _vectors(cw_ptr + (D + c + i) * s_w, s_wc, KC, tl.float32)
    wv = _vectors(cw_ptr + (2 * D + c + j) * s_w, s_wc, KC, tl.float32)
    dtb = tl.load(dtb_ptr + c + i).to(tl.float32)
    rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if NB == 1:
        onw = tl.load(onw_ptr + j).to(tl.float32)
    else:
        onw = tl.load(onw_ptr + jj).to(tl.float32)
    if FOLD_B:
        bws = ()
        for k0 in tl.static_range(0, HID, BKH):
            kk = k0 + tl.arange(0, BKH)
            bws = bws + (tl.load(bw_ptr + h * HID + kk, mask=kk < HID, other=0.0).to(tl.float32),)
    pdl_wait(PDL)

    # wave 2: this step's projections (model dtype: exact in fp32)
    nq = _vectors(q_ptr + (c + i) * s_qc, s_q, T, tl.float32)
    nk = _vectors(k_ptr + (c + i) * s_kc, s_k, T, tl.float32)
    nv = _vectors(v_ptr + (c + j) * s_vc, s_v, T, tl.float32)
    fs = _vectors(f_ptr + (c + i) * s_fc, s_f, T, tl.float32)
    if NB == 1:
        ogs = _vectors(og_ptr + (c + j) * s_ogc, s_og, T, tl.float32)
    else:
        ogs = _vectors(og_ptr + (c + jj) * s_ogc, s_og, T, tl.float32)
    B = ()
    for t in tl.static_range(T):
        if FOLD_B:
            # beta's logit is one row of b_proj per head: computed here rather than by a separate GEMV
            # launch, rounded to the model dtype as the linear's output would be
            acc = tl.zeros([BKH], dtype=tl.float32)
            for k0 in tl.static_range(0, HID, BKH):
                kk = k0 + tl.arange(0, BKH)
                acc += tl.load(bx_ptr + t * HID + kk, mask=kk < HID, other=0.0).to(tl.float32) * bws[k0 // BKH]
            B = B + (_round(tl.sigmoid(_round(tl.sum(acc, axis=0), dtype)), dtype),)
        else:
            bl = tl.load(b_ptr + t * s_b + h * s_bc)
            B = B + (_round(tl.sigmoid(bl.to(tl.float32)), bl.dtype),)  # sigmoid in beta_logit's dtype

    qs = _conv(cq, nq, wq, dtype, T, KC)
    ks = _conv(ck, nk, wk, dtype, T, KC)
    vs = _conv(cv, nv, wv, dtype, T, KC)
    # the conv window (a verify rolls back to it), q/k columns from the head's first program
    first = vb == 0
    _store_window(win_ptr, cq, nq, c + i, first, T, KC, 3 * D)
    _store_window(win_ptr, ck, nk, D + c + i, first, T, KC, 3 * D)
    _store_window(win_ptr, cv, nv, 2 * D + c + j, vb >= 0, T, KC, 3 * D)
    # every thread's reads of the old conv state are done (their values were used) before any write
    tl.debug_barrier()
    _store_conv_state(conv_ptr, s_cv, (2 * D + c + j) * s_cvc, cv, nv, T, KC)
    if NB == 1:  # else the other programs of this head still read the old q/k state: the last one writes it
        _store_conv_state(conv_ptr, s_cv, (c + i) * s_cvc, cq, nq, T, KC)
        _store_conv_state(conv_ptr, s_cv, (D + c + i) * s_cvc, ck, nk, T, KC)

    odt = o_ptr.dtype.element_ty
    for t in tl.static_range(T):
        q = qs[t]
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = ks[t]
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        f = fs[t] + dtb
        if SAFE_GATE:
            g = lower_bound * tl.sigmoid(rate * f)
        else:
            g = -rate * tl.where(f > 20.0, f, _log1p(tl.exp(tl.minimum(f, 20.0))))  # softplus, torch's threshold
        g = _round(g, dtype)  # the twin rounds the gate to the model dtype

        S = delta_rule_step(S, k, vs[t], g, B[t])
        o = _round(tl.sum(S * q[:, None], axis=0), dtype)  # the twin rounds o before the norm
        if KEEP:  # the inputs kda_commit replays: k, v, g, beta (its v columns from every program)
            row = steps_ptr + (t * H + h) * 4 * DH
            tl.store(row + i, k, mask=first)
            tl.store(row + DH + j, vs[t])
            tl.store(row + 2 * DH + i, g, mask=first)
            tl.store(row + 3 * DH + i, tl.zeros_like(k) + B[t], mask=first)
        if NB == 1:  # gated RMSNorm over the whole head, in the twin's order; round first: the cast is exact
            o = o * (1.0 / tl.sqrt(tl.sum(o * o, axis=0) / DH + eps))
            tl.store(o_ptr + t * D + c + j, _round(onw * o * tl.sigmoid(ogs[t]), odt).to(odt))
        else:
            tl.store(o_ptr + t * D + c + j, o.to(odt))  # exact, normalized below

    if not KEEP:  # a verify leaves the state as it found it (kda_commit advances it)
        tl.store(sp, S)
    if NB > 1:
        # the CUTLASS semaphore pattern: CTA barrier, one release atomic; the last arrival's acquire
        # makes every program's o columns visible, and all of them are past their old-state reads
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel", scope="gpu") == NB - 1:
            _store_conv_state(conv_ptr, s_cv, (c + i) * s_cvc, cq, nq, T, KC)
            _store_conv_state(conv_ptr, s_cv, (D + c + i) * s_cvc, ck, nk, T, KC)
            o_rows = ()
            if NORM_AT_ONCE:  # every position's o loaded before any is stored: one trip to L2, not T
                for t in tl.static_range(T):
                    o_rows = o_rows + (tl.load(o_ptr + t * D + c + jj, cache_modifier=".cg").to(tl.float32),)
            for t in tl.static_range(T):
                op = o_ptr + t * D + c + jj
                if NORM_AT_ONCE:
                    O = o_rows[t]
                else:  # loaded after the stores before it
                    O = tl.load(op, cache_modifier=".cg").to(tl.float32)
                O = O * (1.0 / tl.sqrt(tl.sum(O * O, axis=0) / DH + eps))
                tl.store(op, _round(onw * O * tl.sigmoid(ogs[t]), odt).to(odt))
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
    nb, nw = LAUNCH if keep_steps or T != 1 else one_token_launch()
    dv_blocks, num_warps = dv_blocks or nb, num_warps or nw
    if not keep_steps and (T > MAX_TOKENS or chunked) and T <= PROMPT_WINDOWS_MAX_TOKENS and prompt_windows_enabled():
        return _in_windows(q, k, v, f, beta_logit, out_gate, conv_state, recurrent, conv_w, A_log, dt_bias, o_norm_w,
                           heads, head_dim, safe_gate, lower_bound, eps, dv_blocks=dv_blocks, num_warps=num_warps,
                           beta_x=beta_x, beta_w=beta_w)
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

        # a prompt's lengths vary: the uncompiled twin (as KimiDeltaAttention runs it), else the compiled one
        core = ops.kda_core if ops.kda_core is not kda_decode and not chunked else kda_core
        if beta_logit is None:
            beta_logit = torch.nn.functional.linear(beta_x, beta_w)
        return core(q, k, v, f, beta_logit, out_gate, conv_state, recurrent, conv_w, A_log, dt_bias, o_norm_w,
                    heads, head_dim, safe_gate, lower_bound, eps, keep_steps, chunked)
    assert D == heads * head_dim and recurrent.dtype == torch.float32 and conv_state.shape == (K - 1, 3 * D)
    assert dt_bias.is_contiguous() and o_norm_w.is_contiguous() and A_log.is_contiguous()
    o = torch.empty(T, D, dtype=q.dtype, device=q.device)
    window = torch.empty(K - 1 + T, 3 * D, dtype=q.dtype, device=q.device)
    steps = (torch.empty(T, heads, 4, head_dim, dtype=torch.float32, device=q.device) if keep_steps
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
        T=T, H=heads, DH=head_dim, KC=K, NB=dv_blocks, SAFE_GATE=bool(safe_gate), KEEP=bool(keep_steps),
        NORM_AT_ONCE=T > 1 and bool(tail_at_once() & 4), num_warps=num_warps, **fold, **pdl_args(q.device))
    return o, window, steps


def one_token_launch() -> tuple[int, int]:
    """(programs a head, warps) for a one-token step: LAUNCH, or SPARKCHAT_KDA_LAUNCH1=NBxW (e.g. 8x1) to
    time other shapes in the graphed step: the chain after the PDL wait is what the step pays (5.3 us a
    layer exposed on the H200, session 23), mostly reductions over a head's key rows (its norms, k·S,
    q·S) that cross warps when a program has several (one warp a program keeps them in the warp but
    needs 255 registers and spills: docs/benchmarks.md session 24). Verify windows keep LAUNCH:
    kda_commit must replay them in the very same order."""
    spec = os.environ.get("SPARKCHAT_KDA_LAUNCH1", "")
    if spec in ("", "0"):
        return LAUNCH
    nb, _, warps = spec.partition("x")
    if not (nb.isdigit() and warps.isdigit() and int(nb) >= 1 and int(warps) >= 1):
        raise ValueError(f"SPARKCHAT_KDA_LAUNCH1={spec!r}: want programs-a-head x warps, e.g. 8x1")
    return int(nb), int(warps)


def prompt_windows_enabled() -> bool:
    """Short prompts run through this kernel in windows unless SPARKCHAT_KDA_PROMPT_WINDOWS=0."""
    return os.environ.get("SPARKCHAT_KDA_PROMPT_WINDOWS", "1") != "0"


def _window_sizes(T: int) -> list[int]:
    """Windows of 8, then the rest as 4, 2, 1: the token counts decode and verify compile anyway, plus 8."""
    sizes = [MAX_TOKENS] * (T // MAX_TOKENS)
    rest = T % MAX_TOKENS
    for n in (4, 2, 1):
        if rest >= n:
            sizes.append(n)
            rest -= n
    return sizes


def _in_windows(q, k, v, f, beta_logit, out_gate, conv_state, recurrent, *args, beta_x=None, **kw):
    """kda_decode over consecutive windows of a prompt, the states advancing in place between them; the
    conv window returned is the whole prompt's, as the twin's."""
    outs, window = [], []
    t0 = 0
    for n in _window_sizes(q.shape[0]):
        sl = slice(t0, t0 + n)
        o, win, _ = kda_decode(q[sl], k[sl], v[sl], f[sl], None if beta_logit is None else beta_logit[sl],
                               out_gate[sl], conv_state, recurrent, *args, False, False,
                               beta_x=None if beta_x is None else beta_x[sl], **kw)
        outs.append(o)
        window.append(win if not window else win[win.shape[0] - n:])
        t0 += n
    return torch.cat(outs), torch.cat(window), None
