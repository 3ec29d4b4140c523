"""The fused per-call routing kernels' device code (`@triton.jit`; MHAR_SPEC sections 2 and 4).
Their launch side (configurations, alignment, the launch wrappers) is `triton_routing`; grouped
routing's phase-1 kernels (`grouped_kernels`) reuse the helpers here.

One program handles BLOCK_T tokens as a [BLOCK_T, HB, KB] register tile (HB = next_pow2(H),
KB = next_pow2(K), K = d/H; masks cover non-power-of-two K such as 160) and loops once over
the N sources:

    r_n         = (sum(s_n^2)/d + eps)^-1/2          statistic over the full d (fp32)
    khat_n      = fp32(storage(s_n * r_n))           rounded like HF RMSNorm, then * g
    logit_{n,h} = <q_h, (khat_n * g)_h>
    online softmax over n, accumulator kept normalised (a running convex combination, so
    values near the storage dtype's maximum cannot overflow the fp32 accumulator).

Sources are rows of one depth buffer (`depth_buffer`): source n starts at
BUF + SLOTS[n] * B*T*d (`_slot_base`, int64), its gradient at the same offset in GRADS. A (d,)
null source is a separate argument, source 0 (row stride 0: broadcast over tokens).

Saved for backward by the caller: the statistics STATS (N + 1, B*T, H) in fp32 (rows 0..N-1 the
logits, row N the lse: one tensor, one allocation and one saved tensor per call) and the
normalised mix (B, T, d): the output itself in replacement mode, an extra output of the forward
in delta mode (one row written). The backward kernel reads each source ONCE: S_h = <dmix_h, mix_h>
comes from the saved mix (rounded to the storage dtype: in bf16 the measured gradient errors equal
the eager path's), so every source's gradient is written in the same pass that reads it: into a
gradient row, or (HAS_ACCUM, per source by a flag in ACCUM) added to what a later site's
backward already wrote there, one rounding to the storage dtype per addition.
dq, dg, dalpha and dnull are accumulated over the token tiles of a fixed number of programs
(`reduce_programs`) and written as (programs, d) partial sums that the host reduces in a fixed
order: no atomics, so results are bitwise repeatable, and no per-site (B*T, d) partial buffers.

Aligned variant (ALIGNED=True, chosen on the host by `aligned`): every row starts on a 16-byte
boundary and d and the head width are multiples of 8 elements, so
the kernels tell the compiler so (`tl.multiple_of`) and get 128-bit loads and stores; otherwise
the general variant makes no such promise (a wrong hint would fault). The loop over sources is
software-pipelined (`tl.range(..., num_stages=NUM_STAGES)`).

All loads are cast to fp32 right away and outputs are cast at the store (the interpreter
cannot do arithmetic on bf16). float64 sources run the same kernels in float64 (gradcheck).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter, read as Triton reads it (its runtime
    knob: 1, true, on or yes; an older Triton without knobs: "1")."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Triton reads the flag when the @triton.jit decorators run, so it must be set before this import;
# every kernel module is decorated together (triton_routing imports grouped_kernels).
INTERPRET = interpret_requested()


# ---------------------------------------------------------------------------- device code
@triton.jit
def _to_storage(x, TY: tl.constexpr, RNE_BF16: tl.constexpr):
    """Cast fp32 x to TY. The interpreter truncates fp32 -> bf16 where a GPU rounds to nearest
    even; with RNE_BF16 the rounding is done on the bits first, so both give the same values
    (bf16 subnormals aside)."""
    if RNE_BF16 and TY == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    return x.to(TY)


@triton.jit
def _slot_base(BUF, SLOTS, n, BT, D, ALIGNED: tl.constexpr):
    """Pointer to token 0 of the depth-buffer row that source n of the call reads (or of its gradient
    row, with BUF the gradient buffer): BUF + SLOTS[n] * B*T * d, in int64 (a row is up to 2^31
    elements). In the aligned variant it is known to be 16-byte aligned."""
    base = BUF + tl.load(SLOTS + n).to(tl.int64) * BT * D
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return base


@triton.jit
def _load_source(base, rows, cols, mask, D, CDT: tl.constexpr):
    """Tile [BLOCK_T, HB, KB] of the source whose token 0 is at `base` (row stride d), cast to the
    compute dtype."""
    return tl.load(base + rows * D + cols, mask=mask, other=0.0).to(CDT)


@triton.jit
def _load_null(NULL, rows, cols, mask, CDT: tl.constexpr):
    """The (d,) null source broadcast over the tile's tokens [BLOCK_T, HB, KB] (row stride 0)."""
    return tl.load(NULL + rows * 0 + cols, mask=mask, other=0.0).to(CDT)


@triton.jit
def _inv_rms_and_key(v, D, eps, SRC_TY: tl.constexpr, CDT: tl.constexpr, RNE_BF16: tl.constexpr):
    """r = (mean over the full d of v^2 + eps)^-1/2 per token [BLOCK_T, 1, 1] and the rounded
    normalised key khat = fp32(storage(v * r)) (MHAR_SPEC section 4, steps 2-3)."""
    ss = tl.sum(tl.sum(v * v, axis=2), axis=1)
    if CDT == tl.float32:
        r = 1.0 / tl.sqrt_rn(ss / D + eps)  # correctly rounded, also on a GPU
    else:
        r = 1.0 / tl.sqrt(ss / D + eps)
    r = r[:, None, None]
    khat = _to_storage(v * r, SRC_TY, RNE_BF16).to(CDT)
    return r, khat


@triton.jit
def _online_step(v, row, acc, m, l, qg, g, LOGITS, th, thmask, BT, H, D, eps, SRC_TY: tl.constexpr,
                 CDT: tl.constexpr, RNE_BF16: tl.constexpr):
    """One source tile v [BLOCK_T, HB, KB] into the online depth softmax (acc, m, l); its logits
    are stored in statistics row `row`."""
    r, khat = _inv_rms_and_key(v, D, eps, SRC_TY, CDT, RNE_BF16)
    logit = tl.sum(khat * g * qg, axis=2)  # [BLOCK_T, HB]
    tl.store(LOGITS + row * BT * H + th, logit, mask=thmask)
    m_new = tl.maximum(m, logit)
    keep = l * tl.exp(m - m_new)
    p = tl.exp(logit - m_new)
    l_new = keep + p
    acc = acc * (keep / l_new)[:, :, None] + v * (p / l_new)[:, :, None]
    return acc, m_new, l_new


@triton.jit
def _route_fwd_kernel(
    BUF, SLOTS, NULL, Q, G, PARTIAL, ALPHA, STATE_OUT, STATE_LSE,
    OUT, MIX, RES, STATS,
    N, BT, D, H, K, eps,
    HAS_NULL: tl.constexpr, HAS_PARTIAL: tl.constexpr, HAS_STATE: tl.constexpr, HAS_RES: tl.constexpr,
    ALIGNED: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_T: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, CDT: tl.constexpr, RNE_BF16: tl.constexpr,
):
    SRC_TY: tl.constexpr = BUF.dtype.element_ty
    if ALIGNED:
        D = tl.multiple_of(D, 8)
        K = tl.multiple_of(K, 8)
    LOGITS = STATS  # STATS (HAS_NULL + N + 1, B*T, H): the null's and the N sources' logits rows, then the lse row
    LSE = STATS + (N + HAS_NULL) * BT * H
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, HB)
    k = tl.arange(0, KB)
    rows = t[:, None, None].to(tl.int64)
    cols = h[None, :, None] * K + k[None, None, :]
    cmask = (h[None, :, None] < H) & (k[None, None, :] < K)
    tmask = t[:, None, None] < BT
    mask = tmask & cmask
    th = t[:, None] * H + h[None, :]  # [BLOCK_T, HB] index into (B*T, H)
    thmask = (t[:, None] < BT) & (h[None, :] < H)

    qg = tl.load(Q + cols, mask=cmask, other=0.0).to(CDT)
    g = tl.load(G + cols, mask=cmask, other=0.0).to(CDT)

    if HAS_STATE:  # incoming online-softmax state: normalised mix and its log-sum-exp
        acc = tl.load(STATE_OUT + rows * D + cols, mask=mask, other=0.0).to(CDT)
        m = tl.load(STATE_LSE + th, mask=thmask, other=0.0).to(CDT)
        l = tl.where(m > float("-inf"), 1.0, 0.0).to(CDT)
    else:
        acc = tl.zeros([BLOCK_T, HB, KB], CDT)
        m = tl.full([BLOCK_T, HB], float("-inf"), CDT)
        l = tl.zeros([BLOCK_T, HB], CDT)

    if HAS_NULL:  # the (d,) null source is source 0 (statistics row 0)
        v = _load_null(NULL, rows, cols, mask, CDT)
        acc, m, l = _online_step(v, 0, acc, m, l, qg, g, LOGITS, th, thmask, BT, H, D, eps, SRC_TY, CDT, RNE_BF16)
    for n in tl.range(0, N, num_stages=NUM_STAGES):
        v = _load_source(_slot_base(BUF, SLOTS, n, BT, D, ALIGNED), rows, cols, mask, D, CDT)
        acc, m, l = _online_step(v, n + HAS_NULL, acc, m, l, qg, g, LOGITS, th, thmask, BT, H, D, eps, SRC_TY, CDT,
                                 RNE_BF16)

    tl.store(LSE + th, m + tl.log(l), mask=thmask)
    if HAS_PARTIAL:  # delta routing: partial + alpha * mix, one rounding at the store; the mix is kept
        saved = _to_storage(acc, MIX.dtype.element_ty, RNE_BF16)
        tl.store(MIX + rows * D + cols, saved, mask=mask)
        alpha = tl.load(ALPHA).to(CDT)
        out = tl.load(PARTIAL + rows * D + cols, mask=mask, other=0.0).to(CDT) + alpha * acc
        tl.store(OUT + rows * D + cols, _to_storage(out, OUT.dtype.element_ty, RNE_BF16), mask=mask)
    else:
        saved = _to_storage(acc, OUT.dtype.element_ty, RNE_BF16)
        tl.store(OUT + rows * D + cols, saved, mask=mask)
    if HAS_RES:  # what rounding the saved mix lost, so that the backward's <dmix, mix> is the fp32 one
        tl.store(RES + rows * D + cols, _to_storage(acc - saved.to(CDT), RES.dtype.element_ty, RNE_BF16), mask=mask)


@triton.jit
def _source_grad(v, w, dmix, S, qg, g, r, khat, D):
    """Closed-form backward for one source (MHAR_SPEC section 4; the storage cast is identity).

    Returns dv [BLOCK_T, HB, KB] and this source's dq, dg contributions summed over tokens."""
    a = tl.sum(dmix * v, axis=2)  # <dmix_h, v_h>, [BLOCK_T, HB]
    dlogit = (w * (a - S))[:, :, None]
    dq = tl.sum(dlogit * khat * g, axis=0)
    dkey = dlogit * qg  # d logit / d (khat * g)
    dg = tl.sum(dkey * khat, axis=0)
    dkp = dkey * g
    c = tl.sum(tl.sum(dkp * v, axis=2), axis=1)[:, None, None]
    # r * dkp - (r^3 / d) <dkp, v> v, ordered so that r^3 never appears: it underflows fp32
    # once the source's RMS exceeds ~1e12, while c * r * r stays O(|dkp| |v| r^2).
    dv = r * (dkp - (c * r * r / D) * v) + w[:, :, None] * dmix
    return dv, dq, dg


@triton.jit
def _route_bwd_kernel(
    BUF, SLOTS, GRADS, ACCUM, NULL, Q, G, ALPHA, DOUT, MIX, RES, STATS,
    PARTS, DALPHA_PART, STATE_LSE, DSTATE, DSTATE_NORM,
    N, BT, D, H, K, eps,
    HAS_ALPHA: tl.constexpr, HAS_NULL: tl.constexpr, HAS_ACCUM: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_STATE: tl.constexpr, WRITE_DSTATE: tl.constexpr, ALIGNED: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_T: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, CDT: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    SRC_TY: tl.constexpr = BUF.dtype.element_ty
    if ALIGNED:
        D = tl.multiple_of(D, 8)
        K = tl.multiple_of(K, 8)
    LOGITS = STATS  # the forward's STATS (HAS_NULL + N + 1, B*T, H): the logits rows, then the lse row
    LSE = STATS + (N + HAS_NULL) * BT * H
    # PARTS (2 or 3, programs, d) fp32: the programs' partial sums of dq, dg (and dnull)
    DQ_PART = PARTS
    DG_PART = PARTS + tl.num_programs(0) * D
    DNULL_PART = PARTS + 2 * tl.num_programs(0) * D
    pid = tl.program_id(0)
    h = tl.arange(0, HB)
    k = tl.arange(0, KB)
    hk = h[:, None] * K + k[None, :]  # [HB, KB]
    cols = hk[None, :, :]
    cmask2 = (h[:, None] < H) & (k[None, :] < K)
    cmask = cmask2[None, :, :]
    qg = tl.load(Q + cols, mask=cmask, other=0.0).to(CDT)
    g = tl.load(G + cols, mask=cmask, other=0.0).to(CDT)

    dq = tl.zeros([HB, KB], CDT)
    dg = tl.zeros([HB, KB], CDT)
    dnull = tl.zeros([HB, KB], CDT)
    dalpha = tl.zeros([BLOCK_T, HB], CDT)
    # Persistent programs: token tiles pid, pid + P, ...; dq, dg (dalpha, dnull) summed over them.
    for tile in range(pid, tl.cdiv(BT, BLOCK_T), tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = t[:, None, None].to(tl.int64)
        mask = (t[:, None, None] < BT) & cmask
        th = t[:, None] * H + h[None, :]
        thmask = (t[:, None] < BT) & (h[None, :] < H)
        lse = tl.load(LSE + th, mask=thmask, other=0.0).to(CDT)
        dout = tl.load(DOUT + rows * D + cols, mask=mask, other=0.0).to(CDT)
        mix = tl.load(MIX + rows * D + cols, mask=mask, other=0.0).to(CDT)  # saved by the forward
        if HAS_RES:
            mix += tl.load(RES + rows * D + cols, mask=mask, other=0.0).to(CDT)
        if HAS_ALPHA:
            dalpha += tl.sum(dout * mix, axis=2)
            dmix = tl.load(ALPHA).to(CDT) * dout
        else:
            dmix = dout
        S = tl.sum(dmix * mix, axis=2)  # <dmix_h, mix_h>, [BLOCK_T, HB]
        if HAS_STATE:  # the incoming state (a source of logit lse_state): d state mix, d state normaliser
            w0 = tl.where(thmask, tl.exp(tl.load(STATE_LSE + th, mask=thmask, other=0.0).to(CDT) - lse), 0.0)
            tl.store(DSTATE_NORM + th, -w0 * S, mask=thmask)
            if WRITE_DSTATE:
                tl.store(DSTATE + rows * D + cols, _to_storage(w0[:, :, None] * dmix, DSTATE.dtype.element_ty,
                                                              RNE_BF16), mask=mask)
        if HAS_NULL:  # source 0 is the (d,) null source: its gradient is summed over the tokens
            v = _load_null(NULL, rows, cols, mask, CDT)
            logit = tl.load(LOGITS + th, mask=thmask, other=0.0).to(CDT)
            w = tl.where(thmask, tl.exp(logit - lse), 0.0)
            r, khat = _inv_rms_and_key(v, D, eps, SRC_TY, CDT, RNE_BF16)
            dv, dq_n, dg_n = _source_grad(v, w, dmix, S, qg, g, r, khat, D)
            dq += dq_n
            dg += dg_n
            dnull += tl.sum(tl.where(mask, dv, 0.0), axis=0)
        # One read of each source, one write of its gradient.
        for n in tl.range(0, N, num_stages=NUM_STAGES):
            v = _load_source(_slot_base(BUF, SLOTS, n, BT, D, ALIGNED), rows, cols, mask, D, CDT)
            logit = tl.load(LOGITS + (n + HAS_NULL) * BT * H + th, mask=thmask, other=0.0).to(CDT)
            w = tl.where(thmask, tl.exp(logit - lse), 0.0)
            r, khat = _inv_rms_and_key(v, D, eps, SRC_TY, CDT, RNE_BF16)
            dv, dq_n, dg_n = _source_grad(v, w, dmix, S, qg, g, r, khat, D)
            dq += dq_n
            dg += dg_n
            dptr = _slot_base(GRADS, SLOTS, n, BT, D, ALIGNED) + rows * D + cols
            if HAS_ACCUM:  # add into the gradient buffer that later sites' backward already wrote
                accumulate = (rows * 0 + tl.load(ACCUM + n)) != 0  # [BLOCK_T, 1, 1]
                dv += tl.load(dptr, mask=mask & accumulate, other=0.0).to(CDT)
            tl.store(dptr, _to_storage(dv, SRC_TY, RNE_BF16), mask=mask)
    tl.store(DQ_PART + pid * D + hk, dq, mask=cmask2)
    tl.store(DG_PART + pid * D + hk, dg, mask=cmask2)
    if HAS_ALPHA:
        tl.store(DALPHA_PART + pid, tl.sum(tl.sum(dalpha, axis=1), axis=0))
    if HAS_NULL:
        tl.store(DNULL_PART + pid * D + hk, dnull, mask=cmask2)
