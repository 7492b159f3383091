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
    run_peers(tiny_model_dir, prompts_file, "--methods", "ours_ngram", "--out", str(tmp_path / "sub"))
    with pytest.raises(SystemExit, match="unknown"):
        run_peers(tiny_model_dir, prompts_file, "--methods", "ours_nothing", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "sub" / "peers.json").read_text())["rows"]
    assert {k for k in rows if not k.startswith("llama_cpp")} == {"ours_plain", "ours_ngram"}
    assert rows["ours_ngram"]["equal_to_plain"] is True and rows["ours_ngram"]["equal_to_hf_generate"] is None
