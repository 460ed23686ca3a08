"""Run jax-triton 0.3.1's own kernel compilation (``get_or_create_triton_kernel``) on a machine
without a GPU, through ejgen's extension of it, and print what jaxlib would have been given (JSON).

jax-triton's package refuses to import without a CUDA jax, so its ``triton_lib`` module is loaded on
its own, and jaxlib's kernel library is replaced by a recorder. Run in a process without
TRITON_INTERPRET (test_jax_triton_extension.py does), since the kernels must be compiled, not
interpreted. Argument: JSON {"kernels": [{"kernel": "fwd_kernel" | "foreign", "tma": bool}, ...]} (each kernel in
turn, in one process), or
{"op": true, "autotune": [bool, ...], "seq": int, "head_dim": int} (flash_attention's forward and backward, lowered
for CUDA once per value, in one process).
"""

import importlib
import importlib.util
import json
import re
import sys
import types


def load_triton_lib():
    spec = importlib.util.find_spec("jax_triton")
    package = types.ModuleType("jax_triton")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["jax_triton"] = package
    return importlib.import_module("jax_triton.triton_lib")


class Recorder:
    """Stands in for jaxlib's triton module: keeps the arguments of every kernel object built."""

    def __init__(self):
        self.kernels = []
        self.autotuned = []

    def TritonKernel(self, name, num_warps, num_ctas, shared, ptx, ttir, *rest):
        self.kernels.append({"name": name, "num_warps": num_warps, "shared": shared, "ptx": ptx, "ttir": ttir})
        return name

    def get_compute_capability(self, device):
        return 90

    def create_array_parameter(self, bytes_to_zero, divisibility):
        return ("array", bytes_to_zero)

    def create_scalar_parameter(self, value, dtype):
        return ("scalar", value)

    def TritonKernelCall(self, kernel, grid_x, grid_y, grid_z, params):
        return _Call({"kernel": kernel, "grid": [grid_x, grid_y, grid_z], "zeroed": [p[1] for p in params if p[1]]})

    def TritonAutotunedKernelCall(self, name, calls, aliases):
        self.autotuned.append([{"config": config, **call.record} for call, config in calls])
        return _Call({"autotuned": name})


class _Call:
    def __init__(self, record):
        self.record = record

    def to_proto(self, name, metadata):
        return b"recorded"


def lower_op(args, triton_lib, recorder):
    """Lower flash_attention's forward and backward for CUDA, as a GPU would, and report the kernel
    calls (autotuned or not) that jaxlib would have been given."""
    import os

    import jax
    import jax.numpy as jnp

    from ejgen.runtime.attention.triton import host as triton_attention
    from ejgen.runtime.launch import triton_call

    triton_call.mode = lambda: ("gpu", "")
    triton_attention._arch = lambda: "sm90"
    from ejgen.ops import flash_attention

    b, s, h, d = 2, args.get("seq", 1024), 4, args.get("head_dim", 64)
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, platform="triton").astype(jnp.float32))

    autotuned = []
    for autotune in args["autotune"]:  # read when the op is traced; kernels compiled before are reused
        os.environ["EJGEN_TRITON_AUTOTUNE"] = "1" if autotune else "0"
        recorder.autotuned.clear()
        jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, q, q).lower(lowering_platforms=("cuda",))
        autotuned.append(list(recorder.autotuned))
    print(json.dumps({"autotuned": autotuned, "kernels": [k["name"] for k in recorder.kernels]}))


def main():
    args = json.loads(sys.argv[1])
    triton_lib = load_triton_lib()
    recorder = Recorder()
    triton_lib.triton_kernel_call_lib = recorder
    if args.get("op"):
        return lower_op(args, triton_lib, recorder)

    from ejgen.runtime.launch import triton_call

    triton_call._extend_jax_triton()
    print(json.dumps([lower_kernel(one, triton_lib, recorder) for one in args["kernels"]]))


def lower_kernel(args, triton_lib, recorder):
    """One kernel through jax-triton's compile path: what its PTX holds. A foreign kernel is lowered before the same
    kernel as ejgen's own (which it then stays), and nothing is reused from jax-triton's cache between them."""
    from ejgen.runtime.launch import triton_call
    from ejgen.testing.aot import _signature, constexprs

    module = importlib.import_module("ejgen.generated.flash_attention.triton_kernels")
    kernel = module.flash_attention_fwd_kernel
    if args["kernel"] == "fwd_kernel":
        triton_call._OWN_KERNELS.add(kernel.__name__)  # what `triton_call.launch` does
    else:
        assert kernel.__name__ not in triton_call._OWN_KERNELS, "a foreign kernel goes first"
    triton_lib._COMPILED_KERNEL_CACHE.clear()
    consts = constexprs(causal=True, block_m=64, block_n=128, tma=args["tma"])
    signature = _signature(kernel, "bfloat16", {})
    arg_dtypes = [signature[n] for n in kernel.arg_names if n not in consts]
    metaparams = {n: consts[n] for n in kernel.arg_names if n in consts}
    triton_lib.get_or_create_triton_kernel(
        triton_lib.get_cuda_backend, "cuda", kernel, arg_dtypes, [], num_warps=8, num_stages=2, num_ctas=1,
        compute_capability=90, enable_fp_fusion=True, metaparams=metaparams, dump=False)
    built = recorder.kernels[-1]
    ptx, name = built["ptx"], built["name"]
    entry = re.search(rf"\.entry\s+{name}\s*\((.*?)\)", ptx, re.S).group(1)
    n = len(re.findall(rf"\b{name}_param_\d+\b", entry))
    return {
        "name": name, "num_warps": built["num_warps"], "explicit_args": len(arg_dtypes), "ptx_params": n,
        "hidden_scratch_reads": ptx.count(f"[{name}_param_{n - 2}]"),
        "last_explicit_reads": ptx.count(f"[{name}_param_{n - 3}]"),
        "bulk_tensor_copies": ptx.count("cp.async.bulk.tensor"),
        "debug_sections": ptx.count(".section\t.debug"), "loc_lines": len(re.findall(r"^\s*\.loc\b", ptx, re.M)),
        "ttir_chars": len(built["ttir"]),
    }


if __name__ == "__main__":
    main()
