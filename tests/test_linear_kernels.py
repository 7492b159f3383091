"""The kernel choice of the fast twins: each kernel computes x @ W.T + b, the choice follows the
measurements (another layout only where it pays and fits), and the measurement is cached per machine."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.decode import linear_kernels
from specdraft.decode.linear_kernels import (KERNELS, KernelPlan, PackedLinear, auto_plan, candidates, choose,
                                             fixed_plan, measure, row_padding)

GiB = 1 << 30


@pytest.mark.parametrize("name", list(dict.fromkeys([*candidates(torch.float32, torch.device("cpu")), "torch"])))
@pytest.mark.parametrize("bias", [False, True])
def test_each_kernel_computes_the_linear_layer(name, bias):
    torch.manual_seed(0)
    weight, b = torch.randn(48, 20), (torch.randn(48) if bias else None)
    linear = PackedLinear(weight, b, fixed_plan(name, torch.float32, torch.device("cpu")))
    for rows in (1, 2, 3, 4, 5, 8, 17):  # a kernel packed for some rows pads fewer and falls back for more
        x = torch.randn(rows, 20)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def table(**rows):
    """kernel -> {rows: ms} from kernel=(ms at 1, 2, 4, 8 rows)."""
    return {name: dict(zip(("1", "2", "4", "8"), ms)) for name, ms in rows.items()}


def test_one_kernel_wins_both_or_the_split_pays_and_fits():
    # The same kernel fastest everywhere: one layout.
    assert choose(table(onednn4=(10, 11, 12, 13), mkl=(12, 14, 16, 18)), GiB, 16 * GiB) == ("onednn4", "onednn4", {})
    # mkl far faster for one row, oneDNN for several: two layouts, when the copy fits a quarter of memory.
    split = table(onednn4=(20, 21, 22, 23), mkl=(14, 28, 32, 40))
    assert choose(split, GiB, 16 * GiB) == ("mkl", "onednn4", {})
    assert choose(split, GiB, 2 * GiB) == ("onednn4", "onednn4", {})  # no room: the best single kernel overall
    # A split that saves under 5% where it is used is not worth a second copy of the weights.
    assert choose(table(onednn4=(20, 21, 22, 23), mkl=(19.5, 28, 32, 40)), GiB, 16 * GiB) == ("onednn4", "onednn4", {})
    # Ties go to the registry's first candidate.
    assert choose(table(onednn4=(10, 10, 10, 10), mkl=(10, 10, 10, 10)), GiB, 16 * GiB) == ("onednn4", "onednn4", {})


def test_each_verify_width_gets_its_fastest_kernel_while_the_layouts_fit():
    measured = table(onednn16=(30, 37, 40, 46), mkl=(28, 44, 44, 56), torch=(29, 30, 46, 59),
                     mklpack4=(35, 36, 35, 59), mklpack8=(42, 42, 42, 41))
    # Room for every layout: mkl for one row, F.linear for two, each packed kernel at its own width; past
    # 8 rows the fastest kernel at 8 of those that run any width (a packed one falls back to F.linear there).
    assert choose(measured, GiB, 64 * GiB) == ("mkl", "onednn16", {"2": "torch", "4": "mklpack4", "8": "mklpack8"})
    # Room for two extra layouts: the two largest savings (2 rows, then 4; 8 rows saves as much but comes later).
    assert choose(measured, GiB, 8 * GiB) == ("onednn16", "onednn16", {"2": "torch", "4": "mklpack4", "8": "onednn16"})
    # A saving under 5% is not worth a layout: mklpack8 at 45 of 46 ms.
    measured["mklpack8"]["8"] = 45
    assert choose(measured, GiB, 64 * GiB)[2]["8"] == "onednn16"
    # Past the widths, another kernel that runs any width where it is faster there.
    measured["torch"]["8"] = 40
    assert choose(measured, GiB, 64 * GiB)[1:] == ("torch", {"2": "torch", "4": "mklpack4", "8": "torch"})
    # A kernel packed for one width is never the one for all widths, even when it is fastest overall; nor
    # the one for a wider width, where it only runs F.linear (the torch entry's kernel, timed alike).
    assert choose(table(mklpack4=(1, 1, 1, 1), torch=(9, 9, 9, 9)), GiB, GiB)[0] == "torch"
    assert choose(table(mklpack2=(9, 9, 8, 8), torch=(9, 9, 9, 9)), GiB, 64 * GiB) == ("torch", "torch", {})


def test_a_plan_names_a_kernel_for_every_width():
    plan = KernelPlan("mkl", "onednn16", "config", by_rows={"2": "torch", "4": "mklpack4", "8": "mklpack8"})
    assert [plan.kernel_for(rows) for rows in (1, 2, 3, 4, 5, 8, 9, 300)] == [
        "mkl", "torch", "mklpack4", "mklpack4", "mklpack8", "mklpack8", "onednn16", "onednn16"]
    assert plan.kernels == ["mkl", "torch", "mklpack4", "mklpack8", "onednn16"]
    assert plan.label == "mkl (1 row) + torch (2 rows) + mklpack4 (3-4 rows) + mklpack8 (5-8 rows) + onednn16 (9+ rows)"
    assert KernelPlan("mkl", "torch", "config").label == "mkl (1 row) + torch (2+ rows)"
    merged = KernelPlan("mkl", "onednn16", "config", by_rows={"2": "torch", "3": "torch", "4": "mklpack4", "6": "onednn16", "8": "onednn16"})
    assert merged.label == "mkl (1 row) + torch (2-3 rows) + mklpack4 (4 rows) + onednn16 (5+ rows)"


def test_a_packed_linear_runs_the_kernel_its_plan_names_for_the_rows(monkeypatch):
    names = [n for n in ("mkl", "torch", "mklpack4") if n in candidates(torch.float32, torch.device("cpu"))]
    if len(names) < 3:
        pytest.skip("MKL's kernels do not run here")
    calls = []
    for name in names:
        kernel = KERNELS[name]
        monkeypatch.setitem(KERNELS, name, kernel.__class__(name, kernel.pack, lambda x, p, b, run=kernel.run, name=name:
                                                           calls.append(name) or run(x, p, b), kernel.available, kernel.rows))
    weight = torch.randn(12, 8)
    linear = PackedLinear(weight, None, KernelPlan("mkl", "torch", "config", by_rows={"2": "torch", "4": "mklpack4"}))
    for rows in (1, 2, 3, 4, 5, 40):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(linear(x), x @ weight.T, atol=1e-5, rtol=1e-5)
    assert calls == ["mkl", "torch", "mklpack4", "mklpack4", "torch", "torch"]


def test_a_width_runs_padded_where_a_wider_one_was_measured_faster():
    plan = KernelPlan("onednn4", "onednn16", "config", by_rows={"2": "onednn16", "8": "onednn16"})
    measured = {"onednn4": {"1": 10.0, "2": 9.0}, "onednn16": {"1": 11.0, "2": 12.0, "3": 10.5, "4": 10.0, "6": 11.0, "8": 14.0}}
    # 2 rows (12 ms on the plan's onednn16) run as 4 (10 ms); 3 rows' 10.5 are within 5% of 4's; 1 row's kernel
    # is onednn4 (10 ms): no wider width beats it by 5%; the times of kernels the plan does not run there count not.
    assert row_padding(plan, measured) == {"2": 4}
    assert row_padding(plan, {"onednn16": {"1": 10.0, "2": 10.4, "4": 10.0}}) == {}  # 4% faster: not worth it
    assert row_padding(plan, {"onednn4": {"1": 20.0}, "onednn16": {"2": 30.0, "4": 12.0, "8": 12.0}}) == {"1": 4, "2": 4}
    assert KernelPlan("mkl", "mkl", "config", pad_rows={"2": 4, "1": 3}).label == "mkl; 1 row padded to 3; 2 rows padded to 4"


def test_a_padded_width_computes_the_same_on_the_wider_rows(monkeypatch):
    name = candidates(torch.float32, torch.device("cpu"))[0]
    kernel, widths = KERNELS[name], []
    monkeypatch.setitem(KERNELS, name, kernel.__class__(name, kernel.pack, lambda x, p, b, run=kernel.run:
                                                        widths.append(x.shape[0]) or run(x, p, b), kernel.available, kernel.rows))
    weight, bias = torch.randn(12, 8), torch.randn(12)
    linear = PackedLinear(weight, bias, KernelPlan(name, name, "config", pad_rows={"1": 4, "2": 4, "3": 6}))
    for rows in (1, 2, 3, 4, 5, 6, 9):
        x = torch.randn(rows, 8)
        out = linear(x)
        assert out.shape == (rows, 12) and out.is_contiguous()
        torch.testing.assert_close(out, x @ weight.T + bias, atol=1e-5, rtol=1e-5)
    assert widths == [4, 4, 6, 4, 5, 6, 9]


def test_the_plan_pads_from_its_own_measurement_cached_or_not(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path))
    device = torch.device("cpu")
    names = candidates(torch.float32, device)
    if len(names) < 2:
        pytest.skip("one kernel runs here: nothing is measured")
    # Every kernel 2 rows slow, 4 rows fast: whichever the plan keeps, 2 rows run padded to 4.
    slow_two = lambda kernels: {n: {"1": 10.0, "2": 13.0, "3": 10.0, "4": 9.9, "6": 11.0, "8": 12.0} for n in kernels}  # noqa: E731
    first = auto_plan({(24, 16): 2}, torch.float32, device, timer=slow_two)
    second = auto_plan({(24, 16): 2}, torch.float32, device, timer=slow_two)
    assert (first.source, second.source) == ("measured", "cached")
    assert first.pad_rows == second.pad_rows == {"2": 4}


def test_measure_scales_a_sample_back_to_the_models_counts():
    names = candidates(torch.float32, torch.device("cpu"))
    got = measure({(32, 16): 40, (64, 16): 1}, torch.float32, names, rows=(1, 4), repeats=2, cold_bytes=1 << 14)
    assert set(got) == set(names) and all(set(ms) == {"1", "4"} and min(ms.values()) > 0 for ms in got.values())


def test_the_decision_is_cached_and_a_damaged_entry_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path))
    device = torch.device("cpu")
    if len(candidates(torch.float32, device)) < 2:
        pytest.skip("one kernel runs here: nothing to choose or cache")
    runs = []
    real = linear_kernels.measure
    monkeypatch.setattr(linear_kernels, "measure", lambda *a, **k: runs.append(1) or real(*a, **k, repeats=1))
    shapes = {(24, 16): 2, (64, 16): 1}
    first = auto_plan(shapes, torch.float32, device)
    second = auto_plan(shapes, torch.float32, device)
    assert (first.source, second.source, len(runs)) == ("measured", "cached", 1)
    assert (second.one_row, second.multi_row, second.by_rows) == (first.one_row, first.multi_row, first.by_rows)
    assert second.measured_ms == first.measured_ms
    path = tmp_path / next(p.name for p in tmp_path.iterdir())
    path.write_text("{ not json")
    assert auto_plan(shapes, torch.float32, device).source == "measured" and len(runs) == 2
    assert json.loads(path.read_text())["one_row"] in KERNELS  # rewritten whole
    # Another shape is another entry.
    auto_plan({(8, 16): 1}, torch.float32, device)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_read_only_cache_still_gives_a_plan(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: the cache cannot be written
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(blocked / "kernels"))
    plan = auto_plan({(24, 16): 1}, torch.float32, torch.device("cpu"))
    assert plan.one_row in KERNELS and (plan.cache_file is None or plan.source == "only candidate")


def test_bf16_never_offers_the_float32_only_kernel():
    assert "mkl" not in candidates(torch.bfloat16, torch.device("cpu"))
    assert candidates(torch.float16, torch.device("cpu")) == ["torch"]


def test_the_fast_target_times_its_own_forward_with_each_kernel(monkeypatch, tmp_path):
    from specdraft.decode.fast_target import FastTarget
    from tests.helpers import tiny_llama

    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path))
    plan = FastTarget(tiny_llama(0)).plan
    names = candidates(torch.float32, torch.device("cpu"))
    if len(names) > 1:
        assert plan.source == "measured" and set(plan.measured_ms) == set(names)
        assert all(set(ms) == {str(rows) for rows in linear_kernels.ROWS} for ms in plan.measured_ms.values())
        assert FastTarget(tiny_llama(0)).plan.source == "cached"
    assert set(plan.kernels) <= set(names)


def test_a_change_to_a_kernels_own_source_measures_it_again(monkeypatch, tmp_path):
    """The cached decision is keyed by the code a candidate runs (Kernel.source), so an edited kernel is timed anew;
    kernels without a source of ours leave the key alone."""
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path))
    source = tmp_path / "kernel.c"
    source.write_text("one")
    torch_kernel = KERNELS["torch"]
    monkeypatch.setitem(KERNELS, "ours", torch_kernel.__class__("ours", torch_kernel.pack, torch_kernel.run,
                                                                torch_kernel.available, source=source))
    shapes = {(8, 4): 1}
    before = linear_kernels._cache_file(shapes, torch.float32, ["ours", "torch"], "linears")
    assert linear_kernels._cache_file(shapes, torch.float32, ["ours", "torch"], "linears") == before
    source.write_text("two")
    assert linear_kernels._cache_file(shapes, torch.float32, ["ours", "torch"], "linears") != before
    only_torch = linear_kernels._cache_file(shapes, torch.float32, ["torch"], "linears")
    source.write_text("three")
    assert linear_kernels._cache_file(shapes, torch.float32, ["torch"], "linears") == only_torch
