"""DSpark vs DFlash vs Eagle-3 (and, with --modes ... standalone, the peft standalone drafter) on one target:
identical data, steps and seed; one benchmark table.

    .venv/bin/python scripts/compare.py [--out runs/compare] [--experiment cpu_full] [-- distill overrides ...]

1. Trains each mode with `train/distill.py drafter=MODE experiment=EXPERIMENT` into OUT/MODE, all reading
   one regenerated data set (OUT/data, produced by the first mode with no data time limit), the same seed
   and the same number of steps (no training time limit, so a slower mode is not cut short). A mode whose OUT/MODE/results.json exists is skipped; an interrupted one resumes from its last
   checkpoint (trainer.resume=auto).
2. Benchmarks every export on --num-prompts prompts of each data set (MT-bench, held-out ShareGPT) at each
   temperature, in --dtype: per prompt, plain decoding and every drafter run interleaved (order rotated), so
   the plain baseline is measured once per data set and temperature and every ratio comes from one run.
   Each (data, temperature) result is saved as OUT/bench/DATA-T.json and skipped when present.
3. Prints and writes OUT/compare.md (and OUT/compare.json): τ by position, mean τ, tokens/s, speedup vs
   plain, and the τ ratios dspark/dflash and dspark/eagle3.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402

DEFAULT_MODES = ("dspark", "dflash", "eagle3")
MODES = (*DEFAULT_MODES, "standalone")  # standalone: opt-in (--modes ... standalone)


def train_mode(mode: str, out: Path, experiment: str, overrides: list[str]) -> dict:
    """Distill one mode into OUT/MODE (skipped when done, resumed when interrupted)."""
    results = out / mode / "results.json"
    if results.is_file():
        done = json.loads(results.read_text())
        if done.get("compare_settings") == [experiment, *overrides]:
            print(f"[{mode}] trained already: {results}")
            return done
        raise SystemExit(f"{results} was trained with {done.get('compare_settings')}, not {[experiment, *overrides]}; "
                         "use another --out, or delete that mode's folder to retrain it")
    overlay = [] if experiment == "default" else [f"experiment={experiment}"]
    cmd = [sys.executable, str(REPO / "train" / "distill.py"), f"drafter={mode}", *overlay,
           f"hydra.run.dir={out / mode}", "budget.train_s=1e9", f"data.cache_dir={out / 'data'}", "budget.data_s=1e9",
           "validate.num_prompts=0", *overrides]
    print(f"[{mode}] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)
    done = json.loads(results.read_text())
    done["compare_settings"] = [experiment, *overrides]  # what a rerun must match to reuse this mode
    results.write_text(json.dumps(done, indent=2) + "\n")
    return done


def bench_one(target, proposers: dict, num_draft: dict, layers: tuple, data: str, temperature: float, num_prompts: int,
              max_new_tokens: int, seed: int) -> dict:
    """Plain decoding and every proposer on the same prompts, interleaved; statistics per method."""
    from specdraft.decode.backend import build_backend
    from specdraft.decode.bench_setup import run_interleaved
    from specdraft.io.target import eos_ids
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.metrics import acceptance_stats, timing_stats
    from specdraft.decode.proposer import NoProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession
    from specdraft.io.data import chat_prompt_ids, load_prompts

    sampler = Sampler(temperature)
    prompts = load_prompts(data, None, num_prompts)
    encoded = [chat_prompt_ids(target.tokenizer, p["prompt"]) for p in prompts]
    stop = eos_ids(target)
    backend = build_backend(target.model)  # target.backend=auto: the fast twin where it runs exactly
    session = CausalSession(backend, layers)
    plain_session = CausalSession(backend)  # plain decoding gathers no hidden states

    def run(kind: str, index: int, ids: list[int]):
        generator = torch.Generator().manual_seed(seed + index)
        if kind == "plain":
            config = GenerateConfig(sampler, max_new_tokens, 0, stop)
            return speculative_generate(plain_session, ids, NoProposer(), config, generator=generator)
        config = GenerateConfig(sampler, max_new_tokens, num_draft[kind], stop)
        return speculative_generate(session, ids, proposers[kind], config, generator=generator)

    results = run_interleaved(["plain", *proposers], run, encoded)
    plain = timing_stats(results["plain"])
    table = {"plain": {"tokens_per_s": plain["tokens_per_s"]}}
    for kind in proposers:
        timing = timing_stats(results[kind])
        same = [g.output_ids == p.output_ids for g, p in zip(results[kind], results["plain"])]
        table[kind] = {**acceptance_stats(results[kind]), "tokens_per_s": timing["tokens_per_s"],
                       "speedup_vs_plain": timing["tokens_per_s"] / plain["tokens_per_s"],
                       "match_rate_vs_plain": sum(same) / len(same) if sampler.greedy else None}
    return {"data": data, "temperature": temperature, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "methods": table}


def markdown(benches: list[dict], modes: list[str]) -> str:
    lines = []
    for bench in benches:
        methods = bench["methods"]
        lines += [f"\n### {bench['data']}, T={bench['temperature']:g} ({bench['num_prompts']} prompts, "
                  f"{bench['max_new_tokens']} new tokens; plain {methods['plain']['tokens_per_s']:.2f} tok/s)\n",
                  "| mode | τ | acceptance by position | tok/s | speedup vs plain | match vs plain |",
                  "|---|---|---|---|---|---|"]
        for mode in modes:
            m = methods[mode]
            by_position = " ".join("-" if a is None else f"{a:.2f}" for a in m["acceptance_by_position"])
            match = "-" if m["match_rate_vs_plain"] is None else f"{m['match_rate_vs_plain']:.2f}"
            lines.append(f"| {mode} | {m['tau']:.3f} | {by_position} | {m['tokens_per_s']:.2f} | "
                         f"{m['speedup_vs_plain']:.3f} | {match} |")
        taus = {mode: methods[mode]["tau"] for mode in modes}
        first, *others = modes  # the first mode (dspark by default) against each of the others
        ratios = [f"τ({first})/τ({other}) = {taus[first] / taus[other]:.3f}" for other in others]
        if ratios:
            lines.append("\n" + "; ".join(ratios))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare")
    parser.add_argument("--experiment", default="cpu_full",
                        help="the distill overlay every mode trains with ('default': none, the no-argument settings)")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES,
                        help="drafter modes to train and compare; the table ends with tau of the first over each other")
    parser.add_argument("--standalone-draft", type=int, default=4, help="tokens the standalone drafter proposes per step")
    parser.add_argument("--data", nargs="+", default=["mtbench", "sharegpt_heldout"], choices=["mtbench", "sharegpt_heldout"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="target dtype of the speed benchmark (auto: bf16 where native)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="extra distill overrides, after --")
    args = parser.parse_args()
    out = args.out.resolve()
    trained = {mode: train_mode(mode, out, args.experiment, args.overrides) for mode in args.modes}

    from specdraft.decode.bench_setup import strip_generation_defaults
    from specdraft.decode.config import ProposerConfig
    from specdraft.decode.factory import make_proposer
    from specdraft.io.target import load_target
    from specdraft.models.registry import kind

    target = load_target(trained[args.modes[0]]["config"]["target"]["name_or_path"], args.dtype, args.threads)
    strip_generation_defaults(target.model)
    proposers, num_draft = {}, {}
    for mode in args.modes:
        # a standalone drafter is a plain HF model with the target's tokenizer, drafting autoregressively
        runs_with = kind(trained[mode]["config"]["drafter"]["mode"]).proposer  # model for standalone, else drafter
        proposers[mode], _ = make_proposer(ProposerConfig(name=runs_with, path=trained[mode]["export_path"]), target,
                                           trained[mode]["config"]["target"]["name_or_path"], "hf")
        num_draft[mode] = args.standalone_draft if runs_with == "model" else proposers[mode].max_draft
    feature_layers = {p.feature_layers for p in proposers.values() if p.feature_layers}
    if len(feature_layers) > 1:
        raise ValueError("the modes were trained on different target layers; one verify pass cannot serve them all")
    layers = next(iter(feature_layers), ())
    benches = []
    for data in args.data:
        for temperature in args.temperatures:
            path = out / "bench" / f"{data}-T{temperature:g}.json"
            settings = {"dtype": args.dtype, "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                        "seed": args.seed, "exports": {m: trained[m]["export_path"] for m in args.modes}}
            saved = json.loads(path.read_text()) if path.is_file() else None
            if saved and saved.get("settings") == settings and set(saved["methods"]) >= set(args.modes):
                benches.append(saved)
                continue
            print(f"benchmark: {data}, T={temperature:g}", flush=True)
            bench = bench_one(target, proposers, num_draft, layers, data, temperature, args.num_prompts, args.max_new_tokens,
                              args.seed)
            bench.update(settings=settings, train_steps={m: trained[m]["train_steps"] for m in args.modes})
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(bench, indent=2) + "\n")
            os.replace(path.with_suffix(".tmp"), path)
            benches.append(bench)
    text = f"# DSpark vs DFlash vs Eagle-3 ({args.dtype}, experiment={args.experiment})\n" + markdown(benches, args.modes)
    (out / "compare.md").write_text(text)
    (out / "compare.json").write_text(json.dumps(benches, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
