"""Ahead-of-time compile check (no GPU) of the persistent Gluon backward (kernel.py), and of the per-program original
(ejgen.runtime.attention.gluon.kernels.gluon_attention_bwd_kernel) for comparison, for sm_90a.

    <python> aot.py [--kernels persistent,persistent_dyn,persistent_epi,persistent_dyn_epi,persistent_k1v1,original] [--dtypes bf16,f16] [--d 128,64]
                    [--masks 0,1,2] [--shapes aot|gpu] [--dump DIR]

Works with Triton 3.6 and 3.9. Per (kernel, dtype, D, MASK): triton.compile(GluonASTSource) for
GPUTarget("cuda", 90, 32) with tt.divisibility 16 on every pointer (what jax-triton promises), then
`ptxas -v --gpu-name sm_90a` on the PTX with the ptxas Triton itself uses for sm_90
(triton.backends.nvidia.compiler.get_ptxas(90) on 3.9, bin/ptxas on 3.6) -> registers, spills, stack; shared
memory and descriptor scratch from the metadata (checked against the 232,448-byte limit); setmaxnreg values from
the PTX. `persistent_epi` is the persistent kernel with EPI_TMA (dK / dV by bulk stores), `persistent_k1v1` the
persistent kernel with one K and one V buffer (K_STAGES = V_STAGES = 1); `persistent_dyn` (`persistent_dyn_epi`) the
persistent kernel (with EPI_TMA) with the dynamic tile scheduler (DYNAMIC=1; `atom` counts the PTX atomics).

--shapes aot (default): one representative shape per (dtype, D, MASK): B=2, HQ=8, HKV=2 (GQA 4), SEQ=1000 (ragged).
--shapes gpu: the shapes run_gpu.py launches (its correctness cases and its bf16 D=128 timing cases), each
compiled once per kernel; register allocation depends on the constexprs (SEQ, heads), so spills are checked there.
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


AOT_SHAPE = (2, 8, 2, 1000)  # B, HQ, HKV, SEQ: ragged, GQA 4


def gpu_shapes():
    """(dtype, D, MASK, (B, HQ, HKV, SEQ)) of every distinct kernel run_gpu.py compiles."""
    import run_gpu
    out = []
    for cases in run_gpu.CORR_GROUPS.values():
        for (B, S, H, Hkv, D, mask) in cases:
            for dt in (("bf16",) if D == 128 else ("bf16", "f16")):
                out.append((dt, D, run_gpu.MASKS[mask][0], (B, H, Hkv, S)))
    for _, S, mask in run_gpu.TIME_CASES:
        out.append(("bf16", run_gpu.TD, run_gpu.MASKS[mask][0], (run_gpu.TOKENS // S, run_gpu.TH, run_gpu.TH, S)))
    return list(dict.fromkeys(out))


def compile_one(which, dtype, D, mask, shape=AOT_SHAPE):
    """Compile one variant: (result dict, ptxas warnings, compiled kernel)."""
    B, HQ, HKV, SEQ = shape
    causal, window = mask >= 1, mask == 2
    if which.startswith("persistent"):
        fn = pk.gluon_persistent_bwd_kernel
        consts = pk.constexprs(B, HQ, HKV, SEQ, D, causal, window, epi_tma=which.endswith("_epi"),
                               dynamic=which.startswith("persistent_dyn"))
        if which == "persistent_k1v1":  # one K and one V buffer (run_gpu.py times it too)
            consts.update(K_STAGES=1, V_STAGES=1)
    else:
        from ejgen.runtime.attention.gluon import host as gluon_attention
        from ejgen.runtime.attention.gluon import kernels as gluon_kernels
        fn = gluon_kernels.gluon_attention_bwd_kernel
        consts = gluon_attention.bwd_constexprs(B, HQ, HKV, SEQ, D, causal, window)
    assert consts["MASK"] == mask
    ptr = DTYPES[dtype]
    pointers = dict(Q=ptr, K=ptr, V=ptr, DO=ptr, LSE="*fp32", DELTA="*fp32", F32="*fp32", I32="*i32",
                    DQ_ACC="*fp32", DK=ptr, DV=ptr, TILE_CTR="*i32", SCRATCH="*u8")
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
    res = dict(kernel=which, dtype=dtype, D=D, mask=MASK_NAMES[mask], shape="B{}xHQ{}xHKV{}xS{}".format(*shape),
               ptxas_rc=rc,
               regs=grab(r"Used (\d+) registers", out), spill_st=grab(r"(\d+) bytes spill stores", out),
               spill_ld=grab(r"(\d+) bytes spill loads", out), stack=grab(r"(\d+) bytes stack frame", out),
               smem=md.shared, smem_ok=md.shared <= pk.SMEM_LIMIT, scratch=md.global_scratch_size,
               warps=md.num_warps, setmaxnreg=setmax, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
               bulk_wait=sorted(set(re.findall(r"cp\.async\.bulk\.wait_group(?:\.read)? \d+", ptx))),
               dq_mode=consts["DQ_MODE"], kv_stages=(consts.get("K_STAGES"), consts.get("V_STAGES")),
               head_group=consts.get("HEAD_GROUP"),
               dynamic=consts.get("DYNAMIC"), atom=len(re.findall(r"atom\.", ptx)), secs=round(time.time() - t0, 1))
    if which.startswith("persistent"):
        res["smem_model"] = pk.smem_bytes(D, consts["K_STAGES"], consts["V_STAGES"], consts["DQ_MODE"])
    warn = [line.strip() for line in out.splitlines() if "warning" in line.lower()]
    return res, warn, k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="persistent,persistent_dyn,persistent_epi,persistent_dyn_epi,original")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--d", default="128,64")
    ap.add_argument("--masks", default="0,1,2")
    ap.add_argument("--shapes", default="aot", choices=("aot", "gpu"))
    ap.add_argument("--dump", default="", help="folder for the ttgir / ptx of each compile")
    a = ap.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__}); ptxas {ptxas_path()}", flush=True)
    if a.shapes == "aot":
        jobs = [(dt, D, m, AOT_SHAPE) for dt in a.dtypes.split(",") for D in [int(x) for x in a.d.split(",")]
                for m in [int(x) for x in a.masks.split(",")]]
    else:
        jobs = gpu_shapes()
    ok = bad = 0
    for which in a.kernels.split(","):
        for dtype, D, mask, shape in jobs:
            try:
                res, warn, k = compile_one(which, dtype, D, mask, shape)
                print(f"[{triton.__version__}] " + " ".join(f"{key}={val}" for key, val in res.items()), flush=True)
                for w in warn:
                    print("    ptxas:", w, flush=True)
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    for ext in ("ttgir", "ptx"):
                        name = f"{which}_{dtype}_d{D}_m{mask}_{res['shape']}.{ext}"
                        with open(os.path.join(a.dump, name), "w") as fh:
                            fh.write(k.asm[ext])
                good = res["ptxas_rc"] == 0 and res["smem_ok"]
                ok += good
                bad += not good
            except Exception as e:
                bad += 1
                print(f"[{triton.__version__}] kernel={which} dtype={dtype} D={D} mask={mask} shape={shape} COMPILE "
                      f"FAILED: {type(e).__name__}: {str(e)[:3000]}", flush=True)
                traceback.print_exc(limit=3)
    print(f"done: {ok} compiled, {bad} failed", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
