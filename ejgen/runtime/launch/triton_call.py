"""Launching a Triton kernel from JAX: jax-triton on CUDA, Triton's interpreter on the CPU.

On the CPU the kernel runs inside ``jax.pure_callback`` on torch CPU tensors, so the very kernel
source that runs on the GPU is what CI executes. That needs TRITON_INTERPRET=1 in the environment
before the kernels are imported (Triton decides at decoration time) and torch installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np

from ejgen.runtime.core import vma


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def mode() -> tuple[str | None, str]:
    """("gpu" | "interpret" | None, why not when None)."""
    if not _has("triton"):
        return None, "triton is not installed (pip install 'ejgen[gpu]')"
    if jax.default_backend() == "gpu":
        if not _has("jax_triton"):
            return None, "jax-triton is not installed (pip install 'ejgen[gpu]')"
        return "gpu", ""
    if os.environ.get("TRITON_INTERPRET") == "1":
        if not _has("torch"):
            return None, "Triton's interpreter needs torch (pip install torch==2.13.0 for a CPU build)"
        return "interpret", ""
    return None, ("no NVIDIA GPU is visible to JAX; to run the Triton kernels in Triton's interpreter on "
                  "the CPU, set TRITON_INTERPRET=1 before starting Python")


def available() -> tuple[bool, str]:
    how, why = mode()
    return how is not None, why


GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's grid: programs along axes 0, 1, 2


def _check_grid(kernel, grid) -> None:
    """A grid CUDA can launch: one clear error here instead of a failed launch on the device (the interpreter would
    run it)."""
    for axis, (n, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if int(n) > limit:
            raise ValueError(f"{kernel.__name__}: grid {tuple(int(g) for g in grid)} has {int(n)} programs along axis "
                             f"{axis}, more than CUDA launches ({limit}); the call is too large for this kernel "
                             f"(fewer sequences x heads per call)")


def launch(kernel, grid, inputs, out_shapes, *, zeroed=(), num_warps=4, num_stages=2, autotune=None, aliases=None,
           **constexprs):
    """Run ``kernel[grid](*inputs, *outputs, **constexprs)``; returns the outputs as a list.

    ``aliases``: {input index: output index}, outputs written into their input's buffer (jax-triton's
    input_output_aliases: XLA copies the input first only where it is still needed, so a donated or loop-carried
    input is updated in place): an aliased output starts as its input (a kernel may read it there, or only add to
    it: the Gluon backward's dQ accumulator). The interpreter's outputs are fresh arrays holding the same values;
    both paths check that each pair has one shape and dtype and that the output is not zeroed (jax-triton would clear
    the input), so the interpreter catches what the GPU would refuse.

    ``autotune``: block configs (``triton_configs.KernelConfig``) for jax-triton's autotuned call, which
    times them on the call's own inputs on the device the first time the compiled program runs; then
    ``grid`` is a function of the chosen config's {"BLOCK_M", "BLOCK_N"} (each config also sets its own
    STAGED: merged or not). GPU only.

    Inside ``jax.shard_map`` the outputs are typed as varying over the mesh axes the inputs vary over: neither
    jax-triton's primitive nor ``pure_callback`` says so (their outputs come back typed invariant), and a
    gradient typed so would not match its varying input."""
    _check_aliases(kernel, inputs, out_shapes, aliases or {}, zeroed)
    if not callable(grid):
        _check_grid(kernel, grid)
    how, why = mode()
    axes = vma.varying_axes(inputs)
    if how == "gpu":
        from jax_triton import triton_lib

        _extend_jax_triton()
        _OWN_KERNELS.add(kernel.__name__)
        if autotune:
            import triton

            configs = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n,
                                      "STAGED": not c.merged},
                                     num_warps=c.num_warps,
                                     num_stages=c.num_stages) for c in autotune]
            kernel = triton.autotune(configs=configs, key=[])(kernel)
            constexprs = {k: v for k, v in constexprs.items() if k not in ("BLOCK_M", "BLOCK_N", "STAGED")}
        outs = triton_lib.triton_call(*inputs, kernel=kernel, out_shape=out_shapes, grid=grid, num_warps=num_warps,
                                      num_stages=num_stages, zeroed_outputs=tuple(zeroed),
                                      input_output_aliases=dict(aliases or {}), **constexprs)
        return list(vma.vary(list(outs), axes))
    if autotune:
        raise ValueError("EJGEN_TRITON_AUTOTUNE: jax-triton's autotuned call times configs on a GPU; in the "
                         "interpreter, pin a config with EJGEN_TRITON_CONFIG instead")
    if how == "interpret":
        call = functools.partial(_interpret, kernel, grid, tuple(out_shapes), constexprs, dict(aliases or {}))
        outs = jax.pure_callback(call, tuple(out_shapes), *inputs, vmap_method="sequential")
        return list(vma.vary(list(outs), axes))
    raise RuntimeError(f"the triton backend cannot run here: {why}")


def _check_aliases(kernel, inputs, out_shapes, aliases: dict, zeroed):
    """Each {input: output} of ``aliases`` names two arrays of one shape and dtype (XLA refuses others on the GPU;
    the interpreter ignores aliases) and an output that is not zeroed (jax-triton clears it before the kernel runs,
    the input's values with it)."""
    name = getattr(kernel, "__name__", kernel)
    for i, o in aliases.items():
        if not (0 <= i < len(inputs) and 0 <= o < len(out_shapes)):
            raise ValueError(f"{name}: alias {i} -> {o} names no input / output ({len(inputs)} inputs, "
                             f"{len(out_shapes)} outputs)")
        x, out = inputs[i], out_shapes[o]
        if tuple(x.shape) != tuple(out.shape) or jnp.dtype(x.dtype) != jnp.dtype(out.dtype):
            raise ValueError(f"{name}: input {i} {jnp.dtype(x.dtype).name}{list(x.shape)} cannot be output {o}'s "
                             f"buffer, {jnp.dtype(out.dtype).name}{list(out.shape)} (an alias needs one shape and "
                             f"dtype)")
        if o in tuple(zeroed):
            raise ValueError(f"{name}: output {o} is zeroed before the kernel runs, so it cannot alias input {i}")


def _to_torch(x):
    import torch

    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    if x.dtype == np.bool_:
        return torch.from_numpy(x.astype(np.int8))
    return torch.from_numpy(x.copy())


def _torch_dtype(dtype):
    import torch

    return {
        np.dtype(np.uint8): torch.uint8,
        np.dtype(np.float32): torch.float32,
        np.dtype(np.float16): torch.float16,
        np.dtype(jnp.bfloat16): torch.bfloat16,
        np.dtype(np.int32): torch.int32,
    }[np.dtype(dtype)]


def _to_numpy(t, dtype):
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy().astype(dtype, copy=False)


_INTERPRETER = threading.Lock()  # Triton's interpreter patches triton.language while it runs: one kernel at a time


def _interpret(kernel, grid, out_shapes, constexprs, aliases, *arrays):
    """One launch in Triton's interpreter, each aliased output starting as a copy of its input (``aliases``:
    {input: output}, as on the GPU). Under ``shard_map`` every device's callback comes on its own thread, so the
    launches take turns."""
    import torch

    inputs = [_to_torch(a) for a in arrays]
    outputs = [torch.zeros(s.shape, dtype=_torch_dtype(s.dtype)) for s in out_shapes]
    for i, o in aliases.items():
        outputs[o] = inputs[i].clone()
    with _INTERPRETER:
        kernel[grid](*inputs, *outputs, **constexprs)
    return tuple(_to_numpy(o, s.dtype) for o, s in zip(outputs, out_shapes))


# --- What jax-triton 0.3.1 lacks for tensor descriptors and warp specialisation ---------------------
#
# A kernel that builds tensor descriptors on the device writes them into Triton's implicit global
# scratch argument, and jaxlib passes a null pointer there. A warp-specialised kernel needs more
# warps than it was asked for (a producer warp group), and jax-triton launches the number it asked.
# So, on the GPU, jax-triton compiles through a copy of its own CUDA compile step which, for the
# kernels that ejgen launches (every one ends with a SCRATCH output of SCRATCH_PER_PROGRAM bytes per
# program), points the global scratch reads at that output and records the compiled warp count, which
# the kernel object is then built with. Gluon kernels (gluon_kernels) are made from Gluon's own source and
# lowered by Gluon's stage (their module is TTGIR already). Other kernels compile to exactly what
# jax-triton produces.

SCRATCH_PER_PROGRAM = 1024
_OWN_KERNELS: set = set()  # names of the kernels launched through `launch`
_compiled = threading.local()  # (name, warps) of the latest compilation in this thread


def route_global_scratch(ptx: str, name: str) -> str:
    """PTX whose global scratch reads come from the last explicit parameter instead.

    Triton appends two hidden pointers to every kernel (global scratch, then profile scratch), so
    with n parameters the global scratch is number n - 2 and the last explicit one n - 3."""
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    params = re.findall(rf"\b{re.escape(name)}_param_(\d+)\b", entry.group(1)) if entry else []
    n = len(params)
    if n < 3 or [int(p) for p in params] != list(range(n)):
        raise RuntimeError(f"{name}: unexpected PTX parameter list {params}")
    hidden, explicit = f"[{name}_param_{n - 2}]", f"[{name}_param_{n - 3}]"
    if hidden not in ptx:
        raise RuntimeError(f"{name}: the kernel declares global scratch but never reads its pointer")
    return ptx.replace(hidden, explicit)


def strip_debug(ptx: str) -> str:
    """PTX without its debug information (the DWARF sections Triton appends, `.loc` / `.file` lines): the same
    machine code (ptxas 13.4, the Gluon forward: identical SASS, a 95 KB cubin instead of 377 KB). jaxlib finds a
    launch's kernel by hashing and comparing the call's whole opaque, PTX included, on every call
    (`GetKernelCall`): the Gluon forward's 382 KB of PTX is 264 KB without it."""
    text = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in text.splitlines() if not re.match(r"\s*\.(loc|file)\b", line)) + "\n"


def _extend_jax_triton():
    from jax_triton import triton_lib

    if getattr(triton_lib, "_ejgen_extended", False):
        return

    code_gen = triton_lib.code_gen

    class _CodeGen:
        """jax-triton's `code_gen`, with Gluon kernels (ejgen.runtime.attention.gluon.kernels) made by Gluon's own source:
        its module is already TTGIR (the compile step below takes it from there)."""

        def __getattr__(self, attr):
            return getattr(code_gen, attr)

        @staticmethod
        def ast_to_ttir(fn, src, *, options, codegen_fns, context, module_map):
            if not getattr(fn, "is_gluon", lambda: False)():
                return code_gen.ast_to_ttir(fn, src, options=options, codegen_fns=codegen_fns, context=context,
                                            module_map=module_map)
            from triton.backends.compiler import GPUTarget
            from triton.experimental.gluon._runtime import GluonASTSource

            gluon_src = GluonASTSource(fn, src.signature, src.constants, src.attrs)
            capability = triton_lib.triton_kernel_call_lib.get_compute_capability(0)
            module = gluon_src.make_ir(GPUTarget("cuda", capability, 32), options, codegen_fns, module_map, context)
            _compiled.gluon = True
            return module

    def compile_ttir_to_ptx_inplace(ttir, backend, options, capability):
        # jax-triton 0.3.1's step, plus the scratch routing and warp count of ejgen's kernels, and Gluon's stages
        metadata = {}
        gluon = getattr(_compiled, "gluon", False)
        _compiled.gluon = False
        try:
            if gluon:
                ttgir = backend.gluon_to_ttgir(ttir, metadata, options, capability)
            else:
                ttgir = backend.make_ttgir(backend.make_ttir(ttir, metadata, options, capability), metadata, options,
                                           capability)
        except RuntimeError as e:
            ttir.dump()
            raise ValueError("TTIR->TTGIR pass failed!") from e
        try:
            llir = backend.make_llir(ttgir, metadata, options, capability)
        except RuntimeError as e:
            ttgir.dump()
            raise ValueError("TTGIR->LLIR pass failed!") from e
        if metadata.get("tmem_size", 0) > triton_lib._TMEM_MAX_SIZE:
            raise ValueError(f"TMEM size {metadata['tmem_size']} exceeds limit {triton_lib._TMEM_MAX_SIZE}.")
        ptx = backend.make_ptx(llir, metadata, options, capability)
        name = metadata["name"]
        if name in _OWN_KERNELS:
            if metadata.get("global_scratch_size", 0) > 0:
                if metadata["global_scratch_size"] > SCRATCH_PER_PROGRAM or metadata["global_scratch_align"] > 128:
                    raise RuntimeError(f"{name} needs {metadata['global_scratch_size']} bytes of global scratch "
                                       f"(aligned to {metadata['global_scratch_align']}); the launch gives "
                                       f"{SCRATCH_PER_PROGRAM} per program")
                ptx = route_global_scratch(ptx, name)
            ptx = strip_debug(ptx)
            _compiled.last = (name, metadata["num_warps"])
        dump = bool(triton_lib._JAX_TRITON_DUMP_DIR)
        return triton_lib.CompilationResult(binary=ptx, name=name, shared_mem_bytes=metadata["shared"],
                                            ttgir=str(ttgir) if dump else None, llir=str(llir) if dump else None)

    lib = triton_lib.triton_kernel_call_lib

    class _KernelLib:
        """jaxlib's triton module, with ejgen's kernels built with the warps they were compiled for."""

        def __getattr__(self, attr):
            return getattr(lib, attr)

        @staticmethod
        def TritonKernel(name, num_warps, num_ctas, shared, ptx, ttir, *rest):
            last = getattr(_compiled, "last", None)
            if last is not None and last[0] == name:
                # the compiled warp count; no TTIR (jaxlib keeps it for debugging only, and hashes it with the PTX
                # on every launch: see strip_debug)
                num_warps, ttir = last[1], ""
            return lib.TritonKernel(name, num_warps, num_ctas, shared, ptx, ttir, *rest)

    triton_lib.code_gen = _CodeGen()
    triton_lib.compile_ttir_to_ptx_inplace = compile_ttir_to_ptx_inplace
    triton_lib.triton_kernel_call_lib = _KernelLib()
    triton_lib._ejgen_extended = True
