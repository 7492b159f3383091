"""The offline feature cache: online and offline feeding give identical batches (float32) and equal losses;
bf16 storage stays close; top-k keeps the k most likely tokens and counts the rest as unmatched mass;
several writers shard the work and a rerun resumes; a cache for another setting is refused with both
fingerprints shown; distill.py builds and trains from it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import tiny_llama
from tests.helpers import examples
from specdraft.train.feature_cache import FeatureCache, cache_fingerprint, read_manifest, write_manifest, write_shards
from specdraft.train.signals import target_signals
from specdraft.train.step import LossSettings, distill_step
from specdraft.train.trainer import data_fingerprint, make_batch

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0)
    rows = examples(6, length=20) + examples(3, length=11)
    draft_to_target = torch.arange(2, 50)  # a reduced draft vocabulary: the target has mass outside it
    return target, rows, draft_to_target


def build(path, target, rows, draft_to_target, world=1, **kwargs):
    fingerprint = cache_fingerprint(target, "tiny", LAYERS, draft_to_target, data_fingerprint(rows))
    for rank in range(world):
        write_shards(path, target, rows, LAYERS, draft_to_target, rank=rank, world=world, batch_size=2, shard_examples=2, **kwargs)
    form, dtype, top_k = kwargs.get("form", "full"), kwargs.get("dtype", "bfloat16"), kwargs.get("top_k")
    write_manifest(path, fingerprint, rows, form, dtype, top_k)
    return FeatureCache(path, fingerprint)


def test_offline_batches_equal_online_in_float32(tmp_path, setup):
    target, rows, draft_to_target = setup
    cache = build(tmp_path, target, rows, draft_to_target, dtype="float32")
    batch = make_batch(rows, [1, 7, 3], epoch=0, seed=0, pad_id=0)  # mixed lengths, right-padded
    online = target_signals(target, batch.input_ids, batch.attention_mask, LAYERS, draft_to_target)
    offline = cache(target, batch.input_ids, batch.attention_mask, LAYERS, draft_to_target)
    real = batch.attention_mask.bool()
    for a, b in zip(online, offline):  # equal up to float32 rounding (the cache ran other batch shapes)
        assert torch.allclose(a[real], b[real], rtol=1e-5, atol=1e-6)
    # The training step sees the same loss either way.
    from tests.helpers import fresh_drafter

    loss_online, _ = distill_step(fresh_drafter(target), target, batch, LAYERS, 4, LossSettings())
    loss_offline, _ = distill_step(fresh_drafter(target), target, batch, LAYERS, 4, LossSettings(), signals=build(
        tmp_path / "full_vocab", target, rows, torch.arange(64), dtype="float32"))
    assert float(loss_offline.detach()) == pytest.approx(float(loss_online.detach()), rel=1e-6)


def test_bf16_and_topk_forms(tmp_path, setup):
    target, rows, draft_to_target = setup
    batch = make_batch(rows, [0, 8], epoch=0, seed=0, pad_id=0)
    real = batch.attention_mask.bool()
    features, probs, outside = target_signals(target, batch.input_ids, batch.attention_mask, LAYERS, draft_to_target)
    bf16 = build(tmp_path / "bf16", target, rows, draft_to_target)(target, batch.input_ids, batch.attention_mask, LAYERS, draft_to_target)
    assert torch.allclose(bf16[0][real], features[real], rtol=1e-2, atol=1e-2)
    assert torch.allclose(bf16[1][real], probs[real], atol=4e-3)
    top = build(tmp_path / "top", target, rows, draft_to_target, form="topk", top_k=4, dtype="float32")
    _, top_probs, top_outside = top(target, batch.input_ids, batch.attention_mask, LAYERS, draft_to_target)
    assert ((top_probs[real] > 0).sum(-1) <= 4).all()
    kept = probs[real].topk(4, dim=-1)
    assert torch.allclose(top_probs[real].gather(-1, kept.indices), kept.values)
    # Everything the drafter is not told about counts as unmatched: the mass still sums to one.
    assert torch.allclose(top_probs[real].sum(-1) + top_outside[real], torch.ones(int(real.sum())), atol=1e-5)
    assert (top_outside[real] >= outside[real] - 1e-6).all()
    build(tmp_path / "full32", target, rows, draft_to_target, dtype="float32")
    full_bytes, top_bytes, bf16_bytes = (read_manifest(tmp_path / n)["bytes_per_token"] for n in ("full32", "top", "bf16"))
    assert top_bytes < full_bytes and bf16_bytes < full_bytes


def test_sharded_writers_and_resume(tmp_path, setup):
    target, rows, draft_to_target = setup
    cache = build(tmp_path, target, rows, draft_to_target, world=2)
    manifest = read_manifest(tmp_path)
    assert {s.split("-")[2] for s in manifest["shards"]} == {"r0", "r1"}  # both writers' shards
    assert manifest["num_sequences"] == len(rows) and manifest["bytes_per_token"] > 0
    assert len(cache.where) == len(rows)
    # Resume: a lost shard is rewritten, finished ones are left alone.
    lost = tmp_path / manifest["shards"][0]
    kept = tmp_path / manifest["shards"][1]
    lost.unlink()
    stamp = kept.stat().st_mtime_ns
    write_shards(tmp_path, target, rows, LAYERS, draft_to_target, rank=0, world=2, batch_size=2, shard_examples=2)
    write_shards(tmp_path, target, rows, LAYERS, draft_to_target, rank=1, world=2, batch_size=2, shard_examples=2)
    assert lost.is_file() and kept.stat().st_mtime_ns == stamp


def test_cache_for_another_setting_is_refused(tmp_path, setup):
    target, rows, draft_to_target = setup
    build(tmp_path, target, rows, draft_to_target)
    other_layers = cache_fingerprint(target, "tiny", (0, 1), draft_to_target, data_fingerprint(rows))
    with pytest.raises(ValueError, match=r"feature_layers differ(.|\n)*cache: \{\"feature_layers\": \[1, 2\]\}(.|\n)*run:   \{\"feature_layers\": \[0, 1\]\}"):
        FeatureCache(tmp_path, other_layers)
    other_target = cache_fingerprint(tiny_llama(1), "tiny", LAYERS, draft_to_target, data_fingerprint(rows))
    with pytest.raises(ValueError, match="target differ"):
        FeatureCache(tmp_path, other_target)
    with pytest.raises(FileNotFoundError, match="not a finished feature cache"):
        FeatureCache(tmp_path / "nothing", other_target)
    cache = FeatureCache(tmp_path, cache_fingerprint(target, "tiny", LAYERS, draft_to_target, data_fingerprint(rows)))
    unknown = make_batch(examples(1, length=9), [0], 0, 0, 0)
    with pytest.raises(KeyError, match="not in feature cache"):
        cache(target, unknown.input_ids, unknown.attention_mask, LAYERS, draft_to_target)


def test_distill_builds_and_trains_from_the_cache(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    from tests.helpers import REPO

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"w{i} w{i + 1} w3", "response": "w1 w2 w5 w7"}) + "\n"
                            for i in range(12)))
    base = [sys.executable, str(REPO / "train" / "distill.py"), "experiment=smoke", f"target.name_or_path={tiny_model_dir}",
            "data=jsonl", f"data.path={chat}", "data.regenerate=false", "drafter.draft_vocab_size=32",
            "drafter.feature_layers=[0,1]", "validate.num_prompts=0", f"features.path={tmp_path / 'cache'}"]
    first = subprocess.run(base + [f"hydra.run.dir={tmp_path / 'a'}"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = read_manifest(tmp_path / "cache")
    assert manifest["num_sequences"] == 10 and "bytes per token" in first.stdout
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert "features" in results["stage_seconds"] and results["train_steps"] == 6
    # Another layer set must not silently reuse it.
    second = subprocess.run(base + ["drafter.feature_layers=[1,1]", f"hydra.run.dir={tmp_path / 'b'}"],
                            capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert second.returncode != 0 and "feature_layers differ" in second.stderr
