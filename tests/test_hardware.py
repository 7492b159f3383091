"""Native-bf16 detection: the warning that names the fix, and the profile fingerprint that keeps an AVX2
machine's cost curves apart from an AVX512-BF16 machine's."""

import pytest
import torch

from decode.profile import machine_fingerprint
from train.hardware import bf16_warning, cpu_flags, native_bf16

AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"


def test_flags_are_read_from_cpuinfo_on_x86_and_arm():
    assert cpu_flags(AVX2) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert "bf16" in cpu_flags(ARM)
    assert cpu_flags("processor\t: 0\n") is None  # no flags line: unknown, not "no features"


@pytest.mark.parametrize("cpuinfo, expected", [(AVX2, False), (AVX512_BF16, True), (ARM, True), ("", None)])
def test_native_bf16(cpuinfo, expected):
    assert native_bf16(cpu_flags(cpuinfo)) is expected


def test_bf16_on_an_emulating_cpu_warns_with_the_fix():
    message = bf16_warning(torch.bfloat16, torch.device("cpu"), cpu_flags(AVX2))
    assert "target.dtype=float32" in message and "avx512_bf16" in message


@pytest.mark.parametrize("dtype, device, cpuinfo", [
    (torch.float32, "cpu", AVX2),  # fp32 is the fast path there
    (torch.bfloat16, "cpu", AVX512_BF16),  # native bf16
    (torch.bfloat16, "cpu", ""),  # unknown CPU: no guess
    (torch.bfloat16, "cuda", AVX2),  # the host CPU does not compute a GPU model
])
def test_no_warning_where_bf16_is_native_or_unknown(dtype, device, cpuinfo):
    assert bf16_warning(dtype, torch.device(device), cpu_flags(cpuinfo)) is None


def test_profile_fingerprint_names_the_cpu_isa():
    machine = machine_fingerprint()
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["native_bf16"] == native_bf16(cpu_flags())
