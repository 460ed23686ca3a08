"""Public ops and the controls every op shares.

- ``flash_attention``: generated from ``specs/flash_attention.yaml`` (docs/DESIGN.md §3).
- ``blocksparse_attention``: the seed's signature ([batch, heads, seq, head_dim], qkv_layouts, segment ids, ...)
  on the op generated from ``specs/blocksparse_attention.yaml`` (``ejgen.ops.blocksparse``).
- ``ragged_decode_attention``, ``page_attention``: the seed's decode ops on the flash spec's decode modes
  (``ejgen.ops.decode``; every spec listing ``decode`` / ``paged`` in ``modes`` has ``<name>_decode`` / ``_paged``).
- ``mean_pooling``: the seed's ``mean_pooling(x, chunk_size=32, cu_seqlens=None)``, generated from
  ``specs/mean_pooling.yaml`` (docs/DESIGN.md §3 pooling; the other pooling specs' ops are in ``ejgen.generated``).
- ``ring_attention``: the flash spec's ring form (``flash_attention_ring``; every spec has ``<name>_ring``): the
  sequence cut over a mesh axis, key/value blocks passed around it (docs/DESIGN.md §3, Ring attention);
  ``ring_permute`` / ``ring_unpermute`` / ``ring_positions`` lay a sequence out in a balanced token order and back.
- ``recurrent``: the seed's ``recurrent(query, key, value, g=None, g_gamma=None, gk=None, gv=None,
  softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None) -> (o, final_state)``, generated from
  ``specs/recurrent.yaml`` (docs/DESIGN.md §3 linear recurrent; gla, simple_gla, lightning_attention and
  linear_attention are in ``ejgen.generated``).
- ``recurrent_cp``: its context-parallel form (every recurrent op has ``<name>_cp``): the steps cut over a mesh axis,
  the state passed along it (docs/DESIGN.md §3, Context parallelism).
- ``explain(op, *args, target=None, **kwargs)``: which platform and kernel sets a call takes, and why,
  without running it (docs/DESIGN.md §6).
- ``settings(**changes)``: a scoped override of the settings (``deterministic``, ``gluon``,
  ``chunk_forward``, ``chunk_state_dtype``, ``chunk_gate_sums``, ``chunk_products``, ``triton_configs``,
  ``triton_autotune``; the rest in
  ``ejgen.runtime.core.settings``); ``current_settings()`` the ones in force.
"""

from ejgen.generated import flash_attention, mean_pooling, recurrent, recurrent_cp
from ejgen.generated import flash_attention_ring as ring_attention
from ejgen.ops.blocksparse import blocksparse_attention
from ejgen.ops.decode import page_attention, ragged_decode_attention
from ejgen.runtime.attention.ring import ring_permute, ring_positions, ring_unpermute
from ejgen.runtime.core.kernels import KernelChoice, explain
from ejgen.runtime.core.settings import Settings, settings
from ejgen.runtime.core.settings import current as current_settings

__all__ = ["flash_attention", "ring_attention", "ring_permute", "ring_unpermute", "ring_positions", "mean_pooling",
           "recurrent", "recurrent_cp", "blocksparse_attention", "ragged_decode_attention", "page_attention", "explain",
           "settings", "current_settings", "KernelChoice", "Settings"]
