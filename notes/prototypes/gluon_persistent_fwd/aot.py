"""Ahead-of-time compile check (no GPU) of the persistent Gluon forward (kernel.py), and of the non-persistent
original (ejgen.runtime.gluon_kernels) for comparison, for sm_90a.

    <python> aot.py [--kernels persistent,original] [--dtypes bf16,f16] [--d 128,64] [--masks none,causal,window]

Works with Triton 3.6 and 3.9. Per (kernel, dtype, D, mask): triton.compile(GluonASTSource) for
GPUTarget("cuda", 90, 32), then `ptxas -v --gpu-name sm_90a` on the PTX with the ptxas Triton itself uses for
sm_90 (triton.backends.nvidia.compiler.get_ptxas(90)) -> registers, spills, shared memory; warps from the metadata.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..", "..")))  # /work/main: the original kernel

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

import kernel as pk

MASKS = {"none": (False, False), "causal": (True, False), "window": (True, True)}
DTYPES = {"bf16": "*bf16", "f16": "*fp16"}


def ptxas_path():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except Exception:
        from triton.backends.nvidia.compiler import _path_to_binary
        return _path_to_binary("ptxas")[0]


def run_ptxas(ptx):
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        with open(f, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([ptxas_path(), "-v", "--gpu-name", "sm_90a", f, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr


def grab(pattern, text):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def compile_one(which, dtype, D, mask, B=2, HQ=8, HKV=2, SEQ=1000):
    causal, window = MASKS[mask]
    if which == "persistent":
        fn = pk.gluon_persistent_fwd_kernel
        consts = pk.constexprs(B, HQ, HKV, SEQ, D, causal, window)
    else:
        from ejgen.runtime import gluon_attention, gluon_kernels
        fn = gluon_kernels.gluon_attention_fwd_kernel
        consts = gluon_attention.constexprs(B, HQ, HKV, SEQ, D, causal, window)
    ptr = DTYPES[dtype]
    pointers = dict(Q=ptr, K=ptr, V=ptr, F32="*fp32", I32="*i32", O=ptr, LSE="*fp32", SCRATCH="*u8")
    names = list(fn.arg_names)
    sig = {n: pointers.get(n, "constexpr") for n in names}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = GluonASTSource(fn, sig, constexprs={n: consts[n] for n in names if n in consts}, attrs=attrs)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    rc, out = run_ptxas(ptx)
    md = k.metadata
    threads = grab(r"\.reqntid (\d+)", ptx) or grab(r"\.maxntid (\d+)", ptx)
    setmax = sorted(set(a + b for a, b in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    res = dict(kernel=which, dtype=dtype, D=D, mask=mask, ptxas_rc=rc, regs=grab(r"Used (\d+) registers", out),
               spill_st=grab(r"(\d+) bytes spill stores", out), spill_ld=grab(r"(\d+) bytes spill loads", out),
               stack=grab(r"(\d+) bytes stack frame", out), ptxas_smem=grab(r"(\d+) bytes smem", out),
               smem=md.shared, scratch=md.global_scratch_size, warps=md.num_warps, threads=threads,
               setmaxnreg=setmax, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
               bulk_wait=sorted(set(re.findall(r"cp\.async\.bulk\.wait_group(?:\.read)? \d+", ptx))),
               head_group=consts.get("HEAD_GROUP"), secs=round(time.time() - t0, 1))
    warn = [line.strip() for line in out.splitlines() if "warning" in line.lower()]
    return res, warn, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="persistent,original")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--masks", default="none,causal,window")
    ap.add_argument("--dump", default="", help="folder for the ttgir / ptx of each compile")
    a = ap.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__}); ptxas {ptxas_path()}", flush=True)
    ok = bad = 0
    for which in a.kernels.split(","):
        for dtype in a.dtypes.split(","):
            for D in [int(x) for x in a.d.split(",")]:
                for mask in a.masks.split(","):
                    try:
                        res, warn, k = compile_one(which, dtype, D, mask)
                        print(f"[{triton.__version__}] " + " ".join(f"{key}={val}" for key, val in res.items()),
                              flush=True)
                        for w in warn:
                            print("    ptxas:", w, flush=True)
                        if a.dump:
                            os.makedirs(a.dump, exist_ok=True)
                            for ext in ("ttgir", "ptx"):
                                with open(os.path.join(a.dump, f"{which}_{dtype}_d{D}_{mask}.{ext}"), "w") as fh:
                                    fh.write(k.asm[ext])
                        ok += res["ptxas_rc"] == 0
                        bad += res["ptxas_rc"] != 0
                    except Exception as e:
                        bad += 1
                        print(f"[{triton.__version__}] kernel={which} dtype={dtype} D={D} mask={mask} COMPILE FAILED: "
                              f"{type(e).__name__}: {str(e)[:3000]}", flush=True)
                        traceback.print_exc(limit=3)
    print(f"done: {ok} compiled, {bad} failed", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
