"""The drafter export (DIR/export): a `speculators` checkpoint plus a small sidecar of ours.

`config.json` + `model.safetensors` are vLLM's speculators format (see train/speculators_export.py);
`specdraft.json` records the target the drafter was distilled from, so decoding with another
target is refused with both named, before any weight is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.io.files import write_folder_atomically
from specdraft.models.drafter import BlockDrafter
from specdraft.models.eagle3 import Eagle3Drafter
from specdraft.models.speculators_export import export_speculators, import_speculators

SIDECAR = "specdraft.json"
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "model_type")


def target_signature(target_model, name_or_path: str) -> dict:
    """What identifies a target for a drafter: its name and the shapes the drafter depends on."""
    config = target_model.config
    return {"name_or_path": name_or_path, **{k: getattr(config, k) for k in SHAPE_KEYS}}


def save_drafter(out_dir: Path, drafter: BlockDrafter | Eagle3Drafter, feature_layers, target_model, target_name: str, verifier_path: str) -> Path:
    """Write the export atomically: speculators checkpoint + sidecar."""

    def write(tmp: Path) -> None:
        if getattr(drafter, "mode", None) == "standalone":  # a plain HF model + the target's tokenizer
            from transformers import AutoTokenizer

            drafter.merged().save_pretrained(tmp)
            AutoTokenizer.from_pretrained(verifier_path).save_pretrained(tmp)
        else:
            export_speculators(drafter, feature_layers, verifier_path, target_model.config, tmp)
        sidecar = {"target": target_signature(target_model, target_name), "feature_layers": list(feature_layers)}
        (tmp / SIDECAR).write_text(json.dumps(sidecar, indent=2))

    return write_folder_atomically(out_dir, write)


def load_drafter(path: str | Path, target_model, target_name: str) -> tuple[BlockDrafter | Eagle3Drafter, tuple[int, ...]]:
    """A drafter export for this target (refused, naming both, if it was made for another)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a drafter export (no config.json); pass the export folder of a distill run")
    sidecar = path / SIDECAR
    expected = json.loads(sidecar.read_text())["target"] if sidecar.is_file() else None
    actual = target_signature(target_model, target_name)
    keys = SHAPE_KEYS
    if expected is None:  # a checkpoint from elsewhere: only the widths its decoder config records can be compared
        layer_config = json.loads((path / "config.json").read_text()).get("transformer_layer_config", {})
        expected = {"name_or_path": "(recorded in config.json)", **{k: layer_config.get(k) for k in SHAPE_KEYS}}
        keys = ("vocab_size", "hidden_size")
    if any(expected[k] != actual[k] for k in keys):
        raise ValueError(
            f"drafter {path} was distilled from target {expected['name_or_path']!r} "
            f"({', '.join(f'{k}={expected[k]}' for k in SHAPE_KEYS)}) but the target is {target_name!r} "
            f"({', '.join(f'{k}={actual[k]}' for k in SHAPE_KEYS)})"
        )
    try:
        drafter, layers = import_speculators(path, target_model.config)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"drafter export {path} is corrupt or incomplete ({type(err).__name__}: {err})") from None
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
    return drafter.to(device=target_model.device, dtype=target_model.dtype).eval(), layers
