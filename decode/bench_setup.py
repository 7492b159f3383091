"""What every benchmark mode shares (decode/bench.py's single mode, decode/bench_modes.py's others, the
scripts): the target and proposer a BenchConfig names, HF `generate` as a timed baseline, interleaved runs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.io.files import write_text_atomically
from specdraft.decode.backend import build_backend
from specdraft.decode.config import BenchConfig
from specdraft.decode.factory import attach_calibration, make_proposer, proposer_modules
from specdraft.decode.generate import Generation
from specdraft.decode.sampling import Sampler
from specdraft.decode.tree import side_rows
from specdraft.io import assets
from specdraft.io.data import chat_prompt_ids, load_prompts, source_modules
from specdraft.io.target import eos_ids, load_target, target_modules
from specdraft.models.export import recorded_target


def build_proposer(cfg: BenchConfig, target):
    """The configured proposer (decode/factory.py), the name of the matching HF baseline and its `generate` kwargs."""
    proposer, model = make_proposer(cfg.proposer, target, cfg.target.name_or_path, cfg.target.backend,
                                    cfg.target.kernel)
    if cfg.proposer.name == "ngram":
        # HF's lookup takes the leftmost match and has no minimum size; ours takes the most recent one.
        return proposer, "hf_prompt_lookup", {"prompt_lookup_num_tokens": cfg.decode.num_draft,
                                              "max_matching_ngram_size": cfg.proposer.max_ngram}
    if cfg.proposer.name == "model":
        # Like for like: a constant number of assistant tokens and HF's confidence-based early stop off.
        model.generation_config.num_assistant_tokens = cfg.decode.num_draft
        model.generation_config.num_assistant_tokens_schedule = "constant"
        model.generation_config.assistant_confidence_threshold = 0.0
        return proposer, "hf_assisted", {"assistant_model": model}
    return proposer, None, {}  # HF has no block-drafter / Eagle-3 baseline


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
        from specdraft.decode.profile import CostProfile, load_or_measure

        cfg = self.cfg
        if cfg.scheduler.profile:
            return CostProfile(**json.loads(Path(cfg.scheduler.profile).read_text())), cfg.scheduler.profile, False
        block = self.proposer.max_draft or cfg.decode.num_draft
        sizes = sorted(set(cfg.bench.concurrency) | {1})
        return load_or_measure(cfg.target.name_or_path, self.backend, self.proposer, cfg.proposer.path, block,
                               sizes, cfg.scheduler.profile_context, contexts=cfg.scheduler.profile_contexts,
                               tree_rows=side_rows(self.proposer, cfg.decode.temperature == 0))


def with_verifier(cfg: BenchConfig) -> BenchConfig:
    """The config with proposer.verifier applied: the target an export is verified with replaces target.name_or_path
    ("export": the target the export records), so everything downstream (and results.json) names the one used."""
    verifier = cfg.proposer.verifier
    if verifier is None:
        return cfg
    if cfg.proposer.name not in ("drafter", "hybrid") or not cfg.proposer.path:
        raise ValueError(f"proposer.verifier={verifier!r} applies to a drafter export (proposer=drafter or hybrid with "
                         "proposer.path=EXPORT); set target.name_or_path to choose the target otherwise")
    name = recorded_target(cfg.proposer.path) if verifier == "export" else verifier
    return replace(cfg, target=replace(cfg.target, name_or_path=name))


def setup_bench(cfg: BenchConfig, sampler: Sampler | None = None) -> BenchSetup:
    cfg = with_verifier(cfg)
    modules = target_modules(cfg.target.name_or_path) + source_modules(cfg.data.name, cfg.data.path)
    assets.ensure(modules + proposer_modules(cfg.proposer.name), "specdraft-bench")
    sampler = sampler or Sampler(cfg.decode.temperature, cfg.decode.top_k, cfg.decode.top_p)
    prompts = load_prompts(cfg.data.name, cfg.data.path, cfg.bench.num_prompts, cfg.bench.first_prompt, cfg.data.categories,
                           cfg.bench.spread)
    if not prompts:
        raise ValueError(f"no prompts: data={cfg.data.name} from index {cfg.bench.first_prompt} is empty")
    target = load_target(cfg.target.name_or_path, cfg.target.dtype, cfg.target.threads, cfg.target.device)
    backend = build_backend(target.model, cfg.target.backend, kernel=cfg.target.kernel)
    proposer, baseline_name, baseline_kwargs = build_proposer(cfg, target)
    calibration = (None if cfg.bench.mode == "calibrate"  # calibration fits the raw confidences
                   else attach_calibration(proposer, cfg.proposer.path, cfg.bench.calibration))
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


def target_report(bench: BenchSetup) -> dict:
    """What results.json records of how the target ran: its dtype (and why) and its backend."""
    return {"target_dtype": {"dtype": str(bench.target.dtype).replace("torch.", ""), "requested": bench.cfg.target.dtype,
                             "reason": bench.target.dtype_reason},
            "target_backend": {"requested": bench.cfg.target.backend, **bench.backend.describe()},
            # the token tree the proposer drafts at T=0 (proposer.branches as resolved: None takes the proposer's default)
            "tree": {"requested": bench.cfg.proposer.branches, "branches": getattr(bench.proposer, "branches", 1)}}


def memory_report(bench: BenchSetup) -> dict:
    """Bytes by part (decode/memory.py): the weights each holds, and the target's KV cache at the longest
    sequence of this run (prompt plus decode.max_new_tokens), computed from the target's geometry."""
    from specdraft.decode.memory import kv_cache_bytes, weights_by_part

    longest = max(len(ids) for ids in bench.encoded) + bench.cfg.decode.max_new_tokens
    return {**weights_by_part(bench.target, bench.backend, bench.proposer),
            "kv_cache": kv_cache_bytes(bench.target.model.config, longest, bench.target.dtype)}


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


atomic_write = write_text_atomically  # bench.py and bench_modes.py write results.json through it
