"""The generated tree says a thing once (docs/DESIGN.md §5, shared folders): the Triton kernels of the linear recurrent
specs without hooks are one module of the package, `_linear_recurrent/triton_kernels.py`, which each such op's
`triton_kernels.py` binds its kernel names to; the backend modules (`triton_kernels.py`, `pallas.py`, `xla.py`) of the
attention specs with no hooks of their own are one module each per set of built-in masks, `_attention/<masks>/`,
which each such op's modules bind their names to; a shared folder is written only where some op of the build shares
it, and goes where none does; a build whose sharing ops would render differently fails; no two committed modules are
the same text past their header, and none the same up to its op's name beyond a few lines (but attention's
`triton_launch.py`, which names the op's own Layout)."""

from __future__ import annotations

import importlib
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from ejgen.cli import main
from ejgen.spec import load_spec, load_specs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"specs": ROOT / "generated", "zoo": ROOT / "zoo" / "generated"}
SHARED = "_linear_recurrent"
KERNELS = ("fused_fwd", "fused_bwd", "chunk_state", "chunk_intra", "chunk_output", "chunk_state_bwd",
           "chunk_grads_intra", "chunk_grads_qk", "chunk_grads_v")  # what the host launches
ATTENTION = "_attention"
ATTENTION_FILES = ("triton_kernels.py", "pallas.py", "xla.py")
ATTENTION_KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")  # what the host launches: <name>_<which>_kernel
IMPORTED = {"specs": "ejgen.generated", "zoo": "ejgen.zoo"}
ALLOWANCE = 40  # lines: a recurrent or pooling op's backend modules, a binding module (~25 lines each)


def _recurrent(folder: Path) -> dict[str, bool]:
    """The Triton recurrent specs of a folder: name -> whether it has hooks (a feature map or a gate map)."""
    return {v.name: bool(dict(v.map_texts)) for v in load_specs(folder)
            if v.family == "linear_recurrent" and "triton" in v.backends}


def test_hookless_recurrent_ops_share_one_kernel_module():
    specs = _recurrent(ROOT / "specs")
    hookless = sorted(name for name, hooks in specs.items() if not hooks)
    assert len(hookless) >= 2 and any(specs.values()), specs  # (what the test is about is there)
    shared = importlib.import_module(f"ejgen.generated.{SHARED}.triton_kernels")
    assert Path(shared.__file__).resolve() == (PACKAGES["specs"] / SHARED / "triton_kernels.py").resolve()
    for name, hooks in specs.items():
        path = PACKAGES["specs"] / name / "triton_kernels.py"
        module = importlib.import_module(f"ejgen.generated.{name}.triton_kernels")
        lines = len(path.read_text(encoding="utf-8").splitlines())
        for which in KERNELS:
            kernel, common = getattr(module, f"{name}_{which}_kernel"), getattr(shared, f"linear_recurrent_{which}_kernel")
            assert (kernel is common) == (not hooks), f"{name} ({'hooks' if hooks else 'no hooks'}): {which}"
        assert (lines <= ALLOWANCE) == (not hooks), f"{path}: {lines} lines"


def test_the_shared_folder_is_written_only_where_an_op_shares_it(tmp_path, capsys):
    """One build folder, three builds: a recurrent spec with hooks alone writes no shared folder; one without hooks
    beside it brings the folder; taking that spec away again drops it (and `--check` calls it stale before)."""
    folder, out = tmp_path / "specs", tmp_path / "pkg"
    folder.mkdir()
    hooked = next(n for n, hooks in _recurrent(ROOT / "specs").items() if hooks)
    plain = next(n for n, hooks in _recurrent(ROOT / "specs").items() if not hooks)
    shutil.copy(ROOT / "specs" / f"{hooked}.yaml", folder)
    shutil.copy(ROOT / "specs" / "mean_pooling.yaml", folder)
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert not (out / SHARED).exists() and (out / hooked / "triton_kernels.py").stat().st_size > 10_000
    shutil.copy(ROOT / "specs" / f"{plain}.yaml", folder)
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert sorted(p.name for p in (out / SHARED).iterdir()) == ["__init__.py", "triton_kernels.py"]
    assert f"from ..{SHARED} import triton_kernels" in (out / plain / "triton_kernels.py").read_text(encoding="utf-8")
    (folder / f"{plain}.yaml").unlink()
    capsys.readouterr()
    assert main(["build", str(folder), "-o", str(out), "--check"]) == 1
    assert f"stale (no spec generates it): {out / SHARED / 'triton_kernels.py'}" in capsys.readouterr().out
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert not (out / SHARED).exists()
    assert main(["build", str(folder), "-o", str(out), "--check"]) == 0


def test_a_spec_named_like_the_shared_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "specs"
    folder.mkdir()
    plain = next(n for n, hooks in _recurrent(ROOT / "specs").items() if not hooks)
    shutil.copy(ROOT / "specs" / f"{plain}.yaml", folder)
    text = (ROOT / "specs" / f"{plain}.yaml").read_text(encoding="utf-8")
    (folder / f"{SHARED}.yaml").write_text(re.sub(r"^name: .*$", f"name: {SHARED}", text, flags=re.M), encoding="utf-8")
    capsys.readouterr()
    assert main(["build", str(folder), "-o", str(tmp_path / "pkg")]) == 1
    err = capsys.readouterr().err
    assert f"spec '{SHARED}' is named like the package's folder of shared kernels" in err, err
    assert not (tmp_path / "pkg").exists()


def _bodies(package: Path) -> dict[str, str]:
    """Every module of an op's folder: its text past the two header lines, by path."""
    return {p.relative_to(package).as_posix(): p.read_text(encoding="utf-8").split("\n", 2)[2]
            for p in sorted(package.glob("*/*.py"))}


def test_no_two_generated_modules_repeat_each_other():
    same, renamed = defaultdict(list), defaultdict(list)
    for package in PACKAGES.values():
        for path, body in _bodies(package).items():
            same[body].append(f"{package.name}/{path}")
            if path.endswith("/triton_launch.py") or len(body.splitlines()) <= ALLOWANCE:
                continue  # (an attention op's launch module names its own Layout)
            op = path.split("/")[0]
            renamed[re.sub(rf"\b{op}(?![A-Za-z0-9])", "<op>", body)].append(f"{package.name}/{path}")
    assert not [paths for paths in same.values() if len(paths) > 1]
    assert not [paths for paths in renamed.values() if len(paths) > 1]
    assert sum(map(len, renamed.values())) > 50  # (what is compared: attention's and the recurrent ops' kernels)


def test_a_wide_recurrent_spec_without_hooks_binds_within_the_width(tmp_path):
    """The binding module of a long op name wraps its docstring and stays importable text."""
    name = "a_linear_recurrent_op_whose_name_is_long_enough_to_push_every_line_of_its_docstring_past_the_width"
    plain = next(n for n, hooks in _recurrent(ROOT / "specs").items() if not hooks)
    text = (ROOT / "specs" / f"{plain}.yaml").read_text(encoding="utf-8")
    (tmp_path / f"{name}.yaml").write_text(re.sub(r"^name: .*$", f"name: {name}", text, flags=re.M), encoding="utf-8")
    from ejgen.render import render

    files = render([load_spec(tmp_path / f"{name}.yaml")])
    binding = files[f"{name}/triton_kernels.py"]
    compile(binding, "binding", "exec")
    assert max(len(line) for line in binding.splitlines() if not line.startswith(name)) <= 120
    assert f"{name}_chunk_state_kernel = _shared.linear_recurrent_chunk_state_kernel" in binding


def _attention(folder: Path) -> dict[str, str | None]:
    """The attention specs of a folder, read from their YAML: name -> the built-in masks (`causal_window`, `causal`,
    ...) of one with nothing but features (no score, mask, params or options), None for the others."""
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        if spec["family"] == "attention":
            masks = [word for feature, word in (("causal", "causal"), ("sliding_window", "window"))
                     if feature in spec.get("features", {})]
            hooks = {"score", "mask", "params", "options"} & set(spec)
            out[spec["name"]] = None if hooks else "_".join(masks) or "unmasked"
    return out


@pytest.mark.parametrize("specs", sorted(PACKAGES))
def test_attention_ops_without_hooks_share_their_backend_modules(specs):
    """Every attention op with nothing but features binds its kernels, its Pallas and its XLA kernel set to its masks'
    shared modules (the kernels' names, what profiles show, are the shared ones'); every other keeps its own."""
    package, ops = PACKAGES[specs], _attention(ROOT / specs)
    keys = sorted({key for key in ops.values() if key})
    assert keys and None in ops.values() and sum(key is not None for key in ops.values()) >= 3, ops
    assert sorted(p.parent.name for p in (package / ATTENTION).glob("*/__init__.py")) == keys
    for key in keys:
        assert sorted(p.name for p in (package / ATTENTION / key).glob("*.py")) == sorted(("__init__.py",) + ATTENTION_FILES)
    for name, key in ops.items():
        shared = {f: key and importlib.import_module(f"{IMPORTED[specs]}.{ATTENTION}.{key}.{f[:-3]}")
                  for f in ATTENTION_FILES}
        own = {f: importlib.import_module(f"{IMPORTED[specs]}.{name}.{f[:-3]}") for f in ATTENTION_FILES}
        for which in ATTENTION_KERNELS:
            kernel = getattr(own["triton_kernels.py"], f"{name}_{which}_kernel")
            assert kernel.__name__ == (f"attention_{key}_{which}_kernel" if key else f"{name}_{which}_kernel")
            assert kernel.fn.__module__ == (shared["triton_kernels.py"] or own["triton_kernels.py"]).__name__
        for file in ("pallas.py", "xla.py"):
            assert (own[file]._KERNELS is getattr(shared[file], "_KERNELS", None)) == (key is not None), (name, file)
            assert own[file].forward.__self__ is own[file]._KERNELS
        assert own["pallas.py"].NAME == (f"attention_{key}" if key else name)
        for file in ATTENTION_FILES:
            lines = len((package / name / file).read_text(encoding="utf-8").splitlines())
            assert (lines <= ALLOWANCE) == (key is not None), f"{name}/{file}: {lines} lines"


def test_attention_sharing_comes_and_goes_with_its_ops(tmp_path, capsys):
    """A spec with a mask of its own alone writes no `_attention`; a causal spec with nothing but features beside it
    brings `_attention/causal/`, a causal sliding-window one `_attention/causal_window/`; taking them away drops them."""
    folder, out = tmp_path / "specs", tmp_path / "pkg"
    folder.mkdir()
    shutil.copy(ROOT / "specs" / "prefix_lm_attention.yaml", folder)
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert not (out / ATTENTION).exists() and (out / "prefix_lm_attention" / "xla.py").stat().st_size > 2_000
    for spec in ("causal_attention", "sliding_window_attention"):
        shutil.copy(ROOT / "zoo" / f"{spec}.yaml", folder)
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert sorted(p.name for p in (out / ATTENTION).iterdir()) == ["__init__.py", "causal", "causal_window"]
    binding = (out / "causal_attention" / "triton_kernels.py").read_text(encoding="utf-8")
    assert f"from ..{ATTENTION}.causal import triton_kernels as _shared" in binding
    assert "causal_attention_fwd_kernel = _shared.attention_causal_fwd_kernel" in binding
    (folder / "causal_attention.yaml").unlink()
    capsys.readouterr()
    assert main(["build", str(folder), "-o", str(out), "--check"]) == 1
    assert f"stale (no spec generates it): {out / ATTENTION / 'causal' / 'xla.py'}" in capsys.readouterr().out
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert sorted(p.name for p in (out / ATTENTION).iterdir()) == ["__init__.py", "causal_window"]
    (folder / "sliding_window_attention.yaml").unlink()
    assert main(["build", str(folder), "-o", str(out)]) == 0
    assert not (out / ATTENTION).exists()


def test_attention_specs_assumed_to_share_but_rendering_apart_fail_the_build(tmp_path, monkeypatch):
    """Were the sharing rule wrong (here: told that a causal spec and a causal sliding-window one have the same masks),
    the build fails naming the specs and the template rather than run one spec's kernels for the other."""
    from ejgen.emit.attention import op as attention_op
    from ejgen.render import render

    specs = [load_spec(ROOT / "zoo" / f"{name}.yaml") for name in ("causal_attention", "sliding_window_attention")]
    assert set(render(specs)) >= {f"{ATTENTION}/causal/xla.py", f"{ATTENTION}/causal_window/xla.py"}
    monkeypatch.setattr(attention_op, "shared_key", lambda plan: "causal")
    with pytest.raises(AssertionError, match=r"the triton_kernels.py of causal_attention and sliding_window_attention "
                                             r"differ .* attention/triton/train_kernels.py.j2 reads more of a spec"):
        render(specs)


def test_a_wide_attention_spec_without_hooks_binds_within_the_width(tmp_path):
    name = "an_attention_op_whose_name_is_long_enough_to_push_every_line_of_its_docstrings_past_the_width"
    text = (ROOT / "zoo" / "gpt_oss_attention.yaml").read_text(encoding="utf-8")
    (tmp_path / f"{name}.yaml").write_text(re.sub(r"^name: .*$", f"name: {name}", text, flags=re.M), encoding="utf-8")
    from ejgen.render import render

    files = render([load_spec(tmp_path / f"{name}.yaml")])
    for file in ATTENTION_FILES:
        binding = files[f"{name}/{file}"]
        compile(binding, file, "exec")
        assert max(len(line) for line in binding.splitlines() if not line.startswith(name)) <= 120, file
    assert f"{name}_bwd_dq_kernel = _shared.attention_causal_window_bwd_dq_kernel" in files[f"{name}/triton_kernels.py"]
