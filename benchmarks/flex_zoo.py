"""The spec zoo against FlexAttention, the torch side: each case of `benchmarks/zoo_cases.py` written the way a
FlexAttention user writes it — `create_block_mask` from a mask_mod where the variant masks, a `score_mod` for ALiBi,
T5's table and the soft caps — `flex_attention` under `torch.compile`, bf16, layout [B, H, S, D] (the numpy
inputs of zoo_cases transposed), the same seeded data as benchmarks/zoo.py. Runs in its own process (torch and JAX
do not share the GPU well); on the GPU host run it with `env -u PYTHONPATH` (as gpu_session.sh runs
flex_blocksparse.py) so that the torch install's own packages come first.

    env -u PYTHONPATH python3 benchmarks/flex_zoo.py --out bench-out/zoo
    python benchmarks/zoo.py --out bench-out/zoo --table

Choices that matter for the comparison:
- The block mask is built once per case, outside the timed region (`create_block_mask` on the device, 128 x 128
  blocks; a model builds it once per batch and reuses it in every layer). Its build time is recorded apart
  ("ms build").
- fwd is timed under `torch.no_grad()` (an inference forward, as ejgen's jitted forward keeps no residuals);
  fwd+bwd is the forward with grad and `torch.autograd.grad(out, (q, k, v, learnable...), do)`.
- gpt-oss's sinks: FlexAttention has no sinks. The forward asks for the lse and rescales the output by
  1 / (1 + exp(sink - lse)) = sigmoid(lse - sink), which is exactly the softmax with exp(sink) added to the
  denominator (docs/DESIGN.md §3 step 5); it is differentiable (the sinks' gradient, and the lse's back into
  flex_attention's backward), and one extra elementwise pass over out that ejgen does not pay.
- T5's table is a learnable float32 tensor captured by the score_mod; FlexAttention returns its gradient.
- torch.compile: `torch._dynamo.reset()` before every case and raised recompile limits, so no case falls back to
  the unfused eager path after the cache fills up (dynamo's default is 8 recompiles of one function).
- `--eager` (for the CPU check: compiled FlexAttention on the CPU is slow to build and lacks the lse gpt-oss
  needs) calls flex_attention without torch.compile: the unfused implementation, no timing worth reporting. On
  the CPU FlexAttention has no backward at all, so there fwd+bwd differentiates FlexAttention's own eager math
  (`math_attention`: the same score_mod and mask_mod over the dense scores) with autograd — enough for the
  cross-check of dq and the learnable gradients, never a timing.

Timing as flex_blocksparse.py's `timed` (samples of 4 calls back to back, medians), with a warm-up of 0.3 s that
brings the clocks up after a compile, and `--rounds` alternating fwd and fwd+bwd (median over rounds), as zoo.py.
Each mask_mod is also evaluated densely on a sample of rows and compared with zoo_cases' numpy mask (the one the
visible share comes from): a mismatch is recorded as an error. Writes <out>/zoo_flex.json and
<out>/zoo_flex_check.npz (the slices zoo.py saves: out[0, rows, heads, :8], dq, learnable gradients).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo_cases

try:  # torch >= 2.9: the lse through return_aux (return_lse is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

BATCH = 4  # calls per sample, as zoo.py and flex_blocksparse.py


def flex_lse(q, k, v, score_mod=None, block_mask=None):
    """flex_attention returning (out, lse), lse float32 [B, H, S] (natural log)."""
    if AuxRequest is not None:
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)


def reference_lse(q, k, v, score_mod=None, block_mask=None):
    """FlexAttention's own eager math (`torch._higher_order_ops.flex_attention.math_attention`: the same score_mod
    and mask_mod over the dense score matrix), differentiable by plain autograd: the CPU check's fwd+bwd, since
    FlexAttention has no backward on the CPU. (out, lse), lse in natural log as flex_lse's."""
    from torch._higher_order_ops.flex_attention import math_attention

    mask = (lambda b, h, q_idx, kv_idx: q_idx >= 0) if block_mask is None else block_mask.mask_mod
    out, lse2, _ = math_attention(q, k, v, score_mod or (lambda s, b, h, q_idx, kv_idx: s), (mask,),
                                  1.0 / math.sqrt(q.shape[-1]), {})
    return out, lse2 * math.log(2.0)  # it returns the kernel's base-2 lse


def reference(q, k, v, score_mod=None, block_mask=None):
    return reference_lse(q, k, v, score_mod, block_mask)[0]


def variant(case: zoo_cases.Case, device: str) -> dict:
    """The FlexAttention version of a case: dict(mask_mod, score_mod, learn: {name: tensor}, sinks: name | None).
    Each is read from the case's YAML (zoo/*.yaml, specs/prefix_lm_attention.yaml) with docs/DESIGN.md §3's
    semantics: `//` and `%` floor, causal kv <= q, a window (left, 0) is q - left <= kv, soft cap c tanh(s / c)."""
    o, c, seq = case.kwargs, case.compiled, case.seq
    arr = {n: torch.tensor(a, device=device) for n, a in case.arrays.items()}
    learn = {n: arr[n].float().requires_grad_() for n in case.learnable}
    key = case.key
    mask_mod = score_mod = None

    def causal(b, h, q, kv):
        return kv <= q

    def soft_cap(cap):
        def score(s, b, h, q, kv):
            return cap * torch.tanh(s / cap)
        return score

    if key in ("causal", "causal_zoo", "gemma2", "alibi"):
        mask_mod = causal
    elif key == "chunked":
        chunk = o["chunk"]

        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q // chunk == kv // chunk)
    elif key in ("dilated", "sliding_window", "gemma3", "gpt_oss"):
        left = (o.get("sliding_window") or c.get("sliding_window"))[0]
        dilation = o.get("dilation")

        def mask_mod(b, h, q, kv):
            return (kv <= q) & (q - kv <= left)
        if dilation:
            window = mask_mod

            def mask_mod(b, h, q, kv):  # every dilation-th key of the window
                return window(b, h, q, kv) & ((q - kv) % dilation == 0)
    elif key == "natten1d":
        kernel = o["kernel"]

        def mask_mod(b, h, q, kv):
            start = torch.clamp(q - kernel // 2, 0, seq - kernel)
            return (kv >= start) & (kv < start + kernel)
    elif key == "natten2d":
        width, kernel = o["width"], o["kernel"]

        def mask_mod(b, h, q, kv):
            row = torch.clamp(q // width - kernel // 2, 0, seq // width - kernel)
            col = torch.clamp(q % width - kernel // 2, 0, width - kernel)
            return ((kv // width >= row) & (kv // width < row + kernel)
                    & (kv % width >= col) & (kv % width < col + kernel))
    elif key == "streaming":
        sinks, window = o["sink_tokens"], o["window"]

        def mask_mod(b, h, q, kv):
            return (kv <= q) & ((kv < sinks) | (q - kv < window))
    elif key == "paligemma":
        n = o["image_tokens"]

        def mask_mod(b, h, q, kv):
            return (kv <= q) | ((q < n) & (kv < n))
    elif key == "sliding_tile":
        t, gh, gw = o["tile_tokens"], o["grid_h"], o["grid_w"]
        rt, rh, rw = o["radius_t"], o["radius_h"], o["radius_w"]

        def mask_mod(b, h, q, kv):
            return (((q // (t * gh * gw) - kv // (t * gh * gw)).abs() <= rt)
                    & ((q // (t * gw) % gh - kv // (t * gw) % gh).abs() <= rh)
                    & ((q // t % gw - kv // t % gw).abs() <= rw))
    elif key == "documents":
        ids = arr["segment_ids"]

        def mask_mod(b, h, q, kv):  # as flex_blocksparse.py: causal within documents
            return (ids[b, q] == ids[b, kv]) & (q >= kv)
    elif key == "flamingo":
        latest, n = arr["latest"], o["image_tokens"]

        def mask_mod(b, h, q, kv):
            return kv // n == latest[b, q]
    elif key == "prefix_lm":
        prefix = o["prefix_len"]

        def mask_mod(b, h, q, kv):
            return (kv <= q) | (kv < prefix)
    elif key != "t5":
        raise KeyError(f"no FlexAttention version of case {key!r}")

    if key == "gemma2":
        score_mod = soft_cap(c["logits_soft_cap"])
    elif key == "gemma3":
        score_mod = soft_cap(o["logits_soft_cap"])
    elif key == "alibi":  # 2 ** (-8 (h + 1) / num_heads), times the distance
        slopes = torch.exp2(-8.0 * torch.arange(1, case.heads + 1, device=device, dtype=torch.float32)
                            / o["num_heads"])

        def score_mod(s, b, h, q, kv):
            return s - slopes[h] * (q - kv).abs()
    elif key == "t5":  # the spec's bucket: 16 for keys after the query, 8 exact distances, then log to max_distance
        table = learn["table"]
        denom = float(np.log(np.float32(o["max_distance"] / 8.0)))  # the float32 value, as the kernels compute it

        def score_mod(s, b, h, q, kv):
            d = kv - q
            a = d.abs()
            large = 8 + (torch.log(torch.clamp(a, min=1).float() / 8.0) / denom * 8.0).to(torch.int32)
            bucket = torch.where(d > 0, 16, 0) + torch.where(a < 8, a, torch.clamp(large, max=15))
            return s + table[h, bucket]
    return dict(mask_mod=mask_mod, score_mod=score_mod, learn=learn,
                sinks="softmax_aux" if c.get("sinks") else None)


def mask_agrees(case: zoo_cases.Case, mask_mod, device: str, rows: int = 64) -> bool:
    """The mask_mod, evaluated densely on `rows` query rows, against zoo_cases' numpy mask."""
    if mask_mod is None:
        return case.mask is None
    q = np.arange(0, case.seq, max(case.seq // rows, 1))[:, None]
    kv = np.arange(case.seq)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    got = mask_mod(zero, zero, torch.tensor(q, device=device), torch.tensor(kv, device=device))
    return bool(np.array_equal(got.cpu().numpy(), np.broadcast_to(case.mask(q, kv), got.shape)))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, reps: int, device: str, warm_seconds: float) -> float:
    """Median seconds per call: 2 warm-up calls, `warm_seconds` more (clocks up), then `reps` samples of BATCH
    calls back to back (flex_blocksparse.py's `timed`, with the warm-up of ejgen's `median_seconds`)."""
    for _ in range(2):
        fn()
    sync(device)
    end = time.perf_counter() + (warm_seconds if device.startswith("cuda") else 0.0)
    while time.perf_counter() < end:
        fn()
        sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(BATCH):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / BATCH)
    return statistics.median(samples)


def check_slice(x: torch.Tensor, case: zoo_cases.Case) -> np.ndarray:
    """x [B, H, S, D] -> float32 [rows, heads, 8], zoo.py's slice of its [B, S, H, D] tensors."""
    x = x.detach().float().cpu().numpy()[0][zoo_cases.check_heads(case.heads)]
    return x[:, zoo_cases.check_rows(case.seq), :8].transpose(1, 0, 2).copy()


def run_case(case: zoo_cases.Case, device: str, eager: bool, reps: int, rounds: int, checks: dict) -> dict:
    row = dict(case=case.key, label=case.label, visible=zoo_cases.visible_fraction(case), errors={})
    torch._dynamo.reset()  # a fresh cache per case: no case counts against another's recompile limit
    spec = variant(case, device)
    if not mask_agrees(case, spec["mask_mod"], device):
        row["errors"]["mask"] = "the mask_mod disagrees with zoo_cases' numpy mask"
    data = zoo_cases.inputs(case)
    q, k, v, do = (torch.from_numpy(data[n]).transpose(1, 2).contiguous().to(device=device, dtype=torch.bfloat16)
                   for n in ("q", "k", "v", "do"))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    learn = spec["learn"]
    mask_mod, score_mod, sinks = spec["mask_mod"], spec["score_mod"], spec["sinks"]

    def build():
        if mask_mod is None:
            return None
        return create_block_mask(mask_mod, None, None, case.seq, case.seq, device=device,
                                 _compile=device.startswith("cuda") and not eager)

    def make_attend(plain, with_lse):
        def attend(q, k, v, block_mask):
            if sinks is None:
                return plain(q, k, v, score_mod=score_mod, block_mask=block_mask)
            out, lse = with_lse(q, k, v, score_mod=score_mod, block_mask=block_mask)
            # no sinks in FlexAttention: exp(sink) joins the denominator, out * sigmoid(lse - sink), differentiable
            scale = torch.sigmoid(lse - learn[sinks][None, :, None])
            return (out.float() * scale[..., None]).to(out.dtype)
        return attend

    attend = make_attend(flex_attention, flex_lse)
    if not eager:
        attend = torch.compile(attend, dynamic=False)
    # FlexAttention has no backward on the CPU: there fwd+bwd is its eager math reference (the same mods)
    attend_bwd = make_attend(reference, reference_lse) if device == "cpu" else attend
    t0 = time.perf_counter()
    block_mask = build()
    sync(device)
    row["build_s first"] = time.perf_counter() - t0
    params = (q, k, v, *learn.values())
    q0, k0, v0 = (x.detach() for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            return attend(q0, k0, v0, block_mask)

    def fwd_bwd():
        out = attend_bwd(q, k, v, block_mask)
        return torch.autograd.grad(out, params, do)

    ok = {}
    for pass_, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        try:
            t0 = time.perf_counter()
            result = fn()
            sync(device)
            row[f"compile_s {pass_}"] = time.perf_counter() - t0
            if pass_ == "fwd":
                checks[f"{case.key}/out"] = check_slice(result, case)
                row["out_finite"] = bool(torch.isfinite(result.float()).all())
            else:
                checks[f"{case.key}/dq"] = check_slice(result[0], case)
                for name, g in zip(learn, result[3:]):
                    checks[f"{case.key}/d_{name}"] = g.detach().float().cpu().numpy()
            ok[pass_] = fn
        except Exception as e:  # noqa: BLE001 - recorded, the next pass / case goes on
            row["errors"][pass_] = error_text(e)
    times = {p: [] for p in ok}
    for r in range(rounds):
        for pass_, fn in ok.items():
            try:
                times[pass_].append(timed(fn, reps, device, 0.3 if r == 0 else 0.05))
            except Exception as e:  # noqa: BLE001
                row["errors"][pass_] = error_text(e)
    pairs = row["visible"] * case.seq * case.seq
    for pass_, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
        if times.get(pass_) and pass_ not in row["errors"]:
            ms = statistics.median(times[pass_]) * 1e3
            row[f"ms {pass_}"] = ms
            row[f"tflops {pass_}"] = mult * 4.0 * case.batch * case.heads * case.dim * pairs / ms / 1e9
    if mask_mod is not None:
        try:
            row["ms build"] = timed(build, max(reps // 2, 1), device, 0.0) * 1e3
        except Exception as e:  # noqa: BLE001
            row["errors"]["build"] = error_text(e)
    return row


def error_text(e: BaseException) -> str:
    """The exception's type and message on one line (inductor's messages run to pages: cut), then its last frames."""
    head = f"{type(e).__name__}: {' '.join(str(e).split())}"[:1500]  # the message on the first line
    frames = traceback.format_tb(e.__traceback__)
    return head + "\n" + "".join(frames[-2:])[-1500:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out/zoo")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=4, help="calls a sample dispatches back to back (the peer's script "
                   "takes the same option): the host's dispatch of a sample's first call and its wake-up after the "
                   "wait count 1/calls of a row")
    p.add_argument("--cases", default="", help="comma-separated keys or parts of labels (default: all)")
    p.add_argument("--merge", action="store_true", help="keep the other cases' rows of an earlier run in --out "
                                                        "(same sizes and device): a run split over several calls")
    p.add_argument("--seq", type=int, default=zoo_cases.SEQ)
    p.add_argument("--heads", type=int, default=zoo_cases.HEADS)
    p.add_argument("--dim", type=int, default=zoo_cases.DIM)
    p.add_argument("--device", default="cuda")
    p.add_argument("--eager", action="store_true", help="flex_attention without torch.compile (CPU check)")
    a = p.parse_args()
    global BATCH
    BATCH = a.calls
    for name, value in (("cache_size_limit", 256), ("recompile_limit", 256),
                        ("accumulated_cache_size_limit", 4096), ("accumulated_recompile_limit", 4096)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, value)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = zoo_cases.select(zoo_cases.cases(a.seq, a.heads, a.dim), a.cases)
    device_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    meta = dict(side="flex", device=device_name, torch=torch.__version__, eager=a.eager, seq=a.seq, heads=a.heads,
                dim=a.dim, reps=a.reps, rounds=a.rounds, calls=a.calls,
                cases=[c.describe() for c in zoo_cases.cases(a.seq, a.heads, a.dim)])
    if a.device == "cpu":
        meta["fwd+bwd"] = "FlexAttention's eager math reference (no FlexAttention backward on the CPU)"
    rows, checks = [], {}
    if a.merge:
        rows, checks = zoo_cases.previous(out / "zoo_flex.json", out / "zoo_flex_check.npz", meta, chosen)
    for case in chosen:
        t0 = time.perf_counter()
        try:
            row = run_case(case, a.device, a.eager, a.reps, a.rounds, checks)
        except Exception as e:  # noqa: BLE001 - one broken variant must not lose the rest of the run
            row = dict(case=case.key, label=case.label, errors={"case": error_text(e)})
        row["wall_s"] = time.perf_counter() - t0
        rows = sorted(rows + [row], key=lambda r: zoo_cases.order(r["case"]))
        (out / "zoo_flex.json").write_text(json.dumps(dict(meta, rows=rows), indent=1, default=str))
        np.savez(out / "zoo_flex_check.npz", **checks)
        err = "; ".join(f"{p}: {t.splitlines()[0][:300]}" for p, t in row["errors"].items())
        print(f"{case.key:15s} fwd {row.get('ms fwd', math.nan):9.3f} ms  fwd+bwd "
              f"{row.get('ms fwd+bwd', math.nan):9.3f} ms  build {row.get('ms build', math.nan):7.3f} ms  "
              f"({row['wall_s']:.0f} s) {err}", flush=True)
    print(f"wrote {out / 'zoo_flex.json'}")


if __name__ == "__main__":
    main()
