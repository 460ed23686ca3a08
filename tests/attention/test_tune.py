"""`ejgen tune` and the shape-keyed config cache, exercised through the Triton interpreter (the
timings mean nothing on a CPU; the mechanics — sweep, cache, lookup — are what is tested)."""

import json

import pytest

from ejgen.cli import main
from ejgen.runtime.attention.triton import configs as triton_configs
from ejgen.runtime.attention.triton import tuning_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EJGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EJGEN_TRITON_CONFIG", raising=False)
    return tmp_path


def test_keys_bucket_sequences_by_powers_of_two():
    assert tuning_cache.key("sm90", "fwd", 128, 16, 3000, True) == "sm90/fwd/d128/16bit/s4096/causal"
    assert tuning_cache.key("sm90", "dq", 64, 32, 10, False) == "sm90/dq/d64/32bit/s128/full"


def test_a_cached_config_wins_over_the_table_and_a_pinned_one_over_both(cache_dir, monkeypatch):
    table = triton_configs.KernelConfig(128, 128, 8, 3, tma=True)
    assert triton_configs.pick("sm90", "fwd", 128, 16, 4096, False) == table
    tuning_cache.store({tuning_cache.key("sm90", "fwd", 128, 16, 4096, True): "64,64,4,2,tma",
                        tuning_cache.key("sm90", "dq", 128, 16, 4096, True): [64, 32, 4, 2]})  # older entries: lists
    assert triton_configs.pick("sm90", "fwd", 128, 16, 4000, True) == triton_configs.KernelConfig(64, 64, 4, 2, tma=True)
    assert triton_configs.pick("sm90", "dq", 128, 16, 4000, True) == triton_configs.KernelConfig(64, 32, 4, 2)
    assert triton_configs.pick("sm90", "fwd", 128, 16, 4096, False) == table
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "fwd=32,32,4,1")
    assert triton_configs.pick("sm90", "fwd", 128, 16, 4096, True) == triton_configs.KernelConfig(32, 32, 4, 1)


def test_config_text_round_trips_and_bad_text_names_the_entry(monkeypatch):
    for text in ("128,128,8,3", "128,128,4,2,tma,ws", "64,32,4,1,tma"):
        assert triton_configs.text(triton_configs.parse(text)) == text
    monkeypatch.setenv("EJGEN_TRITON_CONFIG", "fwd=128,128,8,3,fast")
    with pytest.raises(ValueError, match=r"EJGEN_TRITON_CONFIG: bad entry 'fwd=128,128,8,3,fast'"):
        triton_configs.pick("sm90", "fwd", 128, 16, 4096, True)


def test_an_unreadable_cache_is_an_error_that_says_what_to_do(cache_dir):
    (cache_dir / "triton-configs.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="tuning cache .* is unreadable"):
        triton_configs.pick("sm90", "fwd", 128, 16, 4096, True)


def test_ejgen_tune_sweeps_every_pass_and_fills_the_cache(cache_dir, capsys):
    rc = main(["tune", "--seq", "20", "--head-dim", "16", "--dtype", "float32", "--heads", "1", "--reps", "1", "--causal"])
    assert rc == 0
    entries = json.loads((cache_dir / "triton-configs.json").read_text())
    assert set(entries) == {f"interpret/{p}/d16/32bit/s128/causal" for p in ("fwd", "dkdv", "dq")}
    out = capsys.readouterr().out
    assert out.count(" ms") == 6 and "wrote 3 tuned config(s)" in out
    for pass_ in ("fwd", "dkdv", "dq"):
        chosen = triton_configs.pick("interpret", pass_, 16, 32, 20, True)
        assert triton_configs.text(chosen) == entries[f"interpret/{pass_}/d16/32bit/s128/causal"]


def test_windowed_calls_have_entries_of_their_own(cache_dir):
    k_full = tuning_cache.key("sm90", "fwd", 128, 16, 16384, True)
    k_window = tuning_cache.key("sm90", "fwd", 128, 16, 16384, True, window=True)
    assert k_window == k_full + "-window"
    tuning_cache.store({k_window: "64,64,4,2,tma"})
    assert triton_configs.pick("sm90", "fwd", 128, 16, 16384, True, window=True) == triton_configs.KernelConfig(
        64, 64, 4, 2, tma=True)
    assert triton_configs.pick("sm90", "fwd", 128, 16, 16384, True) == triton_configs.KernelConfig(
        128, 128, 8, 3, tma=True, merged=True)


def test_short_or_masked_loops_take_their_own_table_rows(cache_dir):
    pick, conf = triton_configs.pick, triton_configs.KernelConfig
    two_per_sm = conf(128, 64, 4, 2, tma=True, merged=True)
    assert pick("sm90", "fwd", 128, 16, 4096, True) == two_per_sm  # causal, short
    assert pick("sm90", "fwd", 128, 16, 16384, True, window=True) == two_per_sm
    assert pick("sm90", "fwd", 128, 16, 16384, False) == conf(128, 128, 8, 3, tma=True)
    assert pick("sm90", "dkdv", 128, 16, 2048, True).merged and not pick("sm90", "dkdv", 128, 16, 2048, False).merged
    assert pick("sm90", "fwd", 128, 32, 4096, True) == conf(64, 32, 4, 2)  # float32: the plain table
    assert pick("sm90", "fwd", 64, 16, 4096, True) == conf(128, 128, 8, 3)  # measured at D=128 only


def test_ejgen_tune_with_a_window_fills_the_window_entries(cache_dir, capsys):
    rc = main(["tune", "--seq", "20", "--head-dim", "16", "--dtype", "float32", "--heads", "1", "--reps", "1",
               "--causal", "--window", "8"])
    assert rc == 0
    entries = json.loads((cache_dir / "triton-configs.json").read_text())
    assert set(entries) == {f"interpret/{p}/d16/32bit/s128/causal-window" for p in ("fwd", "dkdv", "dq")}
    assert "window 8" in capsys.readouterr().out
