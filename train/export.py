"""Saving and loading a trained block drafter (DIR/export).

Layout: `drafter.json` (architecture, feature layers, vocabulary map size, and the target it was
distilled from) and `model.safetensors` (every weight except the target's embeddings, which are
re-read from the target at load time). Loading refuses a target other than the one recorded, naming
both. (Conversion to vLLM's `speculators` format is a separate step of the distillation issue.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from train.checkpoint import trainable_state
from train.drafter import BlockDrafter

FORMAT = "specdraft-drafter-1"
ARCHITECTURE_KEYS = ("mode", "num_layers", "block_size", "markov_rank", "markov_head_type", "mask_token_id")


def target_signature(target_model, name_or_path: str) -> dict:
    """What identifies a target for a drafter: its name and the shapes the drafter depends on."""
    config = target_model.config
    return {
        "name_or_path": name_or_path,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "model_type": config.model_type,
    }


def save_drafter(out_dir: Path, drafter: BlockDrafter, architecture: dict, feature_layers, target_signature_: dict) -> Path:
    """Write the drafter export atomically."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        save_file(trainable_state(drafter), str(tmp / "model.safetensors"))
        spec = {
            "format": FORMAT,
            "architecture": {k: architecture[k] for k in ARCHITECTURE_KEYS},
            "feature_layers": list(feature_layers),
            "draft_vocab_size": int(drafter.draft_to_target.numel()),
            "target": target_signature_,
        }
        (tmp / "drafter.json").write_text(json.dumps(spec, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def load_drafter(path: str | Path, target_model, target_name: str) -> tuple[BlockDrafter, tuple[int, ...]]:
    """A drafter export for this target (refused, naming both, if it was made for another)."""
    path = Path(path)
    spec_file = path / "drafter.json"
    if not spec_file.is_file():
        raise FileNotFoundError(f"{path} is not a drafter export (no drafter.json); pass the export folder of a distill run")
    spec = json.loads(spec_file.read_text())
    if spec.get("format") != FORMAT:
        raise ValueError(f"{path}: drafter format {spec.get('format')!r}, expected {FORMAT!r}")
    expected = spec["target"]
    actual = target_signature(target_model, target_name)
    shape_keys = ("vocab_size", "hidden_size", "num_hidden_layers", "model_type")
    if any(expected[k] != actual[k] for k in shape_keys):
        raise ValueError(
            f"drafter {path} was distilled from target {expected['name_or_path']!r} "
            f"({', '.join(f'{k}={expected[k]}' for k in shape_keys)}) but the target is {target_name!r} "
            f"({', '.join(f'{k}={actual[k]}' for k in shape_keys)})"
        )
    try:
        weights = load_file(str(path / "model.safetensors"))
    except Exception as err:
        raise ValueError(f"drafter weights {path / 'model.safetensors'} are corrupt or missing ({type(err).__name__}: {err})") from None
    arch = spec["architecture"]
    drafter = BlockDrafter(
        target_model.config, num_layers=arch["num_layers"], num_feature_layers=len(spec["feature_layers"]),
        block_size=arch["block_size"], mask_token_id=arch["mask_token_id"], mode=arch["mode"],
        markov_rank=arch["markov_rank"], markov_head_type=arch["markov_head_type"],
        draft_vocab_ids=weights["draft_to_target"],
    )
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"drafter weights in {path} do not match drafter.json: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
    return drafter.to(target_model.dtype).eval(), tuple(spec["feature_layers"])
