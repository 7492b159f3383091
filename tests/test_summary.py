"""The distill run's closing summary says which pass each figure comes from, rounds it, and explains a slowdown
from the measured cost profile."""

from __future__ import annotations

import json

from specdraft.pipeline import summary_lines


def results(speedup: float, profile: str | None) -> dict:
    return {"export_path": "RUN/export", "config": {"drafter": {"mode": "dspark"}}, "train_steps": 72,
            "eval_tau_estimate": 1.2031, "lossless": True, "tau_float32": 1.0924, "tau": 1.1595,
            "speedup_vs_plain": speedup, "acceptance_by_position": [0.3676, 0.09],
            "speed_pass": {"dtype": "bfloat16", "scheduler": "cost", "num_prompts": 3, "max_new_tokens": 64,
                           "mean_draft_len": 1.4, "profile": profile},
            "stage_seconds": {"data": 86.2, "train": 351.0, "export": 4.1, "validate": 63.3}}


def test_summary_names_passes_and_rounds(tmp_path):
    text = "\n".join(summary_lines(results(1.1427893735413048, None), tmp_path))
    assert "exactness pass  float32, 3 held-out prompts: lossless True" in text
    assert "speed pass      bfloat16, scheduler cost: tau 1.16, 1.14x the speed of plain decoding (faster than" in text
    assert "1.1427" not in text and "why:" not in text
    assert "stage seconds   data 86, train 351, export 4, validate 63" in text


def test_summary_explains_a_slowdown_from_the_profile(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"verify": {"single": {"1": [0.020, 0.025, 0.030]}}}))
    text = "\n".join(summary_lines(results(0.5973075191997613, str(profile)), tmp_path))
    assert "0.60x the speed of plain decoding (slower than plain decoding)" in text
    assert "a verify of 1 drafted token(s) costs 1.25x a plain step" in text  # 0.025 / 0.020
    assert "accepted 37% of the time" in text


def test_summary_of_a_run_without_validation_or_evaluation(tmp_path):
    run = results(1.0, None) | {"lossless": None, "eval_tau_estimate": None}
    text = "\n".join(summary_lines(run, tmp_path))
    assert "validation      skipped" in text and "estimate tau n/a" in text
