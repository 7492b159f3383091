"""scripts/peers.py end to end on a tiny saved model, and scripts/fast_backend_table.py over its output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_peers(target: str, prompts_file: str, *extra: str) -> None:
    """scripts/peers.py on 2 prompts x 8 tokens of the tiny target (it sets the thread count; restored after)."""
    threads = torch.get_num_threads()
    try:
        load_script("peers").main(["--target", target, "--data", "jsonl", "--data-path", prompts_file, "--num-prompts",
                                   "2", "--max-new-tokens", "8", "--assistant-layers", "1", *extra])
    finally:
        torch.set_num_threads(threads)


def test_peers_table_on_a_tiny_target(tiny_model_dir, prompts_file, tmp_path):
    run_peers(tiny_model_dir, prompts_file, "--scheduler", "fixed", "--out", str(tmp_path / "peers"))
    summary = json.loads((tmp_path / "peers" / "peers.json").read_text())
    rows = summary["rows"]
    python_rows = ["hf_generate", "hf_prompt_lookup", "hf_assisted", "ours_plain", "ours_ngram", "ours_assisted"]
    for name in python_rows:
        assert rows[name]["status"] == "ran" and rows[name]["decode_tokens_per_s"] > 0, name
        assert rows[name]["equal_to_hf_generate"] is True, name  # fp32 greedy: every method is exact
    assert rows["ours_plain"]["decode_vs_plain"] == 1.0
    # llama.cpp runs the embedded GGUF only: a folder target gets a row that says so, never a failure.
    assert all("embedded" in rows[name]["status"] or "not built" in rows[name]["status"]
               for name in ("llama_cpp_plain", "llama_cpp_ngram", "llama_cpp_curve"))
    assert (tmp_path / "peers" / "peers.png").stat().st_size > 1000
    table = load_script("fast_backend_table")
    import sys

    argv, sys.argv = sys.argv, ["fast_backend_table.py", str(tmp_path)]
    try:
        table.main()
    finally:
        sys.argv = argv
    text = (tmp_path / "tables.md").read_text()
    assert "| ours_ngram |" in text and "| hf_generate |" in text


def test_peers_methods_subset_compares_with_plain(tiny_model_dir, prompts_file, tmp_path):
    run_peers(tiny_model_dir, prompts_file, "--methods", "ours_ngram", "--spread", "--out", str(tmp_path / "sub"))
    with pytest.raises(SystemExit, match="unknown"):
        run_peers(tiny_model_dir, prompts_file, "--methods", "ours_nothing", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "sub" / "peers.json").read_text())
    assert summary["settings"]["spread"] is True  # the prompts taken evenly over the source (load_prompts' spread)
    rows = summary["rows"]
    assert {k for k in rows if not k.startswith("llama_cpp")} == {"ours_plain", "ours_ngram"}
    assert rows["ours_ngram"]["equal_to_plain"] is True and rows["ours_ngram"]["equal_to_hf_generate"] is None


def test_llama_cpp_builds_are_kept_per_cpu_and_a_foreign_one_is_named(monkeypatch, tmp_path):
    """The build compiles for its machine's CPU and the cache outlives machines: a build made on another CPU
    is not this one's (it died of an illegal instruction when it was), and such a death says what to do."""
    import signal
    from pathlib import Path

    from specdraft.decode import llama_cpp

    cpuinfo = tmp_path / "cpuinfo"
    real_read = Path.read_text

    def keyed(flags):
        cpuinfo.write_text(f"model name\t: Intel(R) Xeon(R)\nflags\t\t: {flags}\n")
        monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: real_read(cpuinfo if str(self) == "/proc/cpuinfo" else self, *a, **k))
        return llama_cpp.cpu_key()

    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    here, other = keyed("fpu avx2 avx512f amx_tile"), keyed("fpu avx2")
    assert here != other and keyed("avx512f fpu amx_tile avx2") == here  # flags in any order: one CPU
    assert llama_cpp.build_dir().name.startswith(f"build-{here}-") and llama_cpp.bin_dir() is None
    assert "illegal instruction" in llama_cpp.exit_reason(-signal.SIGILL)
    assert "bash scripts/build_llama_cpp.sh" in llama_cpp.exit_reason(128 + signal.SIGILL)
    assert llama_cpp.exit_reason(-signal.SIGSEGV) == f"exit {-signal.SIGSEGV}: killed by SIGSEGV"
    # ggml's AMX matmul is left out where the CPU has AMX (its batched path crashed there), and the
    # configuration is part of the folder, so a changed recipe builds anew.
    amx_folder = llama_cpp.build_dir()
    assert any("-mno-amx-int8" in flag for flag in llama_cpp.cmake_flags())
    keyed("fpu avx2 avx512f")
    assert not any("amx" in flag for flag in llama_cpp.cmake_flags()) and llama_cpp.build_dir() != amx_folder
