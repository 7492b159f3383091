"""scripts/schedule_table.py's load table: the paired column where results have it, none where they predate it."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "schedule_table.py"


def _table_module():
    spec = importlib.util.spec_from_file_location("schedule_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(concurrency: int, plain: list[float], scheduled: list[float], paired: bool) -> dict:
    def method(runs):
        return {"total_tokens_per_s": sorted(runs)[len(runs) // 2], "total_tokens_per_s_runs": runs,
                "per_request_tokens_per_s": runs[0] / concurrency}
    row = {"concurrency": concurrency, "plain": method(plain), "fixed": method([5.0, 5.0, 5.0]),
           "scheduled": method(scheduled), "mean_admitted_per_step": 0.5}
    if paired:
        row["scheduled_vs_plain"] = 0.95
    return row


def test_load_rows_show_paired_ratio_only_where_recorded(tmp_path):
    for name, paired in (("load-new", True), ("load-old", False)):
        (tmp_path / name).mkdir()
        table = [_row(4, [10.0, 12.0, 11.0], [11.0, 12.0, 13.0], paired)]
        (tmp_path / name / "results.json").write_text(json.dumps({"table": table}))
    lines = _table_module().load_rows(tmp_path)
    rows = [line for line in lines if line.startswith("| 4 ")]
    assert len(rows) == 2
    new, old = rows  # folders in name order: load-new, then load-old
    # scheduled ÷ plain: medians 12 / 11, fastest runs 13 / 12; only the new results add the paired median
    assert "| 1.09; 1.08; 0.95 |" in new and "| 1.09; 1.08 |" in old
