"""The bench's other modes: `bench.mode=sweep | load | calibrate` (see decode/bench.py for `single`).

sweep: per prompt, interleaved, plain decoding and speculative decoding at every fixed verify length,
every threshold and the cost scheduler: tokens/s, τ and speedup per setting, the best fixed length, and
the ceiling an oracle schedule would reach on the fixed lengths' steps (decode/oracle.py); OUT/runs.jsonl
keeps every prompt's runs, which scripts/pool_sweeps.py pools over several sweeps (decode/sweep_runs.py).
load: closed-loop load at each concurrency C (C requests in flight, the next joins when one leaves):
plain, fixed-length and load-scheduled batched decoding; per-request and total tokens/s, and a PNG.
calibrate: held-out decoding at each temperature bucket; fits the confidence maps, stores
them with the export, reports ECE/Brier/AUROC before and after, and draws a reliability diagram.
check: an export loaded as a serving engine loads it, decoded greedily with every position verified, its tau
held to what training measured on held-out data (the "fine in validation, tau near 1 when served" failure).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.decode.batch_generate import LoadPolicy, Request, batched_generate
from specdraft.decode.bench_setup import atomic_write, repeat_report, run_interleaved, target_report
from specdraft.decode.decoder import SpecDecoder
from specdraft.decode.metrics import acceptance_stats, paired_speed_interval, timing_stats
from specdraft.decode.oracle import oracle_ceiling
from specdraft.decode.proposer import NoProposer, gives_confidence
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, FixedRule, LoadRule, ThresholdRule
from specdraft.decode.sweep_runs import fixed_setting, fixed_settings, write_runs


def _config(bench) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(bench.cfg), resolve=True)


def _write(bench, name: str, summary: dict) -> dict:
    summary.update(target_report(bench))
    out = Path(bench.cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / name, json.dumps(summary, indent=2) + "\n")
    return summary


def run_sweep(bench) -> dict:
    """Fixed lengths, thresholds and the cost scheduler on the same prompts, interleaved."""
    cfg, sampler, proposer = bench.cfg, bench.sampler, bench.proposer
    block = proposer.max_draft or cfg.decode.num_draft
    lengths = cfg.bench.sweep_lengths or list(range(1, block + 1))
    rules = {fixed_setting(k): (k, FixedRule()) for k in lengths}
    has_confidence = gives_confidence(proposer)
    profile_info = None
    if has_confidence:
        rules.update({f"threshold_{t:g}": (block, ThresholdRule(t)) for t in cfg.bench.sweep_thresholds})
        profile, path, measured = bench.profile()
        rules["cost"] = (block, CostRule(profile, max_skip=cfg.scheduler.max_skip))
        profile_info = {"path": str(path), "measured_now": measured}
    # one decoder per setting on the shared backend (decode/decoder.py); plain gathers no hidden states
    decoders = {kind: SpecDecoder(bench.target, proposer, rule, num_draft, bench.backend)
                for kind, (num_draft, rule) in rules.items()}
    decoders["plain"] = SpecDecoder(bench.target, NoProposer(), None, 0, bench.backend)

    def run(kind, index, ids):
        generator = torch.Generator(device=bench.target.model.device).manual_seed(cfg.bench.seed + index)
        return decoders[kind].run(ids, sampler, cfg.decode.max_new_tokens, generator)

    results = run_interleaved(["plain", *rules], run, bench.encoded, cfg.bench.repeats)
    plain, plain_tpot = (timing_stats(results["plain"])[k] for k in ("tokens_per_s", "tpot_s"))
    rows = {}
    for kind in rules:
        stats, timing = acceptance_stats(results[kind]), timing_stats(results[kind])
        rows[kind] = {"tau": stats["tau"], "mean_draft_len": stats["mean_draft_len"], "tokens_per_s": timing["tokens_per_s"],
                      "speedup_vs_plain": timing["tokens_per_s"] / plain,
                      # after the first token: prefill (identical for every setting) left out
                      "decode_tokens_per_s": 1 / timing["tpot_s"] if timing["tpot_s"] else None,
                      "decode_speedup_vs_plain": plain_tpot / timing["tpot_s"] if timing["tpot_s"] else None,
                      # T=0: every output equal to plain decoding's (which single mode holds equal to HF generate's)
                      "equal_to_plain": all(g.output_ids == p.output_ids for g, p in zip(results[kind], results["plain"]))
                      if sampler.greedy else None}
    fixed = {k: rows[k] for k in fixed_settings(rows)}
    best_fixed = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    summary = {"mode": "sweep", "plain_tokens_per_s": plain, "settings": rows, "best_fixed": best_fixed,
               "num_prompts": len(bench.encoded), "calibration": bench.calibration, "profile": profile_info,
               **repeat_report(cfg, results)}
    if "cost" in rows:
        summary["cost_vs_best_fixed"] = rows["cost"]["tokens_per_s"] / fixed[best_fixed]["tokens_per_s"]
        best_decode = max(fixed, key=lambda k: fixed[k]["decode_tokens_per_s"] or 0)
        if rows["cost"]["decode_tokens_per_s"] and fixed[best_decode]["decode_tokens_per_s"]:
            summary["cost_vs_best_fixed_decode"] = rows["cost"]["decode_tokens_per_s"] / fixed[best_decode]["decode_tokens_per_s"]
        # How far the prompts let those two ratios move (95%, prompts resampled in pairs): a tie reads as one.
        summary["cost_vs_best_fixed_interval"] = {
            "level": 0.95,
            "e2e": paired_speed_interval(results["cost"], results[best_fixed]),
            "decode": paired_speed_interval(results["cost"], results[best_decode], decode=True)}
        # What any schedule could gain over the best fixed length with this drafter (decode/oracle.py).
        summary["ceiling"] = oracle_ceiling(results, [len(ids) for ids in bench.encoded], profile)
    summary["config"] = _config(bench)
    write_runs(Path(cfg.out_dir), results, bench.encoded)  # per prompt: what pooling several sweeps needs
    return _write(bench, "results.json", summary)


def _closed_loop(bench, concurrency: int, proposer, num_draft: int, load: LoadPolicy | None) -> dict:
    cfg = bench.cfg
    device = bench.target.model.device
    requests = [Request(ids, cfg.decode.max_new_tokens, torch.Generator(device=device).manual_seed(cfg.bench.seed + i))
                for i, ids in enumerate(bench.encoded)]
    start = time.perf_counter()
    gens = batched_generate(bench.backend, requests, proposer, bench.sampler, num_draft, bench.stop, None, load,
                            concurrency, bench.pad)
    wall = time.perf_counter() - start
    tokens = sum(len(g.output_ids) for g in gens)
    per_request = [len(g.output_ids) / g.total_s for g in gens if g.total_s > 0]
    return {
        "total_tokens_per_s": tokens / wall,
        "per_request_tokens_per_s": sum(per_request) / len(per_request),
        "tau": acceptance_stats(gens)["tau"] if num_draft else None,
        "tokens": tokens,
        "seconds": wall,
        "outputs": [g.output_ids for g in gens],
    }


def _median_run(runs: list[dict]) -> dict:
    """One method's figures over bench.load_repeats runs: each rate is the median of its runs (this
    machine's speed drifts between runs; rotating the methods and taking medians keeps the ratios
    between methods from depending on which ran in a slow stretch). Seeds repeat, so outputs do too."""
    row = dict(runs[0])
    for key in ("total_tokens_per_s", "per_request_tokens_per_s", "seconds"):
        row[key] = statistics.median(run[key] for run in runs)
    row["total_tokens_per_s_runs"] = [run["total_tokens_per_s"] for run in runs]
    # At T=0 the runs do the same work, so their fastest is the least noisy estimate (noise only adds time).
    row["total_tokens_per_s_best"] = max(row["total_tokens_per_s_runs"])
    return row


def paired_ratios(runs: list[dict], baseline: list[dict]) -> list[float]:
    """Total tokens/s of each run ÷ the baseline's run of the same repeat. A repeat runs every method back to
    back, so a slow stretch of the machine hits both sides of its ratio: the median of these paired ratios
    is steadier than a ratio of the two methods' medians, which may come from different repeats."""
    return [run["total_tokens_per_s"] / base["total_tokens_per_s"] for run, base in zip(runs, baseline, strict=True)]


def run_load(bench) -> dict:
    """Plain, fixed and load-scheduled batched decoding at each concurrency."""
    cfg = bench.cfg
    if cfg.bench.load_repeats < 1:  # before the profile: a bad setting must not cost a measurement
        raise ValueError(f"bench.load_repeats={cfg.bench.load_repeats}; it must be >= 1 (runs per method and concurrency)")
    profile, path, measured = bench.profile()
    num_draft = cfg.decode.num_draft
    # Warm-up: first-call allocations stay out of the first measurement.
    warm = Request(bench.encoded[0][:16], 4)
    batched_generate(bench.backend, [warm], bench.proposer, bench.sampler, num_draft, bench.stop, max_concurrency=1)
    table = []
    for concurrency in tqdm(cfg.bench.concurrency, desc="concurrency", mininterval=5):
        row = {"concurrency": concurrency}
        load = LoadPolicy(profile, LoadRule(cfg.scheduler.max_skip))
        # Rotate the order per concurrency and per repeat so no method always runs first.
        methods = [("plain", NoProposer(), 0, None), ("fixed", bench.proposer, num_draft, None),
                   ("scheduled", bench.proposer, num_draft, load)]
        runs = {name: [] for name, *_ in methods}
        for repeat in range(cfg.bench.load_repeats):
            shift = (len(table) + repeat) % len(methods)
            for name, proposer, k, policy in methods[shift:] + methods[:shift]:
                runs[name].append(_closed_loop(bench, concurrency, proposer, k, policy))
        for name, method_runs in runs.items():  # not `measured`: that names whether the profile was measured now
            row[name] = _median_run(method_runs)
        row["scheduled_vs_plain_runs"] = paired_ratios(runs["scheduled"], runs["plain"])
        row["scheduled_vs_plain"] = statistics.median(row["scheduled_vs_plain_runs"])
        greedy_same = None
        if bench.sampler.greedy:
            greedy_same = row["scheduled"]["outputs"] == row["plain"]["outputs"] == row["fixed"]["outputs"]
        for name in ("plain", "fixed", "scheduled"):
            row[name].pop("outputs")
        row["outputs_equal_at_T0"] = greedy_same
        row["mean_admitted_per_step"] = sum(load.admitted) / len(load.admitted) if load.admitted else None
        table.append(row)
        print(f"  C={concurrency:<3} total tok/s plain {row['plain']['total_tokens_per_s']:.1f} "
              f"fixed {row['fixed']['total_tokens_per_s']:.1f} scheduled {row['scheduled']['total_tokens_per_s']:.1f} "
              f"(scheduled ÷ plain, paired: {row['scheduled_vs_plain']:.2f})")
    summary = {"mode": "load", "num_prompts": len(bench.encoded), "num_draft": num_draft, "table": table,
               "profile": {"path": str(path), "measured_now": measured}, "calibration": bench.calibration,
               "config": _config(bench)}
    _write(bench, "results.json", summary)
    plot_load(table, Path(cfg.out_dir) / "load_sweep.png")
    return summary


def plot_load(table: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [row["concurrency"] for row in table]
    for name in ("plain", "fixed", "scheduled"):
        axes[0].plot(xs, [row[name]["total_tokens_per_s"] for row in table], marker="o", label=name)
        axes[1].plot(xs, [row[name]["per_request_tokens_per_s"] for row in table], marker="o", label=name)
    axes[0].set(title="total tokens/s", xlabel="concurrent requests", xscale="log")
    axes[1].set(title="per-request tokens/s", xlabel="concurrent requests", xscale="log")
    for ax in axes:
        ax.legend()
        ax.set_xticks(xs, [str(x) for x in xs])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class CheckFailed(ValueError):
    """bench.mode=check: the export accepts far less when served than training measured."""


def run_check(bench) -> dict:
    """Decode the prompts greedily with the export at its full block and compare tau with the training record.
    The export is loaded through speculators' own loader (SpeculatorModel.from_pretrained, what vLLM reads)."""
    from specdraft.models.export import training_record

    cfg, proposer = bench.cfg, bench.proposer
    if cfg.proposer.name != "drafter" or not cfg.proposer.path:
        raise ValueError("bench.mode=check checks a drafter export: proposer=drafter proposer.path=EXPORT")
    record = training_record(cfg.proposer.path)
    block = proposer.max_draft or cfg.decode.num_draft
    decoder = SpecDecoder(bench.target, proposer, FixedRule(), block, bench.backend)
    gens = [decoder.run(ids, Sampler(), cfg.decode.max_new_tokens)
            for ids in tqdm(bench.encoded, desc="check", mininterval=5)]
    stats = acceptance_stats(gens)
    if stats["tau"] is None:
        raise ValueError(f"bench.mode=check verified nothing ({len(gens)} prompts ended at their first token); raise "
                         "decode.max_new_tokens or give other prompts")
    expected = (record or {}).get("eval_tau_greedy")
    floor = None if expected is None else 1 + cfg.bench.check_min_ratio * (expected - 1)
    passed = None if floor is None else stats["tau"] >= floor
    summary = {"mode": "check", "export": cfg.proposer.path, "loader": "speculators.SpeculatorModel.from_pretrained",
               "tau": stats["tau"], "acceptance_by_position": stats["acceptance_by_position"], "block_size": block,
               "num_prompts": len(gens), "training": record, "tau_floor": floor, "passed": passed,
               "llama_cpp": llama_cpp_check(bench, block, gens) if cfg.bench.check_llama_cpp else {"status": "off"},
               "config": _config(bench)}
    _write(bench, "results.json", summary)
    engine = summary["llama_cpp"]
    if engine.get("passed") is False:
        raise CheckFailed(f"llama.cpp serves the export worse than our engine does: {engine['status']} "
                          "(bench.check_llama_cpp=false checks our engine and speculators' loader only)")
    if passed is False:
        raise CheckFailed(
            f"the export accepts far less when served than in training: tau {stats['tau']:.2f} over {len(gens)} prompts "
            f"(greedy, {block} drafted per step) against {expected:.2f} on training's held-out data (floor {floor:.2f} = "
            f"1 + bench.check_min_ratio x {expected - 1:.2f}). It is read differently here than in training: a config.json "
            f"edited or converted (layer ids, vocabulary mapping), another target, or prompts unlike its training data")
    if passed is None:
        print(f"bench.mode=check: {cfg.proposer.path} records no training tau (made elsewhere or before the record "
              f"existed): served tau {stats['tau']:.2f}, nothing to compare it with")
    return summary


LLAMA_SPEC_TYPES = {"dspark": "draft-dspark", "dflash": "draft-dflash", "eagle3": "draft-eagle3"}


def llama_cpp_check(bench, block: int, ours: list) -> dict:
    """The export as llama.cpp serves it: converted by llama.cpp's own converter, decoded greedily by
    llama-speculative-simple on the same prompts at the same draft length. Its acceptance (accepted / drafted)
    is held to bench.check_min_ratio of ours: llama.cpp computes a quantized target with other kernels, so the
    rates differ a little, while a conversion that misreads the export (layer ids, vocabulary) accepts ~0."""
    from specdraft.decode import llama_cpp
    from specdraft.io.target import _gguf_file, resolve_target_path

    cfg = bench.cfg
    binaries = llama_cpp.bin_dir()
    if binaries is None:
        return {"status": "not built (bash scripts/build_llama_cpp.sh builds llama.cpp and its converter)",
                "passed": None}
    mode = json.loads((Path(cfg.proposer.path) / "config.json").read_text()).get("speculators_model_type")
    if mode not in LLAMA_SPEC_TYPES:
        return {"status": f"not applicable: llama.cpp has no draft type for a {mode!r} export", "passed": None}
    out = Path(cfg.out_dir) / "llama_cpp"
    target_dir = resolve_target_path(cfg.target.name_or_path)
    try:  # the embedded target's own GGUF (its weights are what training saw, dequantized); else the HF folder's
        target_gguf = _gguf_file(cfg.target.name_or_path)
    except (KeyError, ValueError, FileNotFoundError):
        target_gguf = llama_cpp.convert_to_gguf(target_dir, out / "target.gguf")
    # --no-repack: this build's repacked AMX kernels crash on the Q4_1 target on AMX CPUs (a segfault in
    # ggml_backend_amx_mul_mat, found on a Xeon with AMX); acceptance does not depend on the kernels' layout.
    command = ["-m", str(target_gguf), "--no-repack", "-n", str(cfg.decode.max_new_tokens), "--temp", "0", "-c", "4096",
               "-t", str(torch.get_num_threads()), "--spec-type", LLAMA_SPEC_TYPES[mode], "--spec-draft-n-max", str(block)]
    try:
        draft_gguf = llama_cpp.convert_to_gguf(cfg.proposer.path, out / "draft.gguf", target_dir)
        command[2:2] = ["-md", str(draft_gguf)]
        texts = [bench.target.tokenizer.decode(ids) for ids in bench.encoded]  # the chat-formatted prompts
        total = sum((llama_cpp.speculative_simple(binaries, command, text) for text in texts), llama_cpp.SpeculativeRun())
    except RuntimeError as error:
        return {"status": f"failed: {error}", "passed": False}
    rate = total.accepted / total.drafted if total.drafted else None
    our_rate = sum(a for g in ours for a in g.accepted) / max(1, sum(d for g in ours for d in g.drafted))
    floor = cfg.bench.check_min_ratio * our_rate
    passed = rate is not None and rate >= floor
    return {"status": (f"acceptance {rate if rate is not None else 0:.3f} (accepted {total.accepted} of "
                       f"{total.drafted} drafted) against ours {our_rate:.3f}, floor {floor:.3f}"),
            "passed": passed, "acceptance": rate, "our_acceptance": our_rate, "drafted": total.drafted,
            "accepted": total.accepted, "decoded": total.decoded,
            "decode_tokens_per_s": total.decoded / total.decode_s if total.decode_s else None,
            "command": " ".join(["llama-speculative-simple", *command, "-p", "PROMPT"])}


def run_calibrate(bench) -> dict:
    """Decode held-out prompts with every position verified, per temperature bucket; fit on half the
    prompts, report on the other half, store the maps in the export."""
    from specdraft.decode.calibrate import fit_bucket, plot_reliability, write_calibration

    cfg, proposer = bench.cfg, bench.proposer
    if getattr(getattr(proposer, "drafter", None), "confidence_head", None) is None:
        raise ValueError("bench.mode=calibrate needs proposer=drafter with a dspark export (it has a confidence head)")
    if len(bench.encoded) < 2:
        raise ValueError("bench.mode=calibrate needs at least 2 prompts (half fit the maps, half evaluate them)")
    if cfg.proposer.branches is None:
        proposer.branches = 1  # the default tree is for decoding; calibration verifies the main chain alone
    if getattr(proposer, "branches", 1) != 1:
        raise ValueError(f"bench.mode=calibrate fits the main chain's confidences: set proposer.branches=1 "
                         f"(it is {proposer.branches}; a token tree's side branches would hide which positions survived)")
    block = proposer.max_draft
    decoder = SpecDecoder(bench.target, proposer, FixedRule(), block, bench.backend)
    buckets = {}
    for temperature in cfg.calibrate.temperatures:
        name = "greedy" if temperature == 0 else "sampling"
        if name in buckets:
            raise ValueError(f"calibrate.temperatures={list(cfg.calibrate.temperatures)}: one T=0 and one T>0 at most")
        sampler = Sampler(temperature, cfg.decode.top_k, cfg.decode.top_p)
        gens = []
        for index, ids in enumerate(tqdm(bench.encoded, desc=f"calibrate {name}", mininterval=5)):
            generator = torch.Generator(device=bench.target.model.device).manual_seed(cfg.bench.seed + index)
            gens.append(decoder.run(ids, sampler, cfg.decode.max_new_tokens, generator))
        buckets[name] = fit_bucket(gens[0::2], gens[1::2], block)
        buckets[name]["temperature"] = temperature
        buckets[name]["tau"] = acceptance_stats(gens)["tau"]
    meta = {"data": cfg.data.name, "first_prompt": cfg.bench.first_prompt, "num_prompts": len(bench.encoded),
            "max_new_tokens": cfg.decode.max_new_tokens, "dtype": cfg.target.dtype,
            "temperatures": {name: bucket["temperature"] for name, bucket in buckets.items()}}
    path = write_calibration(Path(cfg.proposer.path), buckets, meta)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_reliability(buckets, out / "reliability.png")
    summary = {"mode": "calibrate", "calibration_path": str(path), "reliability_png": str(plot), **meta,
               "buckets": {name: {k: v for k, v in bucket.items() if k != "_eval"} for name, bucket in buckets.items()},
               "config": _config(bench)}
    return _write(bench, "results.json", summary)
