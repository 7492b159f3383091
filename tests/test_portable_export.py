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


def fake_alias(monkeypatch, tmp_path, source: str) -> str:
    """An embedded alias whose "GGUF conversion" copies a saved tiny model (the real one needs the 100 MB GGUF)."""
    from specdraft.io import target as target_module

    gguf = tmp_path / "package" / "tiny.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(b"stand-in")
    monkeypatch.setitem(target_module.EMBEDDED_ALIASES, "tiny-alias", ("tiny_package", gguf.name))
    monkeypatch.setattr(target_module, "_gguf_file", lambda alias: gguf)
    monkeypatch.setattr(target_module, "_convert_gguf", lambda _, out_dir: shutil.copytree(source, out_dir))
    return "tiny-alias"


def test_an_export_resolves_its_alias_on_another_machine(tmp_path, monkeypatch):
    """Machine A distils from the alias; the export moves to machine B, whose cache is elsewhere and empty:
    loading resolves the recorded alias there (converting it into B's cache) and takes the same weights."""
    from specdraft.models.export import recorded_target

    alias = fake_alias(monkeypatch, tmp_path, save_tiny_model(tmp_path / "source"))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache-a"))
    export, drafter = export_for(load_target(alias, "float32").path, tmp_path / "machine-a" / "export", alias)
    assert str(tmp_path / "cache-a") not in (export / "config.json").read_text()  # nothing machine-local recorded
    moved = shutil.move(tmp_path / "machine-a" / "export", tmp_path / "machine-b-export")
    shutil.rmtree(tmp_path / "cache-a")
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache-b"))
    assert recorded_target(moved) == alias
    target = load_target(recorded_target(moved), "float32")
    assert target.path.startswith(str(tmp_path / "cache-b"))
    loaded, _ = load_drafter(moved, target.model, alias)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_set_verifier_rewrites_only_the_serving_field(tmp_path):
    from specdraft.models.export import recorded_target, set_serving_verifier

    folder = save_tiny_model(tmp_path / "t")
    export, _ = export_for(folder, tmp_path / "export", "smollm2-135m-instruct")
    elsewhere = save_tiny_model(tmp_path / "served-copy")
    assert set_serving_verifier(export, elsewhere) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == elsewhere
    assert recorded_target(export) == "smollm2-135m-instruct"  # what specdraft verifies with is unchanged
    with pytest.raises(FileNotFoundError, match="not a drafter export"):
        set_serving_verifier(tmp_path / "nothing", "x")
