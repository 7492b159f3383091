"""decode/bench.py end to end on a tiny saved model: the results.json / samples.jsonl contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from specdraft.decode.bench import run_bench
from specdraft.decode.memory import kv_cache_bytes
from tests.helpers import bench_config, save_tiny_model

REPO = Path(__file__).resolve().parents[1]
RESULT_KEYS = {
    "tau", "tokens_per_s", "plain_tokens_per_s", "speedup_vs_plain", "hf_generate_tokens_per_s",
    "acceptance_by_position", "mean_draft_len", "fallbacks", "ttft_s", "tpot_s", "peak_rss_mb", "lossless",
    "match_rate", "config",
}


@pytest.mark.parametrize("proposer", [["proposer=ngram"], ["proposer=model", "proposer.num_layers=1"]])
def test_bench_writes_contract(tiny_model_dir, prompts_file, tmp_path, proposer):
    cfg = bench_config(
        [f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", "data=jsonl", f"data.path={prompts_file}",
         "bench.num_prompts=2", "decode.max_new_tokens=12", "decode.num_draft=3", f"out_dir={tmp_path}"] + proposer
    )
    run_bench(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    assert RESULT_KEYS <= results.keys()
    assert results["lossless"] is True and results["match_rate"] == 1.0
    assert results["tau"] >= 1.0 and results["num_prompts"] == 2
    assert results["config"]["decode"]["num_draft"] == 3
    # How the target ran: the fast backend by default (a tiny Llama in fp32 is supported), and the dtype's reason.
    assert results["target_backend"]["requested"] == "auto" and results["target_backend"]["name"] == "fast"
    assert results["target_dtype"] == {"dtype": "float32", "requested": "float32",
                                       "reason": "target.dtype=float32 as configured"}
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["id"] for s in samples] == ["a", "prompts-2"]
    memory = results["memory_bytes"]
    assert memory.keys() == {"target_weights", "fast_backend_weights", "drafter_weights", "kv_cache"}
    # ngram holds no weights; a one-layer copy of the two-layer target holds its own, fewer than the target's
    assert (memory["drafter_weights"] == 0) == (proposer == ["proposer=ngram"])
    assert memory["drafter_weights"] < memory["target_weights"]
    longest = max(len(s["prompt_token_ids"]) for s in samples) + 12
    assert memory["kv_cache"] == kv_cache_bytes(AutoConfig.from_pretrained(tiny_model_dir), longest, torch.float32)
    for sample in samples:
        assert {"id", "prompt", "prompt_token_ids", "output_token_ids", "output_text"} <= sample.keys()
        assert 1 <= len(sample["output_token_ids"]) <= 12


def test_bench_sampling_reports_null_exactness(tiny_model_dir, prompts_file, tmp_path):
    cfg = bench_config(
        [f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", "data=jsonl", f"data.path={prompts_file}",
         "bench.num_prompts=1", "decode.max_new_tokens=6", "decode.temperature=1.0", "decode.top_p=0.9",
         "bench.baselines=false", f"out_dir={tmp_path}"]
    )
    results = run_bench(cfg)
    assert results["lossless"] is None and results["match_rate"] is None
    assert results["hf_generate_tokens_per_s"] is None


def test_bench_script_runs_under_hydra(tiny_model_dir, prompts_file, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "decode" / "bench.py"), f"target.name_or_path={tiny_model_dir}",
           "target.dtype=float32", "data=jsonl", f"data.path={prompts_file}", "bench.num_prompts=1",
           "decode.max_new_tokens=4", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tau" in proc.stdout and "lossless" in proc.stdout
    assert json.loads((run_dir / "results.json").read_text())["lossless"] is True  # out_dir defaults to Hydra's run dir


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.2, top_p=0.8)])
def test_sampled_plain_loop_equals_hf_generate_with_same_seed(target_model, settings):
    """Same seed, same RNG use: our sampling must pick exactly HF generate's tokens (HF semantics)."""
    import torch

    from specdraft.decode.bench_setup import hf_generate, strip_generation_defaults
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import NoProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession

    sampler = Sampler(**settings)
    target_model.generation_config.top_k = 3  # a checkpoint default that must not leak into HF's run
    strip_generation_defaults(target_model)
    session = CausalSession(target_model)
    for seed in range(4):
        torch.manual_seed(seed)
        ours = speculative_generate(session, [5, 6, 7], NoProposer(), GenerateConfig(sampler, 25, 0)).output_ids
        torch.manual_seed(seed)
        theirs = hf_generate(target_model, [5, 6, 7], sampler, 25, [], 0).output_ids
        assert ours == theirs


def test_repeats_keep_the_fastest_run_and_rotate_the_order():
    """bench.repeats: every method runs `repeats` times per prompt, in a rotated order, and the run with the
    shortest total time is kept, whole (noise only adds time); tokens and step statistics come from the first run."""
    from specdraft.decode.bench_setup import run_interleaved
    from specdraft.decode.generate import Generation

    calls, times = [], {"a": iter([(1.0, 5.0), (0.5, 4.0), (0.8, 3.0)]), "b": iter([(2.0, 9.0), (2.5, 7.0), (3.0, 8.0)])}

    def run(kind, index, ids):
        calls.append(kind)
        if len(ids) == 16:  # the warm-up call, on the prompt's first 16 tokens
            return Generation(output_ids=[0])
        ttft, decoding = next(times[kind])
        tokens = [7, 8] if (kind, len([c for c in calls if c == kind])) != ("b", 4) else [7, 9]
        return Generation(output_ids=tokens, drafted=[len(calls)], ttft_s=ttft, total_s=ttft + decoding)

    results = run_interleaved(["a", "b"], run, [list(range(20))], repeats=3)
    assert calls[2:] == ["a", "b", "b", "a", "a", "b"]  # after the warm-ups, rounds rotate the order
    a, b = results["a"][0], results["b"][0]
    assert (a.ttft_s, a.total_s) == (0.8, 3.8)  # the fastest whole run, not the fastest prefill of another
    assert (b.ttft_s, b.total_s) == (2.5, 9.5)
    assert a.drafted == [3] and a.output_ids == [7, 8]  # the first run's statistics
    assert (a.repeats_differ, b.repeats_differ) == (0, 1)
    with pytest.raises(ValueError, match="bench.repeats=0"):
        run_interleaved(["a"], run, [list(range(20))], repeats=0)


def test_proposer_verifier_picks_the_target_an_export_is_verified_with(tiny_model_dir, tiny_export, prompts_file,
                                                                       tmp_path):
    """proposer.verifier=export takes the target the export records (target.name_or_path is ignored), a path is
    checked against the export's fingerprint, and the option needs a drafter export."""
    from specdraft.decode.bench_setup import with_verifier

    base = ["proposer=drafter", f"proposer.path={tiny_export}", "target.name_or_path=some/other-model",
            f"out_dir={tmp_path / 'o'}"]
    cfg = with_verifier(bench_config(base + ["proposer.verifier=export"]))
    assert cfg.target.name_or_path == tiny_model_dir
    other = save_tiny_model(tmp_path / "other", seed=5)  # same shapes, other weights
    run = bench_config(base + [f"proposer.verifier={other}", "target.dtype=float32", "data=jsonl",
                               f"data.path={prompts_file}"])
    with pytest.raises(ValueError, match=f"but the target is '{other}'.*proposer.verifier=export"):
        run_bench(run)
    with pytest.raises(ValueError, match="applies to a drafter export"):
        with_verifier(bench_config(["proposer=ngram", "proposer.verifier=export", f"out_dir={tmp_path}"]))


def test_kv_cache_bytes_are_what_the_hf_cache_holds():
    from tests.helpers import tiny_llama

    model = tiny_llama(0)
    with torch.no_grad():
        cache = model(torch.arange(11)[None], use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_cache_bytes(model.config, 11, torch.float32) == held


def test_spread_prompts_cover_every_mt_bench_category():
    from collections import Counter

    from specdraft.io.data import load_prompts

    first, spread = load_prompts("mtbench", num_prompts=16), load_prompts("mtbench", num_prompts=16, spread=True)
    assert len(Counter(p["category"] for p in first)) < 8  # the file is sorted by category
    assert Counter(p["category"] for p in spread) == {c: 2 for c in {p["category"] for p in load_prompts("mtbench")}}
    assert load_prompts("mtbench", num_prompts=500, spread=True) == load_prompts("mtbench")
