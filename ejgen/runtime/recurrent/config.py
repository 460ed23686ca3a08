"""Static configuration of one recurrent call. Hashable: a ``nondiff_argnames`` argument of ``jax.custom_vjp`` and a
jit cache key."""

from __future__ import annotations

import dataclasses


SCALAR_LOG_GATES = ("g", "g_gamma")  # the gates whose gradients come from one log decay gradient per step


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    batch: int  # B of the call (1 with varlen)
    seq_len: int  # T: steps of each batch row (packed tokens with varlen)
    heads: int  # H: query heads, one state each
    kv_heads: int  # Hkv: key / value heads (H % Hkv == 0; head h reads h // (H // Hkv))
    dk: int  # K: head dim of q and k
    dv: int  # V: head dim of v
    n_seqs: int  # N: sequences (rows of initial_state and final_state): B, or len(cu_seqlens) - 1
    varlen: bool  # packed sequences in batch 1, bounds in ctx["cu"]
    reverse: bool  # t runs from the last step to the first
    gates: tuple  # the gates the call passes, in RECURRENT_GATES order ("g", "g_gamma", "gk", "gv")
    initial_state: bool  # an initial_state was passed (else zeros)
    scale: float  # softmax_scale (default K ** -0.5)
    algorithm: str  # "chunked" | "fused": the one the call runs (auto resolved)
    chunk: int  # steps of a chunk (chunked); 1 for the fused recurrence
    dtype: str  # q, k, v's dtype name
    # the operands of the Triton chunked kernels' products with a float32 state or adjoint for 16-bit inputs:
    # "tf32" or "bfloat16" (the chunk_products setting, resolved when the op is called, so that the backward,
    # traced later, takes the forward's choice); float32 inputs multiply in float32 whatever it says
    products: str
    # whether the backward forms the key side's scalar log gates' gradients (SCALAR_LOG_GATES): False where the op's
    # custom_vjp sees none of them perturbed (a fixed decay, as Lightning attention and RetNet keep it), set by its
    # backward (`api.learned`); with gk always formed
    log_grads: bool = True

    def has(self, gate: str) -> bool:
        return gate in self.gates

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class Hooks:
    """A spec's element-wise hooks as its generated ``hooks.py`` defines them (None where the spec has none): jnp
    functions of an array of elements, which the XLA and Pallas backends, the Triton host's sums and the
    context-parallel form read; the Triton kernels carry their own ``@triton.jit`` ones."""

    feature_map: object = None  # phi(x) on q and k
    gate_map: object = None  # on the per-step gates g, gk, gv
    feature_map_grad: object = None  # phi'(x)
    gate_map_grad: object = None  # m'(x)


NO_HOOKS = Hooks()  # a spec without a feature map or gate map (it has no ``hooks.py``)
