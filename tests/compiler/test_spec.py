"""Loading specs: the full docs/DESIGN.md §2 example, defaults, field rules, the bad-spec corpus."""

import ast
import hashlib
import pathlib
import textwrap

import pytest
import yaml

import ejgen
from ejgen.errors import SpecError
from ejgen.ir.expr import Binary, Call, Const, ParamRef, Var
from ejgen.ir.variant import BACKENDS, Feature, Option, Param, Variant
from ejgen.spec import load_spec, load_specs

BAD_SPECS = pathlib.Path(__file__).parent / "bad_specs"
EXPECTED = yaml.safe_load((BAD_SPECS / "expected.yaml").read_text())

ALIBI = """\
name: alibi_attention            # identifier: the op's name in the emitted package
family: attention                # attention | linear_recurrent | pooling
doc: ALiBi attention with learnable per-head slopes.
modes: [train, decode, paged]    # attention family: which kernels to emit (default [train])
backends: [triton, pallas, xla]  # default: all
features:                        # built-in features; absent = not accepted by the op
  causal: runtime                #   runtime  -> keyword argument of the op
  sliding_window: runtime        #   a value  -> compiled in (e.g. sliding_window: 4096)
  logits_soft_cap: 30.0          #   always   -> on, no argument (flags such as causal)
  sinks: runtime
  gqa: true
  segment_ids: runtime
  bias: runtime
  varlen: runtime
params:                          # extra tensor inputs, keyword arguments of the op
  slopes: {shape: [heads], dtype: float32, grad: true}
options:                         # extra scalar keyword arguments (runtime, never recompiles)
  max_distance: {type: int, default: 1024}
score: s - slopes[h] * min(abs(q_idx - kv_idx), max_distance)   # DSL, default `s`
mask: kv_idx <= q_idx                                           # DSL predicate, default `true`
"""


def builtin(name):
    return Var(name, kind="builtin")


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_text(tmp_path, text):
    return load_spec(write(tmp_path, text))


def test_design_example_loads_to_the_expected_variant(tmp_path):
    path = write(tmp_path, ALIBI, "alibi.yaml")
    expected = Variant(
        name="alibi_attention",
        family="attention",
        doc="ALiBi attention with learnable per-head slopes.",
        modes=("train", "decode", "paged"),
        backends=("triton", "pallas", "xla"),
        features=(
            Feature("bias", "runtime"),
            Feature("causal", "runtime"),
            Feature("gqa", "always"),
            Feature("logits_soft_cap", "value", 30.0),
            Feature("segment_ids", "runtime"),
            Feature("sinks", "runtime"),
            Feature("sliding_window", "runtime"),
            Feature("varlen", "runtime"),
        ),
        params=(Param("slopes", ("heads",), "float32", grad=True),),
        options=(Option("max_distance", "int", 1024),),
        score=Binary(
            "-",
            builtin("s"),
            Binary(
                "*",
                ParamRef("slopes", (builtin("h"),)),
                Call(
                    "min",
                    (
                        Call("abs", (Binary("-", builtin("q_idx"), builtin("kv_idx")),)),
                        Var("max_distance", kind="option"),
                    ),
                ),
            ),
        ),
        mask=Binary("<=", builtin("kv_idx"), builtin("q_idx")),
        path=str(path),
        source_hash=hashlib.sha256(ALIBI.encode()).hexdigest(),
    )
    variant = load_spec(path)
    assert variant == expected
    assert (variant.loc.line, variant.loc.col) == (1, 7)
    assert variant.param("slopes").loc.line == 16
    assert variant.feature("causal").loc.line == 7
    assert (variant.score.b.b.args[1].loc.line, variant.score.b.b.args[1].loc.col) == (19, 49)


def test_defaults(tmp_path):
    variant = load_text(tmp_path, "name: plain\nfamily: attention\n")
    assert variant.doc == ""
    assert variant.modes == ("train",)
    assert variant.backends == BACKENDS
    assert variant.features == variant.params == variant.options == ()
    assert variant.score == builtin("s")
    assert variant.mask == Const(True)


def test_path_is_kept_as_given_and_hash_is_of_the_bytes(tmp_path, monkeypatch):
    text = "name: plain\nfamily: pooling\n"
    write(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    variant = load_spec("spec.yaml")
    assert variant.path == "spec.yaml"
    assert variant.source_hash == hashlib.sha256(text.encode()).hexdigest()
    assert load_spec(pathlib.Path("spec.yaml")).path == "spec.yaml"


@pytest.mark.parametrize(
    "setting, feature",
    [
        ("causal: runtime", Feature("causal", "runtime")),
        ("causal: always", Feature("causal", "always")),
        ("causal: true", Feature("causal", "always")),
        ("causal: false", None),
        ("gqa: true", Feature("gqa", "always")),
        ("varlen: runtime", Feature("varlen", "runtime")),
        ("attention_mask: always", Feature("attention_mask", "always")),
        ("sliding_window: runtime", Feature("sliding_window", "runtime")),
        ("sliding_window: 4096", Feature("sliding_window", "value", (4096, 4096))),
        ("sliding_window: [128, 0]", Feature("sliding_window", "value", (128, 0))),
        ("logits_soft_cap: runtime", Feature("logits_soft_cap", "runtime")),
        ("logits_soft_cap: 30", Feature("logits_soft_cap", "value", 30.0)),
        ("logits_soft_cap: 50.5", Feature("logits_soft_cap", "value", 50.5)),
    ],
)
def test_feature_settings(tmp_path, setting, feature):
    variant = load_text(tmp_path, f"name: f\nfamily: attention\nfeatures:\n  {setting}\n")
    assert variant.features == (() if feature is None else (feature,))
    if feature is not None and feature.name == "logits_soft_cap" and feature.mode == "value":
        assert type(variant.features[0].value) is float


def test_features_are_sorted_by_name(tmp_path):
    variant = load_text(
        tmp_path,
        """\
        name: f
        family: attention
        features: {varlen: runtime, causal: true, bias: runtime, sinks: false}
        """,
    )
    assert [f.name for f in variant.features] == ["bias", "causal", "varlen"]


def test_params_and_options(tmp_path):
    variant = load_text(
        tmp_path,
        """\
        name: f
        family: attention
        params:
          table: {shape: [heads, 32, kv_len], dtype: bfloat16}
          bucket: {shape: [q_len], dtype: int32}
        options:
          temperature: {type: float, default: 2}
          use_window: {type: bool, default: false}
          width: {type: int, default: -3}
        score: s * temperature + table[h, bucket[q_idx], kv_idx] + width
        mask: use_window or kv_idx <= q_idx
        """,
    )
    assert variant.params == (
        Param("table", ("heads", 32, "kv_len"), "bfloat16", grad=False),
        Param("bucket", ("q_len",), "int32", grad=False),
    )
    assert variant.options == (
        Option("temperature", "float", 2.0),
        Option("use_window", "bool", False),
        Option("width", "int", -3),
    )
    assert type(variant.options[0].default) is float


def test_yaml_scalars_are_read_as_dsl_text(tmp_path):
    variant = load_text(tmp_path, "name: f\nfamily: attention\nscore: 2\nmask: true\n")
    assert variant.score == Const(2)
    assert variant.mask == Const(True)


def test_block_scalar_expressions(tmp_path):
    variant = load_text(
        tmp_path,
        """\
        name: f
        family: attention
        score: >
          s * 0.5
        mask: |
          kv_idx <= q_idx
            and q_idx - kv_idx < 128
        """,
    )
    assert variant.score == Binary("*", builtin("s"), Const(0.5))
    assert variant.mask.b == Binary("<", Binary("-", builtin("q_idx"), builtin("kv_idx")), Const(128))
    assert (variant.mask.b.loc.line, variant.mask.b.loc.col) == (7, 9)


@pytest.mark.parametrize(
    "body, at, message",
    [
        ("doc: 3", (3, 6), "doc must be a string, got an int (3)"),
        ("modes: []", (3, 8), "modes must be a non-empty list, got a list"),
        ("modes: [train, 3]", (3, 16), "mode must be a string, got an int (3)"),
        ("modes: [trian]", (3, 9), "unknown mode 'trian'; did you mean 'train'?"),
        ("features: [causal]", (3, 11), "features must be a mapping, got a list"),
        ("features: {causal: 1}", (3, 20), "feature 'causal' takes 'runtime', 'always', true or false, got an int (1)"),
        ("features: {sliding_window: [1, 2, 3]}", (3, 28), "sliding_window [left, right] needs 2 ints, got 3"),
        ("features: {sliding_window: true}", (3, 28), "sliding_window takes 'runtime', a positive int or [left, right]"),
        ("features: {sliding_window: [1.5, 2]}", (3, 29), "a window side must be a non-negative int, got a float (1.5)"),
        ("features: {logits_soft_cap: true}", (3, 29), "logits_soft_cap takes 'runtime' or a positive number, got a bool"),
        ("features: {logits_soft_cap: .inf}", (3, 29), "logits_soft_cap takes 'runtime' or a positive number"),
        ("params: [a]", (3, 9), "params must be a mapping, got a list"),
        ("params: {a: [heads]}", (3, 13), "param 'a' must be a mapping, got a list"),
        ("params: {a: {dtype: float32}}", (3, 10), "param 'a' is missing the required field 'shape'"),
        ("params: {a: {shape: []}}", (3, 21), "shape must be a non-empty list of dims, got a list"),
        ("params: {a: {shape: heads}}", (3, 21), "shape must be a non-empty list of dims, got a string"),
        ("params: {a: {shape: [0]}}", (3, 22), "a dim must be a dim name or a positive int, got an int (0)"),
        ("params: {a: {shape: [true]}}", (3, 22), "a dim must be a dim name or a positive int, got a bool"),
        ("params: {a: {shape: [heads], dtype: float64}}", (3, 37), "unknown dtype 'float64'"),
        ("params: {a: {shape: [heads], grad: 1}}", (3, 36), "grad must be true or false, got an int (1)"),
        ("params: {1a: {shape: [heads]}}", (3, 10), "param name '1a' is not an identifier"),
        ("params: {true: {shape: [heads]}}", (3, 10), "param name 'true' clashes with a DSL keyword"),
        ("params: {softmax_scale: {shape: [heads]}}", (3, 10), "clashes with a built-in argument of the op"),
        ("options: {w: {type: int}}", (3, 11), "option 'w' is missing the required field 'default'"),
        ("options: {w: {type: flot, default: 1}}", (3, 21), "unknown type 'flot'; did you mean 'float'?"),
        ("options: {w: {type: float, default: true}}", (3, 37), "must be a float, got a bool (true)"),
        ("options: {w: {type: bool, default: 0}}", (3, 36), "must be a bool, got an int (0)"),
        ("options: {w: {type: int, default: 1, doc: x}}", (3, 38), "unknown field 'doc'"),
        ("options: {kv_len: {type: int, default: 1}}", (3, 11), "clashes with a built-in name of the DSL"),
        ("options: {where: {type: int, default: 1}}", (3, 11), "option name 'where' clashes with a DSL function"),
        ("options: {and: {type: int, default: 1}}", (3, 11), "option name 'and' is a Python keyword"),
        ("score: [s]", (3, 8), "score must be an expression, got a list"),
        ("mask: ~", (3, 7), "mask must be an expression, got nothing (null)"),
        ("mask: True", (3, 7), "unknown name 'True'; did you mean 'true'?"),
        ("score: !!python/object/apply:os.getcwd []", (3, 8), "invalid YAML: unsupported tag"),
        ("doc: !!python/name:os.getcwd ''", (3, 6), "invalid YAML: unsupported tag"),
        ("doc: !custom text", (3, 6), "invalid YAML: unsupported tag '!custom'"),
        ("? [a, b]\n: 1", (3, 3), "a mapping key must be a plain name"),
        ("---\nname: g", (3, 1), "invalid YAML: expected a single document in the stream, but found another"),
    ],
)
def test_field_errors(tmp_path, body, at, message):
    path = write(tmp_path, f"name: f\nfamily: attention\n{body}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert (err.loc.line, err.loc.col) == at, err.render()
    assert message in err.message
    assert_caret(err, path)


def assert_caret(err, path):
    """``render`` names ``path:line:col``, shows the source line and a caret under the column."""
    lines = path.read_text().splitlines()
    line = lines[err.loc.line - 1] if err.loc.line <= len(lines) else ""
    rendered = err.render().splitlines()
    assert rendered[0] == f"{path}:{err.loc.line}:{err.loc.col}: {err.message}"
    assert err.loc.text == line
    assert rendered[1] == f"    {line}"
    assert rendered[2] == "    " + " " * (err.loc.col - 1) + "^"


def bad_spec_files():
    return sorted(p.name for p in BAD_SPECS.glob("*.yaml") if p.name != "expected.yaml")


def test_every_bad_spec_has_an_expectation():
    assert len(bad_spec_files()) >= 20
    assert set(bad_spec_files()) == set(EXPECTED)


@pytest.mark.parametrize("name", bad_spec_files())
def test_bad_spec(name):
    path = BAD_SPECS / name
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert f"{err.loc.line}:{err.loc.col}" == EXPECTED[name]["at"], err.render()
    assert EXPECTED[name]["message"] in err.message, err.render()
    assert err.loc.path == str(path)
    assert_caret(err, path)


def test_windows_line_endings_and_byte_order_mark(tmp_path):
    path = tmp_path / "crlf.yaml"
    path.write_bytes(
        b"\xef\xbb\xbfname: demo\r\nfamily: attention\r\n"
        b"mask: |\r\n  kv_idx <= q_idx\r\n    and q_idx - kv_idx < (128\r\n"
    )
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    assert (err.loc.line, err.loc.col) == (5, 26)
    assert err.loc.text == "    and q_idx - kv_idx < (128"
    path.write_bytes(b"\xef\xbb\xbfname: 1demo\r\nfamily: attention\r\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert (info.value.loc.line, info.value.loc.col, info.value.loc.text) == (1, 7, "name: 1demo")


def test_recursive_alias(tmp_path):
    path = write(tmp_path, "name: f\nfamily: attention\nparams: &p {a: *p}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert (info.value.loc.line, info.value.loc.col) == (3, 9)
    assert "an alias refers to a node that contains it" in info.value.message


def test_the_scaffold_of_ejgen_new_loads(tmp_path):
    from ejgen.cli import SCAFFOLD

    variant = load_text(tmp_path, SCAFFOLD.format(name="my_op"))
    assert variant.name == "my_op"
    assert variant.score == builtin("s") and variant.mask == Const(True)


def test_load_specs_sorts_by_file_name_and_skips_other_files(tmp_path):
    write(tmp_path, "name: second\nfamily: attention\n", "b.yaml")
    write(tmp_path, "name: first\nfamily: attention\n", "a.yml")
    write(tmp_path, "not: a spec\n", "notes.txt")
    (tmp_path / "nested").mkdir()
    write(tmp_path / "nested", "name: nested\nfamily: attention\n", "c.yaml")
    variants = load_specs(tmp_path)
    assert [v.name for v in variants] == ["first", "second"]
    assert [v.path for v in variants] == [str(tmp_path / "a.yml"), str(tmp_path / "b.yaml")]


def test_load_specs_rejects_a_repeated_name_at_the_second_spec(tmp_path):
    write(tmp_path, "name: same\nfamily: attention\n", "a.yaml")
    second = write(tmp_path, "family: attention\nname:   same\n", "b.yaml")
    with pytest.raises(SpecError) as info:
        load_specs(tmp_path)
    err = info.value
    assert err.loc.path == str(second)
    assert (err.loc.line, err.loc.col) == (2, 9)
    assert err.message == f"spec name 'same' is already used by {tmp_path / 'a.yaml'}"
    assert_caret(err, second)


def test_load_specs_of_an_empty_directory(tmp_path):
    assert load_specs(tmp_path) == []


def test_unreadable_inputs(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match="not a directory"):
        load_specs(tmp_path / "missing")
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(tmp_path / "latin1.yaml")


def test_nothing_from_a_spec_is_executed(tmp_path):
    marker = tmp_path / "pwned"
    attempts = [
        f"score: __import__('os').system('touch {marker}')\n",
        f'score: !!python/object/apply:os.system ["touch {marker}"]\n',
        f"mask: exec('open(\"{marker}\", \"w\")')\n",
    ]
    for body in attempts:
        path = write(tmp_path, f"name: f\nfamily: attention\n{body}")
        with pytest.raises(SpecError):
            load_spec(path)
    assert not marker.exists()


def test_ejgen_has_no_eval_or_exec():
    sources = sorted(pathlib.Path(ejgen.__file__).parent.rglob("*.py"))
    assert any(p.name == "dsl.py" for p in sources)
    forbidden = {"eval", "exec", "compile", "__import__"}
    unsafe_yaml = {"load", "load_all", "unsafe_load", "full_load", "Loader", "UnsafeLoader", "FullLoader"}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in forbidden, f"{source}:{node.lineno}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "yaml":
                    assert node.attr not in unsafe_yaml, f"{source}:{node.lineno}: use the safe loader"
