"""The benchmark's structured config (`python decode/bench.py`), mirrored by conf/bench.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from train.config import TargetConfig

PROPOSERS = ("ngram", "model", "drafter")


@dataclass
class ProposerConfig:
    """Which drafter proposes tokens, and its settings."""

    name: str = "ngram"
    max_ngram: int = 3  # ngram: longest suffix to match
    min_ngram: int = 1  # ngram: shortest suffix to match
    path: str | None = None  # model: a causal LM with the target's tokenizer (None: the target itself); drafter: an export
    num_layers: int | None = None  # model: keep only the first k decoder layers (None: all)


@dataclass
class DataConfig:
    """Benchmark prompts: mtbench, sharegpt_heldout, or jsonl (with path)."""

    name: str = "mtbench"
    path: str | None = None


@dataclass
class DecodeConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    num_draft: int = 4


@dataclass
class SchedulerConfig:
    """fixed (decode.num_draft every step) or threshold (cut at the first confidence below scheduler.threshold)."""

    name: str = "fixed"
    threshold: float = 0.5


@dataclass
class BenchSettings:
    num_prompts: int | None = 10  # first N prompts in file order (None: all)
    seed: int = 0
    baselines: bool = True  # also run HF generate and HF's own speculative baseline per prompt


@dataclass
class BenchConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    proposer: ProposerConfig = field(default_factory=ProposerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    bench: BenchSettings = field(default_factory=BenchSettings)
    out_dir: str = "${hydra:runtime.output_dir}"


def register_configs() -> None:
    """Register the schema that conf/bench.yaml extends."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
