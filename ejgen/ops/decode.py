"""The seed's decode ops on the flash spec's decode modes (docs/DESIGN.md §3, "Decode and paged modes"):
``ragged_decode_attention`` (``flash_attention_decode``) and ``page_attention`` (``flash_attention_paged``), with
the seed's signatures. A single query per sequence is the usual call; ``query [B, Sq, Hq, D]`` (Sq <= 16) puts Sq
queries at the sequence's last positions, causal among themselves (speculative verification, chunked prefill)."""

from __future__ import annotations

from ejgen.generated.flash_attention import flash_attention_decode, flash_attention_paged


def ragged_decode_attention(query, key, value, sequence_start, sequence_end, *, softmax_scale=None,
                            sliding_window=None, logits_soft_cap=None, softmax_aux=None, platform="auto",
                            return_lse=False, batch_invariant=False):
    """query [B, Hq, D] (or [B, Sq, Hq, D]), key/value [B, S, Hkv, D|Dv], sequence_start/end int [B]: each
    sequence's keys ``start_b <= j < end_b`` of its cache row; the query stands at ``end_b - 1``. An empty range
    gives 0. Returns out [B, Hq, Dv] (and lse [B, Hq] with ``return_lse``). ``batch_invariant``: a sequence's
    result bitwise the same whatever else is in the batch (a fixed split size; the Triton kernel)."""
    return flash_attention_decode(query, key, value, sequence_start, sequence_end, causal=True,
                                  softmax_scale=softmax_scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, platform=platform,
                                  return_lse=return_lse, batch_invariant=batch_invariant)


def page_attention(query, key_cache, value_cache, context_lens, block_tables, *, softmax_scale=None,
                   sliding_window=None, logits_soft_cap=None, softmax_aux=None, platform="auto", return_lse=False,
                   batch_invariant=False):
    """query [B, Hq, D] (or [B, 1|Sq, Hq, D] as in the seed's example), key_cache/value_cache [num_pages,
    page_size, Hkv, D|Dv], context_lens int [B], block_tables int [B, max_pages]: token t of sequence b at
    ``(block_tables[b, t // page_size], t % page_size)``, visible for ``t < context_lens[b]``."""
    return flash_attention_paged(query, key_cache, value_cache, context_lens, block_tables, causal=True,
                                 softmax_scale=softmax_scale, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, platform=platform,
                                 return_lse=return_lse, batch_invariant=batch_invariant)
