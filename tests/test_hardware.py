"""bf16 kernel detection: the warning that names the fix, and the profile fingerprint that keeps an AVX2
machine's cost curves apart from an AVX512-BF16 machine's."""

import types
import warnings

import pytest
import torch

import specdraft.decode.profile as profile
import specdraft.io.target as target
import specdraft.io.hardware as hardware
from specdraft.io.hardware import bf16_warning, native_bf16

CPU = torch.device("cpu")


def test_bf16_without_onednn_bf16_on_x86_warns_with_the_fix():
    message = bf16_warning(torch.bfloat16, CPU, False, "x86_64")
    assert "target.dtype=float32" in message and "--dtype float32" in message


@pytest.mark.parametrize("dtype, device, native, machine", [
    (torch.float32, "cpu", False, "x86_64"),  # fp32 is the fast path there
    (torch.bfloat16, "cpu", True, "x86_64"),  # oneDNN bf16 kernels
    (torch.bfloat16, "cpu", None, "x86_64"),  # torch cannot say: no guess
    (torch.bfloat16, "cpu", False, "aarch64"),  # another fallback than the one measured
    (torch.bfloat16, "cuda", False, "x86_64"),  # the host CPU does not compute a GPU model
])
def test_no_warning_where_bf16_is_native_or_unknown(dtype, device, native, machine):
    assert bf16_warning(dtype, torch.device(device), native, machine) is None


def test_native_bf16_is_unknown_where_torch_has_no_onednn(monkeypatch):
    assert native_bf16() in (True, False)  # this torch has oneDNN: it answers
    monkeypatch.setattr(hardware, "torch", types.SimpleNamespace())  # a build without torch.ops.mkldnn
    assert native_bf16() is None


def test_load_target_warns_on_emulated_bf16(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(target, "native_bf16", lambda: False)
    monkeypatch.setattr(target.platform, "machine", lambda: "x86_64")
    with pytest.warns(RuntimeWarning, match="target.dtype=float32"):
        target.load_target(tiny_model_dir, "bfloat16")
    monkeypatch.setattr(target, "native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # where bf16 is native, loading says nothing
        target.load_target(tiny_model_dir, "bfloat16")


def test_profiles_of_machines_that_differ_only_in_bf16_kernels_do_not_share_a_fingerprint(monkeypatch):
    monkeypatch.setattr(profile, "cpu_model", lambda: "AMD EPYC")
    fingerprints = []
    for native in (False, True):
        monkeypatch.setattr(profile, "native_bf16", lambda native=native: native)
        fingerprints.append(profile.machine_fingerprint())
    assert fingerprints[0]["cpu"] == fingerprints[1]["cpu"] and fingerprints[0] != fingerprints[1]
    assert fingerprints[0]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_dtype_auto_takes_bf16_only_where_it_is_native(monkeypatch, tiny_model_dir, capsys):
    monkeypatch.setattr(target, "native_bf16", lambda: True)
    dtype, reason = target.choose_dtype("auto", CPU)
    assert dtype == torch.bfloat16 and "natively" in reason and "target.dtype=float32" in reason
    for native in (False, None):  # emulated, or torch cannot say: the exact, fast-here dtype
        monkeypatch.setattr(target, "native_bf16", lambda native=native: native)
        dtype, reason = target.choose_dtype("auto", CPU)
        assert dtype == torch.float32 and "not native" in reason
    assert target.choose_dtype("bfloat16", CPU) == (torch.bfloat16, "target.dtype=bfloat16 as configured")
    loaded = target.load_target(tiny_model_dir, "auto")
    assert loaded.dtype == torch.float32 and loaded.dtype_reason == reason
    assert "specdraft: target.dtype=auto" in capsys.readouterr().out and "float32" in reason
    with pytest.raises(ValueError, match="choose one of"):
        target.choose_dtype("fp8", CPU)
