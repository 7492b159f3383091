"""A sweep's per-prompt runs (OUT/runs.jsonl), and comparisons of its settings pooled over several sweeps.

Why pool: at T=1 the settings of a sweep sample different texts from the same prompt, so a prompt's pair of
runs differs in its tokens as well as in its speed, and one sweep of 20 prompts decides the ratio of two
settings only to about ±4% (the default export's cost scheduler against two drafted tokens, 2026-12-05).
Sweeps of the same settings with other seeds (bench.seed) or other prompts pool into one paired interval:
each sweep's prompt pairs stay pairs, and the pooled interval resamples all of them
(`decode/metrics.py` paired_speed_interval). scripts/pool_sweeps.py prints it.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.decode.generate import Generation
from specdraft.decode.metrics import paired_speed_interval, speed
from specdraft.io.files import write_text_atomically

RUNS_FILE = "runs.jsonl"
FIXED_PREFIX = "fixed_"  # a sweep's fixed-length settings: fixed_1, fixed_2, ...


def fixed_setting(length: int) -> str:
    """The sweep's name for verifying `length` drafted tokens at every step."""
    return f"{FIXED_PREFIX}{length}"


def fixed_settings(settings) -> list:
    """The fixed-length settings among a sweep's, in their order."""
    return [setting for setting in settings if setting.startswith(FIXED_PREFIX)]


def write_runs(out_dir: Path, results: dict[str, list[Generation]], encoded: list[list[int]]) -> Path:
    """OUT/runs.jsonl (atomic): one line per prompt and setting, what a pooled comparison needs."""
    lines = [json.dumps({"prompt": index, "setting": setting, "prompt_tokens": len(encoded[index]),
                         "output_token_ids": gen.output_ids, "ttft_s": gen.ttft_s, "total_s": gen.total_s,
                         "drafted": gen.drafted, "accepted": gen.accepted})
             for setting, generations in results.items() for index, gen in enumerate(generations)]
    path = Path(out_dir) / RUNS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, "\n".join(lines) + "\n")
    return path


def read_runs(out_dir: str | Path) -> dict[str, list[Generation]]:
    """One sweep's runs: setting -> its Generations in prompt order."""
    path = Path(out_dir) / RUNS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pool the out_dir of a sweep "
                                f"(decode/bench.py bench.mode=sweep out_dir=...), which writes it")
    runs: dict[str, dict[int, Generation]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            gen = Generation(row["output_token_ids"], row["drafted"], row["accepted"], ttft_s=row["ttft_s"],
                             total_s=row["total_s"])
            runs.setdefault(row["setting"], {})[row["prompt"]] = gen
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}, line {number} is not a sweep run ({error}); write it again with "
                             f"decode/bench.py bench.mode=sweep") from error
    counts = {setting: len(by_prompt) for setting, by_prompt in runs.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{path} holds different numbers of prompts per setting ({counts}): a sweep interrupted "
                         f"while writing? Run it again")
    return {setting: [by_prompt[i] for i in sorted(by_prompt)] for setting, by_prompt in runs.items()}


def pool(out_dirs: list[str | Path]) -> dict[str, list[Generation]]:
    """The runs of several sweeps of the same settings, setting -> Generations (each sweep's prompts in turn,
    so the i-th runs of two settings are always one prompt's pair)."""
    if not out_dirs:
        raise ValueError("no sweep to pool: give one or more out_dir folders of decode/bench.py bench.mode=sweep")
    pooled: dict[str, list[Generation]] = {}
    for out_dir in out_dirs:
        runs = read_runs(out_dir)
        if pooled and set(runs) != set(pooled):
            missing, extra = sorted(set(pooled) - set(runs)), sorted(set(runs) - set(pooled))
            raise ValueError(f"{out_dir} swept other settings than {out_dirs[0]} (missing {missing}, extra {extra}); "
                             f"pool sweeps of the same bench.sweep_lengths and thresholds")
        for setting, generations in runs.items():
            pooled.setdefault(setting, []).extend(generations)
    return pooled


def best_fixed(pooled: dict[str, list[Generation]], decode: bool = True) -> str:
    """The fixed length that was fastest over all pooled runs."""
    fixed = fixed_settings(pooled)
    if not fixed:
        raise ValueError(f"no fixed length among the pooled settings {sorted(pooled)}")
    return max(fixed, key=lambda setting: speed(pooled[setting], decode) or 0)


def compare(pooled: dict[str, list[Generation]], faster: str, slower: str) -> dict:
    """Speed of `faster` ÷ speed of `slower` over the pooled prompt pairs, end to end and after the first token,
    each with its 95% paired bootstrap interval."""
    for setting in (faster, slower):
        if setting not in pooled:
            raise ValueError(f"setting {setting!r} is not among the pooled ones {sorted(pooled)}")
    row = {"faster": faster, "slower": slower, "pairs": len(pooled[faster])}
    for name, decode in (("e2e", False), ("decode", True)):
        a, b = speed(pooled[faster], decode), speed(pooled[slower], decode)
        row[name] = a / b if a and b else None
        row[f"{name}_interval"] = paired_speed_interval(pooled[faster], pooled[slower], decode=decode)
    return row
