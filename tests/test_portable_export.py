"""Exports move between machines: config.json names the target as a serving engine resolves it, loading reads the
verifier weights from the target loaded here, and a different target is refused by its fingerprint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdraft.io.target import SERVING_IDS, load_target, same_target, serving_name, target_fingerprint
from specdraft.models.drafter import BlockDrafter
from specdraft.models.export import load_drafter, save_drafter
from tests.helpers import save_tiny_model


def export_for(target_dir: str, out, name: str):
    target = load_target(target_dir, "float32")
    torch.manual_seed(0)
    drafter = BlockDrafter(target.model.config, 1, 2, block_size=3, mask_token_id=0, markov_rank=8)
    drafter.copy_target_weights(target.model)
    return save_drafter(out, drafter, (1, 2), target.model, name, target_dir), drafter


def test_export_moves_with_its_target(tmp_path):
    first = save_tiny_model(tmp_path / "machine-a" / "target")
    export, drafter = export_for(first, tmp_path / "machine-a" / "export", first)
    assert json.loads((export / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == first
    # Another machine: the target and the export live elsewhere, the first folder is gone.
    shutil.move(tmp_path / "machine-a", tmp_path / "machine-b")
    moved_target, moved_export = tmp_path / "machine-b" / "target", tmp_path / "machine-b" / "export"
    target = load_target(str(moved_target), "float32")
    loaded, layers = load_drafter(moved_export, target.model, str(moved_target))
    assert layers == (1, 2)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_different_target_with_the_same_shapes_is_refused_naming_both(tmp_path):
    ours = save_tiny_model(tmp_path / "ours", seed=0)
    theirs = save_tiny_model(tmp_path / "theirs", seed=1)  # same config, other weights
    export, _ = export_for(ours, tmp_path / "export", "my-target")
    other = load_target(theirs, "float32")
    with pytest.raises(ValueError, match=r"distilled from target 'my-target' .*weights config .* but the target is "
                                         r"'their-target' .*weights config"):
        load_drafter(export, other.model, "their-target")


def test_fingerprint_ignores_dtype_and_folder(tmp_path):
    folder = save_tiny_model(tmp_path / "t")
    copy = shutil.copytree(folder, tmp_path / "copy")
    fp32 = target_fingerprint(load_target(folder, "float32").model)
    for dtype in ("bfloat16", "float16"):
        assert same_target(fp32, target_fingerprint(load_target(str(copy), dtype).model)), dtype
    other = target_fingerprint(load_target(save_tiny_model(tmp_path / "o", seed=2), "float32").model)
    assert not same_target(fp32, other)  # same config, other weights
    assert not same_target(fp32, {**fp32, "config": "0" * 16})


def test_an_alias_is_exported_as_its_hub_id(tmp_path):
    assert serving_name("smollm2-135m-instruct") == SERVING_IDS["smollm2-135m-instruct"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert serving_name("org/model") == "org/model"
    folder = save_tiny_model(tmp_path / "t")
    export, _ = export_for(folder, tmp_path / "export", "smollm2-135m-instruct")
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads((export / "specdraft.json").read_text())["target"]["name_or_path"] == "smollm2-135m-instruct"
