"""The benchmark's structured config (`python decode/bench.py`), mirrored by conf/bench.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from specdraft.io.config import TargetConfig

PROPOSERS = ("ngram", "model", "drafter", "hybrid")


@dataclass
class ProposerConfig:
    """Which drafter proposes tokens, and its settings."""

    name: str = "ngram"
    max_ngram: int = 3  # ngram: longest suffix to match
    min_ngram: int = 1  # ngram: shortest suffix to match
    # ngram: learn its confidences from every request of the run (true) or from each request alone (false:
    # a request's verify lengths, and so its sampled tokens at T > 0, do not depend on other requests)
    share_stats: bool = True
    path: str | None = None  # model: a causal LM with the target's tokenizer (None: the target itself); drafter: an export
    # drafter/hybrid: the target to verify the export with, in place of target.name_or_path: "export" (the target
    # the export records, resolved here: the embedded alias to its converted folder) or a folder / HF id (a local
    # copy where the recorded id does not resolve on this machine). The export's fingerprint check still applies.
    verifier: str | None = None
    num_layers: int | None = None  # model: keep only the first k decoder layers (None: all)
    # drafter/hybrid: the trained drafter's dtype: target (the target's), auto (bfloat16 where this machine runs it
    # natively, else the target's: it halves the weights a drafting step reads; a one-token draft right after a
    # verify step took 3.9 instead of 5.4 ms on the Zen 4 EPYC), float32 or bfloat16. Each is lossless:
    # verification uses the q the drafter sampled from, whatever precision computed it.
    dtype: str = "auto"
    # drafter/hybrid/ngram, greedy decoding: candidates drafted for the first position (the main chain's first token
    # and, as side branches, the drafter's runners-up or what else followed the last token in the context), all
    # verified in one forward as a token tree (decode/tree.py); 1: one chain. Sampling drafts one chain. None: the
    # proposer's default (decode/factory.py DEFAULT_BRANCHES: 4 for a block drafter, 3 for prompt lookup; where the
    # side rows are not free on this machine, scheduler=cost drops the branches that do not pay for them).
    branches: int | None = None
    # ngram with branches > 1: the most tokens each side branch (another earlier continuation of the last token,
    # decode/proposer.py ngram_siblings) holds; it is never longer than the main chain's verified draft.
    side_length: int = 1


@dataclass
class DataConfig:
    """Benchmark prompts: mtbench, sharegpt_heldout, or jsonl (with path)."""

    name: str = "mtbench"
    path: str | None = None
    categories: list[str] | None = None  # only prompts of these categories (MT-bench: coding, math, extraction, ...)


@dataclass
class DecodeConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    num_draft: int = 4


@dataclass
class SchedulerConfig:
    """fixed (decode.num_draft every step), threshold (cut at the first confidence below scheduler.threshold),
    cost (extend while expected tokens/s improves, on the measured cost profile) or load (DSpark's
    load-aware admission across concurrent requests)."""

    name: str = "fixed"
    threshold: float = 0.5
    profile: str | None = None  # a cost-profile JSON to use; None: measured once per machine/dtype/models, cached
    profile_context: int = 256  # context length the profile is measured at
    # further contexts the one-request verify and draft curves are measured at; scheduler=cost prices each
    # step at its own context, linear between (and beyond) these. []: one context only.
    profile_contexts: list[int] = field(default_factory=lambda: [64, 1024])
    # cost/load: after a step whose speculation did not pay for its drafting, skip the drafter for 1, 2, 4, ...
    # steps (at most this many) before probing again: the fallback to plain decoding where the drafter does not
    # pay. Per request for cost, batch-wide for load. 0: never skip.
    max_skip: int = 16


@dataclass
class CalibrateSettings:
    """bench.mode=calibrate: held-out decoding that fits the confidence maps stored with the export."""

    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])  # buckets: 0 -> greedy, >0 -> sampling


@dataclass
class BenchSettings:
    mode: str = "single"  # single | sweep | load | calibrate | check
    num_prompts: int | None = 10  # N prompts in file order (None: all)
    first_prompt: int = 0  # skip this many (calibrate on prompts the benchmark does not use)
    spread: bool = False  # take the N prompts evenly spaced over the source (every category of MT-bench), not the first N
    seed: int = 0
    baselines: bool = True  # also run HF generate and HF's own speculative baseline per prompt
    # Confidence calibration of a dspark export: auto = EXPORT/calibration.json when present; none; or a file.
    calibration: str = "auto"
    sweep_lengths: list[int] | None = None  # mode=sweep: fixed verify lengths (None: 1..block size)
    sweep_thresholds: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7, 0.9])
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])  # mode=load
    load_repeats: int = 1  # mode=load: runs of each method per concurrency, rotated; rates are their medians
    # mode=single/sweep: runs of every method per prompt, rotated; the fastest run is kept (seeds repeat)
    repeats: int = 1
    # mode=check: fail when the export's served tau - 1 (tokens gained per step) is below this share of what
    # training measured on held-out data (the export records it)
    check_min_ratio: float = 0.5
    # mode=check: also serve the export with llama.cpp (its converter, then llama-speculative-simple) where
    # scripts/build_llama_cpp.sh built it; fail when it accepts below check_min_ratio of what our engine accepts
    check_llama_cpp: bool = True


@dataclass
class BenchConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    proposer: ProposerConfig = field(default_factory=ProposerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    bench: BenchSettings = field(default_factory=BenchSettings)
    calibrate: CalibrateSettings = field(default_factory=CalibrateSettings)
    out_dir: str = "${hydra:runtime.output_dir}"


@dataclass
class ServerSettings:
    """`python decode/serve.py`: where it listens, its limits and the live A/B split."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None  # the id /v1/models lists and requests name (None: target.name_or_path)
    max_concurrency: int = 16  # requests in the running batch at most
    max_queue: int = 64  # requests waiting for a slot at most; more are refused with 429
    max_prompt_tokens: int | None = None  # None: the target's context window
    max_tokens: int | None = None  # a request's max_tokens at most (None: what the context window leaves)
    request_timeout_s: float = 600.0  # from arrival to the last token; past it the request ends with 504
    max_body_bytes: int = 1 << 20  # larger request bodies are refused with 413
    # A random share of requests decoded without speculation (same engine, same batch), every metric
    # labelled by arm; a request may force its arm with "specdraft_arm": "spec" | "plain".
    ab_fraction: float = 0.0
    ab_seed: int = 0
    summary_every_s: float = 60.0  # a log line of both arms' figures this often while requests come (0: never)


@dataclass
class ServeConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    proposer: ProposerConfig = field(default_factory=ProposerConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # defaults of requests that do not set them
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    calibration: str = "auto"  # as bench.calibration
    server: ServerSettings = field(default_factory=ServerSettings)


def register_configs() -> None:
    """Register the schemas that conf/bench.yaml and conf/serve.yaml extend."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    ConfigStore.instance().store(name="serve_schema", node=ServeConfig)
