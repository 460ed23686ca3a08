#!/usr/bin/env python
"""GPU harness (H100 / H200; torch + Triton 3.6, no jax) for the persistent Gluon forward (kernel.py).

    cd notes/prototypes/gluon_persistent_fwd && python3 run_gpu.py        # < 3 minutes including compiles
    python3 run_gpu.py --skip-timing | --skip-corr

Correctness against a float32 torch reference (O and lse), each group of cases in its own subprocess with a
timeout (an mbarrier deadlock is reported as TIMEOUT with the case that was running, not hung); every case runs
with grid = number of SMs and with a small grid (7 programs: many tiles per program, so the ring / Q / turn
phases really cross tile boundaries). Then timing (bf16, D=128, B*S=32768, H=Hkv=16), one subprocess per case:
the persistent kernel (HEAD_GROUP from kernel.head_group, and HEAD_GROUP=1 = the original grid's tile order),
the non-persistent ejgen kernel, and torch's cuDNN SDPA. One table at the end.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
for p in ("/work/main", ROOT, HERE):  # the repository root (ejgen) and this folder (kernel.py)
    if p not in sys.path:
        sys.path.insert(0, p)

O_TOL = 2e-2  # max |O - O_ref| (16-bit O)
LSE_TOL = 1e-3  # max |lse - lse_ref| / max(1, |lse_ref|)
SMALL_GRID = 7

# correctness: (B, S, H, Hkv, D, causal, window, left, right)
MASKS = {
    "causal": (True, False, 0, 0),
    "win256": (False, True, 256, 0),  # window only (the right bound's code path)
    "win1024": (True, True, 1024, 0),  # causal + window (what ejgen passes for (1024, 0))
    "none": (False, False, 0, 0),
}
CORR_GROUPS = {}
for _m in MASKS:
    CORR_GROUPS[_m] = [(2, s, 8, hkv, 128, _m) for s in (1024, 1040) for hkv in (8, 2)]
CORR_GROUPS["d64"] = [(2, 1040, 8, 2, 64, "causal"), (2, 1024, 8, 8, 64, "win256")]

# timing: bf16, D=128, B*S = 32768, H = Hkv = 16
TOKENS, TH, TD = 32768, 16, 128
TIME_CASES = [("S16k_win1024", 16384, "win1024"), ("S4k_causal", 4096, "causal"), ("S16k_causal", 16384, "causal"),
              ("S4k_none", 4096, "none")]


def flops(B, H, S, D, mask):
    """4 * B * H * (visible (query, key) pairs) * D."""
    causal, window, left, right = MASKS[mask]
    pairs = 0
    for q in range(S):
        hi = min(S - 1, q + right if window else S - 1, q if causal else S - 1)
        lo = max(0, q - left) if window else 0
        pairs += max(0, hi - lo + 1)
    return 4.0 * B * H * pairs * D


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


# --- worker side ----------------------------------------------------------------------------------------------
def _setup():
    import torch
    import triton

    def alloc_fn(size, alignment, stream):  # global scratch of the device-side TMA descriptors
        return torch.empty(size, device="cuda", dtype=torch.uint8)

    triton.set_allocator(alloc_fn)
    return torch, triton


def _inputs(torch, B, S, H, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _launcher(torch, which, q, k, v, mask, head_group=None, programs=None):
    """A no-argument closure launching `which` ("persistent" / "original") on q, k, v; returns (fn, o, lse)."""
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    causal, window, left, right = MASKS[mask]
    f32 = torch.tensor([1.0 / math.sqrt(D), 0, 0, 0], device="cuda", dtype=torch.float32)
    i32 = torch.tensor([left, right, 0, 0], device="cuda", dtype=torch.int32)
    scratch = torch.empty(1024, device="cuda", dtype=torch.uint8)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, S), float("nan"), device="cuda", dtype=torch.float32)
    if which == "persistent":
        import kernel as pk
        consts = pk.constexprs(B, H, Hkv, S, D, causal, window)
        if head_group is not None:
            consts["HEAD_GROUP"] = head_group
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        grid = pk.grid(B, H, S, programs or sms)
        fn_k = pk.gluon_persistent_fwd_kernel
    else:
        from ejgen.runtime import gluon_attention, gluon_kernels
        consts = gluon_attention.constexprs(B, H, Hkv, S, D, causal, window)
        grid = (-(-S // consts["BLOCK_M"]), B * H)
        fn_k = gluon_kernels.gluon_attention_fwd_kernel

    def fn():
        fn_k[grid](q, k, v, f32, i32, o, lse, scratch, **consts, num_warps=4)

    return fn, o, lse


def reference(torch, q, k, v, mask):
    B, S, H, D = q.shape
    g = H // k.shape[2]
    causal, window, left, right = MASKS[mask]
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(g, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    i = torch.arange(S, device="cuda")[:, None]
    j = torch.arange(S, device="cuda")[None, :]
    vis = torch.ones(S, S, dtype=torch.bool, device="cuda")
    if causal:
        vis &= j <= i
    if window:
        vis &= (j >= i - left) & (j <= i + right)
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vf
    return o.transpose(1, 2), lse


def worker_corr(group):
    torch, triton = _setup()
    emit(kind="info", triton=triton.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(),
         sms=torch.cuda.get_device_properties(0).multi_processor_count)
    for (B, S, H, Hkv, D, mask) in CORR_GROUPS[group]:
        for dtype in (torch.bfloat16, ) if D == 128 else (torch.bfloat16, torch.float16):
            q, k, v = _inputs(torch, B, S, H, Hkv, D, dtype)
            o_ref, lse_ref = reference(torch, q, k, v, mask)
            for programs in (None, SMALL_GRID):
                case = f"B{B} S{S} H{H} Hkv{Hkv} D{D} {mask} {str(dtype)[6:]} grid={'SMs' if programs is None else programs}"
                print(f"START {case}", flush=True)
                try:
                    t0 = time.time()
                    fn, o, lse = _launcher(torch, "persistent", q, k, v, mask, programs=programs)
                    fn()
                    torch.cuda.synchronize()
                    o_err = (o.float() - o_ref).abs().max().item()
                    lse_err = ((lse - lse_ref).abs() / lse_ref.abs().clamp_min(1.0)).max().item()
                    ok = o_err < O_TOL and lse_err < LSE_TOL  # NaN compares False
                    emit(kind="corr", case=case, ok=ok, o_err=o_err, lse_err=lse_err, secs=round(time.time() - t0, 1))
                except Exception as e:
                    emit(kind="corr", case=case, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")


def bench(torch, fn, warmup=3, iters=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        st[i].record()
        fn()
        en[i].record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in zip(st, en))
    return ts[len(ts) // 2]


def worker_time(case):
    torch, triton = _setup()
    import kernel as pk
    name, S, mask = next(c for c in TIME_CASES if c[0] == case)
    B = TOKENS // S
    fl = flops(B, TH, S, TD, mask)
    q, k, v = _inputs(torch, B, S, TH, TH, TD, torch.bfloat16)
    hg = pk.head_group(B, TH, TH, S, TD)
    runs = [("original", "original", None), (f"persistent(HG={hg})", "persistent", None)]
    if hg != 1:
        runs.append(("persistent(HG=1)", "persistent", 1))
    for label, which, head_group in runs:
        print(f"START {case} {label}", flush=True)
        try:
            fn, o, lse = _launcher(torch, which, q, k, v, mask, head_group=head_group)
            ms = bench(torch, fn)
            bad = bool(torch.isnan(o).any().item())
            emit(kind="time", case=case, kernel=label, ms=ms, tflops=fl / ms / 1e9, nan=bad)
        except Exception as e:
            emit(kind="time", case=case, kernel=label, error=f"{type(e).__name__}: {str(e)[:300]}")
    # cuDNN SDPA ([B, H, S, D] views); a window has no SDPA flag: a dense boolean mask (full S x S work)
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        causal, window, left, right = MASKS[mask]
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        am = None
        if window:
            i = torch.arange(S, device="cuda")[:, None]
            j = torch.arange(S, device="cuda")[None, :]
            am = (j <= i + right) & (j >= i - left)
            if causal:
                am &= j <= i
        label = "cudnn_sdpa" + ("(dense mask)" if window else "")

        def fn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=am, is_causal=causal and not window)

        print(f"START {case} {label}", flush=True)
        ms = bench(torch, fn)
        emit(kind="time", case=case, kernel=label, ms=ms, tflops=fl / ms / 1e9, nan=False)
    except Exception as e:
        emit(kind="time", case=case, kernel="cudnn_sdpa", error=f"{type(e).__name__}: {str(e)[:300]}")


# --- driver side ----------------------------------------------------------------------------------------------
def start(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE, env=env)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        rc = "TIMEOUT"
    results, last_start = [], None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            results.append(json.loads(line[7:]))
        elif line.startswith("START "):
            last_start = line[6:]
    return rc, results, last_start, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corr-worker")
    ap.add_argument("--time-worker")
    ap.add_argument("--skip-corr", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--corr-timeout", type=float, default=70)
    ap.add_argument("--time-timeout", type=float, default=26)
    a = ap.parse_args()
    if a.corr_worker:
        return worker_corr(a.corr_worker)
    if a.time_worker:
        return worker_time(a.time_worker)

    t0 = time.time()
    print(f"== persistent Gluon forward (UNVERIFIED PROTOTYPE); python {sys.version.split()[0]}", flush=True)
    n_pass = n_fail = 0
    if not a.skip_corr:  # the groups in parallel (compiles are CPU bound; the kernels are tiny)
        procs = {g: start(["--corr-worker", g]) for g in CORR_GROUPS}
        for g, p in procs.items():
            rc, res, last, err = finish(p, max(5.0, a.corr_timeout - (time.time() - t0)))
            for r in res:
                if r["kind"] == "info":
                    if g == "causal":
                        print(f"   {r}", flush=True)
                elif "error" in r:
                    n_fail += 1
                    print(f"   corr {r['case']:52s} FAIL  {r['error']}", flush=True)
                else:
                    n_pass += r["ok"]
                    n_fail += not r["ok"]
                    print(f"   corr {r['case']:52s} {'PASS' if r['ok'] else 'FAIL'}  max|dO|={r['o_err']:.2e} "
                          f"lse_rel={r['lse_err']:.2e} ({r['secs']}s)", flush=True)
            if rc != 0:
                n_fail += 1
                print(f"   group {g}: rc={rc}; running when it ended: {last!r}\n" +
                      "\n".join("     " + line for line in err[-2000:].splitlines()), flush=True)
        print(f"== correctness: {n_pass} PASS, {n_fail} FAIL ({time.time() - t0:.0f}s)", flush=True)

    rows = []
    if not a.skip_timing:
        for case, S, mask in TIME_CASES:
            rc, res, last, err = finish(start(["--time-worker", case]), a.time_timeout)
            rows += res
            for r in res:
                if "error" in r:
                    print(f"   time {case:14s} {r['kernel']:22s} FAILED {r['error']}", flush=True)
            if rc != 0:
                print(f"   timing {case}: rc={rc}; running when it ended: {last!r}\n" +
                      "\n".join("     " + line for line in err[-1500:].splitlines()), flush=True)
        print("\n== bf16, D=128, H=Hkv=16, B*S=32768 (FLOPs = 4 * B * H * visible pairs * D; CUDA events, median of 15)")
        print(f"{'case':14s} {'kernel':24s} {'ms':>9s} {'TFLOP/s':>8s} {'vs original':>12s}")
        for case, S, mask in TIME_CASES:
            base = next((r["ms"] for r in rows if r["case"] == case and r["kernel"] == "original" and "ms" in r), None)
            for r in rows:
                if r["case"] == case and "ms" in r:
                    ratio = base / r["ms"] if base else float("nan")
                    print(f"{case:14s} {r['kernel']:24s} {r['ms']:9.3f} {r['tflops']:8.1f} {ratio:11.3f}x"
                          + ("  NaN in O!" if r.get("nan") else ""), flush=True)
        print("(vs original = original ms / this ms: > 1 is faster than the non-persistent kernel; the window's "
              "cuDNN runs a dense mask, i.e. the full S x S work)")
    print(f"== total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
