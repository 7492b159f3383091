"""Markdown tables from the results of scripts/schedule_bench.sh: one row per sweep cell (speed as a
multiple of plain decoding, τ in brackets; end to end and after the first token; the best cut on c_1
and the oracle ceiling of decode/oracle.py) and the load sweep.

Usage: .venv/bin/python scripts/schedule_table.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _cut(summary: dict) -> str:
    """The best cut on c_1 (decode/oracle.py's confidence_cut) over the best fixed length: probes priced;
    in brackets, the share of steps it drafts and how many of those survive."""
    probed = ((summary.get("ceiling") or {}).get("confidence_cut") or {}).get("probed")
    if not probed or probed.get("vs_best_fixed") is None:
        return "-"
    precision = "-" if probed["precision"] is None else f"{probed['precision']:.2f}"
    return f"{probed['vs_best_fixed']:.2f} (drafts {probed['drafted_fraction']:.2f}, survive {precision})"


def sweep_rows(out: Path) -> list[str]:
    cells = sorted(out.glob("sweep-*/results.json"))
    if not cells:
        return []
    summaries = [json.loads(path.read_text()) for path in cells]
    names = list(dict.fromkeys(name for summary in summaries for name in summary["settings"]))  # cells may sweep different lengths
    lines = ["| data, T | plain tok/s | " + " | ".join(names)
             + " | cost / best fixed | same, after the first token | best c_1 cut / best fixed, priced"
             + " | ceiling: oracle / best fixed, priced |",
             "|" + "---|" * (len(names) + 6)]
    for summary in summaries:
        settings = summary["settings"]
        config = summary["config"]
        label = f"{config['data']['name']}, {config['decode']['temperature']:g}"
        row = [f"{settings[n]['speedup_vs_plain']:.2f} / {settings[n]['decode_speedup_vs_plain']:.2f} ({settings[n]['tau']:.2f})"
               if n in settings else "-" for n in names]
        lines.append(f"| {label} | {summary['plain_tokens_per_s']:.2f} | " + " | ".join(row)
                     + f" | {summary.get('cost_vs_best_fixed', float('nan')):.2f}"
                     + f" | {summary.get('cost_vs_best_fixed_decode', float('nan')):.2f}"
                     + f" | {_cut(summary)}"
                     + f" | {(summary.get('ceiling') or {}).get('oracle_vs_best_fixed') or float('nan'):.2f} |")
    return lines


def load_rows(out: Path) -> list[str]:
    lines = []
    for path in sorted(out.glob("load-*/results.json")):
        summary = json.loads(path.read_text())
        lines += ["", f"{path.parent.name}: total tok/s plain / fixed / scheduled, medians of the runs "
                  "(scheduled ÷ plain: medians; fastest runs; paired by repeat); per-request tok/s",
                  "| C | total | scheduled ÷ plain | per request plain / fixed / scheduled | admitted per step |",
                  "|---|---|---|---|---|"]
        for row in summary["table"]:
            total = [row[name]["total_tokens_per_s"] for name in ("plain", "fixed", "scheduled")]
            best = [max(row[name]["total_tokens_per_s_runs"]) for name in ("plain", "scheduled")]
            each = [row[name]["per_request_tokens_per_s"] for name in ("plain", "fixed", "scheduled")]
            admitted = row["mean_admitted_per_step"]
            paired = f"; {row['scheduled_vs_plain']:.2f}" if "scheduled_vs_plain" in row else ""  # older results lack it
            lines.append(f"| {row['concurrency']} | {' / '.join(f'{x:.1f}' for x in total)} | "
                         f"{total[2] / total[0]:.2f}; {best[1] / best[0]:.2f}{paired} | "
                         f"{' / '.join(f'{x:.2f}' for x in each)} | {'-' if admitted is None else f'{admitted:.2f}'} |")
    return lines


def main(out: str) -> None:
    root = Path(out)
    lines = sweep_rows(root) + load_rows(root)
    if not lines:
        raise SystemExit(f"no results under {root}: run scripts/schedule_bench.sh EXPORT {root} first")
    print("speed ÷ plain, end to end / after the first token (τ)\n" + "\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
