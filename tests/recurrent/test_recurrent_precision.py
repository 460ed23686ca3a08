"""The gates' gradients at lengths where writing them as a difference lost digits (docs/DESIGN.md §3 linear
recurrent, "Gates' gradients"). The kernels once derived them from reverse cumulative sums of q ⊙ dq - k ⊙ dk, whose
terms grow with the steps after a step while the gradient does not: the first GPU run (issue 17) saw g_gamma's
gradient err by 3e-2 in bfloat16 and 6e-5 in float32 at T = 300, and the value side, summed from the output rounded
to bfloat16, likewise. Each case below failed so (by the factor of its tolerance in its comment); the kernels now
write the log decay's gradient per step as a sum over pairs of steps, none subtracted from another. The XLA backend
(JAX's derivative of its scan) is checked at the same length."""

from __future__ import annotations

import pytest

from recurrent_cases import Case, check

pytestmark = pytest.mark.usefixtures("x64_stays_off")

ALL = ("g", "g_gamma", "gk", "gv")
FUSED = {"algorithm": "fused", "chunk": None}
CASES = (  # (case, platform): the smallest that failed, each in a few seconds
    (Case("lightning_attention", ("g_gamma",), dtype="bfloat16", shape=(1, 600, 2, 1, 16, 32), chunk=64),
     "triton"),  # dg_gamma 2.1 x its tolerance
    (Case("simple_gla", ("g", "g_gamma"), shape=(1, 600, 2, 1, 16, 32), chunk=64, h0=True), "triton"),  # 3.5
    (Case("recurrent", ALL, dtype="bfloat16", shape=(1, 200, 1, 1, 16, 32), **FUSED), "triton"),  # dgv 2.7
    (Case("recurrent", ALL, shape=(1, 200, 1, 1, 16, 32), h0=True, **FUSED), "triton"),  # dg_gamma 1.5
    (Case("simple_gla", ("g", "g_gamma"), dtype="bfloat16", shape=(1, 600, 2, 1, 16, 32), chunk=64, h0=True),
     "pallas"),  # dg_gamma 23, dg 1.1
    (Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 600, 2, 1, 16, 32), chunk=64, h0=True), "pallas"),  # 2.0
    (Case("recurrent", ("g", "g_gamma", "gk"), shape=(1, 600, 2, 1, 16, 32), chunk=64, h0=True), "xla"),
)


@pytest.mark.parametrize("case,platform", CASES, ids=[f"{p}-{c.id}" for c, p in CASES])
def test_gate_gradients_at_length(case, platform):
    check(case, platform)
