"""The merge of the Triton decode kernel's work items (docs/DESIGN.md §3, "Decode and paged modes"): program (b, kv
head) combines the partial results of that sequence's items for that kv head by their maxima (float32), sinks joining
the denominator, in item order (so the result does not depend on how the GPU schedules programs), and writes the
output [B, SQ, HQ, DV] in the query's dtype and lse [B, HKV, G, SQ]. A sequence without items (empty) gets o = 0 and
lse = -inf, or the sinks' lse."""

import triton
import triton.language as tl


@triton.jit
def merge_kernel(O_PART, M_PART, L_PART, ITEMS, SINKS, OUT, LSE, SCRATCH,
                 HKV: tl.constexpr, G: tl.constexpr, SQ: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                 M_PAD: tl.constexpr, N_SINKS: tl.constexpr):
    off_b = tl.program_id(0)
    off_hk = tl.program_id(1)
    first = tl.load(ITEMS + off_b)
    n_splits = (tl.load(ITEMS + off_b + 1) - first) // HKV
    base = (first + off_hk * n_splits).to(tl.int64)
    r = tl.arange(0, M_PAD)
    row_ok = r < G * SQ
    o_dv = tl.arange(0, DV_PAD)
    m = tl.full([M_PAD], float("-inf"), tl.float32)
    for j in range(n_splits):
        m = tl.maximum(m, tl.load(M_PART + (base + j) * M_PAD + r))
    if N_SINKS > 0:  # sinks [HKV, G, N_SINKS]: row r is head r // SQ of the group
        p_sink = SINKS + ((off_hk * G + r // SQ) * N_SINKS)
        for s in tl.static_range(N_SINKS):
            m = tl.maximum(m, tl.load(p_sink + s, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, DV_PAD], tl.float32)
    for j in range(n_splits):
        m_j = tl.load(M_PART + (base + j) * M_PAD + r)
        w = tl.where(m_j == float("-inf"), 0.0, tl.exp(m_j - m_safe))
        denom += w * tl.load(L_PART + (base + j) * M_PAD + r)
        acc += w[:, None] * tl.load(O_PART + ((base + j) * M_PAD + r[:, None]) * DV_PAD + o_dv[None, :])
    if N_SINKS > 0:
        for s in tl.static_range(N_SINKS):
            denom += tl.where(row_ok, tl.exp(tl.load(p_sink + s, mask=row_ok, other=0.0) - m_safe), 0.0)
    ok = denom > 0
    out = acc / tl.where(ok, denom, 1.0)[:, None]
    lse = tl.where(ok, m_safe + tl.log(tl.where(ok, denom, 1.0)), float("-inf"))
    head = off_hk * G + r // SQ
    p_out = OUT + (((off_b * SQ + r % SQ) * (HKV * G) + head).to(tl.int64) * DV)[:, None] + o_dv[None, :]
    tl.store(p_out, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (o_dv[None, :] < DV))
    tl.store(LSE + (off_b * HKV + off_hk) * (G * SQ) + r, lse, mask=row_ok)
