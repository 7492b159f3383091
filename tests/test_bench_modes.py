"""bench.mode=calibrate | sweep | load and scheduler=cost on a tiny target with a random dspark export."""

from __future__ import annotations

import json
import math

import pytest

from specdraft.decode.bench import run_bench
from specdraft.decode.sweep_runs import compare, pool
from tests.helpers import bench_config


def config(tiny_model_dir, prompts_file, out, *extra):
    return bench_config([f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", "data=jsonl",
                         f"data.path={prompts_file}", "proposer=drafter", "decode.max_new_tokens=10",
                         "decode.num_draft=3", f"out_dir={out}", "bench.concurrency=[1,2]", *extra])


def test_calibrate_then_cost_scheduler_uses_calibration_and_profile(tiny_model_dir, prompts_file, tmp_path, tiny_export):
    summary = run_bench(config(tiny_model_dir, prompts_file, tmp_path / "cal", f"proposer.path={tiny_export}",
                               "bench.mode=calibrate", "bench.num_prompts=3"))
    stored = json.loads((tiny_export / "calibration.json").read_text())
    for bucket in ("greedy", "sampling"):
        assert len(stored[bucket]["scale"]) == 3 and len(stored[bucket]["shift"]) == 3
        assert all(math.isfinite(v) for v in stored[bucket]["scale"] + stored[bucket]["shift"])
    report = summary["buckets"]["greedy"]["report"]
    assert {"ece_before", "ece_after", "brier_before", "auroc_after"} <= report[0].keys()
    assert (tmp_path / "cal" / "reliability.png").stat().st_size > 1000

    out = tmp_path / "cost"
    summary = run_bench(config(tiny_model_dir, prompts_file, out, f"proposer.path={tiny_export}", "scheduler=cost",
                               "bench.num_prompts=2", "scheduler.profile_contexts=[64,300,1024]"))
    assert summary["lossless"] is True
    assert summary["calibration"] == str(tiny_export / "calibration.json")
    assert summary["profile"]["measured_now"] is True
    profile = json.loads(open(summary["profile"]["path"]).read())
    assert len(profile["draft"]) == 4 and set(profile["verify"]) == {"single", "batched"}
    assert set(profile["draft_batched"]) == set(profile["verify"]["batched"])  # one batched draft per row count
    assert all(len(curve) == len(profile["draft"]) - 1 and min(curve) > 0  # ℓ = 1..block
               for curve in profile["draft_batched"].values())
    # The one-request curves again at the further contexts (scheduler.profile_contexts) the target's window
    # of 512 positions allows, for pricing each step at its own context.
    assert set(profile["by_context"]) == {"64", "300"} and profile["fingerprint"]["contexts"] == [64, 300]
    # the default token tree (proposer.branches unset): 3 side rows beside a full block of 3 and the pending token
    assert summary["tree"]["requested"] is None and summary["tree"]["branches"] == 4
    for curves in profile["by_context"].values():
        assert len(curves["verify"]) == 4 + 3 and len(curves["draft"]) == 4 and min(curves["verify"] + curves["draft"]) > 0
    # The second run reads the cached profile instead of measuring again.
    again = run_bench(config(tiny_model_dir, prompts_file, out, f"proposer.path={tiny_export}", "scheduler=cost",
                             "bench.num_prompts=1", "bench.baselines=false", "scheduler.profile_contexts=[64,300,1024]"))
    assert again["profile"]["measured_now"] is False and again["profile"]["path"] == summary["profile"]["path"]


def test_sweep_mode_reports_every_setting(tiny_model_dir, prompts_file, tmp_path, tiny_export):
    summary = run_bench(config(tiny_model_dir, prompts_file, tmp_path, f"proposer.path={tiny_export}", "bench.mode=sweep",
                               "bench.num_prompts=2", "bench.sweep_thresholds=[0.5]", "bench.repeats=2"))
    # Two runs of every setting per prompt; the seeds repeat, so each repeat produced the same tokens.
    assert summary["repeats"] == 2 and summary["repeats_differ"] == 0
    assert set(summary["settings"]) == {"fixed_1", "fixed_2", "fixed_3", "threshold_0.5", "cost"}
    assert all(row["equal_to_plain"] is True for row in summary["settings"].values())  # fp32 T=0: exact
    assert summary["best_fixed"] in summary["settings"] and summary["cost_vs_best_fixed"] > 0
    interval = summary["cost_vs_best_fixed_interval"]  # two prompts resampled in pairs: an interval around the ratio
    low, high = interval["e2e"]
    assert interval["level"] == 0.95 and 0 < low <= high and len(interval["decode"]) == 2
    ceiling = summary["ceiling"]  # the oracle schedule on each fixed length's steps, priced by the profile
    assert set(ceiling["oracle_decode_tokens_per_s"]) == {"fixed_1", "fixed_2", "fixed_3"}
    assert ceiling["best_fixed"] in ceiling["oracle_decode_tokens_per_s"] and ceiling["oracle_vs_best_fixed"] > 0
    # The best cut on c_1 over fixed_1's steps (every one drafted with a confidence), with and without probes priced.
    probed, free = ceiling["confidence_cut"]["probed"], ceiling["confidence_cut"]["probe_free"]
    assert probed["steps"] == free["steps"] > 0 and probed["probe_priced"] and not free["probe_priced"]
    assert free["decode_tokens_per_s"] >= probed["decode_tokens_per_s"] and probed["vs_best_fixed"] > 0
    # runs.jsonl keeps every prompt's runs: pooled on its own it gives back the summary's ratio and interval
    pooled = pool([tmp_path])
    assert set(pooled) == {"plain", *summary["settings"]} and all(len(runs) == 2 for runs in pooled.values())
    row = compare(pooled, "cost", summary["best_fixed"])
    assert row["e2e"] == pytest.approx(summary["cost_vs_best_fixed"]) and row["e2e_interval"] == tuple(interval["e2e"])


def test_load_mode_table_and_plot(tiny_model_dir, prompts_file, tmp_path, tiny_export):
    summary = run_bench(config(tiny_model_dir, prompts_file, tmp_path, f"proposer.path={tiny_export}", "bench.mode=load",
                               "bench.num_prompts=3", "bench.load_repeats=3"))
    assert [row["concurrency"] for row in summary["table"]] == [1, 2]
    assert summary["profile"]["measured_now"] is True  # the flag, not a method's runs
    for row in summary["table"]:
        assert row["outputs_equal_at_T0"] is True
        for name in ("plain", "fixed", "scheduled"):
            runs = row[name]["total_tokens_per_s_runs"]
            assert len(runs) == 3 and row[name]["total_tokens_per_s"] == sorted(runs)[1]  # the median run's rate
            assert row[name]["total_tokens_per_s_best"] == max(runs)
            assert row[name]["per_request_tokens_per_s"] > 0
        paired = [s / p for s, p in zip(row["scheduled"]["total_tokens_per_s_runs"], row["plain"]["total_tokens_per_s_runs"])]
        assert row["scheduled_vs_plain_runs"] == paired and row["scheduled_vs_plain"] == sorted(paired)[1]
    assert (tmp_path / "load_sweep.png").stat().st_size > 1000


def test_unknown_mode_and_missing_confidence_head_are_refused(tiny_model_dir, prompts_file, tmp_path):
    with pytest.raises(ValueError, match="bench.load_repeats=0"):
        run_bench(config(tiny_model_dir, prompts_file, tmp_path, "proposer=ngram", "bench.mode=load",
                         "bench.load_repeats=0"))
    with pytest.raises(ValueError, match="bench.mode='fast'"):
        run_bench(config(tiny_model_dir, prompts_file, tmp_path, "proposer=ngram", "bench.mode=fast"))
    with pytest.raises(ValueError, match="confidence head"):  # a standalone LM drafts without confidences
        run_bench(config(tiny_model_dir, prompts_file, tmp_path, "proposer=model", "proposer.num_layers=1",
                         "scheduler=threshold", "bench.num_prompts=1"))


def test_check_mode_holds_the_served_tau_to_the_training_record(tiny_model_dir, prompts_file, tmp_path, tiny_export):
    """bench.mode=check loads the export as a serving engine would and fails loudly where it accepts far less
    than training measured; without a record it reports the served tau and judges nothing."""
    from specdraft.decode.bench_modes import CheckFailed

    args = ("proposer=drafter", f"proposer.path={tiny_export}", "bench.mode=check", "bench.check_llama_cpp=false")
    summary = run_bench(config(tiny_model_dir, prompts_file, tmp_path / "none", *args))
    assert summary["passed"] is None and summary["training"] is None and summary["tau"] >= 1
    sidecar = tiny_export / "specdraft.json"
    saved = json.loads(sidecar.read_text())
    for recorded, passes in ((summary["tau"], True), (summary["tau"] + 3.0, False)):
        sidecar.write_text(json.dumps({**saved, "training": {"eval_tau_greedy": recorded, "steps": 10}}))
        out = tmp_path / f"check-{passes}"
        if passes:
            assert run_bench(config(tiny_model_dir, prompts_file, out, *args))["passed"] is True
        else:
            with pytest.raises(CheckFailed, match=r"accepts far less when served than in training: tau"):
                run_bench(config(tiny_model_dir, prompts_file, out, *args))
            assert json.loads((out / "results.json").read_text())["passed"] is False  # written before failing


FAKE_LLAMA = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls.txt"
echo "encoded   20 tokens in    0.010 s, speed: 2000 t/s"
echo "decoded   10 tokens in    0.050 s, speed: 200 t/s"
echo "n_drafted = 12"
echo "n_accept  = $(cat "$(dirname "$0")/accept.txt")"
"""


def test_check_mode_serves_the_export_with_llama_cpp_where_built(tiny_model_dir, prompts_file, tmp_path, tiny_export,
                                                                  monkeypatch):
    """Where llama.cpp is built, the check converts the export with its converter and decodes the same prompts
    with llama-speculative-simple at the same draft length; an engine that accepts almost nothing of what ours
    accepts fails the check (stand-in binaries here: the real ones are built by scripts/build_llama_cpp.sh)."""
    from specdraft.decode import llama_cpp
    from specdraft.decode.bench_modes import CheckFailed

    binaries = tmp_path / "bin"
    binaries.mkdir()
    for name in llama_cpp.NEEDED:
        (binaries / name).write_text(FAKE_LLAMA)
        (binaries / name).chmod(0o755)
    converted = []

    def convert(model_dir, out, target_dir=None, outtype="f32"):
        converted.append((str(model_dir), out.name, target_dir))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"GGUF")
        return out

    monkeypatch.setattr(llama_cpp, "bin_dir", lambda: binaries)
    monkeypatch.setattr(llama_cpp, "convert_to_gguf", convert)
    args = ("proposer=drafter", f"proposer.path={tiny_export}", "bench.mode=check", "bench.num_prompts=2")
    (binaries / "accept.txt").write_text("12")
    engine = run_bench(config(tiny_model_dir, prompts_file, tmp_path / "good", *args))["llama_cpp"]
    assert engine["passed"] is True and engine["acceptance"] == 1.0 and engine["drafted"] == 24
    assert ("draft.gguf" in {name for _, name, _ in converted}) and str(tiny_export) in {m for m, _, _ in converted}
    call = (binaries / "calls.txt").read_text().splitlines()[0].split()
    assert call[call.index("--spec-type") + 1] == "draft-dspark" and call[call.index("--spec-draft-n-max") + 1] == "3"
    assert call[call.index("-md") + 1].endswith("draft.gguf") and call[call.index("--temp") + 1] == "0"
    assert engine["our_acceptance"] > 0  # what the negative control below needs to fail against
    (binaries / "accept.txt").write_text("0")
    with pytest.raises(CheckFailed, match="llama.cpp serves the export worse than our engine does: acceptance 0.000"):
        run_bench(config(tiny_model_dir, prompts_file, tmp_path / "bad", *args))
    monkeypatch.setattr(llama_cpp, "bin_dir", lambda: None)
    engine = run_bench(config(tiny_model_dir, prompts_file, tmp_path / "unbuilt", *args))["llama_cpp"]
    assert engine["passed"] is None and engine["status"].startswith("not built")
