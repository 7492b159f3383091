"""The target's config, shared by distillation and decoding (a Hydra structured-config schema)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TargetConfig:
    """The frozen target: an alias of an embedded model, a local folder, or a Hugging Face id."""

    name_or_path: str = "smollm2-135m-instruct"
    # auto: bfloat16 where it is native (a GPU with bf16, a CPU with AVX512-BF16/AMX oneDNN kernels), else
    # float32 (decided and printed at load, written to results.json); float32 for exactness checks
    dtype: str = "auto"
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    device: str = "auto"  # auto: cuda when available, else cpu (training always follows accelerate's device)
    # Who computes the target's forward when decoding (decode/backend.py): auto (fast where it runs, else hf,
    # with a line saying why), fast (the twin laid out for this machine's kernels; fails where it cannot run)
    # or hf (transformers' model, the reference)
    backend: str = "auto"
    # The fast backend's linear-layer kernels (decode/linear_kernels.py): auto (each candidate timed on the
    # model's shapes once per machine, the decision cached) or one of onednn4, onednn16, mkl, torch
    kernel: str = "auto"
