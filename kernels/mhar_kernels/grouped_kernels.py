"""The fused phase-1 kernels of grouped depth routing: device code (`@triton.jit`; docs/DESIGN.md
"Grouped routing"). Their launch side, autograd Function and custom ops are `triton_grouped`.


For a group of g routing sites and the n sources s_1..s_n that exist when it starts, phase 1
computes, for every site i and routing head h, the online-softmax state over the sources site i
reads (a (g, n) read table; MHAR_SPEC section 2 for the logits):

    l_{n,i,h}  = <q_i[h], (fp32(storage(s_n r_n)) g_i)[h]>      r_n over the full d
    lse_{i,h}  = logsumexp over the sources site i reads of l_{n,i,h}
    mix_i[h]   = sum_n exp(l_{n,i,h} - lse_{i,h}) s_n[h]         (normalised; stored in the storage dtype)

in one pass over the sources: a program holds a [BLOCK_T, SB, HB, KB] accumulator (SB sites of
the group, HB = next_pow2(H), KB = next_pow2(K)), loads each source tile once, computes its
inverse RMS and rounded key once and the SB sites' logits from it. The normaliser of the eager
reference (`norm_i`, identically 1) is not computed; its gradient enters the backward.

Backward (the log-sum-exp held constant, as in the eager reference, so mix_i and norm_i are
plain sums over the sources): per source, recompute its key and the SB sites' logits, then

    a_{n,i}    = exp(l_{n,i} - lse_i)                 (0 where site i does not read source n)
    dl_{n,i}   = a_{n,i} (<dmix_i[h], s_n[h]> + dnorm_i)
    ds_n       = RMSNorm backward of sum_i dl_{n,i} q_i g_i  +  sum_i a_{n,i} dmix_i[h]
    T_i        = sum over tokens and sources of dl_{n,i} khat_n;  dq_i = T_i g_i, dg_i = T_i q_i

so each source's gradient is written once per group. Programs are persistent over token tiles
(`triton_routing.reduce_programs`); T (and the null source's gradient) are written as
(programs, g, d) fp32 partial sums that the host reduces in a fixed order: no atomics, bitwise
repeatable, no per-site (B*T, d) partial buffers.

Site chunks. g sites of d values in fp32 do not fit one program's registers: on a GPU a program
holds one token's [HB, KB] source tile (at the paper's shapes; 2, 4 or 8 warps, each thread 8
contiguous elements of a source row, one 16-byte cp.async of bf16) and SB = 2 sites of it, so a
launch splits the group into C = ceil(g / SB) chunks of SB sites (`launch_config`). In the
forward the C chunk programs of one token tile are adjacent in launch order, so each source is
read C times, all but the first from L2. In the backward one program runs the C chunks of a
token tile one after another: chunk c > 0 adds its part of every source's gradient into what
chunk c - 1 stored and adds its sites' key-gradient sums into the program's own rows of the
partial sums, so each gradient row is written by one launch and never summed on the host.
Chunk c re-reads the tile's sources and gradient rows, 4 N d bytes of bf16 per program since
chunk c - 1 read them: from L2 where P such programs fit it (264 on an H200, 50 MB of L2: up to
11 MB at 100m and 46 MB at 350m, but 60-91 MB in the three deepest groups at 1b, where part of
them comes from HBM). `traffic` counts every row once per launch (as cache hits), as the complete
byte count does. C = 2 at the debug flavor (g = 3), 3 at 100m (g = 5), 4 at 350m (g = 7) and 6
at 1b (g = 11), forward and backward (docs/DESIGN.md "Grouped routing" lists registers and
chunks).

Sources are rows of the depth buffer and their gradients rows of its gradient buffer, as in
`routing_kernels` (the backward writes a row, or adds into it where ACCUM says a later reader
wrote it); the g mixes and their incoming gradients are rows of one (g, B*T, d) tensor each; a
(d,) null source is source 0. All loads are cast to fp32 (fp64 for fp64 sources) and outputs
are rounded at the store (`_to_storage`: the interpreter cannot do bf16 arithmetic).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .routing_kernels import _inv_rms_and_key, _load_null, _load_source, _slot_base, _to_storage


# ---------------------------------------------------------------------------- device code
@triton.jit
def _phase1_step(v, n, acc, m, l, READS, C, s, gq, D, eps, SB: tl.constexpr, SRC_TY: tl.constexpr,
                 CDT: tl.constexpr, RNE_BF16: tl.constexpr):
    """Source n's tile v [BLOCK_T, HB, KB] into the SB sites' online depth softmax (acc, m, l), for
    the sites that read it (read-table row n)."""
    r, khat = _inv_rms_and_key(v, D, eps, SRC_TY, CDT, RNE_BF16)
    logit = tl.sum(khat[:, None, :, :] * gq[None, :, :, :], axis=3)  # [BLOCK_T, SB, HB]
    read = tl.load(READS + n * C * SB + s) != 0  # [SB]; padded sites read nothing
    logit = tl.where(read[None, :, None], logit, float("-inf"))
    m_new = tl.maximum(m, logit)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a site that has read nothing yet
    keep = l * tl.exp(m - shift)
    p = tl.exp(logit - shift)
    l_new = keep + p
    inv = tl.where(l_new > 0, 1.0 / tl.where(l_new > 0, l_new, 1.0), 0.0)
    acc = acc * (keep * inv)[:, :, :, None] + v[:, None, :, :] * (p * inv)[:, :, :, None]
    return acc, m_new, l_new


@triton.jit
def _phase1_fwd_kernel(
    BUF, SLOTS, NULL, READS, MIX, Q, G, LSE,
    N, NG, C, BT, D, H, K, eps,
    HAS_NULL: tl.constexpr, ALIGNED: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_T: tl.constexpr, SB: tl.constexpr,
    HB: tl.constexpr, KB: tl.constexpr, CDT: tl.constexpr, RNE_BF16: tl.constexpr,
):
    SRC_TY: tl.constexpr = BUF.dtype.element_ty
    if ALIGNED:
        D = tl.multiple_of(D, 8)
        K = tl.multiple_of(K, 8)
    pid = tl.program_id(0)
    chunk = pid % C  # the chunks of one token tile are adjacent: repeated source reads hit L2
    t = (pid // C) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = chunk * SB + tl.arange(0, SB)
    h = tl.arange(0, HB)
    k = tl.arange(0, KB)
    smask = s < NG
    rows = t[:, None, None].to(tl.int64)
    cols = h[None, :, None] * K + k[None, None, :]  # [1, HB, KB]
    cmask = (h[None, :, None] < H) & (k[None, None, :] < K)
    mask = (t[:, None, None] < BT) & cmask
    site_cols = s[:, None, None] * D + cols  # [SB, HB, KB] into the (g, d) query / key-norm rows
    site_cmask = smask[:, None, None] & cmask
    gq = tl.load(Q + site_cols, mask=site_cmask, other=0.0).to(CDT) * \
        tl.load(G + site_cols, mask=site_cmask, other=0.0).to(CDT)

    acc = tl.zeros([BLOCK_T, SB, HB, KB], CDT)
    m = tl.full([BLOCK_T, SB, HB], float("-inf"), CDT)
    l = tl.zeros([BLOCK_T, SB, HB], CDT)
    if HAS_NULL:  # the (d,) null source is source 0 (read-table row 0)
        v = _load_null(NULL, rows, cols, mask, CDT)
        acc, m, l = _phase1_step(v, 0, acc, m, l, READS, C, s, gq, D, eps, SB, SRC_TY, CDT, RNE_BF16)
    for n in tl.range(0, N, num_stages=NUM_STAGES):
        v = _load_source(_slot_base(BUF, SLOTS, n, BT, D, ALIGNED), rows, cols, mask, D, CDT)
        acc, m, l = _phase1_step(v, n + HAS_NULL, acc, m, l, READS, C, s, gq, D, eps, SB, SRC_TY, CDT, RNE_BF16)

    th = s[None, :, None] * BT * H + t[:, None, None] * H + h[None, None, :]  # (g, B*T, H): site-major
    thmask = (t[:, None, None] < BT) & smask[None, :, None] & (h[None, None, :] < H)
    tl.store(LSE + th, m + tl.log(tl.where(thmask, l, 1.0)), mask=thmask)
    out = MIX + (s.to(tl.int64) * BT * D)[None, :, None, None]  # the (g, B*T, d) mixes, in the storage dtype
    tl.store(out + rows[:, None] * D + cols[:, None], _to_storage(acc, SRC_TY, RNE_BF16),
             mask=mask[:, None] & smask[None, :, None, None])


@triton.jit
def _phase1_source_grad(v, n, READS, C, s, gq, dmix, dnorm, lse, thmask, D, eps, SB: tl.constexpr,
                        SRC_TY: tl.constexpr, CDT: tl.constexpr, RNE_BF16: tl.constexpr):
    """Backward of phase 1 for source n's tile v [BLOCK_T, HB, KB] at SB sites (module docstring):
    its gradient dv [BLOCK_T, HB, KB] and its key-gradient sums sum_t dl khat [SB, HB, KB]."""
    r, khat = _inv_rms_and_key(v, D, eps, SRC_TY, CDT, RNE_BF16)
    logit = tl.sum(khat[:, None, :, :] * gq[None, :, :, :], axis=3)  # [BLOCK_T, SB, HB]
    read = tl.load(READS + n * C * SB + s) != 0
    a = tl.where(thmask & read[None, :, None], tl.exp(logit - lse), 0.0)
    dl = a * (tl.sum(dmix * v[:, None, :, :], axis=3) + dnorm)
    t_n = tl.sum(dl[:, :, :, None] * khat[:, None, :, :], axis=0)
    dkp = tl.sum(dl[:, :, :, None] * gq[None, :, :, :], axis=1)  # [BLOCK_T, HB, KB]
    c = tl.sum(tl.sum(dkp * v, axis=2), axis=1)[:, None, None]
    # RMSNorm backward as in triton_routing._source_grad (no r^3), plus the mixing term
    dv = r * (dkp - (c * r * r / D) * v) + tl.sum(a[:, :, :, None] * dmix, axis=1)
    return dv, t_n


@triton.jit
def _phase1_bwd_kernel(
    BUF, SLOTS, GRADS, ACCUM, NULL, READS, DMIX, Q, G, DNORM, LSE, T_PART, DNULL_PART,
    N, NG, C, BT, D, H, K, eps,
    HAS_NULL: tl.constexpr, HAS_ACCUM: tl.constexpr, CHUNKED: tl.constexpr, ALIGNED: tl.constexpr,
    NUM_STAGES: tl.constexpr, BLOCK_T: tl.constexpr,
    SB: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, CDT: tl.constexpr, RNE_BF16: tl.constexpr,
):
    SRC_TY: tl.constexpr = BUF.dtype.element_ty
    if ALIGNED:
        D = tl.multiple_of(D, 8)
        K = tl.multiple_of(K, 8)
    prog = tl.program_id(0)
    programs = tl.num_programs(0)
    h = tl.arange(0, HB)
    k = tl.arange(0, KB)
    hk = h[:, None] * K + k[None, :]  # [HB, KB]
    cmask2 = (h[:, None] < H) & (k[None, :] < K)
    cols = hk[None, :, :]
    cmask = cmask2[None, :, :]

    tacc = tl.zeros([SB, HB, KB], CDT)  # one chunk: sum of dl * khat over tokens and sources
    dnull = tl.zeros([HB, KB], CDT)
    for tile in range(prog, tl.cdiv(BT, BLOCK_T), programs):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = t[:, None, None].to(tl.int64)
        mask = (t[:, None, None] < BT) & cmask
        # The site chunks of this token tile, one after another in this program: chunk c > 0
        # adds into the gradients chunk c - 1 stored (the tile's sources and gradients are hot)
        for chunk in range(0, C):
            s = chunk * SB + tl.arange(0, SB)
            smask = s < NG
            site_cols = s[:, None, None] * D + cols
            site_cmask = smask[:, None, None] & cmask
            q = tl.load(Q + site_cols, mask=site_cmask, other=0.0).to(CDT)
            gq = tl.load(G + site_cols, mask=site_cmask, other=0.0).to(CDT) * q  # [SB, HB, KB]
            dmix_rows = DMIX + (s.to(tl.int64) * BT * D)[None, :, None, None]  # (g, B*T, d), storage dtype
            mask4 = mask[:, None] & smask[None, :, None, None]
            th = s[None, :, None] * BT * H + t[:, None, None] * H + h[None, None, :]  # (g, B*T, H)
            thmask = (t[:, None, None] < BT) & smask[None, :, None] & (h[None, None, :] < H)
            dmix = tl.load(dmix_rows + rows[:, None] * D + cols[:, None], mask=mask4, other=0.0).to(CDT)
            dnorm = tl.load(DNORM + th, mask=thmask, other=0.0).to(CDT)
            lse = tl.load(LSE + th, mask=thmask, other=0.0).to(CDT)
            tchunk = tl.zeros([SB, HB, KB], CDT)
            if HAS_NULL:  # source 0 is the (d,) null source: its gradient is summed over the tokens
                v = _load_null(NULL, rows, cols, mask, CDT)
                dv, t_n = _phase1_source_grad(v, 0, READS, C, s, gq, dmix, dnorm, lse, thmask, D, eps, SB, SRC_TY,
                                              CDT, RNE_BF16)
                tchunk += t_n
                dnull += tl.sum(tl.where(mask, dv, 0.0), axis=0)
            # One read of each source, one write of its gradient (the chunks of a tile add into it).
            for n in tl.range(0, N, num_stages=NUM_STAGES):
                v = _load_source(_slot_base(BUF, SLOTS, n, BT, D, ALIGNED), rows, cols, mask, D, CDT)
                dv, t_n = _phase1_source_grad(v, n + HAS_NULL, READS, C, s, gq, dmix, dnorm, lse, thmask, D, eps, SB, SRC_TY,
                                              CDT, RNE_BF16)
                tchunk += t_n
                dptr = _slot_base(GRADS, SLOTS, n, BT, D, ALIGNED) + rows * D + cols
                if HAS_ACCUM:  # add into the shared buffer a later reader wrote, or an earlier chunk did
                    add = ((rows * 0 + tl.load(ACCUM + n)) != 0) | (chunk > 0)  # [BLOCK_T, 1, 1]
                    dv += tl.load(dptr, mask=mask & add, other=0.0).to(CDT)
                tl.store(dptr, _to_storage(dv, SRC_TY, RNE_BF16), mask=mask)
            if CHUNKED:  # this program's partial sums of the chunk's sites (its own rows of T_PART)
                part = T_PART + prog * NG * D + site_cols
                tl.store(part, tl.load(part, mask=site_cmask, other=0.0) + tchunk, mask=site_cmask)
            else:
                tacc += tchunk
    if not CHUNKED:
        s = tl.arange(0, SB)
        site_cols = s[:, None, None] * D + cols
        tl.store(T_PART + prog * NG * D + site_cols, tacc, mask=(s < NG)[:, None, None] & cmask)
    if HAS_NULL:
        tl.store(DNULL_PART + prog * D + hk, dnull, mask=cmask2)  # (programs, d)
