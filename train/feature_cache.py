"""Offline target-feature cache: what `train.signals.target_signals` computes, written once as sharded
safetensors and read back memory-mapped at training time, so a run (or many runs) pays the target once.

Layout of a cache folder:
  manifest.json                      format, fingerprint (target, layers, draft vocabulary, data), form,
                                     dtype, shards, token count, bytes per token; written last
  shard-w{W}-r{R}-{N:05d}.safetensors  rank R of W's N-th shard; per sequence `{key}.features` (T, L*H),
                                     and the target's distribution over the draft vocabulary as either
                                     `{key}.probs` (T, V_draft) (form `full`) or `{key}.topk_ids`/`{key}.topk_probs`
                                     (T, k) (form `topk`: the k most likely target tokens; the rest counts as
                                     mass the drafter cannot match, like tokens outside the draft vocabulary),
                                     plus `{key}.outside` (T,) float32

A sequence's key hashes its tokens, so any rank finds any sequence; each rank writes every W-th
example, shards are written atomically and a rerun skips finished ones (resumable). A cache made
for another target, layer set, draft vocabulary or data is refused with both fingerprints shown.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdraft.train.signals import pad_rows, target_signals
from specdraft.train.trainer import make_batch

FORMAT = "specdraft-feature-cache-1"
FORMS = ("full", "topk")


def sequence_key(ids) -> str:
    """A sequence's name in the cache: a hash of its token ids."""
    return hashlib.sha256(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()[:24]


def cache_fingerprint(target_model, target_name: str, feature_layers, draft_to_target: torch.Tensor, data_fingerprint: str) -> dict:
    """What a cache depends on: the target (name, shapes, a sample of its weights), layers, vocabulary, data."""
    config = target_model.config
    embed = target_model.get_input_embeddings().weight.detach()
    sampled = embed[:: max(1, embed.shape[0] // 64)].float().cpu().numpy().tobytes()  # 64 rows: cheap, weight-specific
    return {
        "target": {"name_or_path": target_name, "model_type": config.model_type, "hidden_size": config.hidden_size,
                   "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
                   "weights_sha": hashlib.sha256(sampled).hexdigest()[:16]},
        "feature_layers": list(feature_layers),
        "draft_vocab_sha": hashlib.sha256(draft_to_target.cpu().numpy().tobytes()).hexdigest()[:16],
        "data": data_fingerprint,
    }


def _row_tensors(key: str, features, probs, outside, form: str, dtype: torch.dtype, top_k: int | None) -> dict:
    """One sequence's stored tensors; features (T, L*H), probs (T, V_draft), outside (T,)."""
    stored = {f"{key}.features": features.to(dtype).contiguous(), f"{key}.outside": outside.float().contiguous()}
    if form == "full":
        stored[f"{key}.probs"] = probs.to(dtype).contiguous()
    else:
        values, ids = probs.topk(min(top_k, probs.shape[-1]), dim=-1)  # (T, k)
        stored[f"{key}.topk_ids"] = ids.to(torch.int32).contiguous()
        stored[f"{key}.topk_probs"] = values.to(dtype).contiguous()
        # The dropped tail is mass the drafter can no longer be told about: count it as outside.
        stored[f"{key}.outside"] = (outside.float() + probs.float().sum(-1) - values.float().sum(-1)).clamp_min(0).contiguous()
    return stored


@torch.no_grad()
def write_shards(out_dir: Path, target_model, examples: list[dict], feature_layers, draft_to_target: torch.Tensor,
                 *, form: str = "full", dtype: str = "bfloat16", top_k: int | None = None, batch_size: int = 4,
                 shard_examples: int = 128, rank: int = 0, world: int = 1) -> list[str]:
    """Rank `rank` of `world` computes every world-th example and writes its shards; returns their names."""
    if form not in FORMS or (form == "topk" and not top_k):
        raise ValueError(f"features.form={form!r}: choose one of {FORMS} (topk needs features.top_k > 0)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    device = next(target_model.parameters()).device
    mine = list(range(rank, len(examples), world))
    names = []
    for number, start in enumerate(range(0, len(mine), shard_examples)):
        name = f"shard-w{world}-r{rank}-{number:05d}.safetensors"
        names.append(name)
        if (out_dir / name).is_file():  # finished by an earlier, interrupted run
            continue
        tensors = {}
        chunk = mine[start : start + shard_examples]
        for b in range(0, len(chunk), batch_size):
            indices = chunk[b : b + batch_size]
            batch = make_batch(examples, indices, epoch=0, seed=0, pad_id=0)  # right-padded; padding never stored
            features, probs, outside = target_signals(target_model, batch.input_ids.to(device), batch.attention_mask.to(device),
                                                      feature_layers, draft_to_target.to(device))
            for j, row in enumerate(examples[i]["input_ids"] for i in indices):
                n = len(row)
                tensors.update(_row_tensors(sequence_key(row), features[j, :n].cpu(), probs[j, :n].cpu(), outside[j, :n].cpu(),
                                            form, torch_dtype, top_k))
        tmp = out_dir / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, out_dir / name)
    return names


def write_manifest(out_dir: Path, fingerprint: dict, examples: list[dict], form: str, dtype: str, top_k: int | None) -> dict:
    """Rank 0, after every rank's shards exist: the manifest that makes the cache usable (written last, atomically)."""
    out_dir = Path(out_dir)
    shards = sorted(p.name for p in out_dir.glob("shard-*.safetensors"))
    keys = set()
    for shard in shards:
        with safe_open(str(out_dir / shard), framework="pt") as handle:
            keys.update(k.split(".")[0] for k in handle.keys())
    missing = [i for i, e in enumerate(examples) if sequence_key(e["input_ids"]) not in keys]
    if missing:
        raise ValueError(f"feature cache {out_dir} lacks {len(missing)} of {len(examples)} sequences (first: {missing[:5]}); "
                         "rerun the cache stage (it skips finished shards)")
    tokens = sum(len(e["input_ids"]) for e in examples)
    size = sum((out_dir / s).stat().st_size for s in shards)
    manifest = {"format": FORMAT, "fingerprint": fingerprint, "form": form, "dtype": dtype, "top_k": top_k,
                "shards": shards, "num_sequences": len(examples), "num_tokens": tokens, "bytes": size,
                "bytes_per_token": size / max(tokens, 1)}
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out_dir / "manifest.json")
    return manifest


def read_manifest(path: Path) -> dict | None:
    file = Path(path) / "manifest.json"
    return json.loads(file.read_text()) if file.is_file() else None


class FeatureCache:
    """A finished cache as a drop-in for `target_signals` (same signature and outputs, float32)."""

    def __init__(self, path: Path, expected: dict):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if self.manifest is None or self.manifest.get("format") != FORMAT:
            raise FileNotFoundError(f"{self.path} is not a finished feature cache (no {FORMAT} manifest.json); "
                                    "build it with the distill cache stage (features.path=DIR)")
        if self.manifest["fingerprint"] != expected:
            differs = sorted(k for k in {*expected, *self.manifest["fingerprint"]}
                             if expected.get(k) != self.manifest["fingerprint"].get(k))
            raise ValueError(
                f"feature cache {self.path} was made for another setting ({', '.join(differs)} differ):\n"
                f"  cache: {json.dumps({k: self.manifest['fingerprint'].get(k) for k in differs})}\n"
                f"  run:   {json.dumps({k: expected.get(k) for k in differs})}\n"
                "use a cache built for this target, layer set, draft vocabulary and data, or a new features.path")
        self.handles, self.where = {}, {}
        for shard in self.manifest["shards"]:
            handle = safe_open(str(self.path / shard), framework="pt")  # memory-mapped: tensors load on demand
            self.handles[shard] = handle
            for name in handle.keys():
                self.where[name.split(".")[0]] = shard

    def _row(self, ids, vocab: int):
        key = sequence_key(ids)
        if key not in self.where:
            raise KeyError(f"sequence {key} is not in feature cache {self.path}: the training data changed since it was built")
        handle = self.handles[self.where[key]]
        features = handle.get_tensor(f"{key}.features").float()
        outside = handle.get_tensor(f"{key}.outside").float()
        if self.manifest["form"] == "full":
            probs = handle.get_tensor(f"{key}.probs").float()
        else:  # densify the top-k over the draft vocabulary: (T, k) -> (T, V_draft)
            top_ids = handle.get_tensor(f"{key}.topk_ids").long()
            probs = torch.zeros((top_ids.shape[0], vocab)).scatter_(-1, top_ids, handle.get_tensor(f"{key}.topk_probs").float())
        return features, probs, outside

    def __call__(self, target_model, input_ids, attention_mask, feature_layers, draft_to_target):
        """features (B, T, L*H), probabilities over the draft vocabulary (B, T, V_draft), mass outside it (B, T)."""
        lengths = attention_mask.sum(-1).tolist()
        rows = [self._row(row[:n].cpu(), len(draft_to_target)) for row, n in zip(input_ids, lengths)]
        return tuple(t.to(input_ids.device) for t in pad_rows(rows, *input_ids.shape))
