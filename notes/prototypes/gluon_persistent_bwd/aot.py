"""Ahead-of-time compile check (no GPU) of the persistent Gluon backward (kernel.py), and of the per-program original
(ejgen.runtime.gluon_kernels.gluon_attention_bwd_kernel) for comparison, for sm_90a.

    <python> aot.py [--kernels persistent,persistent_epi,original] [--dtypes bf16,f16] [--d 128,64]
                    [--masks 0,1,2] [--dump DIR]

Works with Triton 3.6 and 3.9. Per (kernel, dtype, D, MASK): triton.compile(GluonASTSource) for
GPUTarget("cuda", 90, 32) with tt.divisibility 16 on every pointer (what jax-triton promises), then
`ptxas -v --gpu-name sm_90a` on the PTX with the ptxas Triton itself uses for sm_90
(triton.backends.nvidia.compiler.get_ptxas(90) on 3.9, bin/ptxas on 3.6) -> registers, spills, stack; shared
memory and descriptor scratch from the metadata (checked against the 232,448-byte limit); setmaxnreg values from
the PTX. `persistent_epi` is the persistent kernel with EPI_TMA (dK / dV by bulk stores).
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
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))  # /work/main: ejgen (the original kernel, helpers)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import kernel as pk  # noqa: E402

DTYPES = {"bf16": "*bf16", "f16": "*fp16"}
MASK_NAMES = {0: "none", 1: "causal", 2: "window"}


def ptxas_path():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except Exception:  # Triton 3.6
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
    """Compile one variant (SEQ=1000: ragged, GQA 4): (result dict, ptxas warnings, compiled kernel)."""
    causal, window = mask >= 1, mask == 2
    if which.startswith("persistent"):
        fn = pk.gluon_persistent_bwd_kernel
        consts = pk.constexprs(B, HQ, HKV, SEQ, D, causal, window, epi_tma=which == "persistent_epi")
    else:
        from ejgen.runtime import gluon_attention, gluon_kernels
        fn = gluon_kernels.gluon_attention_bwd_kernel
        consts = gluon_attention.bwd_constexprs(B, HQ, HKV, SEQ, D, causal, window)
    assert consts["MASK"] == mask
    ptr = DTYPES[dtype]
    pointers = dict(Q=ptr, K=ptr, V=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", F32="*fp32", I32="*i32",
                    DQ_ACC="*fp32", DK=ptr, DV=ptr, SCRATCH="*u8")
    names = list(fn.arg_names)
    sig = {n: pointers.get(n, "constexpr") for n in names}
    attrs = {(i, ): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    src = GluonASTSource(fn, sig, constexprs={n: consts[n] for n in names if n in consts}, attrs=attrs)
    t0 = time.time()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    rc, out = run_ptxas(ptx)
    md = k.metadata
    setmax = sorted(set(a + b for a, b in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    res = dict(kernel=which, dtype=dtype, D=D, mask=MASK_NAMES[mask], ptxas_rc=rc,
               regs=grab(r"Used (\d+) registers", out), spill_st=grab(r"(\d+) bytes spill stores", out),
               spill_ld=grab(r"(\d+) bytes spill loads", out), stack=grab(r"(\d+) bytes stack frame", out),
               smem=md.shared, smem_ok=md.shared <= pk.SMEM_LIMIT, scratch=md.global_scratch_size,
               warps=md.num_warps, setmaxnreg=setmax, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
               bulk_wait=sorted(set(re.findall(r"cp\.async\.bulk\.wait_group(?:\.read)? \d+", ptx))),
               dq_mode=consts["DQ_MODE"], kv_stages=(consts.get("K_STAGES"), consts.get("V_STAGES")),
               head_group=consts.get("HEAD_GROUP"), secs=round(time.time() - t0, 1))
    if which.startswith("persistent"):
        res["smem_model"] = pk.smem_bytes(D, consts["K_STAGES"], consts["V_STAGES"], consts["DQ_MODE"])
    warn = [line.strip() for line in out.splitlines() if "warning" in line.lower()]
    return res, warn, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="persistent,persistent_epi,original")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--masks", default="0,1,2")
    ap.add_argument("--dump", default="", help="folder for the ttgir / ptx of each compile")
    a = ap.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__}); ptxas {ptxas_path()}", flush=True)
    ok = bad = 0
    for which in a.kernels.split(","):
        for dtype in a.dtypes.split(","):
            for D in [int(x) for x in a.d.split(",")]:
                for mask in [int(x) for x in a.masks.split(",")]:
                    try:
                        res, warn, k = compile_one(which, dtype, D, mask)
                        print(f"[{triton.__version__}] " + " ".join(f"{key}={val}" for key, val in res.items()),
                              flush=True)
                        for w in warn:
                            print("    ptxas:", w, flush=True)
                        if a.dump:
                            os.makedirs(a.dump, exist_ok=True)
                            for ext in ("ttgir", "ptx"):
                                name = f"{which}_{dtype}_d{D}_m{mask}.{ext}"
                                with open(os.path.join(a.dump, name), "w") as fh:
                                    fh.write(k.asm[ext])
                        good = res["ptxas_rc"] == 0 and res["smem_ok"]
                        ok += good
                        bad += not good
                    except Exception as e:
                        bad += 1
                        print(f"[{triton.__version__}] kernel={which} dtype={dtype} D={D} mask={mask} COMPILE FAILED: "
                              f"{type(e).__name__}: {str(e)[:3000]}", flush=True)
                        traceback.print_exc(limit=3)
    print(f"done: {ok} compiled, {bad} failed", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
