"""scripts/report.py on the tiny target: every cell is the decode/bench.py run its command names, the tables
carry those runs' numbers, and a rerun reuses finished cells."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts import report  # noqa: E402


def test_report_cells_are_bench_runs_and_the_tables_carry_their_numbers(tiny_model_dir, tiny_export, prompts_file,
                                                                          tmp_path):
    out, doc = tmp_path / "report", tmp_path / "docs" / "report-test.md"
    argv = ["--drafters", "dspark", "ngram", "hybrid", "--data", "jsonl", "--temperatures", "0", "1",
            "--num-prompts", "2", "--max-new-tokens", "8", "--out", str(out), "--doc", str(doc),
            "--export", f"dspark={tiny_export}",
            "--bench", f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", f"data.path={prompts_file}", "decode.num_draft=3"]
    report.main(argv)
    text = doc.read_text()
    cells = sorted((out / "bench").iterdir())
    assert [c.name for c in cells] == [f"jsonl-T{t}-{d}" for t in (0, 1) for d in ("dspark", "hybrid", "ngram")]
    for cell in cells:
        results = json.loads((cell / "results.json").read_text())
        temperature, drafter = re.match(r"jsonl-T(\d)-(\w+)", cell.name).groups()
        table = text.split(f"### jsonl, T={temperature}")[1].split("###")[0]
        row = next(line for line in table.splitlines() if line.startswith(f"| {drafter} |"))
        assert row.split(" | ")[1] == f"{results['tau']:.3f}"
        assert results["memory_bytes"]["target_weights"] > 0
        if temperature == "0":  # HF generate is the reference: the tiny target decodes exactly in fp32
            assert results["lossless"] is True
    for name in ("report-test-speedup.png", "report-test-acceptance.png"):
        assert (doc.parent / name).stat().st_size > 0 and f"]({name})" in text

    # The command a cell names, run as a user would, decodes the same tokens with the same acceptance.
    cell = out / "bench" / "jsonl-T1-hybrid"
    command = (cell / "command.txt").read_text().split()
    assert command[:2] == ["python", "decode/bench.py"] and f"`{' '.join(command)}`" in text
    again = tmp_path / "again"
    overrides = [o for o in command[2:] if not o.startswith("out_dir=")] + [f"out_dir={again}"]
    subprocess.run([sys.executable, "decode/bench.py", *overrides], cwd=REPO, check=True, capture_output=True)
    mine, theirs = (json.loads((d / "results.json").read_text()) for d in (cell, again))
    assert mine["tau"] == theirs["tau"] and mine["acceptance_by_position"] == theirs["acceptance_by_position"]
    samples = [[json.loads(line)["output_token_ids"] for line in (d / "samples.jsonl").read_text().splitlines()]
               for d in (cell, again)]
    assert samples[0] == samples[1]

    # A rerun reuses every finished cell; a changed setting reruns.
    stamps = {c.name: (c / "results.json").stat().st_mtime_ns for c in cells}
    report.main(argv)
    assert stamps == {c.name: (c / "results.json").stat().st_mtime_ns for c in cells}
    report.main([*argv[:argv.index("--max-new-tokens") + 1], "6", *argv[argv.index("--max-new-tokens") + 2:]])
    assert all((c / "results.json").stat().st_mtime_ns != stamps[c.name] for c in cells)


def test_the_matrix_trains_dspark_for_hybrid_and_names_each_proposer():
    assert report.exports_needed(["ngram", "hybrid"]) == ["dspark"]
    assert report.exports_needed(list(report.DRAFTERS)) == list(report.TRAINED)
    exports = {"dspark": "D", "standalone": "S"}
    assert report.proposer_overrides("hybrid", exports, 4) == ["proposer=hybrid", "proposer.path=D"]
    assert report.proposer_overrides("standalone", exports, 4) == ["proposer=model", "proposer.path=S",
                                                                    "decode.num_draft=4"]
