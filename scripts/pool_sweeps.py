"""Several sweeps of the same settings as one: every setting against plain decoding, and one setting against
another (default: the cost scheduler against the fixed length fastest over all of them), over the pooled
prompt pairs with 95% paired bootstrap intervals (decode/sweep_runs.py).

    .venv/bin/python scripts/pool_sweeps.py OUT [OUT ...] [--faster cost] [--slower best] [--json FILE]

Each OUT is the out_dir of a `decode/bench.py bench.mode=sweep` run (its runs.jsonl), e.g. the same sweep
with bench.seed=0, 1 and 2: at T=1 one sweep of 20 prompts leaves a ratio of two settings a few percent
either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

import argparse  # noqa: E402
import json  # noqa: E402

from specdraft.decode.sweep_runs import best_fixed, compare, pool  # noqa: E402
from specdraft.io.files import write_text_atomically  # noqa: E402


def _cell(row: dict, name: str) -> str:
    low_high = row[f"{name}_interval"]
    interval = f" [{low_high[0]:.3f}, {low_high[1]:.3f}]" if low_high else ""
    return f"{row[name]:.3f}{interval}" if row[name] else "-"


def table(rows: list[dict]) -> str:
    lines = ["| setting | against | prompt pairs | decode speed ratio [95%] | end to end [95%] |", "|---|---|---|---|---|"]
    lines += [f"| {row['faster']} | {row['slower']} | {row['pairs']} | {_cell(row, 'decode')} | {_cell(row, 'e2e')} |"
              for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dirs", nargs="+", help="out_dir folders of decode/bench.py bench.mode=sweep runs")
    parser.add_argument("--faster", default="cost", help="the setting to compare (default: cost)")
    parser.add_argument("--slower", default="best", help="the setting it is held to (best: the fastest fixed length)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    try:
        pooled = pool(args.out_dirs)
        fastest = best_fixed(pooled)
        slower = fastest if args.slower == "best" else args.slower
        rows = [compare(pooled, setting, "plain") for setting in pooled if setting != "plain"]
        if args.faster in pooled or args.faster != "cost":  # a sweep without a confidence head has no cost row
            rows.append(compare(pooled, args.faster, slower))
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(str(error)) from error
    print(f"{len(args.out_dirs)} sweep(s) pooled; the fixed length fastest after the first token: {fastest}")
    print(table(rows))
    if args.json:
        write_text_atomically(args.json, json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
