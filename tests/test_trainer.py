"""The trainer: learns, checkpoints atomically, resumes with identical losses, refuses bad checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import tiny_llama
from specdraft.train.checkpoint import latest_checkpoint, load_checkpoint
from specdraft.train.config import TrackingConfig, TrainerConfig
from specdraft.models.drafter import BlockDrafter
from specdraft.train.trainer import TrainJob, train
from tests.helpers import examples, fresh_drafter, run


def test_resume_continues_with_identical_losses(tmp_path):
    target = tiny_llama(0)
    _, full = run(target, tmp_path / "a")
    assert full["steps"] == 6 and full["loss_history"][-1] < full["loss_history"][0]
    assert "eval/tau_estimate" in full
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-0000006")  # as if killed after step 5
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-0000004")
    _, resumed = run(target, tmp_path / "b")  # resume=auto picks step 2
    assert resumed["loss_history"] == pytest.approx(full["loss_history"][2:], rel=1e-5)


def test_checkpoint_errors_are_clear(tmp_path):
    target = tiny_llama(0)
    run(target, tmp_path, resume="never")
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-0000006"
    (latest / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt or incomplete"):
        load_checkpoint(latest, fresh_drafter(target))
    with pytest.raises(FileNotFoundError, match="not a specdraft checkpoint"):
        load_checkpoint(tmp_path, fresh_drafter(target))
    other = BlockDrafter(target.config, num_layers=2, num_feature_layers=2, block_size=4, markov_rank=8)
    with pytest.raises(ValueError, match="does not fit this drafter"):
        load_checkpoint(tmp_path / "checkpoints" / "step-0000004", other)


def test_resume_with_changed_data_is_refused(tmp_path):
    target = tiny_llama(0)
    run(target, tmp_path)  # 6 steps on 6 examples; then the data grows under the checkpoint
    cfg = TrainerConfig(steps=8, batch_size=2, warmup_steps=1, checkpoint_every=2, eval_every=3)
    with pytest.raises(ValueError, match="trained on 6 examples .* but 7 are given now"):
        train(TrainJob(fresh_drafter(target), target, examples(7), examples(2), (1, 2), 4, 0, tmp_path), cfg,
              TrackingConfig(wandb_mode="disabled"))
    changed = examples(6)
    changed[3]["input_ids"][-1] += 1  # same count, other tokens
    with pytest.raises(ValueError, match="the data changed"):
        train(TrainJob(fresh_drafter(target), target, changed, examples(2), (1, 2), 4, 0, tmp_path), cfg,
              TrackingConfig(wandb_mode="disabled"))


def test_compiled_layers_train_like_the_reference(tmp_path):
    """trainer.compile: the same losses as the uncompiled reference (eager backend: the wiring, not inductor)."""
    target = tiny_llama(0)
    _, reference = run(target, tmp_path / "plain", resume="never")
    drafter, compiled = run(target, tmp_path / "compiled", resume="never", compile=True, compile_backend="eager")
    assert all(layer._compiled_call_impl is not None for layer in drafter.layers)  # really compiled
    assert compiled["loss_history"] == pytest.approx(reference["loss_history"], rel=1e-5)


def test_evaluation_can_read_other_signals_than_training(tmp_path):
    """A lossy training cache (top-k) must not bias held-out figures: evaluation takes its own signals."""
    from specdraft.train.signals import target_signals

    calls = {"train": 0, "eval": 0}

    def counted(name):
        def signals(*args):
            calls[name] += 1
            return target_signals(*args)
        return signals

    target = tiny_llama(0)
    cfg = TrainerConfig(steps=2, batch_size=2, lr=3e-3, warmup_steps=1, checkpoint_every=10, eval_every=2, resume="never")
    train(TrainJob(fresh_drafter(target), target, examples(), examples(2), (1, 2), 4, 0, tmp_path), cfg,
          TrackingConfig(wandb_mode="disabled"), signals=counted("train"), eval_signals=counted("eval"))
    assert calls == {"train": 2, "eval": 1}


def test_tied_weights_checkpoint_once_and_load_back(tmp_path):
    """A drafter with tied embeddings / LM head (the standalone drafter of a tied target such as SmolLM2)."""
    from specdraft.train.checkpoint import load_checkpoint, save_checkpoint

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.inner.weight

    model = Tied()
    path = save_checkpoint(tmp_path, 1, model, {"x": torch.zeros(1)}, {})
    fresh = Tied()
    load_checkpoint(path, fresh)
    assert torch.equal(fresh.head.weight, model.inner.weight) and fresh.head.weight is fresh.inner.weight


@pytest.mark.parametrize("key, value, choices", [("markov_inputs", "drafted", "teacher or sampled"),
                                                 ("ce_labels", "argmax", "data or target_argmax")])
def test_loss_options_name_their_choices(key, value, choices):
    from specdraft.train.trainer import _settings

    with pytest.raises(ValueError, match=f"trainer.{key}='{value}'; choose {choices}"):
        _settings(TrainerConfig(**{key: value}))
