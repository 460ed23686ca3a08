"""The pooling ops inside the caller's ``jax.shard_map`` (check_vma on), sequences cut over 4 host devices, on
every backend: value and gradients (weights included) equal the call on one device. Run by ``test_shard_map`` in
a process of its own (``python shard_check.py``): the device count is fixed when JAX starts."""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
os.environ.setdefault("TRITON_INTERPRET", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ejgen.generated import weighted_mean_pooling  # noqa: E402
from ejgen.runtime.core import vma  # noqa: E402


def main() -> int:
    mesh = jax.make_mesh((4,), ("dp",))
    x = jax.random.normal(jax.random.key(0), (8, 12, 16))
    w = jax.random.uniform(jax.random.key(1), (8, 12)) + 0.5
    mask = jax.random.uniform(jax.random.key(2), (8, 12)) > 0.2

    def loss_of(platform, sharded):
        def op(x, w, m):
            return weighted_mean_pooling(x, 4, weights=w, mask=m, platform=platform)

        if sharded:
            op = vma.shard_map(op, mesh=mesh, in_specs=(P("dp"),) * 3, out_specs=P("dp"))
        return lambda x, w: jnp.sum(jnp.sin(op(x, w, mask)))

    want = jax.value_and_grad(loss_of("xla", False), argnums=(0, 1))(x, w)
    for platform in ("xla", "triton", "pallas"):
        got = jax.jit(jax.value_and_grad(loss_of(platform, True), argnums=(0, 1)))(x, w)
        for name, a, b in (("value", got[0], want[0]), ("dx", got[1][0], want[1][0]), ("dw", got[1][1], want[1][1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6, err_msg=f"{platform} {name}")
        print(platform, "ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
