"""The generated tree says a thing once (docs/DESIGN.md §5, shared folders): the Triton kernels of the linear recurrent
specs without hooks are one module of the package, `_linear_recurrent/triton_kernels.py`, which each such op's
`triton_kernels.py` binds its kernel names to; that folder is written only where some op of the build shares it, and
goes where none does; no two committed modules are the same text past their header, and none outside the attention
family the same up to its op's name beyond a few lines (attention's spec-free kernels are still one copy per op)."""

from __future__ import annotations

import importlib
import re
import shutil
from collections import defaultdict
from pathlib import Path

from ejgen.cli import main
from ejgen.spec import load_spec, load_specs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"specs": ROOT / "generated", "zoo": ROOT / "zoo" / "generated"}
SHARED = "_linear_recurrent"
KERNELS = ("fused_fwd", "fused_bwd", "chunk_state", "chunk_intra", "chunk_output", "chunk_state_bwd",
           "chunk_grads_intra", "chunk_grads_qk", "chunk_grads_v")  # what the host launches
ALLOWANCE = 40  # lines: a recurrent or pooling op's backend modules (~25 lines), which name its runtime and hooks


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
    for specs, package in PACKAGES.items():
        families = {v.name: v.family for v in load_specs(ROOT / specs)}
        for path, body in _bodies(package).items():
            same[body].append(f"{package.name}/{path}")
            op = path.split("/")[0]
            if families.get(op, "shared") != "attention" and len(body.splitlines()) > ALLOWANCE:
                renamed[re.sub(rf"\b{op}(?![A-Za-z0-9])", "<op>", body)].append(f"{package.name}/{path}")
    assert not [paths for paths in same.values() if len(paths) > 1]
    assert not [paths for paths in renamed.values() if len(paths) > 1]
    assert sum(map(len, renamed.values())) > 10  # (what is compared: the recurrent ops' hooked kernels among them)


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
