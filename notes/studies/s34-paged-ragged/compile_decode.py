"""AOT-compile decode_kernel (sm_90) from a given triton_decode.py file; dump ttgir/ptx/sass + regs.
usage: PYTHONPATH=/work/triton36:/work/main python compile_decode.py FILE OUTPREFIX CASE [num_stages]
CASE: ragged (B32 S16k) or b8 (B8 S8k)."""
import importlib.util, os, subprocess, sys, tempfile, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ejgen.runtime.attention import split_k
from ejgen.runtime.attention.triton import decode

path, out, case = sys.argv[1:4]
stages = int(sys.argv[4]) if len(sys.argv) > 4 else 2
extra = {"maxnreg": int(sys.argv[5])} if len(sys.argv) > 5 else {}
spec = importlib.util.spec_from_file_location("tdec_" + str(abs(hash(path))), path)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
kernel = mod.decode_kernel
contig = case.endswith("-contig"); case = case.replace("-contig", "")
B, S = (32, 16384) if case == "ragged" else (8, 8192)
HKV, G, D, PAGE = 8, 4, 128, int(os.environ.get("PAGE", 16))
slots = split_k.slots(decode.BLOCK_N, D, D, 2, decode.NUM_STAGES, sms=132)
n_splits, per_split = split_k.splits(B, HKV, S, decode.BLOCK_N, slots)
print("slots", slots, "n_splits", n_splits, "SPLIT", per_split)
consts = dict(B=B, HQ=HKV * G, HKV=HKV, SQ=1, SEQ_K=S if contig else PAGE, D=D, DV=D, D_PAD=128, DV_PAD=128, G=G, M_PAD=16,
              BLOCK_N=decode.BLOCK_N, SPLIT=per_split, N_SPLITS=n_splits, CAUSAL=True, WINDOW=False, SOFTCAP=False,
              PAGED=not contig, PAGE=1 if contig else PAGE, MAX_PAGES=1 if contig else S // PAGE, POOL_PAGES=1 if contig else B * S // PAGE, PAGES_AHEAD=False,
              WHOLE_PAGE=True, PRECISION="tf32", UPCAST=False)
ptr = dict(Q="*bf16", K="*bf16", V="*bf16", STARTS="*i32", ENDS="*i32", TABLE="*i32", F32="*fp32", I32="*i32",
           O_PART="*fp32", M_PART="*fp32", L_PART="*fp32", SCRATCH="*u8")
sig = {n: ptr.get(n, "constexpr") for n in kernel.arg_names}
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
src = ASTSource(fn=kernel, signature=sig, constexprs={n: consts[n] for n in kernel.arg_names if n in consts}, attrs=aligned)
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages, **extra})
for k in ("ttir", "ttgir", "llir", "ptx"):
    open(f"{out}.{k}", "w").write(c.asm[k])
open(f"{out}.cubin", "wb").write(c.asm["cubin"])
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", "-g", "-hex", f"{out}.cubin"], capture_output=True, text=True)
if sass.returncode:
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f"{out}.cubin"], capture_output=True, text=True)
open(f"{out}.sass", "w").write(sass.stdout + sass.stderr)
res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", f"{out}.cubin"], capture_output=True, text=True).stdout
print(triton.__version__, "shared", c.metadata.shared, re.search(r"REG:\d+ STACK:\d+", res).group(0))
