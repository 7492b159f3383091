"""The evaluation report: every drafter x temperature x data set on the embedded target, one command.

    .venv/bin/python scripts/report.py [--drafters dspark dflash eagle3 standalone ngram hybrid]
        [--temperatures 0 1] [--data mtbench sharegpt_heldout] [--num-prompts 10] [--max-new-tokens 64]
        [--out runs/report] [--doc docs/results/report-DATE.md] [--bench KEY=VALUE ...] [-- distill overrides]

1. Trains each trained drafter (dspark, dflash, eagle3, standalone; hybrid drafts with the dspark one) with the
   no-argument distill settings into OUT/train/MODE, all on one regenerated data set, the same seed and the same
   number of steps (scripts/compare.py's `train_mode`: skipped when done, resumed when interrupted).
2. Runs every cell as `decode/bench.py` runs it (the same `run_bench` on the same composed config; the
   equivalent command is written beside it as OUT/bench/CELL/command.txt): per prompt, plain decoding and
   speculative decoding interleaved, and at T=0 HF `generate` as the exactness reference. A cell whose
   results.json exists for the same command is reused, so an interrupted report resumes.
3. Writes the report (markdown tables: τ, acceptance by position, speedup after the first token and end to end,
   tokens/s, memory by part; two PNG plots; the commit, the machine and the commands) and points the README's
   report link at it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402

TRAINED = ("dspark", "dflash", "eagle3", "standalone")
DRAFTERS = (*TRAINED, "ngram", "hybrid")
README_LINK = re.compile(r"\[the latest evaluation report\]\([^)]*\)")


def exports_needed(drafters: list[str]) -> list[str]:
    """The modes to train: the trained drafters asked for, and dspark when hybrid is (it drafts with it)."""
    wanted = {d for d in drafters if d in TRAINED} | ({"dspark"} if "hybrid" in drafters else set())
    return [mode for mode in TRAINED if mode in wanted]


def proposer_overrides(drafter: str, exports: dict[str, str], standalone_draft: int) -> list[str]:
    """decode/bench.py's proposer settings for one drafter of the matrix."""
    if drafter == "ngram":
        return ["proposer=ngram"]
    if drafter == "hybrid":
        return ["proposer=hybrid", f"proposer.path={exports['dspark']}"]
    from specdraft.models.registry import kind

    runs_with = kind(drafter).proposer  # "model" for the standalone drafter: a plain HF model with the target's tokenizer
    extra = [f"decode.num_draft={standalone_draft}"] if runs_with == "model" else []
    return [f"proposer={runs_with}", f"proposer.path={exports[drafter]}", *extra]


def cell_overrides(drafter: str, data: str, temperature: float, args, exports: dict[str, str], out: Path) -> list[str]:
    """Every setting of one cell, as decode/bench.py overrides (the report's only way to configure a cell)."""
    return [*proposer_overrides(drafter, exports, args.standalone_draft), f"data={data}",
            f"decode.temperature={temperature:g}", f"bench.num_prompts={args.num_prompts}", "bench.spread=true",
            f"decode.max_new_tokens={args.max_new_tokens}", f"target.dtype={args.dtype}",
            # HF generate is the exactness reference at T=0; at T=1 there is nothing to compare token for token
            f"bench.baselines={'true' if temperature == 0 else 'false'}", *args.bench,
            f"out_dir={out / 'bench' / f'{data}-T{temperature:g}-{drafter}'}"]


def bench_command(overrides: list[str]) -> str:
    return " ".join(["python decode/bench.py", *map(shlex.quote, overrides)])


def run_cell(overrides: list[str]) -> dict:
    """One decode/bench.py run in this process (the target loads per cell, as it would for the command)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specdraft import conf_dir
    from specdraft.decode.bench import run_bench
    from specdraft.decode.config import register_configs

    out_dir = Path(next(o for o in overrides if o.startswith("out_dir=")).split("=", 1)[1])
    results, command = out_dir / "results.json", out_dir / "command.txt"
    if results.is_file() and command.is_file() and command.read_text().strip() == bench_command(overrides):
        return json.loads(results.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    command.write_text(bench_command(overrides) + "\n")
    print(f"\n{bench_command(overrides)}", flush=True)
    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = OmegaConf.to_object(compose("bench", overrides=overrides))
    return run_bench(cfg)


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True)
    return (head.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine() -> str:
    from specdraft.decode.profile import machine_fingerprint

    m = machine_fingerprint()
    bf16 = {True: "native bf16", False: "bf16 emulated", None: "bf16 unknown"}[m["native_bf16"]]
    return f"{m['cpu']} ({m['cpu_capability']}, {bf16}), {m['threads']} threads, torch {m['torch']}, {m['device']}"


def shown(text: str) -> str:
    """Paths inside the repository as the README's commands write them: relative to its root."""
    return str(text).replace(f"{REPO}/", "")


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def cell_row(drafter: str, r: dict) -> str:
    by_position = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
    match = "-" if r.get("match_rate") is None else f"{r['match_rate']:.2f}"
    memory = r["memory_bytes"]
    return (f"| {drafter} | {r['tau']:.3f} | {by_position} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
            f"{ratio(r['decode_speedup_vs_plain'])} | {ratio(r['speedup_vs_plain'])} | {match} | "
            f"{mb(memory['target_weights'])} / {mb(memory['fast_backend_weights'])} / {mb(memory['drafter_weights'])}"
            f" / {mb(memory['kv_cache'])} |")


def markdown(cells: dict, trained: dict, args, argv: list[str], plots: list[str], date: str) -> str:
    """The report: settings, training, one table per (data, temperature), plots, commands."""
    first = next(iter(cells.values()))
    dtype, backend = first["target_dtype"], first["target_backend"]
    lines = [f"# Evaluation report, {date}", "",
             f"- Commit: {commit()}", f"- Machine: {machine()}",
             f"- Target: {first['config']['target']['name_or_path']}, {dtype['dtype']} ({dtype['reason']}), "
             f"{backend['name']} backend",
             f"- Each cell: {args.num_prompts} prompts x {args.max_new_tokens} new tokens, plain decoding and "
             "speculative decoding interleaved per prompt in one run (ratios within that run); at T=0 HF `generate` "
             "too, the exactness reference.",
             f"- Regenerate: `{' '.join(['.venv/bin/python scripts/report.py', *map(shlex.quote, argv)])}`",
             ""]
    if trained:
        lines += ["## Drafters", "", "Trained with the no-argument distill settings, one data set, the same seed and "
                  "steps (the drafter's own held-out τ estimate from training in the last column).", "",
                  "| drafter | steps | training s | held-out τ (training) | export |", "|---|---|---|---|---|"]
        for mode, done in trained.items():
            record = done.get("training_record") or {}
            tau = record.get("eval_tau_greedy")
            train_s = done.get("stage_seconds", {}).get("train")
            steps = "given" if done["train_steps"] is None else done["train_steps"]
            lines.append(f"| {mode} | {steps} | {'-' if train_s is None else f'{train_s:.0f}'} | "
                         f"{'-' if tau is None else f'{tau:.3f}'} | `{shown(done['export_path'])}` |")
        lines.append("")
    lines += ["## Results", "",
              "τ: tokens per verify step (prefill excluded). Speedups against plain decoding of the same run: after "
              "the first token (time per output token, the prefill left out) and end to end (tokens/s). Match: share "
              "of outputs equal to HF `generate`'s (T=0). Memory in MB: target weights / the fast backend's packed "
              "copies / the drafter's own weights / the target's KV cache at the longest sequence.", ""]
    for data in args.data:
        for temperature in args.temperatures:
            here = {d: cells[(data, temperature, d)] for d in args.drafters}
            lines += [f"### {data}, T={temperature:g}", "",
                      "| drafter | τ | acceptance by position | tok/s | plain tok/s | speedup after first token | "
                      "speedup end to end | match | memory MB |", "|---|---|---|---|---|---|---|---|---|"]
            lines += [cell_row(d, r) for d, r in here.items()] + [""]
    lines += [f"![{name}]({name})" for name in plots] + [""]
    lines += ["## Commands", "", "Each cell is this `decode/bench.py` run (its results.json is the cell):", ""]
    lines += [f"- `{shown(c['command'])}`" for c in cells.values()] + [""]
    return "\n".join(lines)


def plot(cells: dict, args, stem: Path) -> list[str]:
    """Speedups (after the first token, end to end) and acceptance by position, one panel per (data, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, t) for d in args.data for t in args.temperatures]
    names = []
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    width = 0.4
    for ax, (data, temperature) in zip(axes[0], panels):
        rows = [cells[(data, temperature, d)] for d in args.drafters]
        xs = range(len(rows))
        ax.bar([x - width / 2 for x in xs], [r["decode_speedup_vs_plain"] or 0 for r in rows], width,
               label="after first token")
        ax.bar([x + width / 2 for x in xs], [r["speedup_vs_plain"] for r in rows], width, label="end to end")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(xs), args.drafters, rotation=30)
        ax.set_title(f"{data}, T={temperature:g}")
        ax.set_ylabel("speedup vs plain decoding")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    names.append(f"{stem.name}-speedup.png")
    fig.savefig(stem.parent / names[-1], dpi=110)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (data, temperature) in zip(axes[0], panels):
        for drafter in args.drafters:
            accepted = cells[(data, temperature, drafter)]["acceptance_by_position"]
            points = [(k + 1, a) for k, a in enumerate(accepted) if a is not None]
            ax.plot([k for k, _ in points], [a for _, a in points], marker="o", label=drafter)
        ax.set_title(f"{data}, T={temperature:g}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    names.append(f"{stem.name}-acceptance.png")
    fig.savefig(stem.parent / names[-1], dpi=110)
    plt.close("all")
    return names


def link_readme(doc: Path) -> None:
    """Point the README's report link at `doc` (when the report lands in the repository's docs)."""
    readme = REPO / "README.md"
    if not doc.resolve().is_relative_to(REPO):
        return
    text = readme.read_text()
    updated = README_LINK.sub(f"[the latest evaluation report]({doc.resolve().relative_to(REPO)})", text)
    if updated != text:
        readme.write_text(updated)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    date = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS)
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--data", nargs="+", default=["mtbench", "sharegpt_heldout"], choices=["mtbench", "sharegpt_heldout", "jsonl"], help="data sets (jsonl: --bench data.path=FILE)")
    parser.add_argument("--num-prompts", type=int, default=12, help="per cell, evenly spaced over the data set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="target.dtype of every cell (auto: bf16 where native)")
    parser.add_argument("--standalone-draft", type=int, default=4, help="tokens the standalone drafter proposes per step")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "report")
    parser.add_argument("--doc", type=Path, default=REPO / "docs" / "results" / f"report-{date}.md")
    parser.add_argument("--bench", nargs="*", default=[], metavar="KEY=VALUE",
                        help="more decode/bench.py overrides for every cell (e.g. target.threads=2)")
    parser.add_argument("--export", nargs="*", default=[], metavar="MODE=DIR",
                        help="use this export for MODE instead of training one (e.g. dspark=RUN/export)")
    parser.add_argument("overrides", nargs="*", help="extra distill overrides, after --")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    from scripts.compare import train_mode

    given = dict(item.split("=", 1) for item in args.export)
    unknown = set(given) - set(TRAINED)
    if unknown:
        raise SystemExit(f"--export {sorted(unknown)}: only trained drafters take an export ({', '.join(TRAINED)})")
    trained = {mode: {"export_path": str(Path(given[mode]).resolve()), "train_steps": None} if mode in given
               else train_mode(mode, out / "train", "default", args.overrides) for mode in exports_needed(args.drafters)}
    from specdraft.models.export import training_record

    for done in trained.values():
        done["training_record"] = training_record(done["export_path"])
    exports = {mode: done["export_path"] for mode, done in trained.items()}
    cells = {}
    for data in args.data:
        for temperature in args.temperatures:
            for drafter in args.drafters:
                overrides = cell_overrides(drafter, data, temperature, args, exports, out)
                cells[(data, temperature, drafter)] = {**run_cell(overrides), "command": bench_command(overrides)}
    doc = args.doc.resolve()
    doc.parent.mkdir(parents=True, exist_ok=True)
    plots = plot(cells, args, doc.with_suffix(""))
    doc.write_text(markdown(cells, trained, args, argv, plots, date))
    link_readme(doc)
    print(f"\nreport: {doc}")


if __name__ == "__main__":
    main()
