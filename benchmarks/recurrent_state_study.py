"""Why gla's chunk_state and chunk_output kernels take 3.5-4x flash-linear-attention's chunk_fwd_kernel_h and
chunk_gla_fwd_kernel_o (H200, session 22: 486 / 474 us against 125 / 136 us at B4 T4096 H16 K = V = 128, bf16).

Times the generated kernels and variants that change one thing each (torch tensors, triton.testing.do_bench; a GPU
host with torch and Triton):
  state   ours as generated, SUMS off       the chunk's gate sums scanned in the kernel on [C, BK] tiles (axis 0)
          (and on: the sums read, as the op runs it since session 22's chunk_sums)
  state-T the same sums on [BK, C] tiles    k and gk loaded transposed: the scan runs along a row, the product's
                                            operand needs no transpose in registers (same numbers as ours)
  state-pre the sums read from memory       L(j, C] and L_C precomputed (fla's chunk_local_cumsum does the like)
  state-pre16 state-pre storing bf16 states (fla's choice)
  out     ours as generated                 prefix sums scanned on [C, BK], both state operands rounded by cvt.rna
  out-T   the prefix sums on [BK, C]        q and gk transposed, the scan along a row (same numbers)
  out-pre the prefix sums read from memory
  out-rn  ours with the TF32 rounding left to the tensor cores (no cvt.rna: truncation, only to see its cost)
  out-pre16 out-pre with bf16 states and a bf16 product (fla's numerics)
  intra   chunk_intra (gk) as generated, then its blocks left of the diagonal alone and its diagonal alone, by warps

    PYTHONPATH=$PWD python3 benchmarks/recurrent_state_study.py [--b 4 --t 4096]
Prints a table (us, GB/s of the bytes each reads and writes once) and each variant's largest difference from ours.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from generated._linear_recurrent import triton_kernels as ours


@triton.jit
def state_t_kernel(K_, V_, GK, L_AFTER, L_TOT, HS, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, PRE: tl.constexpr,
                   HS16: tl.constexpr):
    i_nh, i_kv = tl.program_id(0), tl.program_id(1)
    i_k, i_v = i_kv // (V // BV), i_kv % (V // BV)
    i_n, i_h = i_nh // H, i_nh % H
    NT: tl.constexpr = T // C
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, C)
    p_h = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(0, NT):
        p_hs = HS + ((i_n * NT + i_t) * H + i_h).to(tl.int64) * K * V + p_h
        if HS16:
            tl.store(p_hs, b_h.to(tl.bfloat16))
        else:
            tl.store(p_hs, b_h)
        rows = (i_n * T + i_t * C + o_c).to(tl.int64)
        p_kt = (rows[None, :] * H + i_h) * K + o_k[:, None]  # [BK, C]
        b_kt = tl.load(K_ + p_kt).to(tl.float32)
        if PRE:
            b_after = tl.load(L_AFTER + p_kt)
            b_tot = tl.load(L_TOT + ((i_n * NT + i_t) * H + i_h) * K + o_k)
        else:
            b_lt = tl.load(GK + p_kt)
            b_after = tl.cumsum(b_lt, axis=1, reverse=True) - b_lt
            b_tot = tl.sum(b_lt, axis=1)
        b_v = tl.load(V_ + (rows[:, None] * H + i_h) * V + o_v[None, :])
        b_h = b_h * tl.exp(b_tot)[:, None] + ours._dot(b_kt * tl.exp(b_after), b_v, tl.bfloat16)


@triton.jit
def out_t_kernel(Q, V_, GK, P_PRE, HS, A, O, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, SCALE: tl.constexpr, MODE: tl.constexpr,
                 HS16: tl.constexpr):
    """MODE 0: prefix sums scanned on [BK, C]; 1: read from P_PRE [C, BK]; 2: ours with no cvt.rna (tensor cores
    truncate); HS16: bf16 states, bf16 product."""
    i_c, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_bh // H, i_bh % H
    NT: tl.constexpr = T // C
    o_c = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = (i_n * T + i_c * C + o_c).to(tl.int64)
    p_h = HS + ((i_n * NT + i_c) * H + i_h).to(tl.int64) * K * V
    b_o = tl.zeros([C, BV], dtype=tl.float32)
    for i_k in range(0, K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        if MODE == 0:
            p_t = (rows[None, :] * H + i_h) * K + o_k[:, None]  # [BK, C]
            b_qt = tl.load(Q + p_t).to(tl.float32) * tl.exp(tl.cumsum(tl.load(GK + p_t), axis=1))
            b_q = tl.trans(b_qt)
        else:
            p_r = (rows[:, None] * H + i_h) * K + o_k[None, :]  # [C, BK]
            if MODE == 1:
                b_q = tl.load(Q + p_r).to(tl.float32) * tl.exp(tl.load(P_PRE + p_r))
            else:
                b_q = tl.load(Q + p_r).to(tl.float32) * tl.exp(tl.cumsum(tl.load(GK + p_r), axis=0))
        b_s = tl.load(p_h + o_k[:, None] * V + o_v[None, :])
        if HS16:
            b_o += ours._dot(b_q, b_s.to(tl.float32), tl.bfloat16)
        elif MODE == 2 and not ours.UPCAST:
            b_o += tl.dot(b_q, b_s, input_precision="tf32")
        else:
            b_o += ours._dot_state(b_q, b_s, tl.bfloat16)
    p_a = A + ((i_n * NT + i_c) * H + i_h).to(tl.int64) * C * C + o_c[:, None] * C + o_c[None, :]
    b_a = tl.load(p_a, mask=o_c[:, None] >= o_c[None, :], other=0.0)
    b_v = tl.load(V_ + (rows[:, None] * H + i_h) * V + o_v[None, :])
    b_o = b_o * SCALE + ours._dot(b_a.to(tl.float32), b_v, tl.bfloat16)
    tl.store(O + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(O.dtype.element_ty))


@triton.jit
def intra_part_kernel(Q, K_, GK, A, T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                      BC: tl.constexpr, SCALE: tl.constexpr, PART: tl.constexpr):
    """chunk_intra (gk, dense, forward) with one of its two parts: PART 0 the blocks left of the diagonal (one TF32
    product each, factored through the step before the sub-chunk), 1 the diagonal block (`_intra`'s 16-step loop).
    Rows I of A written whole, as the generated kernel writes them."""
    NSUB: tl.constexpr = C // BC
    i_cs, i_bh = tl.program_id(0), tl.program_id(1)
    i_c, i_i = i_cs // NSUB, i_cs % NSUB
    i_n, i_h = i_bh // H, i_bh % H
    bos = i_n.to(tl.int64) * T
    eos = bos + T
    first = i_c * C + i_i * BC
    o_r = tl.arange(0, BC)
    o_k = tl.arange(0, K)
    m_k = o_k < K
    o_j = tl.arange(0, NSUB)
    b_row = tl.zeros([BC, NSUB, BC], dtype=tl.float32)
    b_q = ours._sub(Q, bos, eos, first, i_h, o_k, m_k, H, K, BC, False, False)
    b_li = ours._sub_log(GK, GK, GK, bos, eos, first, i_h, o_k, m_k, H, K, BC, False, False, True, False)
    if PART == 0:
        b_qb = b_q * tl.exp(ours._cumsum(b_li, axis=0))
        b_dec = tl.zeros([1, K], dtype=tl.float32)
        for back in range(0, i_i):
            i_j = i_i - 1 - back
            b_k = ours._sub(K_, bos, eos, i_c * C + i_j * BC, i_h, o_k, m_k, H, K, BC, False, False)
            b_l = ours._sub_log(GK, GK, GK, bos, eos, i_c * C + i_j * BC, i_h, o_k, m_k, H, K, BC, False, False,
                                True, False)
            b_kb = b_k * tl.exp(ours._after(b_l) + b_dec)
            b_blk = ours._dot_state(b_qb, tl.trans(b_kb), tl.bfloat16)
            b_row += tl.where(o_j[None, :, None] == i_j, tl.expand_dims(b_blk, 1), 0.0)
            b_dec += tl.sum(b_l, axis=0, keep_dims=True)
    else:
        b_d = ours._intra(b_q, ours._cumsum(b_li * ours.LOG2E, axis=0), K_, GK, GK, GK, bos, eos, first, i_h, i_h,
                          o_k, m_k, o_r, H, H, K, BC, False, False, True, False, False)
        b_row += tl.where(o_j[None, :, None] == i_i, tl.expand_dims(b_d, 1), 0.0)
    o_c = tl.arange(0, C)
    p_a = A + (((i_n * (T // C) + i_c) * H + i_h) * C + i_i * BC + o_r[:, None]).to(tl.int64) * C + o_c[None, :]
    tl.store(p_a, (tl.reshape(b_row, [BC, C]) * SCALE).to(A.dtype.element_ty))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", type=int, default=4)
    p.add_argument("--t", type=int, default=4096)
    p.add_argument("--warps", default="8,4", help="warps to try for the variants (ours: host.CHUNKED's 8)")
    p.add_argument("--cpu", action="store_true", help="Triton's interpreter on tiny shapes: the diffs only, no times")
    args = p.parse_args()
    B, T, H, K, V, C, BK, BV = args.b, args.t, 16, 128, 128, 64, 64, 64
    NT = T // C
    dev, bf = ("cpu" if args.cpu else "cuda"), torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, device=dev, dtype=bf) for _ in range(3))
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev)) / 16
    # the sums the kernels scan, in float32 as they do: L(j, C] (reverse cumsum less own), L_C, prefix sums P
    gkc = gk.view(B, NT, C, H, K)
    after = (gkc.flip(2).cumsum(2).flip(2) - gkc).view(B, T, H, K).contiguous()
    tot = gkc.sum(2).contiguous()  # [B, NT, H, K]
    pre = gkc.cumsum(2).view(B, T, H, K).contiguous()
    hs = torch.zeros(B * NT, H, K, V, device=dev)
    hs16 = torch.zeros(B * NT, H, K, V, device=dev, dtype=bf)
    ht = torch.zeros(B * H, K, V, device=dev)
    a = torch.randn(B * NT, H, C, C, device=dev).tril().to(bf)
    o = torch.empty(B, T, H, V, device=dev, dtype=bf)
    nil = torch.zeros(1, device=dev)
    dt = tl.bfloat16
    gb = 1e-9

    def ours_state(w=8, s=2, sums=False):
        return lambda: ours.linear_recurrent_chunk_state_kernel[(B * H, (K // BK) * (V // BV))](
            k, v, nil, nil, gk, after, tot, nil, nil, nil, hs, ht, T=T, H=H, HKV=H, K=K, V=V, BK=BK, BV=BV, C=C,
            USE_G=False, USE_GAMMA=False, USE_GK=True, USE_H0=False, VARLEN=False, REVERSE=False, MAP=False, DT=dt,
            SUMS=sums, num_warps=w, num_stages=s)

    def state_t(pre_, hs16_, w, s=2):
        out = hs16 if hs16_ else hs
        return lambda: state_t_kernel[(B * H, (K // BK) * (V // BV))](
            k, v, gk, after, tot, out, T=T, H=H, K=K, V=V, BK=BK, BV=BV, C=C, PRE=pre_, HS16=hs16_,
            num_warps=w, num_stages=s)

    def ours_out(w=8, s=2, sums=False):
        return lambda: ours.linear_recurrent_chunk_output_kernel[(NT, V // BV, B * H)](
            q, k, v, nil, nil, gk, pre, nil, nil, hs, a, o, T=T, H=H, HKV=H, K=K, V=V, BK=BK, BV=BV, C=C, BC=16,
            SCALE=K ** -0.5, USE_G=False, USE_GAMMA=False, USE_GK=True, VARLEN=False, REVERSE=False, MAP=False,
            DT=dt, SUMS=sums, num_warps=w, num_stages=s)

    def out_t(mode, hs16_, w, s=2):
        return lambda: out_t_kernel[(NT, V // BV, B * H)](
            q, v, gk, pre, hs16 if hs16_ else hs, a, o, T=T, H=H, K=K, V=V, BK=BK, BV=BV, C=C, SCALE=K ** -0.5,
            MODE=mode, HS16=hs16_, num_warps=w, num_stages=s)

    sb = {"state": 4 * B * T * H * K * 2 + B * T * H * K * 4 + B * NT * H * K * V * 4}
    ob = 4 * B * T * H * K * 2 + B * T * H * K * 4 + B * NT * H * K * V * 4 + B * NT * H * C * C * 2
    rows = []

    def run(name, fn, bytes_, check=None):
        try:
            fn()
            if args.cpu:
                ms = float("nan")
            else:
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            diff = check() if check else ""
            rows.append((name, ms * 1e3, bytes_ * gb / (ms * 1e-3), diff))
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a row, not the end
            rows.append((name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:160]}"))
        print(rows[-1], flush=True)

    run("state (ours, 8 warps, 2 stages)", ours_state(), sb["state"])
    ref_hs = hs.clone()
    run("state (ours with SUMS: chunk_sums' sums)", ours_state(sums=True), sb["state"],
        lambda: f"{(hs - ref_hs).abs().max().item():.2e}")
    o_ref = None
    for w in [int(x) for x in args.warps.split(",")]:
        for s in ((2,) if args.cpu else (2, 3)):
            run(f"state-T w{w} s{s}", state_t(False, False, w, s), sb["state"],
                lambda: f"{(hs - ref_hs).abs().max().item():.2e}")
            run(f"state-pre w{w} s{s}", state_t(True, False, w, s), sb["state"],
                lambda: f"{(hs - ref_hs).abs().max().item():.2e}")
            run(f"state-pre16 w{w} s{s}", state_t(True, True, w, s), sb["state"] - B * NT * H * K * V * 2,
                lambda: f"{(hs16.float() - ref_hs).abs().max().item():.2e}")
    hs.copy_(ref_hs)
    hs16.copy_(ref_hs.to(bf))
    run("out (ours, 8 warps, 2 stages)", ours_out(), ob)
    o_ref = o.clone()
    run("out (ours with SUMS)", ours_out(sums=True), ob,
        lambda: f"{(o.float() - o_ref.float()).abs().max().item():.2e}")

    def odiff():
        return f"{(o.float() - o_ref.float()).abs().max().item():.2e}"

    for w in [int(x) for x in args.warps.split(",")]:
        for s in ((2,) if args.cpu else (2, 3)):
            run(f"out-T w{w} s{s}", out_t(0, False, w, s), ob, odiff)
            run(f"out-pre w{w} s{s}", out_t(1, False, w, s), ob, odiff)
            run(f"out-rn w{w} s{s}", out_t(2, False, w, s), ob, odiff)
            run(f"out-pre16 w{w} s{s}", out_t(1, True, w, s), ob - B * NT * H * K * V * 2, odiff)
    # chunk_intra (gk): the generated kernel against its two parts alone (where its 0.78 ms goes), by warps
    a_ref = torch.zeros_like(a)

    def ours_intra(w=2):
        return lambda: ours.linear_recurrent_chunk_intra_kernel[(NT * (C // 16), B * H)](
            q, k, nil, nil, nil, gk, nil, nil, nil, a_ref, nil, T=T, H=H, HKV=H, K=K, V=V, BK=K, BV=64, C=C, BC=16,
            SCALE=K ** -0.5, USE_G=False, USE_GAMMA=False, USE_GK=True, VARLEN=False, REVERSE=False, MAP=False,
            DT=dt, GRADS=False, WITH_A=True, num_warps=w, num_stages=1)

    def intra_part(part, w):
        return lambda: intra_part_kernel[(NT * (C // 16), B * H)](q, k, gk, a, T=T, H=H, K=K, C=C, BC=16,
                                                                   SCALE=K ** -0.5, PART=part, num_warps=w)

    ib = 3 * B * T * H * K * 2 + B * T * H * K * 4 + B * NT * H * C * C * 2
    run("intra (ours, 2 warps)", ours_intra(), ib)
    for w in ((2,) if args.cpu else (1, 2, 4, 8)):
        run(f"intra left of the diagonal, w{w}", intra_part(0, w), ib)
        run(f"intra diagonal, w{w}", intra_part(1, w), ib)
    part_sum = lambda: f"{(a.float() - a_ref.float()).abs().max().item():.2e}"  # noqa: E731
    intra_part(0, 2)()
    left = a.clone()
    intra_part(1, 2)()
    a.add_(left)
    run("intra: the two parts' sum against ours (check)", lambda: None, 0, part_sum)
    print(f"\n{'interpreter' if args.cpu else torch.cuda.get_device_name()}; B{B} T{T} H{H} K=V={K}, chunks of {C}, BK = BV = 64, bf16\n")
    print("| kernel | us | GB/s | max diff vs ours |\n|---|---|---|---|")
    for name, us, gbs, diff in rows:
        print(f"| {name} | {us:.1f} | {gbs:.0f} | {diff} |")


if __name__ == "__main__":
    main()
