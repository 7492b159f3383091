"""Markdown tables from the results of scripts/fast_backend_bench.sh: `python scripts/fast_backend_table.py OUT`.

Reads OUT/roofline/roofline.json, OUT/*-single/results.json, OUT/*-sweep-T*/results.json and OUT/peers/peers.json
(whichever exist) and prints, then writes OUT/tables.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def roofline_table(roof: dict) -> list[str]:
    lines = [f"Roofline ({roof['machine']['cpu']}, {roof['machine']['threads']} threads, read bandwidth "
             f"{roof['bandwidth_gbs']:.1f} GB/s): forward ms for k new tokens, ratio to k=1 in brackets", "",
             "| dtype | context | curve | " + " | ".join(f"k={k}" for k in roof["tokens"]) + " |",
             "|---|---|---|" + "---|" * len(roof["tokens"])]
    for dtype, entry in roof["dtypes"].items():
        for context in map(str, roof["contexts"]):
            curves = {"floor": entry["floor_ms"][context], **{b: c[context] for b, c in entry["backends"].items()}}
            for name, curve in curves.items():
                one = curve["1"]
                cells = " | ".join(f"{curve[str(k)]:.1f} ({curve[str(k)] / one:.2f})" for k in roof["tokens"])
                lines.append(f"| {dtype} | {context} | {name} | {cells} |")
    return lines


def single_row(name: str, r: dict) -> str:
    return (f"| {name} | {r['num_prompts']} | {fmt(r['tau'])} | {fmt(r['speedup_vs_plain'])} | "
            f"{fmt(r.get('decode_speedup_vs_plain'))} | {fmt(r['plain_tokens_per_s'], 1)} | "
            f"{fmt(r.get('hf_generate_tokens_per_s'), 1)} | {fmt(r.get('plain_vs_hf_generate'))} | "
            f"{fmt(r.get('hf_baseline_speedup_vs_hf_generate'))} | {r['lossless']} |")


def sweep_rows(name: str, r: dict) -> list[str]:
    rows = []
    for setting, v in r["settings"].items():
        rows.append(f"| {name} | {setting} | {fmt(v['tau'])} | {fmt(v['mean_draft_len'])} | {fmt(v['speedup_vs_plain'])} | "
                    f"{fmt(v['decode_speedup_vs_plain'])} |")
    ceiling = r.get("ceiling") or {}
    rows.append(f"| {name} | cost ÷ best fixed ({r['best_fixed']}) | | | {fmt(r.get('cost_vs_best_fixed'))} | "
                f"{fmt(r.get('cost_vs_best_fixed_decode'))} |")
    if ceiling.get("oracle_vs_best_fixed"):
        rows.append(f"| {name} | priced oracle ÷ best fixed | | | | {fmt(ceiling['oracle_vs_best_fixed'])} |")
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    lines = []
    roof = read(out / "roofline" / "roofline.json")
    if roof:
        lines += roofline_table(roof) + [""]
    singles = {p.parent.name: read(p) for p in sorted(out.glob("*-single/results.json"))}
    if singles:
        lines += ["| run | prompts | τ | ÷ plain, end to end | ÷ plain, after 1st token | plain tok/s | HF generate tok/s | "
                  "plain ÷ HF generate | HF baseline ÷ HF generate | lossless (= HF generate) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [single_row(name, r) for name, r in singles.items()] + [""]
    sweeps = {p.parent.name: read(p) for p in sorted(out.glob("*-sweep-T*/results.json"))}
    if sweeps:
        lines += ["| sweep | setting | τ | drafted per step | ÷ plain, end to end | ÷ plain, after 1st token |",
                  "|---|---|---|---|---|---|"]
        for name, r in sweeps.items():
            lines += sweep_rows(name, r)
        lines.append("")
    peers = out / "peers" / "peers.md"
    if peers.is_file():
        lines += peers.read_text().splitlines()
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
