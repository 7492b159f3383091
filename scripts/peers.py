"""Peers side by side, one run, same prompts: HF `generate`, HF prompt lookup, HF assisted generation, our
plain / ngram / drafter / hybrid decoding, and llama.cpp on the same GGUF.

    python scripts/peers.py [--drafter EXPORT] [--data mtbench] [--categories coding extraction math]
                            [--num-prompts 20] [--spread] [--max-new-tokens 128] [--out docs/results/peers]

Per prompt, every Python method runs interleaved (order rotated; decode/bench.py's run_interleaved), so
each ratio comes from one stretch of time. The llama.cpp rows run its own binaries on the same chat-formatted
prompts after that: `llama-speculative-simple` with `--spec-type ngram-simple` at its longest n-gram, 1024 tokens,
which cannot recur in these contexts (plain decoding in the same binary and loop; `--spec-type none` refuses to
start: "failed to initialize speculative decoding"; the row fails if anything was drafted) and set to our lookup's
n-gram size and draft length (its prompt lookup), and `llama-bench` for its batched-forward curve at depth 300 (the cost of verifying k
tokens). They come from scripts/build_llama_cpp.sh's cache; where it is absent the rows say "not built"
(nothing here builds it). llama.cpp computes the Q4_1 GGUF with quantized dot products, so its tokens are
not the float32 target's: its rows report speed, not exactness.

Writes OUT/peers.json, OUT/peers.md and OUT/peers.png. "decode tok/s" is the speed after the first token
(prefill left out), "e2e tok/s" includes it; "vs plain" divides by our plain decoding's decode speed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

import torch  # noqa: E402

from specdraft.decode import llama_cpp  # noqa: E402

def python_methods(args, target, backend, stop: list[int], pad: int) -> tuple[dict, dict]:
    """name -> run(index, ids) for every Python method, and name -> how it was configured."""
    from specdraft.decode.bench_setup import hf_generate
    from specdraft.decode.config import ProposerConfig
    from specdraft.decode.factory import attach_calibration, make_proposer
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import NoProposer, load_model_proposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.scheduler import CostRule
    from specdraft.decode.session import CausalSession

    def proposer(name: str):  # the bench's factory, with the export's calibration where it has one
        made, _ = make_proposer(ProposerConfig(name=name, max_ngram=args.max_ngram, path=args.drafter,
                                               dtype=args.drafter_dtype, branches=args.branches), target, args.target)
        attach_calibration(made, args.drafter)
        return made

    sampler = Sampler(args.temperature)
    plain_session = CausalSession(backend)
    lookup = proposer("ngram")
    assistant, assistant_model = load_model_proposer(target.path, args.assistant_layers, target)
    for key, value in (("num_assistant_tokens", args.num_draft), ("num_assistant_tokens_schedule", "constant"),
                       ("assistant_confidence_threshold", 0.0)):
        setattr(assistant_model.generation_config, key, value)
    proposers = {"ours_ngram": (lookup, args.num_draft)}
    described = {"hf_generate": "transformers generate, greedy" if sampler.greedy else "transformers generate",
                 "hf_prompt_lookup": f"generate(prompt_lookup_num_tokens={args.num_draft}, max_matching_ngram_size={args.max_ngram})",
                 "hf_assisted": f"generate(assistant_model=the target's first {args.assistant_layers} layers, {args.num_draft} tokens)",
                 "ours_plain": "decode loop, no drafter, target.backend=auto",
                 "ours_ngram": f"prompt lookup (max_ngram={args.max_ngram}, {lookup.branches} first-position candidates "
                               f"at T=0), num_draft={args.num_draft}, scheduler={args.scheduler}",
                 "ours_assisted": f"the same assistant as hf_assisted in our loop, num_draft={args.num_draft}"}
    proposers["ours_assisted"] = (assistant, args.num_draft)
    profile = None
    if args.drafter:
        trained = proposer("drafter")
        proposers["ours_drafter"] = (trained, trained.max_draft)
        proposers["ours_hybrid"] = (proposer("hybrid"), args.num_draft)
        described["ours_drafter"] = (f"{args.drafter} (block {trained.max_draft}, {str(trained.drafter.embed_tokens.weight.dtype).replace('torch.', '')}, "
                                     f"{trained.branches} first-position candidates at T=0), scheduler={args.scheduler}")
        described["ours_hybrid"] = f"prompt lookup where it matches, else {args.drafter}, scheduler={args.scheduler}"
    if args.scheduler == "cost":
        from specdraft.decode.profile import load_or_measure
        from specdraft.decode.tree import side_rows

        # One profile for every method: the verify curve is the target's; the drafting curve the drafter's
        # (lookup is priced without it, decode/proposer.py), or the lookup's own where there is no drafter.
        pricing = proposers.get("ours_drafter", proposers["ours_ngram"])[0]
        # verify curves wide enough for the widest token tree a method drafts (greedy only)
        tree_rows = max(side_rows(made, sampler.greedy) for made, _ in proposers.values())
        profile, _, _ = load_or_measure(args.target, backend, pricing, args.drafter, max(n for _, n in proposers.values()),
                                        [1], 256, contexts=[64, 1024], tree_rows=tree_rows)
    sessions = {name: CausalSession(backend, proposer.feature_layers) for name, (proposer, _) in proposers.items()}

    def ours(name):
        proposer, num_draft = proposers[name]
        # The assistant has no confidences: fixed length. Lookup and drafters: the configured scheduler.
        rule = CostRule(profile) if profile is not None and name != "ours_assisted" else None

        def run(index, ids):
            generator = torch.Generator().manual_seed(args.seed + index)
            config = GenerateConfig(sampler, args.max_new_tokens, num_draft, stop, rule)
            return speculative_generate(sessions[name], ids, proposer, config, generator=generator)
        return run

    def seeded(fn):
        def run(index, ids):
            torch.manual_seed(args.seed + index)  # HF generate samples with the global generator
            return fn(ids)
        return run

    methods = {
        "hf_generate": seeded(lambda ids: hf_generate(target.model, ids, sampler, args.max_new_tokens, stop, pad)),
        "hf_prompt_lookup": seeded(lambda ids: hf_generate(target.model, ids, sampler, args.max_new_tokens, stop, pad,
                                                           prompt_lookup_num_tokens=args.num_draft,
                                                           max_matching_ngram_size=args.max_ngram)),
        "hf_assisted": seeded(lambda ids: hf_generate(target.model, ids, sampler, args.max_new_tokens, stop, pad,
                                                      assistant_model=assistant_model)),
        "ours_plain": lambda index, ids: speculative_generate(
            plain_session, ids, NoProposer(), GenerateConfig(sampler, args.max_new_tokens, 0, stop),
            generator=torch.Generator().manual_seed(args.seed + index)),
        **{name: ours(name) for name in proposers},
    }
    return methods, described


PLAIN_NGRAM = 1024  # llama.cpp's longest ngram-simple n-gram: recurs only in contexts of 2048+ tokens


def llama_rows(args, texts: list[str], bin_dir: Path | None) -> dict:
    """llama.cpp's plain and prompt-lookup decoding on the same prompts, and its batched-forward curve."""
    from specdraft.io.target import _gguf_file

    names = ("llama_cpp_plain", "llama_cpp_ngram")
    if bin_dir is None or args.target != "smollm2-135m-instruct":
        why = "not built (bash scripts/build_llama_cpp.sh)" if bin_dir is None else "only the embedded GGUF target"
        return {name: {"status": why} for name in names} | {"llama_cpp_curve": {"status": why}}
    gguf = str(_gguf_file(args.target))
    common = ["-m", gguf, "-n", str(args.max_new_tokens), "-t", str(torch.get_num_threads()), "--temp",
              str(args.temperature), "--seed", str(args.seed), "-c", "4096"]
    lookup = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.max_ngram),
              "--spec-ngram-simple-size-m", str(args.num_draft), "--spec-draft-n-max", str(args.num_draft)]
    rows = {}
    never = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(PLAIN_NGRAM),
             "--spec-ngram-simple-size-m", str(args.num_draft), "--spec-draft-n-max", str(args.num_draft)]
    for name, extra in (("llama_cpp_plain", never), ("llama_cpp_ngram", lookup)):
        try:
            runs = [llama_cpp.speculative_simple(bin_dir, [*common, *extra], text) for text in texts]
        except RuntimeError as error:
            rows[name] = {"status": str(error)}
            continue
        total = sum(runs, llama_cpp.SpeculativeRun())
        if name == "llama_cpp_plain" and total.drafted:
            rows[name] = {"status": f"not plain decoding: a {PLAIN_NGRAM}-token n-gram recurred and {total.drafted} "
                                    "tokens were drafted (contexts of 2048+ tokens)"}
            continue
        rows[name] = {"status": "ran", "decode_tokens_per_s": total.decoded / total.decode_s if total.decode_s else None,
                      "tokens_per_s": total.decoded / (total.decode_s + total.encode_s) if total.decode_s else None,
                      "prefill_s": total.encode_s / len(texts), "tokens": total.decoded, "drafted": total.drafted,
                      "accepted": total.accepted, "command": " ".join(["llama-speculative-simple", *common[2:], *extra])}
    # Batched forward at depth 300: the cost of verifying k tokens, relative to one.
    sizes = ",".join(str(k) for k in (1, 2, 4, 8, 16))
    proc = subprocess.run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(torch.get_num_threads()), "-d", "300",
                           "-p", sizes, "-n", "0", "-o", "json", "-r", "3"], capture_output=True, text=True, timeout=900)
    try:
        runs = json.loads(proc.stdout)
        curve = {str(r["n_prompt"]): 1000 * r["n_prompt"] / r["avg_ts"] for r in runs}
        rows["llama_cpp_curve"] = {"status": "ran", "depth": 300, "ms_by_tokens": curve,
                                   "ratio_to_one": {k: v / curve["1"] for k, v in curve.items()}}
    except (ValueError, KeyError, TypeError):
        rows["llama_cpp_curve"] = {"status": f"llama-bench failed: {(proc.stdout + proc.stderr)[-400:]}"}
    return rows


def summarize(results: dict, reference: str = "hf_generate") -> dict:
    from specdraft.decode.metrics import acceptance_stats, timing_stats

    plain = timing_stats(results["ours_plain"])
    plain_decode = 1 / plain["tpot_s"]
    rows = {}
    for name, gens in results.items():
        timing, accept = timing_stats(gens), acceptance_stats(gens)
        decode = 1 / timing["tpot_s"] if timing["tpot_s"] else None
        rows[name] = {"status": "ran", "tokens_per_s": timing["tokens_per_s"], "decode_tokens_per_s": decode,
                      "decode_vs_plain": decode / plain_decode if decode else None,
                      "e2e_vs_plain": timing["tokens_per_s"] / plain["tokens_per_s"],
                      "tau": accept["tau"] if name.startswith("ours_") else None,
                      "ttft_s": timing["ttft_s"] if name.startswith("ours_") else None,
                      "equal_to_hf_generate": all(g.output_ids == r.output_ids for g, r in zip(gens, results[reference]))
                      if reference == "hf_generate" else None,
                      "equal_to_plain": all(g.output_ids == p.output_ids for g, p in zip(gens, results["ours_plain"]))}
    return rows


def markdown(summary: dict) -> str:
    lines = [f"# Peers, {summary['settings']['data']} {summary['settings']['categories'] or ''}, "
             f"{summary['settings']['num_prompts']} prompts x {summary['settings']['max_new_tokens']} tokens, "
             f"T={summary['settings']['temperature']}, {summary['machine']}",
             "", "| method | decode tok/s | vs plain | e2e tok/s | vs plain | τ | tokens = HF generate |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda v, p=2: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    for name, row in summary["rows"].items():
        if name == "llama_cpp_curve":
            continue
        if row["status"] != "ran":
            lines.append(f"| {name} | {row['status']} | | | | | |")
            continue
        plain = summary["rows"]["ours_plain"]
        lines.append(f"| {name} | {fmt(row['decode_tokens_per_s'], 1)} | "
                     f"{fmt(row.get('decode_vs_plain') or row['decode_tokens_per_s'] / plain['decode_tokens_per_s'])} | "
                     f"{fmt(row['tokens_per_s'], 1)} | {fmt(row.get('e2e_vs_plain') or row['tokens_per_s'] / plain['tokens_per_s'])} | "
                     f"{fmt(row.get('tau'))} | {fmt(row.get('equal_to_hf_generate'))} |")
    curve = summary["rows"].get("llama_cpp_curve", {})
    if curve.get("status") == "ran":
        ratios = " / ".join(f"{v:.2f}" for v in curve["ratio_to_one"].values())
        lines += ["", f"llama.cpp batched forward at depth 300, {' / '.join(curve['ms_by_tokens'])} tokens, "
                      f"ratio to one token: {ratios}"]
    lines += ["", "Methods:"] + [f"- {k}: {v}" for k, v in summary["methods"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: v for k, v in summary["rows"].items() if v.get("status") == "ran" and "decode_tokens_per_s" in v}
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(list(rows), [v["decode_tokens_per_s"] for v in rows.values()], color="tab:blue")
    ax.set_xlabel("decode tokens/s (after the first token)")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{summary['settings']['num_prompts']} prompts x {summary['settings']['max_new_tokens']} tokens, "
                 f"T={summary['settings']['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from specdraft.decode.factory import DRAFTER_DTYPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="an export folder (adds our drafter and hybrid rows)")
    parser.add_argument("--drafter-dtype", default="auto", choices=DRAFTER_DTYPES,
                        help="proposer.dtype: the drafter's dtype (auto: bfloat16 where native, else the target's)")
    parser.add_argument("--data", default="mtbench", help="mtbench | sharegpt_heldout | jsonl (with --data-path)")
    parser.add_argument("--data-path", default=None)
    parser.add_argument("--categories", nargs="*", default=None)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--spread", action="store_true",
                        help="the N prompts evenly spaced over the source (every chosen MT-bench category), not the first N")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--branches", type=int, default=None,
                        help="proposer.branches for our lookup, drafter and hybrid (default: each proposer's; 1: chains)")
    parser.add_argument("--assistant-layers", type=int, default=4)
    parser.add_argument("--scheduler", choices=["fixed", "cost"], default="cost")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="*", default=None,
                        help="run only these Python methods (ours_plain always runs: every ratio is to it), e.g. "
                             "ours_ngram ours_drafter ours_hybrid for a hybrid against its parts in one run")
    parser.add_argument("--out", type=Path, default=Path("peers"))
    args = parser.parse_args(argv)

    from specdraft.decode.backend import build_backend
    from specdraft.decode.bench_setup import run_interleaved, strip_generation_defaults
    from specdraft.io.target import eos_ids
    from specdraft.io.data import chat_prompt_ids, load_prompts
    from specdraft.io.hardware import cpu_model
    from specdraft.io.target import load_target

    target = load_target(args.target, "float32")
    strip_generation_defaults(target.model)
    backend = build_backend(target.model)
    stop = eos_ids(target)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop[0]
    prompts = load_prompts(args.data, args.data_path, args.num_prompts, categories=args.categories, spread=args.spread)
    encoded = [chat_prompt_ids(target.tokenizer, p["prompt"]) for p in prompts]
    methods, described = python_methods(args, target, backend, stop, pad)
    if args.methods is not None:
        unknown = sorted(set(args.methods) - set(methods))
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(methods)}")
        methods = {k: v for k, v in methods.items() if k in args.methods or k == "ours_plain"}
        described = {k: v for k, v in described.items() if k in methods}
    results = run_interleaved(list(methods), lambda kind, index, ids: methods[kind](index, ids), encoded)
    rows = summarize(results, "hf_generate" if "hf_generate" in results else "ours_plain")
    texts = [target.tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                                  tokenize=False) for p in prompts]
    rows.update(llama_rows(args, texts, llama_cpp.bin_dir()))
    described["llama_cpp_plain"] = (f"llama-speculative-simple on the Q4_1 GGUF, ngram-simple with a {PLAIN_NGRAM}-token "
                                     "n-gram (never matches here: plain decoding, 0 drafted)")
    described["llama_cpp_ngram"] = (f"llama-speculative-simple --spec-type ngram-simple, n-gram {args.max_ngram}, "
                                    f"{args.num_draft} drafted tokens")
    summary = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "machine": f"{cpu_model()}, {torch.get_num_threads()} threads", "methods": described, "rows": rows,
               "target_backend": backend.describe()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "peers.md").write_text(markdown(summary))
    plot(summary, args.out / "peers.png")
    print(markdown(summary))
    print(f"wrote {args.out / 'peers.json'}, peers.md and peers.png")


if __name__ == "__main__":
    main()
