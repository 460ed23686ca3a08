"""Each launch of the chunked linear-recurrent Triton kernels timed alone (issue 17, notes/recurrent-perf.md): gla
and simple_gla, bf16, B4 T4096 H16 K = V = 128, chunks of 64, forward and backward.

Every launch runs under jit on its real inputs (the outputs of the launches before it), through the host's own
functions (`ejgen.runtime.recurrent.triton.host`: chunk_states, chunk_intra (gk), chunk_output, chunk_state_grads,
chunk_intra with dA and chunk_grads_intra (gk), chunk_grads_qk, chunk_grads_v), so what is timed is what the op
launches; the XLA glue after the kernels (the log decay gradient's parts, `gates.finish`: head groups, dtypes, the
gates' gradients) is timed on its own too, and the whole op (fwd, fwd+bwd) next to the sum of its parts. The table
gives each launch's grid, launch settings, ms, and the GB/s and TFLOP/s of a model of what it reads, writes and
multiplies (`traffic`: every operand read once per program that reads it, the MMAs the kernel issues; caches not
modelled). The backward's states are recomputed by the same chunk_state launch as the forward's (listed once).

Before the timings, the kernels' o and gradients at these shapes are compared with the XLA backend (relative error;
FLAG past 2e-2, bf16).

On the GPU host from the repository root (jax-triton from .whl, as benchmarks/recurrent.py):

    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/recurrent_kernels.py

`--sweep` also times each kernel under a few other launch settings (blocks, warps, stages; `SWEEP`), the defaults
marked; `--shapes 2x16384` other shapes; `--cpu-smoke` tiny shapes in Triton's interpreter without a GPU (plumbing
only: its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import statistics
import sys
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="gla,simple_gla")
    p.add_argument("--shapes", default="4x4096", help="comma-separated BxT")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time each kernel under the settings of SWEEP")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the XLA backend")
    p.add_argument("--sweep-kernels", default="", help="comma-separated kernels to sweep (default: every one)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in Triton's interpreter")
    p.add_argument("--rows", default="", help="comma-separated substrings: the other forms' rows built and timed "
                   "only where their name holds one (the default kernels and op fwd / fwd+bwd always; compiling the "
                   "others is most of a table's time)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu_smoke:  # before triton, jax and the kernels are imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's ejgen, run from anywhere

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ejgen.runtime.recurrent import api, gates as gradients  # noqa: E402
from ejgen.runtime.recurrent.triton import host  # noqa: E402
from ejgen.testing.timing import median_seconds  # noqa: E402

GATES = {"gla": ("gk",), "simple_gla": ("g",), "lightning_attention": ("g_gamma",)}
FLAG = 2e-2
SWEEP = {  # other launch settings to time with --sweep (block_k, block_v, warps, stages; 0: the head dim whole)
    "chunk_sums": [(64, 0, 8, 1), (32, 0, 4, 1), (128, 0, 4, 1), (64, 0, 2, 1), (32, 0, 2, 1)],
    "chunk_state": [(64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 4),
                    (64, 32, 4, 4), (128, 64, 8, 2)],
    "chunk_intra": [(0, 64, 4, 1), (0, 64, 1, 1), (32, 64, 2, 1), (64, 64, 4, 1), (64, 64, 2, 1), (32, 64, 4, 1)],
    "chunk_intra_diag": [(0, 0, 4, 1), (0, 0, 1, 1), (0, 0, 8, 1), (32, 0, 2, 1), (64, 0, 4, 1), (32, 0, 1, 1)],
    "chunk_state_bwd": [(64, 64, 8, 2), (64, 64, 8, 3), (64, 64, 4, 4), (64, 64, 4, 2), (32, 64, 4, 4)],
    "chunk_output": [(64, 64, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 3), (128, 128, 8, 2), (64, 128, 8, 3),
                     (32, 64, 4, 2), (64, 128, 8, 2), (64, 128, 4, 2), (32, 128, 4, 3)],
    "chunk_grads_intra": [(32, 0, 2, 1), (64, 0, 2, 1), (64, 0, 4, 1), (16, 0, 1, 1), (16, 0, 2, 1)],
    "chunk_grads_qk": [(64, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (64, 32, 8, 3), (128, 32, 8, 2), (32, 64, 8, 2)],
    "chunk_grads_v": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2), (64, 128, 8, 3),
                      (64, 128, 4, 2)],
}


def make_inputs(op, b, t, h, d, seed=0):
    """q, k, v, do (bf16, [B, T, H, D]) and the op's gates (float32; GLA's logsigmoid(x) / 16)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q, k, v, do = (jax.random.normal(keys[i], (b, t, h, d), jnp.bfloat16) for i in range(4))
    g = {}
    if "gk" in GATES[op]:
        g["gk"] = jax.nn.log_sigmoid(jax.random.normal(keys[4], (b, t, h, d), jnp.float32)) / 16
    if "g" in GATES[op]:
        g["g"] = jax.nn.log_sigmoid(jax.random.normal(keys[5], (b, t, h), jnp.float32)) / 16
    if "g_gamma" in GATES[op]:
        g["g_gamma"] = -(8.0 / h) * (jnp.arange(h, dtype=jnp.float32) + 1) * np.log(2.0) / 8
    return q, k, v, do, g


@dataclasses.dataclass
class Stage:
    name: str  # the kernel (or glue) it launches
    raw: object  # the function
    fn: object  # jitted
    args: tuple
    grid: tuple = ()
    tiles: object = None
    bytes: float = 0.0
    flops: float = 0.0
    which: str = ""  # its kernel's name in host.CHUNKED


def traffic(which, cfg, tiles, direct=True):
    """(bytes, flops) of one launch of chunked kernel ``which``: each operand read once per program that reads it
    (bf16 q, k, v, do; float32 gates and states; dq, dk, dv bf16 where ``direct``, else float32), the products its
    programs issue."""
    b, t, h, kd, vd, c, sub = cfg.batch, cfg.seq_len, cfg.heads, cfg.dk, cfg.dv, cfg.chunk, host.SUB
    grad = 2 if direct else 4  # bytes of a gradient's element
    rows = b * t * h  # steps x heads
    chunks = b * (-(-t // c)) * h
    bk = min(tiles.block_k or kd, kd)
    bv = min(tiles.block_v or vd, vd)
    nk, nv = -(-kd // bk), -(-vd // bv)
    gate = 4 * (kd if cfg.has("gk") else 1)  # bytes of a step's log gate
    state = chunks * kd * vd * jnp.dtype(host.backward_states_dtype(cfg)).itemsize  # as the op's backward stores them
    nsub = c // sub
    if which == "chunk_sums":  # gk: the gates once; P, R per step and L_C per chunk written (float32)
        return rows * gate * 3 + chunks * gate, 0.0
    if which in ("chunk_state", "chunk_state_bwd"):
        read = rows * (2 * kd * nv + 2 * vd * nk + gate * nv)
        return read + state, 2 * rows * kd * vd
    if which == "chunk_intra_diag":  # the row above with the diagonal blocks from their own launch (both launches)
        which = "chunk_intra"
    if which == "chunk_intra":  # a program per chunk: q, k, gates once (the diagonal's rows again from cache), A;
        # the products of the sub-chunks before each, [C, K] x [K, C] masked (nsub - 1 of them), the diagonal's
        # elementwise q k e^x (counted as 2 flops a term); the backward's dA (do, v; dA float32) is not modelled
        read = rows * (2 * 2 * kd + gate)
        return read + rows * c * 2, rows * 2 * kd * c * (nsub - 1) + rows * 2 * kd * sub
    if which == "chunk_output":  # per block of V: q, k (no gk) or gates (gk), the chunk's A (gk); v, the state
        a = 2 * c if cfg.has("gk") else 0
        read = rows * ((2 * (kd if cfg.has("gk") else 2 * kd) + (gate if cfg.has("gk") else 4) + a) * nv + 2 * vd)
        flops = rows * (2 * kd * vd + 2 * c * vd + (0 if cfg.has("gk") else 2 * c * kd * nv))
        return read + state + rows * 2 * vd, flops
    if which == "chunk_grads_intra":  # a program per (chunk, block of K): q, k, gates once (the diagonal's rows again
        # from cache), the chunk's dA (float32) per block; two masked [C, C] x [C, BK] products per boundary between
        # sub-chunks (nsub - 1), the diagonal's elementwise terms (dq, dk, the pairs: counted as 2 flops each); writes
        # dq, dk and the log gate's parts in float32
        read = rows * (2 * 2 * kd + gate) + rows * c * 4 * nk
        flops = rows * 4 * c * kd * (nsub - 1) + rows * 2 * sub * kd * 3
        return read + rows * 3 * 4 * kd, flops
    if which == "chunk_grads_qk":  # per block of K: q, k, gates, do and v whole, both states; with gk the parts
        gk = cfg.has("gk")
        read = rows * (2 * 2 * kd + gate + 2 * 2 * vd * nk + (3 * 4 * kd if gk else 0)) + 2 * state
        flops = rows * (4 * kd * vd + (0 if gk else 2 * c * vd * nk + 6 * c * kd))
        return read + rows * (2 * grad * kd + (4 * kd if gk else 4 * nk)), flops
    if which == "chunk_grads_v":  # the output kernel's transpose
        gk = cfg.has("gk")
        read = rows * ((2 * (kd if gk else 2 * kd) + (gate if gk else 4) + (2 * c if gk else 0)) * nv + 2 * vd)
        flops = rows * (2 * kd * vd + 2 * c * vd + (0 if gk else 2 * c * kd * nv))
        return read + state + rows * grad * vd, flops
    raise ValueError(which)


def stages(op_name, b, t, h, d):
    """The launches of one forward and backward call, in order, each a Stage on its real inputs."""
    q, k, v, do, g = make_inputs(op_name, b, t, h, d)
    op_module = importlib.import_module(f"ejgen.generated.{op_name}.op")
    kernels = op_module.BACKENDS["triton"].KERNELS
    call = api.prepare(op_module.SPEC, q, k, v, **g, algorithm="chunked", chunked=host.CHUNKED_GATES)
    cfg, gates, ctx = call.cfg, call.gates, call.ctx
    dht = jnp.zeros((cfg.n_seqs, cfg.heads, cfg.dk, cfg.dv), jnp.float32)
    out = []

    def add(name, raw, *args, grid=(), which=None, launch=None):
        if not wanted(name):
            return None  # (another form's row: nothing reads its result)
        fn = jax.jit(raw)
        result = jax.block_until_ready(fn(*args))
        tiles = launch or host.CHUNKED.get(which or name)  # (``launch``: the Tiles the row runs, where not CHUNKED's)
        nbytes, flops = traffic(which or name, cfg, tiles, host._direct(kernels, cfg)) if tiles else (0.0, 0.0)
        out.append(Stage(name, raw, fn, args, grid, tiles, nbytes, flops, which or name))
        return result

    blocks = {n: host.tiles(n, cfg.dk, cfg.dv)[0] for n in host.CHUNKED}
    n_c, rows_h = -(-t // cfg.chunk), b * h
    nkv = lambda n: -(-cfg.dk // blocks[n]["BK"]) * -(-cfg.dv // blocks[n]["BV"])  # noqa: E731
    sums = None  # chunk_sums' (gk, the chunk_gate_sums setting "kernel"), which the op forms in each pass
    other = "always" if host.after_stored(q, cfg) else "never"  # the after sums' form the op does not take
    after = {"AFTER_FROM_PREFIX": other}
    v_ahead = host.grads_v_ahead(cfg.gates)  # chunk_grads_v's form the op takes, and the other
    v_other = {"GRADS_V_AHEAD": "never" if v_ahead else "always"}
    b_first = host.blocks_first(cfg.gates)  # the order of a chunk's blocks in the grid the op takes, and the other
    b_other = {"BLOCKS_FIRST": "never" if b_first else "always"}
    if host.chunk_sums(kernels, q, gates, ctx, cfg) is not None:
        sums_grid = (n_c, -(-cfg.dk // blocks["chunk_sums"]["BK"]), rows_h) if cfg.has("gk") else (n_c, 1, b)
        sums = add("chunk_sums", lambda q, g: host.chunk_sums(kernels, q, g, ctx, cfg), q, gates, grid=sums_grid)
        if q.dtype != jnp.float32:  # 16-bit inputs: the after sums' other form (stored, or formed by their readers)
            add(f"chunk_sums, {AFTER_NAMED[other]}", switched(after, lambda q, g: host.chunk_sums(
                kernels, q, g, ctx, cfg)), q, gates, grid=sums_grid, which="chunk_sums")
    stored = host.backward_states_dtype(cfg)  # the states and adjoints as the op's backward stores them
    def walk(k, v, g, s):
        return host.chunk_states(kernels, k, v, g, None, ctx, cfg, stored, sums=s)

    fixed_ok = host.decay_is_fixed(cfg.gates)
    # the forward walk's and output kernel's outside a gradient, as "op fwd" runs them (none: formed there)
    fwd_sums = None if host.fixed_decay(cfg, False) else sums
    hs, _ = add("chunk_state", walk, k, v, gates, fwd_sums, grid=(nkv("chunk_state"), rows_h))
    if fixed_ok and sums is not None:  # a fixed decay's sums: the other form
        add(f"chunk_state, {FIXED_NAMED[not host.FIXED_DECAY_SUMS]}", flipped("FIXED_DECAY_SUMS", walk), k, v, gates,
            sums if host.FIXED_DECAY_SUMS else None, grid=(nkv("chunk_state"), rows_h), which="chunk_state")
    group, ng = flipped("STATE_GROUPS", lambda: host.state_group(cfg))()  # the forward's walk in groups, if it splits
    if not host.STATE_GROUPS and group:
        def grouped(k, v, g, s):
            hs, ht, (gs, dc, _, _) = host.chunk_states_grouped(kernels, k, v, g, None, ctx, cfg, stored, sums=s)
            return hs, ht, gs, dc

        add(f"chunk_state in {ng} groups of {group} + chunk_state_groups", flipped("STATE_GROUPS", grouped), k, v,
            gates, sums, grid=(nkv("chunk_state"), rows_h, ng), which="chunk_state")
        add(f"chunk_state in {ng} groups walked twice + chunk_state_groups", switched(REWALK, lambda k, v, g, s: (
            host.chunk_states(kernels, k, v, g, None, ctx, cfg, stored, sums=s))), k, v, gates, sums,
            grid=(nkv("chunk_state"), rows_h, ng), which="chunk_state")
    a = qg = None
    def gated_q():  # chunk_intra's q ⊙ e^{P} for chunk_output as the op takes it, and the other
        return host.gated_q(q.dtype, cfg.products, cfg.gates, fwd_sums is not None)

    gated, gated_other = gated_q(), switched({"GATED_Q": not host.GATED_Q}, gated_q)()

    def intra(gated):
        return lambda q, k, g, s: host.chunk_intra(kernels, q, k, g, ctx, cfg, sums=s, gated=gated)

    if cfg.has("gk"):
        a, _, qg = add("chunk_intra", intra(gated), q, k, gates, sums, grid=(n_c * (cfg.chunk // host.SUB), rows_h))
        if gated_other != gated:
            other_intra = add(f"chunk_intra, {GATED_NAMED[gated_other]}", intra(gated_other), q, k, gates, sums,
                              grid=(n_c * (cfg.chunk // host.SUB), rows_h), which="chunk_intra")
            qg_other = other_intra and other_intra[2]  # (None where `--rows` leaves the row out)
        for form, pieces, named in other_forms():  # (the kernel's: both launches)
            add(f"chunk_intra, diagonal {named}", diagonal(form, pieces, lambda q, k, g, s: host.chunk_intra(
                kernels, q, k, g, ctx, cfg, sums=s)), q, k, gates, sums, grid=(n_c * (cfg.chunk // host.SUB), rows_h),
                which="chunk_intra_diag" if form == "kernel" else "chunk_intra")
    def output(q, k, v, g, hs, a, s, qg=None):
        return host.chunk_output(kernels, q, k, v, g, ctx, cfg, hs, a, s, qg=qg)

    out_grid = (n_c, -(-cfg.dv // blocks["chunk_output"]["BV"]), rows_h)  # (chunks, blocks of V, rows x heads)
    out_launch = host.output_launch(q.dtype, cfg.products, cfg.gates)
    add("chunk_output", output, q, k, v, gates, hs, a, fwd_sums, qg, grid=host._blocks_grid(*out_grid, b_first),
        launch=out_launch)
    add(f"chunk_output, {AHEAD_NAMED[not host.OUTPUT_AHEAD]}", flipped("OUTPUT_AHEAD", output), q, k, v, gates, hs, a,
        fwd_sums, qg, grid=host._blocks_grid(*out_grid, b_first), which="chunk_output", launch=out_launch)
    if out_grid[1] > 1:  # blocks of V: their other order in the grid
        add(f"chunk_output, {BLOCKS_NAMED[not b_first]}", switched(b_other, output), q, k, v, gates,
            hs, a, fwd_sums, qg, grid=host._blocks_grid(*out_grid, not b_first), which="chunk_output",
            launch=out_launch)
    if not cfg.has("gk") and host._gated(cfg):  # the scalar gates' output kernel at other launches
        for named, values in output_launches():
            add(f"chunk_output, {named}", switched(values, output), q, k, v, gates, hs, a, fwd_sums, qg,
                grid=host._blocks_grid(*out_grid, b_first), which="chunk_output",
                launch=values["OUTPUT_SCALAR_TILES"] or host.CHUNKED["chunk_output"])
    if cfg.has("gk") and gated_other != gated:
        add(f"chunk_output, {GATED_NAMED[gated_other]}", output, q, k, v, gates, hs, a, fwd_sums, qg_other,
            grid=host._blocks_grid(*out_grid, b_first), which="chunk_output")
    if fixed_ok and sums is not None:
        add(f"chunk_output, {FIXED_NAMED[not host.FIXED_DECAY_SUMS]}", flipped("FIXED_DECAY_SUMS", output), q, k, v,
            gates, hs, a, sums if host.FIXED_DECAY_SUMS else None, grid=host._blocks_grid(*out_grid, b_first),
            which="chunk_output", launch=out_launch)
    def state_bwd(q, g, do, dht, s):
        return host.chunk_state_grads(kernels, q, g, ctx, cfg, do, dht, s, stored)

    dhs, dh0 = add("chunk_state_bwd", state_bwd, q, gates, do, dht, sums, grid=(nkv("chunk_state_bwd"), rows_h))
    if not cfg.has("gk") and host._gated(cfg):
        add(f"chunk_state_bwd, {ADJOINT_NAMED[not host.ADJOINT_AS_LOADED]}", flipped("ADJOINT_AS_LOADED", state_bwd),
            q, gates, do, dht, sums, grid=(nkv("chunk_state_bwd"), rows_h), which="chunk_state_bwd")
    a = intra = None
    if cfg.has("gk"):
        add("dA alone (the op's)", lambda q, k, v, g, do: host.chunk_intra(kernels, q, k, g, ctx, cfg, v, do,
                                                                          with_a=False)[1],
            q, k, v, gates, do, grid=(n_c * (cfg.chunk // host.SUB), rows_h), which="chunk_intra")
        a, da, _ = add("chunk_intra + dA", lambda q, k, v, g, do, s: host.chunk_intra(kernels, q, k, g, ctx, cfg, v, do,
                                                                                  sums=s),
                    q, k, v, gates, do, sums, grid=(n_c * (cfg.chunk // host.SUB), rows_h), which="chunk_intra")
        grads_grid = (n_c * (cfg.chunk // host.SUB), -(-cfg.dk // blocks["chunk_grads_intra"]["BK"]), rows_h)

        def grads_intra(q, k, g, da, s):
            return host.chunk_grads_intra(kernels, q, k, g, ctx, cfg, da, s)

        intra = add("chunk_grads_intra", grads_intra, q, k, gates, da, sums, grid=grads_grid)
        if sums is not None:
            named = "scanned gates" if host.GRADS_INTRA_SUMS else "prefix sums"
            add(f"chunk_grads_intra, {named}", flipped("GRADS_INTRA_SUMS", grads_intra), q, k, gates, da, sums,
                grid=grads_grid, which="chunk_grads_intra")
    qk_bk = host.grads_qk_form(q.dtype, cfg.products, cfg.gates, cfg.dk, cfg.dv)[1]["BK"]
    scalar_qk = not cfg.has("gk") and host._gated(cfg)  # (a scalar gate's launch: GRADS_QK_SCALAR_TILES)

    def grads_qk(q, k, v, g, hs, dhs, do, intra, s):
        return host.chunk_grads_qk(kernels, q, k, v, g, ctx, cfg, hs, dhs, do, intra, s)

    qk_grid = (n_c, -(-cfg.dk // qk_bk), rows_h)  # (chunks, blocks of K, rows x heads)
    dq, dk, dlog = add("chunk_grads_qk", grads_qk, q, k, v, gates, hs, dhs, do, intra, sums,
                       grid=host._blocks_grid(*qk_grid, b_first),
                       launch=host.GRADS_QK_SCALAR_TILES if scalar_qk else None)
    if scalar_qk:  # the scalar gates held fixed (RecurrentConfig.log_grads): no log gates' gradient formed
        fixed_cfg = dataclasses.replace(cfg, log_grads=False)
        add("chunk_grads_qk, the gates held fixed", lambda q, k, v, g, hs, dhs, do, intra, s: host.chunk_grads_qk(
            kernels, q, k, v, g, ctx, fixed_cfg, hs, dhs, do, intra, s), q, k, v, gates, hs, dhs, do, intra, sums,
            grid=host._blocks_grid(*qk_grid, b_first), launch=host.GRADS_QK_SCALAR_TILES, which="chunk_grads_qk")
    if scalar_qk:  # a scalar gate's other forms of the kernel (GRADS_QK_FORMS)
        for named, values in qk_forms(cfg):
            bk = switched(values, lambda: host.grads_qk_form(q.dtype, cfg.products, cfg.gates,
                                                             cfg.dk, cfg.dv)[1]["BK"])()
            add(f"chunk_grads_qk, {named}", switched(values, grads_qk), q, k, v, gates, hs, dhs, do, intra, sums,
                grid=host._blocks_grid(n_c, -(-cfg.dk // bk), rows_h, b_first), which="chunk_grads_qk",
                launch=values.get("GRADS_QK_SCALAR_TILES", host.GRADS_QK_SCALAR_TILES))
    if qk_grid[1] > 1:  # blocks of K: their other order in the grid
        add(f"chunk_grads_qk, {BLOCKS_NAMED[not b_first]}", switched(b_other, grads_qk), q, k, v,
            gates, hs, dhs, do, intra, sums, grid=host._blocks_grid(*qk_grid, not b_first), which="chunk_grads_qk",
            launch=host.GRADS_QK_SCALAR_TILES if scalar_qk else None)

    def grads_v(q, k, g, dhs, do, a, s):
        return host.chunk_grads_v(kernels, q, k, g, ctx, cfg, dhs, do, a, s)

    dv_grid = (n_c, -(-cfg.dv // blocks["chunk_grads_v"]["BV"]), rows_h)  # (chunks, blocks of V, rows x heads)
    dv = add("chunk_grads_v", grads_v, q, k, gates, dhs, do, a, sums, grid=host._blocks_grid(*dv_grid, b_first))
    add(f"chunk_grads_v, {AHEAD_NAMED[not v_ahead]}", switched(v_other, grads_v), q, k, gates, dhs, do, a, sums,
        grid=host._blocks_grid(*dv_grid, b_first), which="chunk_grads_v")
    if dv_grid[1] > 1:  # blocks of V: their other order in the grid
        add(f"chunk_grads_v, {BLOCKS_NAMED[not b_first]}", switched(b_other, grads_v), q, k, gates,
            dhs, do, a, sums, grid=host._blocks_grid(*dv_grid, not b_first), which="chunk_grads_v")

    def glue(q, k, v, g, dq, dk, dv, dh0, dlog):
        d_key = None if dlog is None else host.key_log_grad(dlog, cfg)
        return gradients.finish(kernels.hooks, q, k, v, g, None, cfg, dq, dk, dv, dh0, d_key)

    add("glue (XLA)", glue, q, k, v, gates, dq, dk, dv, dh0, dlog)
    op = getattr(importlib.import_module(f"ejgen.generated.{op_name}"), op_name)

    def fwd(q, k, v, g):
        return op(q, k, v, **g, platform="triton", algorithm="chunked")

    def fwd_bwd(q, k, v, g, do):  # (o returned: else XLA drops chunk_output, whose o the backward does not read)
        (o, ht), vjp = jax.vjp(fwd, q, k, v, g)
        return o, vjp((do, jnp.zeros_like(ht)))

    add("op fwd", fwd, q, k, v, g)
    add("op fwd+bwd", fwd_bwd, q, k, v, g, do)
    add(f"op fwd, chunk_output {AHEAD_NAMED[not host.OUTPUT_AHEAD]}", flipped("OUTPUT_AHEAD", fwd), q, k, v, g)
    add(f"op fwd+bwd, chunk_output {AHEAD_NAMED[not host.OUTPUT_AHEAD]}", flipped("OUTPUT_AHEAD", fwd_bwd), q, k, v,
        g, do)
    add(f"op fwd+bwd, chunk_grads_v {AHEAD_NAMED[not v_ahead]}", switched(v_other, fwd_bwd), q, k,
        v, g, do)
    if fixed_ok and sums is not None:  # (outside a gradient alone: a differentiated forward keeps chunk_sums')
        add(f"op fwd, {FIXED_NAMED[not host.FIXED_DECAY_SUMS]}", flipped("FIXED_DECAY_SUMS", fwd), q, k, v, g)
    if scalar_qk:  # the scalar gates held fixed (closed over: the backward forms no log gates' gradient)
        def fwd_bwd_held(q, k, v, g, do):
            (o, ht), vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, g), q, k, v)
            return o, vjp((do, jnp.zeros_like(ht)))

        add("op fwd+bwd, the gates held fixed", fwd_bwd_held, q, k, v, g, do)
    if not cfg.has("gk") and host._gated(cfg):
        for named, values in output_launches():
            add(f"op fwd, chunk_output {named}", switched(values, fwd), q, k, v, g)
    if cfg.has("gk") and gated_other != gated:
        add(f"op fwd, {GATED_NAMED[gated_other]}", flipped("GATED_Q", fwd), q, k, v, g)
        add(f"op fwd+bwd, {GATED_NAMED[gated_other]}", flipped("GATED_Q", fwd_bwd), q, k, v, g, do)
    if max(out_grid[1], qk_grid[1], dv_grid[1]) > 1:  # (one block each: the orders are the same launches)
        add(f"op fwd, {BLOCKS_NAMED[not b_first]}", switched(b_other, fwd), q, k, v, g)
        add(f"op fwd+bwd, {BLOCKS_NAMED[not b_first]}", switched(b_other, fwd_bwd), q, k, v, g, do)
    if not cfg.has("gk") and host._gated(cfg):
        add(f"op fwd+bwd, chunk_state_bwd {ADJOINT_NAMED[not host.ADJOINT_AS_LOADED]}",
            flipped("ADJOINT_AS_LOADED", fwd_bwd), q, k, v, g, do)
    if cfg.has("gk"):
        for form, pieces, named in other_forms():
            add(f"op fwd, chunk_intra's diagonal {named}", diagonal(form, pieces, fwd), q, k, v, g)
        if sums is not None:
            named = "scanned gates" if host.GRADS_INTRA_SUMS else "prefix sums"
            add(f"op fwd+bwd, chunk_grads_intra's {named}", flipped("GRADS_INTRA_SUMS", fwd_bwd), q, k, v, g, do)
    if sums is not None and q.dtype != jnp.float32:
        add(f"op fwd, {AFTER_NAMED[other]}", switched(after, fwd), q, k, v, g)
        add(f"op fwd+bwd, {AFTER_NAMED[other]}", switched(after, fwd_bwd), q, k, v, g, do)
    if not cfg.has("gk") and host._gated(cfg):
        for named, values in qk_forms(cfg):
            add(f"op fwd+bwd, chunk_grads_qk {named}", switched(values, fwd_bwd), q, k, v, g, do)
    if group:
        named = "one walk a sequence" if host.STATE_GROUPS else f"the state walks in {ng} groups"
        add(f"op fwd, {named}", flipped("STATE_GROUPS", fwd), q, k, v, g)
        add(f"op fwd+bwd, {named}", flipped("STATE_GROUPS", fwd_bwd), q, k, v, g, do)
        if not host.STATE_GROUPS:
            add(f"op fwd, {ng} groups walked twice", switched(REWALK, fwd), q, k, v, g)
            add(f"op fwd+bwd, {ng} groups walked twice", switched(REWALK, fwd_bwd), q, k, v, g, do)
    return out, (q, k, v, do, g, fwd)


AHEAD_NAMED = {True: "reads ahead of the K loop", False: "reads after the K loop"}
"""host.OUTPUT_AHEAD / GRADS_V_AHEAD (session 30; on since session 31, chunk_grads_v's for scalar gates alone):
chunk_output's (chunk_grads_v's) tiles, sums and kᵀ (qᵀ) read ahead of their K loops."""

ADJOINT_NAMED = {True: "as loaded", False: "scaled through registers"}
"""host.ADJOINT_AS_LOADED (session 30; on since session 31): chunk_state_bwd's scalar-gate walk as the forward's."""

FIXED_NAMED = {True: "a fixed decay's sums formed in the kernels", False: "a fixed decay's sums from chunk_sums"}
"""host.FIXED_DECAY_SUMS (session 31; on since session 33 for a forward outside a gradient): with g_gamma alone that
forward's walk and output kernel form P and L_C from γ, no chunk_sums launched."""

BLOCKS_NAMED = {True: "blocks of a chunk side by side", False: "chunks first"}
"""host.BLOCKS_FIRST (session 31; on for gk since session 32): chunk_output's, chunk_grads_v's and chunk_grads_qk's
blocks of one chunk numbered side by side in the grid (their shared reads from L2), or the chunks first."""

GATED_NAMED = {True: "q ⊙ e^P from chunk_intra", False: "q ⊙ e^P formed in chunk_output"}
"""host.GATED_Q (session 32, on since): with gk, chunk_intra stores q ⊙ e^{P} in bf16 for chunk_output."""

AFTER_NAMED = {"never": "after sums stored", "always": "after sums from the prefix sums"}
"""16-bit inputs, host.AFTER_FROM_PREFIX: chunk_sums stores the after sums ("never"), or chunk_state, chunk_grads_qk
and chunk_grads_v form them ("always", the default since session 31; "gk" forms them for per-key gates only)."""

GRADS_QK_FORMS = (  # a scalar gate's chunk_grads_qk other than the default (folded, a program a chunk, 3 stages, and
    # with g_gamma alone its chunk's whole share: sessions 30 and 33; the unfolded forms lost in sessions 30-32)
    ("folded, blocks of K", {"GRADS_QK_FOLD": True, "GRADS_QK_SCALAR_TILES": None}),
    ("folded, a program a chunk, 2 stages (before session 33)",
     {"GRADS_QK_FOLD": True, "GRADS_QK_SCALAR_TILES": host.Tiles(128, 64, 8, 2)}),
    # (g_gamma alone: a reverse scan a step, host.GAMMA_TOTAL off; the others always scan)
    ("folded, a program a chunk, g_gamma by a scan a step (before session 33)", {"GAMMA_TOTAL": False}),
)
"""host.GRADS_QK_FOLD / GRADS_QK_SCALAR_TILES / GAMMA_TOTAL: the rows that set them otherwise than the defaults."""


def qk_forms(cfg):
    """GRADS_QK_FORMS that change a call of ``cfg``'s launch (g_gamma's total with g_gamma alone)."""
    return [(named, values) for named, values in GRADS_QK_FORMS
            if "GAMMA_TOTAL" not in values or host.decay_is_fixed(cfg.gates)]


def output_launches():
    """chunk_output's other launches for a scalar gate (host.OUTPUT_SCALAR_TILES: 4 warps, 2 stages since session
    33): CHUNKED's 8 warps, and fla's chunk_fwd_kernel_o launch (its Hopper autotune almost surely takes 64, 64, 4
    warps, 3 stages) with v read after the K loop (both blocks of K in flight, v last: 126 registers, 72 KB on
    sm_90). (v prefetched to L2 at 8 warps, 3 stages lost in session 33 and was removed.)"""
    def launch(tiles, ahead):
        return {"OUTPUT_SCALAR_TILES": tiles, "OUTPUT_AHEAD": ahead}

    return [("8 warps, 2 stages (before session 33)", launch(None, host.OUTPUT_AHEAD)),
            ("4 warps, 3 stages, reads after the K loop (fla's launch)", launch(host.Tiles(64, 64, 4, 3), False))]


REWALK = {"STATE_GROUPS": True, "STATE_GROUP_FORM": "rewalk"}
"""The state walks in groups, each walked twice (its end, then from its joined start): the readers unchanged."""

FORMS = (("inline", False), ("kernel", False), ("inline", True), ("kernel", True))
"""chunk_intra's diagonal blocks: (host.CHUNK_INTRA_DIAGONAL, host.CHUNK_INTRA_PIECES)."""


def other_forms():
    """(form, pieces, its name in a row) of each diagonal form but the host's default."""
    return [(form, pieces, form + (" in pieces" if pieces else "")) for form, pieces in FORMS
            if (form, pieces) != (host.CHUNK_INTRA_DIAGONAL, host.CHUNK_INTRA_PIECES)]


def diagonal(form, pieces, f):
    """``f`` traced with chunk_intra's diagonal blocks formed ``form`` ("inline" / "kernel":
    host.CHUNK_INTRA_DIAGONAL), in pieces of 4 steps or not (host.CHUNK_INTRA_PIECES), read when a launch is traced."""
    def traced(*args):
        before = host.CHUNK_INTRA_DIAGONAL, host.CHUNK_INTRA_PIECES
        host.CHUNK_INTRA_DIAGONAL, host.CHUNK_INTRA_PIECES = form, pieces
        try:
            return f(*args)
        finally:
            host.CHUNK_INTRA_DIAGONAL, host.CHUNK_INTRA_PIECES = before
    return traced


def flipped(name, f):
    """``f`` traced with the host's switch ``name`` flipped (read when a launch is traced)."""
    return switched({name: not getattr(host, name)}, f)


def switched(values: dict, f):
    """``f`` traced with the host's settings ``values`` (name: value; read when a launch is traced)."""
    def traced(*args):
        before = {name: getattr(host, name) for name in values}
        for name, value in values.items():
            setattr(host, name, value)
        try:
            return f(*args)
        finally:
            for name, value in before.items():
                setattr(host, name, value)
    return traced



def check(op_name, inputs):
    """Relative errors of the Triton op's o, final state and gradients against the XLA backend's (float32 math on
    the same bf16 inputs)."""
    q, k, v, do, g, fwd = inputs
    op = getattr(importlib.import_module(f"ejgen.generated.{op_name}"), op_name)

    def both(platform):
        def f(q, k, v, g):
            return op(q, k, v, **g, platform=platform, algorithm="chunked")

        (o, ht), vjp = jax.vjp(jax.jit(f), q, k, v, g)
        return {"o": o, "final_state": ht, **dict(zip(("dq", "dk", "dv", "dgates"), vjp((do, jnp.zeros_like(ht)))))}

    got, ref = both("triton"), both("xla")
    errors = {}
    for name in got:
        a, r = jax.tree.leaves(got[name]), jax.tree.leaves(ref[name])
        for i, (x, y) in enumerate(zip(a, r)):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            errors[name + (f"[{i}]" if len(a) > 1 else "")] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y),
                                                                                                 1e-30))
    return errors


def time_stages(all_stages, reps, rounds, batch):
    """Median ms per stage over interleaved rounds."""
    samples = {id(s): [] for s in all_stages}
    for _ in range(rounds):
        for s in all_stages:
            samples[id(s)].append(median_seconds(s.fn, s.args, reps, batch=batch))
    return {id(s): statistics.median(samples[id(s)]) * 1e3 for s in all_stages}


def table(title, rows, ms):
    print(f"\n{title}\n")
    print("| kernel | grid | BK, BV, warps, stages | ms | GB/s | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for s in rows:
        t = ms[id(s)]
        tiles = "" if s.tiles is None else ", ".join(str(x) for x in dataclasses.astuple(s.tiles)[:4])
        rate = (f"{s.bytes / t / 1e6:.0f}", f"{s.flops / t / 1e9:.1f}") if s.bytes else ("", "")
        print(f"| {s.name} | {'x'.join(map(str, s.grid))} | {tiles} | {t:.3f} | {rate[0]} | {rate[1]} |", flush=True)
    kernels = [s for s in rows if s.tiles is not None]
    fwd = sum(ms[id(s)] for s in kernels if s.name in ("chunk_sums", "chunk_state", "chunk_intra", "chunk_output"))
    bwd = sum(ms[id(s)] for s in rows  # the op's backward forms dA alone (A kept from the forward: e319652)
              if s.name not in ("chunk_intra", "chunk_output", "chunk_intra + dA", "op fwd", "op fwd+bwd")
              and ", " not in s.name and not s.name.startswith(("chunk_state in ", "op ")))  # (not the other forms')
    print(f"\nsum of parts: fwd {fwd:.3f} ms (sums, state, intra, output); fwd+bwd {fwd + bwd:.3f} ms (the sums and "
          "state kernels twice, as the op runs them)")


def wanted(name: str) -> bool:
    """Whether a row is built (`--rows`): every default kernel and op row, another form's where a substring matches."""
    other = ", " in name or name.startswith("op ") and name not in ("op fwd", "op fwd+bwd")
    return not (ARGS.rows and other) or any(r in name for r in ARGS.rows.split(",") if r)


SCALAR_LAUNCHES = {"chunk_grads_qk": "GRADS_QK_SCALAR_TILES", "chunk_output": "OUTPUT_SCALAR_TILES"}
"""The kernels whose launch with a scalar gate is a host switch of its own, not CHUNKED's."""


def sweep(op_name, stage_list, reps, rounds, batch, only=()):
    """Each kernel (of ``only``, if given) under the settings of SWEEP (the others at their defaults)."""
    defaults = dict(host.CHUNKED)
    print(f"\n{op_name}: launch settings (BK, BV, warps, stages; * = default)\n")
    print("| kernel | settings | ms |")
    print("|---|---|---|")
    scalar_tiles = {which: getattr(host, name) for which, name in SCALAR_LAUNCHES.items()}
    for s in stage_list:
        if s.tiles is None or only and s.which not in only:
            continue
        if s.which in SCALAR_LAUNCHES and s.name != s.which:
            continue  # (their other forms' rows set their own launch: GRADS_QK_FORMS, output_launches)
        # a scalar gate's chunk_grads_qk and chunk_output launch their host switch's tiles (SCALAR_LAUNCHES)
        scalar = s.which in SCALAR_LAUNCHES and s.tiles != defaults[s.which]
        for setting in [dataclasses.astuple(s.tiles)] + SWEEP.get(s.which, []):
            if scalar:
                setattr(host, SCALAR_LAUNCHES[s.which], host.Tiles(*setting))
            else:
                host.CHUNKED[s.which] = host.Tiles(*setting)
            try:
                fn = jax.jit(s.raw)
                jax.block_until_ready(fn(*s.args))
                t = statistics.median(median_seconds(fn, s.args, reps, batch=batch) for _ in range(rounds)) * 1e3
                shown = f"{t:.3f}"
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                shown = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            mark = " *" if host.Tiles(*setting) == s.tiles else ""
            print(f"| {s.name} | {', '.join(map(str, setting[:4]))}{mark} | {shown} |", flush=True)
        host.CHUNKED[s.which] = defaults[s.which]
        for which, name in SCALAR_LAUNCHES.items():
            setattr(host, name, scalar_tiles[which])


def main():
    args = ARGS
    smoke = args.cpu_smoke
    shapes = [(1, 64)] if smoke and args.shapes == "4x4096" else [tuple(int(x) for x in s.split("x"))
                                                                    for s in args.shapes.split(",")]
    h, d = (2, 32) if smoke else (16, 128)
    reps, rounds, batch = (1, 1, 1) if smoke else (args.reps, args.rounds, 8)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; bf16, H={h}, K=V={d}, chunks of 64",
          flush=True)
    for b, t in shapes:
        for op_name in args.ops.split(","):
            stage_list, inputs = stages(op_name, b, t, h, d)
            if not args.no_check:
                errors = check(op_name, inputs)
                print(f"\n{op_name} B{b} T{t}: Triton against XLA (relative error): " + ", ".join(
                    f"{n} {e:.1e}" + (" FLAG" if e > FLAG else "") for n, e in errors.items()), flush=True)
            ms = time_stages(stage_list, reps, rounds, batch)
            table(f"{op_name} B{b} T{t}", stage_list, ms)
            if args.sweep:
                sweep(op_name, stage_list, reps, rounds, batch, [k for k in args.sweep_kernels.split(",") if k])


if __name__ == "__main__":
    main()
