"""Structured configs shared by the entry points, registered with Hydra's ConfigStore.

Dataclass schemas make configs strict: a key that is not a field fails at composition, with
Hydra naming the key. Nothing below the entry points imports Hydra; builders take plain values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TargetConfig:
    """The frozen target: an alias of an embedded model, a local folder, or a Hugging Face id."""

    name_or_path: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"  # float32 for exactness checks; bfloat16 for speed
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
