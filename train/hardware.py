"""What this CPU computes natively, where that changes which dtype is fast.

bf16 matmuls run natively on x86 only with AVX512-BF16 or AMX-BF16 (ARM: the bf16 extension). Without
them PyTorch emulates bf16 GEMMs, and a forward's cost grows with every token in it: measured on a
2-core AVX2 EPYC, a 512-token prefill of the embedded target took 5.9 s in bf16 against 0.9 s in fp32,
and a verify step of 1/2/4/8 tokens 35/48/76/134 ms in bf16 against 56/99/106/94 ms in fp32. The same
model on an AVX512-BF16 machine verifies 8 tokens in 31 ms. Such a cost curve decides whether
speculation pays, so cost profiles must not be shared between the two kinds of machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16 / AMX-BF16; "bf16" is ARM's Features name


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, ARM `Features`); None where unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def native_bf16(flags: set[str] | None) -> bool | None:
    """Whether bf16 matmuls run natively on a CPU with these flags; None when the flags are unknown."""
    return None if flags is None else bool(flags & BF16_FLAGS)


def bf16_warning(dtype: torch.dtype, device: torch.device, flags: set[str] | None) -> str | None:
    """The warning for a bf16 model on a CPU that emulates bf16, naming the fix; None when it does not apply."""
    if dtype != torch.bfloat16 or device.type != "cpu" or native_bf16(flags) is not False:
        return None
    return (f"target.dtype=bfloat16 on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo; torch "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}): PyTorch emulates bf16 matmuls here, so a "
            "forward's cost grows with every token in it: prefill runs several times slower than in float32, and each "
            "extra verified token costs about a third of a one-token step, which leaves speculation little to gain. "
            "One-token steps are still faster in bf16; for long prompts or long verify steps use target.dtype=float32")
