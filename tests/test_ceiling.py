"""The oracle's bound on prompt lookup (decode/ceiling.py): steps counted by hand, the all-occurrences
oracle above the lookup's own, and the script on a benchmark folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.decode.ceiling import ceiling, every_occurrence, lookup_drafts, oracle_steps

REPO = Path(__file__).resolve().parents[1]
LOOKUP = lookup_drafts(max_ngram=3, min_ngram=1)


def test_each_step_feeds_what_the_target_accepts_and_the_end_is_a_steps_own_token():
    # 4 recurs nowhere: a plain step; then the context ends in 1, which was followed by 2 3 4 1: the target
    # says 2 3 9, so 2 drafted tokens are accepted and 9 is the step's own token.
    assert oracle_steps([1, 2, 3, 4], [1, 2, 3, 9], LOOKUP, max_draft=4) == [1, 3]
    # A draft that runs past the output's end: the last output token is still a step's own.
    assert oracle_steps([1, 2, 3, 1], [2, 3], LOOKUP, max_draft=4) == [2]
    bound = ceiling([([1, 2, 3, 4], [1, 2, 3, 9])], LOOKUP, {1: 1.0, 3: 1.5}.get, max_draft=4)
    assert bound["tau"] == 2.0 and bound["speedup_flat_curve"] == 2.0
    assert bound["speedup_measured_curve"] == pytest.approx(4 * 1.0 / (1.0 + 1.5))


def test_every_occurrence_finds_the_older_match_the_lookup_passes_over():
    # The context ends in 1; the most recent earlier 1 was followed by 8, an older one by 7, and 7 comes.
    prompt, output = [1, 7, 1, 8, 1], [7, 0]
    assert oracle_steps(prompt, output, LOOKUP, max_draft=4) == [1, 1]
    assert oracle_steps(prompt, output, every_occurrence, max_draft=4) == [2]
    with pytest.raises(ValueError, match="samples are empty"):
        ceiling([], LOOKUP, lambda tokens: 1.0, max_draft=4)


def test_the_script_bounds_a_benchmark_folder_and_refuses_a_sampled_run(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"fingerprint": {}, "verify": {"single": {"1": [0.010, 0.011, 0.012]}},
                                   "draft": [0.0], "context_length": 8}))
    run = tmp_path / "run"
    run.mkdir()
    config = {"proposer": {"name": "ngram", "max_ngram": 3, "min_ngram": 1}, "decode": {"temperature": 0.0, "num_draft": 4}}
    (run / "results.json").write_text(json.dumps({"config": config, "profile": {"path": str(profile)},
                                                  "tau": 1.5, "speedup_vs_plain": 1.2}))
    (run / "samples.jsonl").write_text(json.dumps({"prompt_token_ids": [1, 2, 3, 4], "output_token_ids": [1, 2, 3, 9]}) + "\n")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "lookup_ceiling.py"), str(run)],
                          capture_output=True, text=True, check=True)
    written = json.loads((run / "ceiling.json").read_text())
    # The profile prices verifies of up to 3 tokens, the run drafted up to 4: tau and the flat ceiling only.
    assert written["max_draft"] == 4 and written["lookup_oracle"]["tau"] == 2.0
    assert written["lookup_oracle"]["speedup_measured_curve"] is None and "unpriced" in done.stdout
    subprocess.run([sys.executable, str(REPO / "scripts" / "lookup_ceiling.py"), str(run), "--max-draft", "2"], check=True,
                   capture_output=True)
    written = json.loads((run / "ceiling.json").read_text())
    # Drafts of up to 2: steps feed 1, then 3 (2 3 drafted and accepted), priced 10 and 12 ms.
    assert written["lookup_oracle"]["speedup_measured_curve"] == pytest.approx(4 * 0.010 / (0.010 + 0.012))
    assert "every_occurrence_oracle" in done.stdout
    config["decode"]["temperature"] = 1.0
    (run / "results.json").write_text(json.dumps({"config": config, "profile": {"path": str(profile)}}))
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "lookup_ceiling.py"), str(run)],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "needs a greedy run" in refused.stderr
