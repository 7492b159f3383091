"""Per-prompt sweep runs (decode/sweep_runs.py) and pooling several sweeps (scripts/pool_sweeps.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specdraft.decode.generate import Generation
from specdraft.decode.metrics import timing_stats
from specdraft.decode.sweep_runs import RUNS_FILE, best_fixed, compare, pool, read_runs, write_runs

REPO = Path(__file__).resolve().parents[1]


def gen(tokens: int, ttft: float, total: float, drafted=(), accepted=()) -> Generation:
    return Generation(list(range(tokens)), list(drafted), list(accepted), ttft_s=ttft, total_s=total)


def sweep(out: Path, slow: float) -> dict[str, list[Generation]]:
    """Three prompts, plain and two fixed lengths; fixed_2 decodes each prompt `slow` times faster than plain."""
    results = {"plain": [gen(9, 0.1, 0.1 + 0.8 * (i + 1)) for i in range(3)],
               "fixed_1": [gen(9, 0.1, 0.1 + 0.7 * (i + 1), [1] * 6, [0, 1] * 3) for i in range(3)],
               "fixed_2": [gen(9, 0.1, 0.1 + 0.8 * (i + 1) / slow, [2] * 5, [1, 0, 2, 0, 1]) for i in range(3)]}
    write_runs(out, results, [[1, 2, 3]] * 3)
    return results


def test_runs_round_trip_and_pool_in_pairs(tmp_path):
    written = sweep(tmp_path / "a", 2.0)
    read = read_runs(tmp_path / "a")
    assert set(read) == set(written)
    for setting in written:
        assert [(g.output_ids, g.drafted, g.accepted, g.ttft_s, g.total_s) for g in read[setting]] == \
               [(g.output_ids, g.drafted, g.accepted, g.ttft_s, g.total_s) for g in written[setting]]
    sweep(tmp_path / "b", 4.0)
    pooled = pool([tmp_path / "a", tmp_path / "b"])
    assert all(len(runs) == 6 for runs in pooled.values())
    assert best_fixed(pooled) == "fixed_2"
    row = compare(pooled, "fixed_2", "plain")
    tpot = lambda runs: timing_stats(runs)["tpot_s"]  # noqa: E731
    assert row["pairs"] == 6 and row["decode"] == pytest.approx(tpot(pooled["plain"]) / tpot(pooled["fixed_2"]))
    # every pair has fixed_2 2x or 4x as fast after the first token: the interval lies between the two
    low, high = row["decode_interval"]
    assert 2.0 <= low <= row["decode"] <= high <= 4.0


def test_pooling_refuses_what_does_not_pair(tmp_path):
    sweep(tmp_path / "a", 2.0)
    with pytest.raises(FileNotFoundError, match="bench.mode=sweep"):
        pool([tmp_path / "a", tmp_path / "none"])
    other = {"plain": [gen(5, 0.1, 1.0)], "fixed_3": [gen(5, 0.1, 0.9)]}
    write_runs(tmp_path / "c", other, [[1]])
    with pytest.raises(ValueError, match=r"missing \['fixed_1', 'fixed_2'\], extra \['fixed_3'\]"):
        pool([tmp_path / "a", tmp_path / "c"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / RUNS_FILE).write_text('{"prompt": 0, "setting": "plain"}\n')
    with pytest.raises(ValueError, match="line 1 is not a sweep run"):
        read_runs(tmp_path / "d")
    with pytest.raises(ValueError, match="'cost' is not among"):
        compare(pool([tmp_path / "a"]), "cost", "fixed_1")


def test_pool_sweeps_script_prints_every_setting(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("pool_sweeps", REPO / "scripts" / "pool_sweeps.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    sweep(tmp_path / "a", 2.0)
    sweep(tmp_path / "b", 4.0)
    rows = script.main([str(tmp_path / "a"), str(tmp_path / "b"), "--faster", "fixed_1", "--json", str(tmp_path / "p.json")])
    assert [(row["faster"], row["slower"]) for row in rows] == [("fixed_1", "plain"), ("fixed_2", "plain"),
                                                                ("fixed_1", "fixed_2")]
    printed = capsys.readouterr().out
    assert "fastest after the first token: fixed_2" in printed and "| fixed_1 | fixed_2 | 6 |" in printed
    assert (tmp_path / "p.json").is_file()
    with pytest.raises(SystemExit, match="does not exist"):
        script.main([str(tmp_path / "missing")])
