"""A pretended Hopper GPU for tests of what the hosts hand the Gluon kernels: `triton_call.launch` records each
launch instead of running it (the kernels' numbers are the GPU suite's business); the Hopper path's plain Triton
kernels (`gluon.host.PLAIN_TRITON`: the documents' plan, the backward's delta), whose results the Gluon kernels take
as inputs, run in Triton's interpreter, unrecorded."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ENV = ("EJGEN_TRITON_CONFIG", "EJGEN_GLUON", "EJGEN_GLUON_DYNAMIC_TILES")  # settings a test must not inherit


def pretend_hopper(monkeypatch, sms: int | None = None, values: bool = True) -> list:
    """sm_90 with jax-triton "available" and ``sms`` SMs (None: the host's own rule); returns the list each launch
    appends (kernel, grid, inputs, outs, constexprs) to, the inputs as their values once the call runs where
    ``values`` (they are traced at launch), else as the traced arrays."""
    from ejgen.runtime.attention.gluon import host as gluon_attention
    from ejgen.runtime.core import kernels as core_kernels
    from ejgen.runtime.launch import triton_call

    if not gluon_attention.importable()[0]:
        pytest.fail(gluon_attention.importable()[1])
    seen = []
    launch_options = ("zeroed", "num_warps", "num_stages", "autotune", "aliases")

    def fake_launch(kernel, grid, inputs, outs, **kw):
        if getattr(kernel, "fn", kernel).__module__ in gluon_attention.PLAIN_TRITON:  # run, in the interpreter
            constexprs = {k: v for k, v in kw.items() if k not in launch_options}
            run = functools.partial(triton_call._interpret, kernel, grid, tuple(outs), constexprs, {})
            return list(jax.pure_callback(run, tuple(outs), *inputs, vmap_method="sequential"))
        if values:
            got = []
            jax.debug.callback(lambda *xs: got.extend(np.asarray(x) for x in xs), *inputs)
        seen.append((kernel, grid, got if values else inputs, outs, kw))
        results = [jnp.zeros(o.shape, o.dtype) for o in outs]
        for i, o in (kw.get("aliases") or {}).items():  # an aliased output starts as its input, as on the GPU
            results[o] = inputs[i]
        return results

    monkeypatch.setattr(triton_call, "mode", lambda: ("gpu", ""))
    monkeypatch.setattr(triton_call, "launch", fake_launch)
    monkeypatch.setattr(core_kernels, "target", lambda: core_kernels.Target("gpu", "sm90"))
    if sms is not None:
        monkeypatch.setattr(gluon_attention, "num_sms", lambda: sms)
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    return seen
