"""Hostile inputs to the drafter loader: each is refused with one clear error naming the file and what to do, and
nothing is unpickled. (A truncated model.safetensors used to end in a raw SafetensorError from transformers.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.decode.config import ProposerConfig
from specdraft.decode.factory import make_proposer
from specdraft.io.target import load_target


@pytest.fixture()
def export(tiny_export):
    return Path(tiny_export)


def load(export_dir: Path, model_dir: str):
    target = load_target(model_dir, "float32")
    return make_proposer(ProposerConfig(name="drafter", path=str(export_dir)), target, model_dir)[0]


def edit_config(export_dir: Path, change) -> None:
    config = json.loads((export_dir / "config.json").read_text())
    change(config)
    (export_dir / "config.json").write_text(json.dumps(config))


def test_the_untouched_export_loads(export, tiny_model_dir):
    assert load(export, tiny_model_dir).feature_layers == (1, 2)


@pytest.mark.parametrize("damage", ["truncated", "header_only", "garbage", "empty"])
def test_a_damaged_safetensors_file_is_named_with_the_fix(export, tiny_model_dir, damage):
    weights = export / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "header_only": data[:8], "garbage": b"\x07" * 64,
                         "empty": b""}[damage])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt .*copy or export it again"):
        load(export, tiny_model_dir)


def test_pickle_weights_are_refused_and_never_unpickled(export, tiny_model_dir, monkeypatch):
    state = {"w": torch.zeros(2)}
    (export / "model.safetensors").unlink()
    torch.save(state, export / "pytorch_model.bin")
    unpickled = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a) or state)
    with pytest.raises(ValueError, match=r"holds pickle weights \(pytorch_model\.bin\).*never unpickles"):
        load(export, tiny_model_dir)
    assert not unpickled


def test_missing_weights_say_so(export, tiny_model_dir):
    (export / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no model.safetensors; export the drafter again"):
        load(export, tiny_model_dir)


def test_a_config_that_lies_about_shapes_is_refused(export, tiny_model_dir):
    edit_config(export, lambda c: c["transformer_layer_config"].update(
        intermediate_size=2 * c["transformer_layer_config"]["intermediate_size"]))
    with pytest.raises(ValueError, match="is corrupt or incomplete"):
        load(export, tiny_model_dir)


@pytest.mark.parametrize("layers, match", [([1, 7], r"layers \[7\] do not exist"),
                                           ([0, 1], r"trained on layers \[1, 2\] \(specdraft.json\)")])
def test_a_config_that_lies_about_layer_ids_is_refused(export, tiny_model_dir, layers, match):
    """Read from the wrong layers a drafter still runs and only its acceptance collapses: refuse it up front."""
    edit_config(export, lambda c: c.update(aux_hidden_state_layer_ids=layers))
    with pytest.raises(ValueError, match=match):
        load(export, tiny_model_dir)


def test_a_folder_that_is_not_an_export_is_named(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="is not a drafter export"):
        load(tmp_path, tiny_model_dir)


def test_a_disk_that_fills_during_a_checkpoint_keeps_the_last_one_and_resumes(tmp_path, monkeypatch):
    """A write that fails mid-checkpoint (ENOSPC from the file write, after the weights file) leaves no part of it,
    says what is kept, and the same command goes on from there once there is room."""
    import errno

    from specdraft.train.checkpoint import CheckpointWriteError, latest_checkpoint
    from tests.helpers import run, tiny_llama

    target = tiny_llama(0)
    _, reference = run(target, tmp_path / "reference")
    real = Path.write_bytes

    def full_disk(self, data):  # the disk fills while step 4's trainer state is written: half of it lands
        if self.name == "trainer_state.pt" and self.parent.name.startswith(".step-0000004-"):
            real(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"step-0000004 could not be written .*No space left on device.*"
                                                   r"step-0000002, is kept.*trainer.resume=auto"):
        run(target, tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-0000002"]  # nothing partial
    monkeypatch.setattr(Path, "write_bytes", real)
    _, resumed = run(target, tmp_path / "run")
    assert resumed["loss_history"] == reference["loss_history"][2:]


@pytest.mark.parametrize("kind", ["under_a_file", "read_only"])
def test_a_run_folder_that_cannot_be_written_is_refused_before_training(tmp_path, kind):
    import os

    from specdraft.train.checkpoint import CheckpointWriteError
    from tests.helpers import run, tiny_llama

    if kind == "under_a_file":  # a path through a file: no user can write there, root included
        (tmp_path / "a-file").write_text("")
        folder = tmp_path / "a-file" / "run"
    else:
        folder = tmp_path / "read-only"
        folder.mkdir()
        os.chmod(folder, 0o500)
        if os.access(folder, os.W_OK):
            os.chmod(folder, 0o700)
            pytest.skip("root writes anywhere: a read-only folder cannot be made (the under_a_file case runs)")
    try:
        with pytest.raises(CheckpointWriteError, match="cannot take checkpoints .*hydra.run.dir"):
            run(tiny_llama(0), folder)
    finally:
        if kind == "read_only":
            os.chmod(folder, 0o700)


def test_sharded_index_rules_follow_transformers(export, tiny_model_dir):
    """The single file wins over an index (transformers' order); a broken or empty index without it is named;
    trainer files beside the weights are not taken for pickle weights."""
    (export / "model.safetensors.index.json").write_text("[1, 2]")  # stale and malformed, but the single file is there
    (export / "training_args.bin").write_bytes(b"\x80\x04not read")
    assert load(export, tiny_model_dir).feature_layers == (1, 2)
    weights = (export / "model.safetensors").read_bytes()
    (export / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="is not a safetensors index"):
        load(export, tiny_model_dir)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="lists no weight files"):
        load(export, tiny_model_dir)
    (export / "shard-1.safetensors").write_bytes(weights)
    (export / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard-1.safetensors",
                                                                                   "y": "shard-2.safetensors"}}))
    with pytest.raises(ValueError, match="has no shard-2.safetensors"):
        load(export, tiny_model_dir)
