"""The segment-key pass (`ejgen.ir.passes.segment_key`; docs/DESIGN.md §5, Segment keys): which conjuncts of a mask
are an equality of per-token ids (a query side == a key side, integer arithmetic only) and which stay in the element
mask; the side the ids are offset from; the rest of the mask the kernels keep; and the specs whose mask the planner
keeps whole (decode modes, varlen)."""

from __future__ import annotations

import pytest

from ejgen.ir.expr import to_text
from ejgen.ir.passes.segment_key import split
from ejgen.ir.passes.separate import separate
from ejgen.errors import SpecError
from ejgen.plan.attention import plan_attention, segment_key_of
from ejgen.spec import load_spec

SPEC = """\
name: probe
family: attention
{extra}params:
  types: {{shape: [batch, kv_len], dtype: int32}}
  latest: {{shape: [batch, q_len], dtype: int32}}
  gate: {{shape: [heads], dtype: float32}}
options:
  chunk: {{type: int, default: 4}}
mask: "{mask}"
"""


def load(tmp_path, mask, extra=""):
    path = tmp_path / "probe.yaml"
    path.write_text(SPEC.format(mask=mask, extra=extra))
    return load_spec(path)


@pytest.mark.parametrize("mask, query, key, base", [
    ("q_idx // chunk == kv_idx // chunk", "(q_idx // chunk)", "(kv_idx // chunk)", "key"),
    ("kv_idx // chunk == latest[b, q_idx]", "latest[b, q_idx]", "(kv_idx // chunk)", "key"),  # sides swapped
    ("types[b, kv_idx] == q_idx % 3", "(q_idx % 3)", "types[b, kv_idx]", "query"),  # the key side reads a param
    ("latest[b, q_idx] == types[b, kv_idx]", "latest[b, q_idx]", "types[b, kv_idx]", None),  # both do: ranks
    ("(q_idx - kv_idx) % chunk == 0", "(q_idx % chunk)", "(kv_idx % chunk)", "key"),  # as separate.py writes it
    ("(q_idx < chunk) == (kv_idx < chunk)", "(q_idx < chunk)", "(kv_idx < chunk)", "key"),  # booleans: 0 / 1
    ("kv_idx // chunk == 2", "2", "(kv_idx // chunk)", "key"),  # one id for every query
    ("clamp(q_idx - q_len, -3, 3) == sign(kv_idx - kv_len // 2) * b", "clamp((q_idx - q_len), -3, 3)",
     "(sign((kv_idx - (kv_len // 2))) * b)", "key"),
], ids=lambda x: x if isinstance(x, str) and "==" in x else None)
def test_conjuncts_that_are_segment_keys(tmp_path, mask, query, key, base):
    found, rest = split(separate(load(tmp_path, mask).mask))
    assert found is not None, mask
    assert (to_text(found.query), to_text(found.key), found.base) == (query, key, base)
    assert to_text(rest) == "true"


@pytest.mark.parametrize("mask", [
    "q_idx // chunk == kv_idx // chunk + q_idx % 2",  # a side reads both positions
    "latest[b, kv_idx] == kv_idx // chunk",  # the query side's param read at a key position: no query side
    "q_idx + kv_idx == chunk",  # one side mixes both, the other neither
    "float(q_idx) * 0.5 == float(kv_idx)",  # float-valued sides
    "int(float(q_idx) * 0.5) == kv_idx",  # an int made of floats: the kernels' float rounding is theirs
    "q_idx // chunk != kv_idx // chunk",  # an inequality
    "not (q_idx // chunk != kv_idx // chunk)",  # the same predicate, not written as an equality
    "q_idx // chunk == kv_idx // chunk or kv_idx == 0",  # inside a disjunction
    "h == kv_idx % 4",  # the query side reads the head: ids are per token, shared by the heads
    "b == chunk",  # no position on either side: a per-call condition
    "gate[h] > 0.0 and float(q_idx) == gate[0]",  # nothing of the kind anywhere
])
def test_conjuncts_that_stay_in_the_element_mask(tmp_path, mask):
    variant = load(tmp_path, mask)
    found, rest = split(separate(variant.mask))
    assert found is None and rest == separate(variant.mask), mask
    plan = plan_attention(variant)
    assert plan.segment_key is None and plan.spec_mask == separate(variant.mask)


def test_the_key_leaves_the_mask_and_the_rest_stays(tmp_path):
    """The first key of a conjunction runs as ids; the affine conjunct still gives block ranges, the other key and
    the param test stay in the element mask the kernels print."""
    mask = ("kv_idx <= q_idx + 3 and q_idx // chunk == kv_idx // chunk and types[b, kv_idx] > 0 "
            "and latest[b, q_idx] == types[b, kv_idx]")
    plan = plan_attention(load(tmp_path, mask))
    assert plan.segment_key.text() == "((q_idx // chunk) == (kv_idx // chunk))"
    assert to_text(plan.spec_mask) == ("(((kv_idx <= (q_idx + 3)) and (types[b, kv_idx] > 0)) and "
                                       "(latest[b, q_idx] == types[b, kv_idx]))")
    assert [c.source for c in plan.mask.constraints] == ["(kv_idx <= (q_idx + 3))"]
    assert to_text(plan.mask.residual) == "((types[b, kv_idx] > 0) and (latest[b, q_idx] == types[b, kv_idx]))"


def test_a_whole_key_leaves_no_element_mask(tmp_path):
    plan = plan_attention(load(tmp_path, "q_idx // chunk == kv_idx // chunk", "features:\n  causal: always\n"))
    assert plan.spec_mask is None and not plan.mask.needs_block_mask
    assert plan.names_used() >= {"q_idx", "kv_idx"}  # the spec still reads positions (ring refusals see them)


@pytest.mark.parametrize("extra, why", [
    ("modes: [train, decode]\n", "decode kernels print the spec's mask"),
    ("features:\n  varlen: runtime\n", "positions restart per sequence"),
])
def test_specs_that_keep_their_mask_whole(tmp_path, extra, why):
    plan = plan_attention(load(tmp_path, "q_idx // chunk == kv_idx // chunk", extra))
    assert plan.segment_key is None, why
    assert to_text(plan.spec_mask) == "((q_idx // chunk) == (kv_idx // chunk))"


def test_explicit_positions_keep_the_key_in_the_mask(tmp_path):
    """Explicit positions place tokens the ids would not follow: the key stays in the mask (`segment_key_of`), where
    the planner refuses it with positions (spec expressions over placed tokens are not supported yet)."""
    variant = load(tmp_path, "q_idx // chunk == kv_idx // chunk", "features:\n  positions: runtime\n")
    assert segment_key_of(variant) == (None, variant.mask)
    with pytest.raises(SpecError, match="feature 'positions' cannot be combined with a score or mask that reads "
                                        "kv_idx, q_idx"):
        plan_attention(variant)
