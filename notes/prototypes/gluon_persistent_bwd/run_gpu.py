#!/usr/bin/env python
"""GPU harness (H100 / H200; torch + Triton 3.6, no jax) for the persistent Gluon backward (kernel.py).

    cd notes/prototypes/gluon_persistent_bwd && python3 run_gpu.py      # < 3 minutes including compiles
    python3 run_gpu.py --skip-timing | --skip-corr

Every group of cases runs in its own subprocess and all of them start at once: they compile their kernels
(`warmup`, no launch) in parallel, then take a file lock for each piece of GPU work, so timings never overlap
with other work. A subprocess that does not finish before the deadline is killed and reported as TIMEOUT with
the case it was running (an mbarrier deadlock shows up this way instead of hanging the harness).

Correctness (float32 torch reference; lse and delta = rowsum(dO * O) from the reference forward): dQ, dK, dV of
  * the ORIGINAL per-program kernel (ejgen.runtime.attention.gluon.kernels.gluon_attention_bwd_kernel, grid
    (cdiv(S, 128), B * Hkv)): the control;
  * the persistent kernel (HEAD_GROUP automatic), its EPI_TMA form and its dynamic-scheduler form (DYNAMIC=1,
    "persistent_dyn"), each with grid = #SMs and with grid = 7
    programs (each program then walks 5-21 tiles, so every ring / K / V / dS phase crosses tile boundaries);
  * on two cases also HEAD_GROUP=3 with grid = 7 (a short last head section), static and dynamic.
  Cases: B=2, S in {1024, 1040}, H=8, Hkv in {8, 2}, D=128 bf16, MASK 0 / 1 / 2 (window 256 to the left), and D=64
  bf16 / f16 (causal S=1040 Hkv=2; window S=1024 Hkv=8). Pass: max|x - ref| / max|ref| < 2e-2 for each of dQ, dK,
  dV (NaN fails). Also printed: max|dK|, |dV| difference from the original kernel (the same arithmetic in the
  same order: expected 0) and the dQ difference (float32 adds in another order).
Timing (bf16, D=128, B*S=32768, H=Hkv=16; CUDA events around the kernel alone, dQ zeroed before each launch,
3 warm-ups, median of 15): S=16384 window (1024, 0) [MASK 2], S=4096 causal, S=16384 causal, S=4096 none; the
original, the persistent kernel with the static (DYNAMIC=0) and the dynamic (DYNAMIC=1, tile counter zeroed before
each launch outside the events) tile scheduler, each with automatic HEAD_GROUP and HEAD_GROUP=1. lse is
the analytic log of each row's visible keys (values do not change the work); the outputs are checked for NaN and
against the original's.
"""
import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
for _p in (ROOT, HERE):  # the repository root (ejgen) and this folder (kernel.py)
    if _p not in sys.path:
        sys.path.insert(0, _p)

REL_TOL = 2e-2  # max |x - ref| / max |ref| for dQ, dK, dV
SMALL_GRID = 7
LOCK = os.path.join(tempfile.gettempdir(), "gluon_persistent_bwd_gpu.lock")

# name -> (MASK constexpr, window left)
MASKS = {"none": (0, 0), "causal": (1, 0), "win256": (2, 256), "win1024": (2, 1024)}
# correctness groups: (B, S, H, Hkv, D, mask); D=64 runs bf16 and f16, D=128 bf16
CORR_GROUPS = {f"{m}_S{s}": [(2, s, 8, hkv, 128, m) for hkv in (8, 2)]
               for m in ("none", "causal", "win256") for s in (1024, 1040)}
CORR_GROUPS["d64_causal"] = [(2, 1040, 8, 2, 64, "causal")]
CORR_GROUPS["d64_win256"] = [(2, 1024, 8, 8, 64, "win256")]
HG3_CASES = {(2, 1040, 8, 8, 128, "causal"), (2, 1040, 8, 2, 128, "win256")}  # + HEAD_GROUP=3, grid 7

# timing: bf16, D=128, B*S = 32768, H = Hkv = 16
TOKENS, TH, TD = 32768, 16, 128
TIME_CASES = [("S16k_win1024", 16384, "win1024"), ("S4k_causal", 4096, "causal"), ("S16k_causal", 16384, "causal"),
              ("S4k_none", 4096, "none")]


def visible_pairs(S, mask):
    mask_id, left = MASKS[mask]
    if mask_id == 0:
        return S * S
    if mask_id == 1:
        return S * (S + 1) // 2
    return sum(min(i, left) + 1 for i in range(S))


def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


class gpu_lock:
    """Exclusive use of the GPU among this harness's subprocesses (released if the holder dies)."""

    def __enter__(self):
        self.fh = open(LOCK, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


# --- worker side ----------------------------------------------------------------------------------------------
def _setup():
    import torch
    import triton

    def alloc_fn(size, alignment, stream):  # global scratch of the device-side TMA descriptors
        return torch.empty(size, device="cuda", dtype=torch.uint8)

    triton.set_allocator(alloc_fn)
    return torch, triton


def _sms(torch):
    return torch.cuda.get_device_properties(0).multi_processor_count


def kernel_call(torch, which, q, k, v, do, lse, delta, mask, programs=None, head_group=None, overrides=None):
    """(run, warm, dq, dk, dv): run() launches `which` ("original", "persistent", "persistent_epi", "persistent_dyn":
    DYNAMIC=1) into dq (float32, must be zeroed before), dk, dv; warm() compiles it without launching. run.ctr: the
    int32 tile counter (DYNAMIC), to be zeroed before each launch as dq. overrides: constexprs of the persistent
    kernel to replace (e.g. K_STAGES)."""
    import kernel as pk
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.attention.gluon import kernels as gluon_kernels

    B, S, H, D = q.shape
    Hkv = k.shape[2]
    mask_id, left = MASKS[mask]
    causal, window = mask_id >= 1, mask_id == 2
    f32 = torch.tensor([1.0 / math.sqrt(D), 0, 0, 0], device="cuda", dtype=torch.float32)
    i32 = torch.tensor([left, 0, 0, 0], device="cuda", dtype=torch.int32)
    scratch = torch.empty(1024, device="cuda", dtype=torch.uint8)  # unused by the body (triton.set_allocator)
    dq = torch.zeros(B, S, H, D, device="cuda", dtype=torch.float32)
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    ctr = torch.zeros(4, device="cuda", dtype=torch.int32)  # TILE_CTR (persistent kernels; used by DYNAMIC=1)
    if which == "original":
        fn = gluon_kernels.gluon_attention_bwd_kernel
        consts = gluon_attention.bwd_constexprs(B, H, Hkv, S, D, causal, window)
        grid = (-(-S // consts["BLOCK_N"]), B * Hkv)
    else:
        fn = pk.gluon_persistent_bwd_kernel
        consts = pk.constexprs(B, H, Hkv, S, D, causal, window, head_group_=head_group,
                               epi_tma=which == "persistent_epi", dynamic=which == "persistent_dyn")
        consts.update(overrides or {})
        grid = pk.grid(B, Hkv, S, programs or _sms(torch))
    if which == "original":
        args = (q, k, v, do, lse, delta, f32, i32, dq, dk, dv, scratch)
    else:
        args = (q, k, v, do, lse, delta, f32, i32, dq, dk, dv, ctr, scratch)

    def run():
        fn[grid](*args, **consts, num_warps=4)

    run.ctr = ctr

    def warm():
        try:
            fn.warmup(*args, grid=grid, **consts, num_warps=4)
        except Exception as e:  # compiled by the first launch instead
            print(f"warmup failed ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr, flush=True)

    return run, warm, dq, dk, dv


def reference(torch, q, k, v, do, mask):
    """float32 autograd: (dq, dk, dv) like q, k, v, and lse, delta [B, H, S] (delta = rowsum(dO * O))."""
    B, S, H, D = q.shape
    G = H // k.shape[2]
    mask_id, left = MASKS[mask]
    qf = q.float().transpose(1, 2).contiguous().requires_grad_()
    kf = k.float().transpose(1, 2).contiguous().requires_grad_()
    vf = v.float().transpose(1, 2).contiguous().requires_grad_()
    dof = do.float().transpose(1, 2)
    s = (qf @ kf.repeat_interleave(G, dim=1).transpose(-1, -2)) * (1.0 / math.sqrt(D))
    i = torch.arange(S, device="cuda")[:, None]
    j = torch.arange(S, device="cuda")[None, :]
    vis = torch.ones(S, S, dtype=torch.bool, device="cuda")
    if mask_id >= 1:
        vis &= j <= i
    if mask_id == 2:
        vis &= i - j <= left
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ vf.repeat_interleave(G, dim=1)
    o.backward(dof)
    delta = (dof * o.detach()).sum(-1)
    return (qf.grad.transpose(1, 2), kf.grad.transpose(1, 2), vf.grad.transpose(1, 2), lse.detach().contiguous(),
            delta.contiguous())


def _rel(x, ref):
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def worker_corr(group):
    torch, triton = _setup()
    emit(kind="info", triton=triton.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(),
         sms=_sms(torch))
    plan = []  # (case label, inputs key, kernel, programs, head_group)
    inputs = {}
    for (B, S, H, Hkv, D, mask) in CORR_GROUPS[group]:
        for dtype in (torch.bfloat16, ) if D == 128 else (torch.bfloat16, torch.float16):
            key = (B, S, H, Hkv, D, mask, dtype)
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
            k = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
            v = torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=g)
            do = torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=g)
            lse = torch.zeros(B, H, S, device="cuda", dtype=torch.float32)  # filled from the reference below
            delta = torch.zeros(B, H, S, device="cuda", dtype=torch.float32)
            inputs[key] = (q, k, v, do, lse, delta)
            runs = [("original", None, None)]
            for which in ("persistent", "persistent_epi", "persistent_dyn"):
                runs += [(which, None, None), (which, SMALL_GRID, None)]
            if (B, S, H, Hkv, D, mask) in HG3_CASES:
                runs.append(("persistent", SMALL_GRID, 3))
                runs.append(("persistent_dyn", SMALL_GRID, 3))
            for which, programs, hg in runs:
                grid_txt = "own" if which == "original" else ("SMs" if programs is None else str(programs))
                label = (f"B{B} S{S} H{H} Hkv{Hkv} D{D} {mask} {str(dtype)[6:]} {which}"
                         f"{'' if hg is None else f'(HG={hg})'} grid={grid_txt}")
                plan.append((label, key, which, programs, hg))
    # compile everything first (no GPU work), then run case by case under the lock
    calls, compiled = {}, set()
    for label, key, which, programs, hg in plan:
        q, k, v, do, lse, delta = inputs[key]
        calls[label] = kernel_call(torch, which, q, k, v, do, lse, delta, key[5], programs, hg)
        if (key, which, hg) not in compiled:  # the grid is no constexpr: one compile serves both grids
            compiled.add((key, which, hg))
            print(f"START compile {label}", flush=True)
            calls[label][1]()
    refs = {}
    originals = {}
    for label, key, which, programs, hg in plan:
        q, k, v, do, lse, delta = inputs[key]
        print(f"START {label}", flush=True)
        try:
            t0 = time.time()
            with gpu_lock():
                if key not in refs:
                    dq_r, dk_r, dv_r, lse_r, delta_r = reference(torch, q, k, v, do, key[5])
                    lse.copy_(lse_r)
                    delta.copy_(delta_r)
                    refs[key] = (dq_r, dk_r, dv_r)
                run, _, dq, dk, dv = calls[label]
                run()
                torch.cuda.synchronize()
            dq_r, dk_r, dv_r = refs[key]
            errs = dict(dq=_rel(dq, dq_r), dk=_rel(dk, dk_r), dv=_rel(dv, dv_r))
            ok = all(e < REL_TOL for e in errs.values())  # NaN compares False
            extra = {}
            if which == "original":
                originals[key] = (dq.clone(), dk.clone(), dv.clone())
            elif key in originals:
                oq, ok_, ov = originals[key]
                extra = dict(dkdv_vs_orig=max((dk.float() - ok_.float()).abs().max().item(),
                                              (dv.float() - ov.float()).abs().max().item()),
                             dq_vs_orig=(dq - oq).abs().max().item())
            emit(kind="corr", case=label, ok=ok, secs=round(time.time() - t0, 1), **errs, **extra)
        except Exception as e:
            emit(kind="corr", case=label, ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")


def bench(torch, run, dq, warmup=3, iters=15):
    """Median ms of `iters` launches (CUDA events around the kernel alone; dQ zeroed before each)."""
    for _ in range(warmup):
        dq.zero_()
        run.ctr.zero_()
        run()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        dq.zero_()
        run.ctr.zero_()
        st[i].record()
        run()
        en[i].record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in zip(st, en))
    return ts[len(ts) // 2]


def worker_time(case):
    torch, triton = _setup()
    import kernel as pk
    name, S, mask = next(c for c in TIME_CASES if c[0] == case)
    B, H, D = TOKENS // S, TH, TD
    mask_id, left = MASKS[mask]
    flop = 10.0 * B * H * visible_pairs(S, mask) * D  # 2.5x the forward's 4 * B * H * pairs * D
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    # lse: log of each row's visible keys (+ 0.5, about a standard normal score's share): p stays O(1 / keys)
    rows = torch.arange(S, device="cuda", dtype=torch.float32)
    n_vis = {0: torch.full_like(rows, S), 1: rows + 1, 2: torch.clamp(rows, max=left) + 1}[mask_id]
    lse = (torch.log(n_vis) + 0.5).expand(B, H, S).contiguous()
    delta = 0.1 * torch.randn(B, H, S, device="cuda", dtype=torch.float32, generator=g)
    hg = pk.head_group(B, H, H, S, D)
    runs = [("original", "original", None, None)]
    for which, tag in (("persistent", "static"), ("persistent_dyn", "dynamic")):  # DYNAMIC 0 / 1
        runs.append((f"{tag}(HG={hg})", which, None, None))
        if hg != 1:
            runs.append((f"{tag}(HG=1)", which, 1, None))
    calls = []
    for label, which, head_group, overrides in runs:
        print(f"START compile {case} {label}", flush=True)
        call = kernel_call(torch, which, q, k, v, do, lse, delta, mask, head_group=head_group, overrides=overrides)
        call[1]()
        calls.append((label, call))
    ref = None
    for label, (run, _, dq, dk, dv) in calls:
        print(f"START {case} {label}", flush=True)
        try:
            with gpu_lock():
                ms = bench(torch, run, dq)
                torch.cuda.synchronize()
            bad = bool(torch.isnan(dk).any().item() or torch.isnan(dv).any().item() or torch.isnan(dq).any().item())
            extra = {}
            if ref is None:
                ref = (dq.clone(), dk.clone(), dv.clone())
            else:
                extra = dict(dkdv_vs_orig=max((dk.float() - ref[1].float()).abs().max().item(),
                                              (dv.float() - ref[2].float()).abs().max().item()),
                             dq_vs_orig=_rel(dq, ref[0]))
            emit(kind="time", case=case, kernel=label, ms=ms, tflops=flop / ms / 1e9, nan=bad, **extra)
        except Exception as e:
            emit(kind="time", case=case, kernel=label, error=f"{type(e).__name__}: {str(e)[:300]}")


# --- driver side ----------------------------------------------------------------------------------------------
def start(args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__)] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE, env=env)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
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


def _fmt_corr(r):
    if "error" in r:
        return f"   corr {r['case']:62s} FAIL  {r['error']}"
    txt = f"   corr {r['case']:62s} {'PASS' if r['ok'] else 'FAIL'}  dq={r['dq']:.2e} dk={r['dk']:.2e} dv={r['dv']:.2e}"
    if "dkdv_vs_orig" in r:
        txt += f"  vs orig: dk/dv {r['dkdv_vs_orig']:.1e} dq {r['dq_vs_orig']:.1e}"
    return txt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corr-worker")
    ap.add_argument("--time-worker")
    ap.add_argument("--skip-corr", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=165, help="seconds for everything (subprocesses killed after)")
    a = ap.parse_args()
    if a.corr_worker:
        return worker_corr(a.corr_worker)
    if a.time_worker:
        return worker_time(a.time_worker)

    t0 = time.time()
    deadline = t0 + a.budget
    print(f"== persistent Gluon backward (UNVERIFIED PROTOTYPE); python {sys.version.split()[0]}", flush=True)
    procs = {}
    if not a.skip_corr:
        procs.update({("corr", g): start(["--corr-worker", g]) for g in CORR_GROUPS})
    if not a.skip_timing:
        procs.update({("time", c[0]): start(["--time-worker", c[0]]) for c in TIME_CASES})
    n_pass = n_fail = 0
    rows = []
    info_done = False
    for (kind, name), p in procs.items():
        rc, res, last, err = finish(p, deadline - time.time())
        for r in res:
            if r["kind"] == "info":
                if not info_done:
                    print(f"   {r}", flush=True)
                    info_done = True
            elif r["kind"] == "corr":
                n_pass += bool(r.get("ok"))
                n_fail += not r.get("ok")
                print(_fmt_corr(r), flush=True)
            else:
                rows.append(r)
                if "error" in r:
                    print(f"   time {r['case']:14s} {r['kernel']:24s} FAILED {r['error']}", flush=True)
        if rc != 0:
            n_fail += kind == "corr"
            print(f"   {kind} {name}: rc={rc}; running when it ended: {last!r}\n" +
                  "\n".join("     " + line for line in err[-2000:].splitlines()), flush=True)
    if not a.skip_corr:
        print(f"== correctness: {n_pass} PASS, {n_fail} FAIL ({time.time() - t0:.0f}s)", flush=True)
    if not a.skip_timing:
        print("\n== backward, bf16, D=128, H=Hkv=16, B*S=32768 (FLOPs = 10 * B * H * visible pairs * D; CUDA events, "
              "median of 15)")
        print(f"{'case':14s} {'kernel':26s} {'ms':>8s} {'TFLOP/s':>8s} {'vs original':>12s}  checks")
        for case, S, mask in TIME_CASES:
            base = next((r["ms"] for r in rows if r["case"] == case and r["kernel"] == "original" and "ms" in r), None)
            for r in rows:
                if r["case"] == case and "ms" in r:
                    ratio = base / r["ms"] if base else float("nan")
                    checks = "NaN!" if r.get("nan") else "ok"
                    if "dkdv_vs_orig" in r:
                        checks += f" dk/dv-orig {r['dkdv_vs_orig']:.1e} dq-orig(rel) {r['dq_vs_orig']:.1e}"
                    print(f"{case:14s} {r['kernel']:26s} {r['ms']:8.3f} {r['tflops']:8.1f} {ratio:11.3f}x  {checks}",
                          flush=True)
        print("(vs original = original ms / this ms: > 1 is faster than the per-program kernel)")
    print(f"== total {time.time() - t0:.0f}s", flush=True)
    return 0 if n_fail == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
