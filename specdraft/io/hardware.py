"""What this CPU computes natively, where that changes which dtype is fast.

PyTorch runs bf16 matmuls on a CPU through oneDNN's bf16 kernels only where oneDNN supports the CPU for
bf16 (x86: AVX512 or AVX-NE-CONVERT and up; ARM: the bf16 extension); elsewhere on x86 it falls back to
a generic kernel whose cost grows with every token of a forward. Measured on a 2-core AVX2 EPYC: a
512-token prefill of the embedded target took 5.9 s in bf16 against 0.9 s in fp32, and a verify step of
1/2/4/8 tokens 35/48/76/134 ms in bf16 against 56/99/106/94 ms in fp32; an AVX512-BF16 machine verifies 8
tokens in bf16 in about 31 ms. Such a cost curve decides whether speculation pays, so cost profiles must
not be shared between the two kinds of machine (decode/profile.py puts `native_bf16` in the fingerprint).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

X86 = {"x86_64", "amd64", "i386", "i686"}


def native_bf16() -> bool | None:
    """Whether PyTorch runs bf16 matmuls on this CPU through oneDNN's bf16 kernels; None where torch cannot say."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN, or an older torch
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first `model name`), else what `platform` reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bf16_warning(dtype: torch.dtype, device: torch.device, native: bool | None, machine: str) -> str | None:
    """The warning for a bf16 model on an x86 CPU without oneDNN bf16 (the measured slow fallback), naming
    the fix; None where it does not apply or where nothing is known."""
    if dtype != torch.bfloat16 or device.type != "cpu" or native is not False or machine.lower() not in X86:
        return None
    return (f"bf16 on this CPU (torch CPU capability {torch.backends.cpu.get_cpu_capability()}, no oneDNN bf16 "
            "support) runs through PyTorch's generic kernel. Each token of a forward then costs about 40% of a "
            "one-token step: prefill runs several times slower than in float32, and speculation has little to gain. "
            "One-token steps are still faster in bf16. For long prompts or multi-token steps use float32 "
            "(target.dtype=float32; scripts/compare.py --dtype float32).")
