"""Benchmark and validation entry point: `python decode/bench.py [key=value ...]`.

Per prompt, interleaved so every ratio comes from one run: plain decoding with our loop, speculative
decoding, HF `generate`, and HF's own speculative baseline (prompt lookup for proposer=ngram,
assisted generation for proposer=model). Writes OUT/results.json and OUT/samples.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run as a file: import the package, not this folder's modules (profile.py!) as top-level names

import json  # noqa: E402
import resource  # noqa: E402

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from specdraft import conf_dir  # noqa: E402
from specdraft.decode.bench_setup import (atomic_write, hf_generate, memory_report, repeat_report, run_interleaved,  # noqa: E402
                                          setup_bench, target_report)
from specdraft.decode.config import BenchConfig, register_configs  # noqa: E402
from specdraft.decode.decoder import SpecDecoder  # noqa: E402
from specdraft.decode.generate import Generation  # noqa: E402
from specdraft.decode.metrics import acceptance_stats, timing_stats  # noqa: E402
from specdraft.decode.proposer import NoProposer  # noqa: E402
from specdraft.decode.sampling import Sampler  # noqa: E402
from specdraft.decode.scheduler import build_scheduler  # noqa: E402


BENCH_MODES = ("single", "sweep", "load", "calibrate", "check")


def run_bench(cfg: BenchConfig) -> dict:
    """Run the benchmark described by `cfg` (bench.mode); write results.json (and more) under cfg.out_dir."""
    if cfg.bench.mode not in BENCH_MODES:
        raise ValueError(f"bench.mode={cfg.bench.mode!r}; choose one of {list(BENCH_MODES)}")
    bench = setup_bench(cfg)
    if cfg.bench.mode != "single":
        from specdraft.decode import bench_modes

        return getattr(bench_modes, f"run_{cfg.bench.mode}")(bench)
    cfg, sampler, target, proposer = bench.cfg, bench.sampler, bench.target, bench.proposer
    profile_info = None
    profile = None
    if cfg.scheduler.name in ("cost", "load"):
        profile, profile_path, measured = bench.profile()
        profile_info = {"path": str(profile_path), "measured_now": measured}
    scheduler = build_scheduler(cfg.scheduler.name, cfg.scheduler.threshold, profile, cfg.scheduler.max_skip)
    # The library's decoder (decode/decoder.py), one per method on the shared backend; plain decoding gathers no
    # hidden states: its real cost.
    spec = SpecDecoder(target, proposer, scheduler, cfg.decode.num_draft, bench.backend)
    plain = SpecDecoder(target, NoProposer(), None, 0, bench.backend)
    stop, pad, encoded = bench.stop, bench.pad, bench.encoded

    def run(kind: str, index: int, ids: list[int]) -> Generation:
        seed = cfg.bench.seed + index
        generator = torch.Generator(device=target.model.device).manual_seed(seed)
        torch.manual_seed(seed)  # HF generate samples with the global generator
        common = (sampler, cfg.decode.max_new_tokens)
        if kind == "plain":
            return plain.run(ids, *common, generator)
        if kind == "spec" and cfg.scheduler.name == "load":  # the batched engine, one request at a time
            from specdraft.decode.batch_generate import LoadPolicy, Request, batched_generate

            request = Request(ids, cfg.decode.max_new_tokens, generator)
            return batched_generate(bench.backend, [request], proposer, sampler, cfg.decode.num_draft, stop, None,
                                    LoadPolicy(profile, scheduler), 1, pad)[0]
        if kind == "spec":
            return spec.run(ids, *common, generator)
        if kind == "hf_generate":
            return hf_generate(target.model, ids, *common, stop, pad)
        return hf_generate(target.model, ids, *common, stop, pad, **bench.baseline_kwargs)

    kinds = ["plain", "spec"] + (["hf_generate"] if cfg.bench.baselines else [])
    kinds += [bench.baseline_name] if cfg.bench.baselines and bench.baseline_name else []
    results = run_interleaved(kinds, run, encoded, cfg.bench.repeats)
    summary = summarize(cfg, sampler, target, results, bench.baseline_name)
    summary.update(target_report(bench))
    summary["memory_bytes"] = memory_report(bench)
    summary["calibration"] = bench.calibration
    summary["profile"] = profile_info
    summary.update(repeat_report(cfg, results))
    write_outputs(Path(cfg.out_dir), summary, bench.prompts, encoded, results["spec"], target.tokenizer)
    return summary


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


def write_outputs(out_dir: Path, summary: dict, prompts, encoded, generations, tokenizer) -> None:
    """results.json and samples.jsonl, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "results.json", json.dumps(summary, indent=2) + "\n")
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
    atomic_write(out_dir / "samples.jsonl", "\n".join(lines) + "\n")


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


@hydra.main(version_base=None, config_path=conf_dir(), config_name="bench")
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
