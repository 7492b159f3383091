"""Benchmark and validation entry point: `python decode/bench.py [key=value ...]`.

Per prompt, interleaved so every ratio comes from one run: plain decoding with our loop, speculative
decoding, HF `generate`, and HF's own speculative baseline (prompt lookup for proposer=ngram,
assisted generation for proposer=model). Writes OUT/results.json and OUT/samples.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, Python puts decode/ first on sys.path; put the repository root there instead so
# `decode` and `train` import as packages (and decode/*.py cannot shadow top-level modules).
sys.path[0] = str(Path(__file__).resolve().parents[1])

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tqdm import tqdm  # noqa: E402

from decode.backend import build_backend  # noqa: E402
from decode.config import PROPOSERS, BenchConfig, register_configs  # noqa: E402
from decode.fast_drafter import drafter_for_backend  # noqa: E402
from decode.generate import Generation, speculative_generate  # noqa: E402
from decode.metrics import acceptance_stats, timing_stats  # noqa: E402
from decode.proposer import (BlockDrafterProposer, Eagle3Proposer, HybridProposer, NgramProposer, NoProposer,  # noqa: E402
                             load_model_proposer)
from decode.sampling import Sampler  # noqa: E402
from decode.scheduler import build_scheduler  # noqa: E402
from decode.session import CausalSession  # noqa: E402
from train.data import chat_prompt_ids, load_prompts  # noqa: E402
from train.export import load_drafter  # noqa: E402
from train.target import load_target  # noqa: E402


BENCH_MODES = ("single", "sweep", "load", "calibrate")


def build_proposer(cfg: BenchConfig, target):
    """The configured proposer, the name of the matching HF baseline and its `generate` kwargs."""
    name = cfg.proposer.name
    if name == "ngram":
        proposer = NgramProposer(cfg.proposer.max_ngram, cfg.proposer.min_ngram, share_stats=cfg.proposer.share_stats)
        # HF's lookup takes the leftmost match and has no minimum size; ours takes the most recent one.
        hf = {"prompt_lookup_num_tokens": cfg.decode.num_draft, "max_matching_ngram_size": cfg.proposer.max_ngram}
        return proposer, "hf_prompt_lookup", hf
    if name == "model":
        proposer, drafter = load_model_proposer(cfg.proposer.path or target.path, cfg.proposer.num_layers, target)
        # Like for like: a constant number of assistant tokens and HF's confidence-based early stop off.
        drafter.generation_config.num_assistant_tokens = cfg.decode.num_draft
        drafter.generation_config.num_assistant_tokens_schedule = "constant"
        drafter.generation_config.assistant_confidence_threshold = 0.0
        return proposer, "hf_assisted", {"assistant_model": drafter}
    if name in ("drafter", "hybrid"):
        if not cfg.proposer.path:
            raise ValueError(f"proposer={name} needs proposer.path=EXPORT (the export folder of a distill run)")
        drafter, feature_layers = load_drafter(cfg.proposer.path, target.model, cfg.target.name_or_path)
        drafter = drafter_for_backend(drafter, cfg.target.backend)  # its matmuls on the target's kernels
        kind = Eagle3Proposer if drafter.mode == "eagle3" else BlockDrafterProposer
        proposer = kind(drafter, feature_layers)
        if name == "hybrid":  # prompt lookup where it matches, the drafter elsewhere
            lookup = NgramProposer(cfg.proposer.max_ngram, cfg.proposer.min_ngram, share_stats=cfg.proposer.share_stats)
            proposer = HybridProposer(lookup, proposer)
        return proposer, None, {}  # HF has no block-drafter / Eagle-3 baseline
    raise ValueError(f"unknown proposer {name!r}; choose one of {list(PROPOSERS)}")


GENERATE_ONLY_KWARGS = ("assistant_model",)  # generate() arguments that are not GenerationConfig fields


def hf_generate(model, prompt_ids: list[int], sampler: Sampler, max_new_tokens: int, eos: list[int], pad: int, **extra) -> Generation:
    """HF `generate` for one prompt, timed, as a Generation (no per-step statistics)."""
    from transformers import GenerationConfig

    settings = {k: v for k, v in extra.items() if k not in GENERATE_ONLY_KWARGS}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampler.hf_generate_kwargs(), **settings
    )
    input_ids = torch.tensor([prompt_ids], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            **{k: v for k, v in extra.items() if k in GENERATE_ONLY_KWARGS},
        )
    seconds = time.perf_counter() - start
    return Generation(output_ids=out[0, len(prompt_ids) :].tolist(), total_s=seconds)


def strip_generation_defaults(model) -> None:
    """Leave only bos/eos/pad in the model's generation config.

    `generate` fills every unset field from it, so a checkpoint's own repetition penalty, top-k or
    min-p would reach HF's runs but not ours; the comparison must sample from one distribution.
    """
    from transformers import GenerationConfig

    old = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=old.bos_token_id, eos_token_id=old.eos_token_id, pad_token_id=old.pad_token_id
    )


def eos_ids(target) -> list[int]:
    """The target's stop tokens, from its generation config (an int or a list)."""
    eos = target.model.generation_config.eos_token_id
    if eos is None:
        eos = target.tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


@dataclass
class BenchSetup:
    """What every bench mode shares: target, proposer, prompts and decoding settings."""

    cfg: BenchConfig
    sampler: Sampler
    target: object
    backend: object  # computes the target's forward for our loops (decode/backend.py); HF baselines use target.model
    proposer: object
    baseline_name: str | None
    baseline_kwargs: dict
    prompts: list[dict]
    encoded: list[list[int]]
    stop: list[int]
    pad: int
    calibration: str | None

    def profile(self):
        """The cost profile the cost/load schedulers plan with (measured once, cached)."""
        from decode.profile import CostProfile, load_or_measure

        cfg = self.cfg
        if cfg.scheduler.profile:
            return CostProfile(**json.loads(Path(cfg.scheduler.profile).read_text())), cfg.scheduler.profile, False
        block = self.proposer.max_draft or cfg.decode.num_draft
        sizes = sorted(set(cfg.bench.concurrency) | {1})
        return load_or_measure(cfg.target.name_or_path, self.backend, self.proposer, cfg.proposer.path, block,
                               sizes, cfg.scheduler.profile_context, contexts=cfg.scheduler.profile_contexts)


def setup_bench(cfg: BenchConfig, sampler: Sampler | None = None) -> BenchSetup:
    sampler = sampler or Sampler(cfg.decode.temperature, cfg.decode.top_k, cfg.decode.top_p)
    prompts = load_prompts(cfg.data.name, cfg.data.path, cfg.bench.num_prompts, cfg.bench.first_prompt, cfg.data.categories)
    if not prompts:
        raise ValueError(f"no prompts: data={cfg.data.name} from index {cfg.bench.first_prompt} is empty")
    target = load_target(cfg.target.name_or_path, cfg.target.dtype, cfg.target.threads, cfg.target.device)
    backend = build_backend(target.model, cfg.target.backend)
    proposer, baseline_name, baseline_kwargs = build_proposer(cfg, target)
    calibration = attach_calibration(cfg, proposer)
    strip_generation_defaults(target.model)
    stop = eos_ids(target)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop[0]
    window = getattr(target.model.config, "max_position_embeddings", None)
    encoded = []
    for item in prompts:
        ids = chat_prompt_ids(target.tokenizer, item["prompt"])
        # The newest token is never fed, so a sequence of prompt + max_new_tokens - 1 positions must fit.
        if window and len(ids) + cfg.decode.max_new_tokens - 1 > window:
            raise ValueError(
                f"prompt {item['id']!r} has {len(ids)} tokens; with decode.max_new_tokens={cfg.decode.max_new_tokens} "
                f"it exceeds the target's context of {window} tokens; drop it or lower decode.max_new_tokens"
            )
        encoded.append(ids)
    return BenchSetup(cfg, sampler, target, backend, proposer, baseline_name, baseline_kwargs, prompts, encoded, stop,
                      pad, calibration)


def attach_calibration(cfg: BenchConfig, proposer) -> str | None:
    """Give a block drafter its stored confidence temperatures (bench.calibration); returns the file used."""
    from decode.calibrate import CALIBRATION_FILE, read_calibration

    block_drafter = isinstance(getattr(proposer, "trained", proposer), BlockDrafterProposer)  # a hybrid's drafter part too
    if not block_drafter or cfg.bench.calibration == "none" or cfg.bench.mode == "calibrate":
        return None
    if cfg.bench.calibration == "auto":
        path = Path(cfg.proposer.path) / CALIBRATION_FILE
    else:
        path = Path(cfg.bench.calibration)
        if not path.is_file():
            raise FileNotFoundError(f"bench.calibration={path} does not exist; use auto, none or a calibration.json")
    calibration = read_calibration(path)
    for bucket, temperatures in (calibration or {}).items():
        if len(temperatures) < getattr(proposer, "trained", proposer).max_draft:
            raise ValueError(f"{path} holds {len(temperatures)} {bucket} temperatures but this drafter drafts "
                             f"{getattr(proposer, 'trained', proposer).max_draft} positions: it was made for another export; "
                             "rerun bench.mode=calibrate")
    proposer.calibration = calibration
    return str(path) if calibration else None


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark described by `cfg` (bench.mode); write results.json (and more) under cfg.out_dir."""
    if cfg.bench.mode not in BENCH_MODES:
        raise ValueError(f"bench.mode={cfg.bench.mode!r}; choose one of {list(BENCH_MODES)}")
    bench = setup_bench(cfg)
    if cfg.bench.mode != "single":
        from decode import bench_modes

        return getattr(bench_modes, f"run_{cfg.bench.mode}")(bench)
    cfg, sampler, target, proposer = bench.cfg, bench.sampler, bench.target, bench.proposer
    profile_info = None
    profile = None
    if cfg.scheduler.name in ("cost", "load"):
        profile, profile_path, measured = bench.profile()
        profile_info = {"path": str(profile_path), "measured_now": measured}
    scheduler = build_scheduler(cfg.scheduler.name, cfg.scheduler.threshold, profile, cfg.scheduler.max_skip)
    session = CausalSession(bench.backend, proposer.feature_layers)
    plain_session = CausalSession(bench.backend)  # plain decoding gathers no hidden states: its real cost
    stop, pad, encoded = bench.stop, bench.pad, bench.encoded

    def run(kind: str, index: int, ids: list[int]) -> Generation:
        seed = cfg.bench.seed + index
        generator = torch.Generator(device=target.model.device).manual_seed(seed)
        torch.manual_seed(seed)  # HF generate samples with the global generator
        common = (sampler, cfg.decode.max_new_tokens)
        if kind == "plain":
            return speculative_generate(plain_session, ids, NoProposer(), *common, 0, stop, generator=generator)
        if kind == "spec" and cfg.scheduler.name == "load":  # the batched engine, one request at a time
            from decode.batch_generate import LoadPolicy, Request, batched_generate

            request = Request(ids, cfg.decode.max_new_tokens, generator)
            return batched_generate(bench.backend, [request], proposer, sampler, cfg.decode.num_draft, stop, None,
                                    LoadPolicy(profile, scheduler), 1, pad)[0]
        if kind == "spec":
            return speculative_generate(session, ids, proposer, *common, cfg.decode.num_draft, stop, scheduler, generator)
        if kind == "hf_generate":
            return hf_generate(target.model, ids, *common, stop, pad)
        return hf_generate(target.model, ids, *common, stop, pad, **bench.baseline_kwargs)

    kinds = ["plain", "spec"] + (["hf_generate"] if cfg.bench.baselines else [])
    kinds += [bench.baseline_name] if cfg.bench.baselines and bench.baseline_name else []
    results = run_interleaved(kinds, run, encoded, cfg.bench.repeats)
    summary = summarize(cfg, sampler, target, results, bench.baseline_name)
    summary.update(target_report(bench))
    summary["calibration"] = bench.calibration
    summary["profile"] = profile_info
    summary.update(repeat_report(cfg, results))
    write_outputs(Path(cfg.out_dir), summary, bench.prompts, encoded, results["spec"], target.tokenizer)
    return summary


def target_report(bench: BenchSetup) -> dict:
    """What results.json records of how the target ran: its dtype (and why) and its backend."""
    return {"target_dtype": {"dtype": str(bench.target.dtype).replace("torch.", ""), "requested": bench.cfg.target.dtype,
                             "reason": bench.target.dtype_reason},
            "target_backend": {"requested": bench.cfg.target.backend, **bench.backend.describe()}}


def run_interleaved(kinds: list[str], run, encoded: list[list[int]], repeats: int = 1) -> dict[str, list[Generation]]:
    """Every method on every prompt, `run(kind, index, ids)`, after one warm-up call of each; the order
    rotates per prompt and per round so no method always runs first (cache and CPU frequency effects).
    With repeats > 1 each prompt runs every method `repeats` times and keeps its fastest run (`fastest`)."""
    if repeats < 1:
        raise ValueError(f"bench.repeats={repeats}; it must be >= 1 (runs of every method per prompt)")
    for kind in kinds:  # warm-up: first-call allocations and lazy inits stay out of the timings
        run(kind, 0, encoded[0][:16])
    results: dict[str, list[Generation]] = {kind: [] for kind in kinds}
    for index, ids in enumerate(tqdm(encoded, desc="prompts", mininterval=5)):
        runs: dict[str, list[Generation]] = {kind: [] for kind in kinds}
        for round_ in range(repeats):
            shift = (index + round_) % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                runs[kind].append(run(kind, index, ids))
        for kind in kinds:
            results[kind].append(fastest(runs[kind]))
    return results


def fastest(runs: list[Generation]) -> Generation:
    """One prompt's repeated runs of one method as one Generation: the run with the shortest total time,
    whole (its prefill and decoding together, so methods without a separate prefill time, like HF
    `generate`, are picked by the same rule), with the first run's tokens and step statistics. Every run
    uses the prompt's seed, so the runs do the same work, and other processes on the machine can only add
    time to a run: the fastest is the least noisy estimate (timeit's rule). `repeats_differ` counts runs
    whose tokens differed from the first (nondeterministic kernels)."""
    first, best = runs[0], min(runs, key=lambda g: g.total_s)
    return replace(first, ttft_s=best.ttft_s, total_s=best.total_s,
                   repeats_differ=sum(g.output_ids != first.output_ids for g in runs[1:]))


def repeat_report(cfg: BenchConfig, results: dict[str, list[Generation]]) -> dict:
    """How the timings were taken (results.json): runs per prompt and method, and how many repeated runs
    produced other tokens than the first (0 expected: the seeds repeat)."""
    return {"repeats": cfg.bench.repeats,
            "repeats_differ": sum(g.repeats_differ for gens in results.values() for g in gens)}


def summarize(cfg: BenchConfig, sampler: Sampler, target, results: dict, baseline_name: str) -> dict:
    """results.json: acceptance, throughput ratios from this run, losslessness and the resolved config."""
    spec, plain = timing_stats(results["spec"]), timing_stats(results["plain"])
    summary = {**acceptance_stats(results["spec"])}
    summary.update(
        tokens_per_s=spec["tokens_per_s"],
        plain_tokens_per_s=plain["tokens_per_s"],
        speedup_vs_plain=spec["tokens_per_s"] / plain["tokens_per_s"],
        # after the first token: speculation shortens the time per token, not the prefill
        decode_speedup_vs_plain=plain["tpot_s"] / spec["tpot_s"] if spec["tpot_s"] and plain["tpot_s"] else None,
        ttft_s=spec["ttft_s"],
        tpot_s=spec["tpot_s"],
        plain_tpot_s=plain["tpot_s"],
        generated_tokens=spec["tokens"],
        num_prompts=len(results["spec"]),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    # Exactness: compare with target-only decoding (HF generate; our plain loop when baselines are off)
    # in the same dtype; only meaningful at T=0.
    summary["exactness_reference"] = "hf_generate" if "hf_generate" in results else "plain_loop"
    reference = results.get("hf_generate") or results["plain"]
    same = [s.output_ids == r.output_ids for s, r in zip(results["spec"], reference)]
    greedy = sampler.greedy
    summary["match_rate"] = sum(same) / len(same) if greedy else None
    summary["lossless"] = all(same) if greedy and target.dtype == torch.float32 else None
    summary["plain_match_rate"] = (
        sum(p.output_ids == r.output_ids for p, r in zip(results["plain"], reference)) / len(same) if greedy else None
    )
    summary["hf_generate_tokens_per_s"] = None
    if "hf_generate" in results:
        hf = timing_stats(results["hf_generate"])["tokens_per_s"]
        summary.update(hf_generate_tokens_per_s=hf, plain_vs_hf_generate=plain["tokens_per_s"] / hf)
    if baseline_name in results:
        base = timing_stats(results[baseline_name])["tokens_per_s"]
        summary.update(
            hf_baseline=baseline_name,
            hf_baseline_tokens_per_s=base,
            hf_baseline_speedup_vs_hf_generate=base / summary["hf_generate_tokens_per_s"],
            speedup_vs_hf_baseline=spec["tokens_per_s"] / base,
        )
    summary["config"] = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return summary


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(out_dir: Path, summary: dict, prompts, encoded, generations, tokenizer) -> None:
    """results.json and samples.jsonl, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(out_dir / "results.json", json.dumps(summary, indent=2) + "\n")
    lines = [
        json.dumps(
            {
                "id": item["id"],
                "prompt": item["prompt"],
                "prompt_token_ids": ids,
                "output_token_ids": gen.output_ids,
                "output_text": tokenizer.decode(gen.output_ids, skip_special_tokens=True),
            }
        )
        for item, ids, gen in zip(prompts, encoded, generations)
    ]
    _atomic_write(out_dir / "samples.jsonl", "\n".join(lines) + "\n")


def format_table(summary: dict) -> str:
    """A readable summary for stdout."""
    def fmt(value):
        if isinstance(value, float):
            return f"{value:.3f}"
        return str(value)

    keys = [
        "num_prompts", "tau", "mean_draft_len", "fallbacks", "tokens_per_s", "plain_tokens_per_s", "speedup_vs_plain",
        "decode_speedup_vs_plain",
        "hf_generate_tokens_per_s", "plain_vs_hf_generate", "hf_baseline", "hf_baseline_tokens_per_s",
        "speedup_vs_hf_baseline", "ttft_s", "tpot_s", "peak_rss_mb", "match_rate", "plain_match_rate", "lossless",
    ]
    rows = [f"  {key:<28} {fmt(summary.get(key))}" for key in keys if key in summary]
    by_position = " ".join("-" if a is None else f"{a:.2f}" for a in summary["acceptance_by_position"])
    rows.append(f"  {'acceptance_by_position':<28} {by_position}")
    return "\n".join(rows)


register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="bench")
def main(config) -> None:
    cfg: BenchConfig = OmegaConf.to_object(config)
    summary = run_bench(cfg)
    dtype, backend = summary["target_dtype"]["dtype"], summary["target_backend"]["name"]
    if cfg.bench.mode != "single":
        print(f"\nspecdraft bench — mode {cfg.bench.mode}, {cfg.proposer.name} on {cfg.data.name}, {dtype}, {backend} backend")
        print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
        print(f"  results: {Path(cfg.out_dir) / 'results.json'}")
        return
    print(f"\nspecdraft bench — {cfg.proposer.name} on {cfg.data.name}, {dtype}, {backend} backend, T={cfg.decode.temperature}")
    print(format_table(summary))
    print(f"  results: {Path(cfg.out_dir) / 'results.json'}")


if __name__ == "__main__":
    main()
