"""Kill anywhere, resume exactly: training processes SIGKILLed mid-step, mid-checkpoint-write and at random
moments, each resumed with trainer.resume=auto, end with the same weights (bit for bit, CPU) and the same
losses as one uninterrupted run; a half-written checkpoint is never picked up."""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.train.checkpoint import latest_checkpoint
from tests.helpers import killable_training

STEPS = 6


# forkserver: children fork from a fresh server process that imported torch and the helpers once, so a kill costs
# no import (a spawn would spend seconds each), and no lock held by a thread of the pytest process (earlier
# tests leave threads behind) can be inherited locked, as a plain fork from pytest could.
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["tests.helpers"])


def process(run_dir: Path, out: Path, kill=None):
    child = CONTEXT.Process(target=killable_training, args=(str(run_dir), str(out), kill))
    child.start()
    return child


def finish(run_dir: Path, out: Path) -> tuple[dict, dict]:
    child = process(run_dir, out)
    child.join(timeout=120)
    assert child.exitcode == 0, f"the resumed run failed (exit {child.exitcode})"
    return load_file(str(out) + ".safetensors"), json.loads(Path(str(out) + ".json").read_text())


def only_complete_checkpoints(run_dir: Path) -> None:
    for folder in (run_dir / "checkpoints").glob("step-*"):
        assert (folder / "meta.json").is_file(), f"{folder} is named like a checkpoint but incomplete"


def test_training_killed_anywhere_resumes_to_the_same_weights_and_losses(tmp_path):
    start = time.perf_counter()
    reference_weights, reference = finish(tmp_path / "reference", tmp_path / "reference-out")
    full_s = time.perf_counter() - start
    assert reference["steps"] == STEPS
    points = [("step", n) for n in range(1, STEPS + 1)] + [("checkpoint", n) for n in range(1, STEPS + 1)]
    rng = random.Random(0)
    points += [("random", rng.uniform(0.0, 0.8) * full_s) for _ in range(8)]  # 20 kill points in all
    for i, (where, at) in enumerate(points):
        run_dir, out = tmp_path / f"run-{i}", tmp_path / f"out-{i}"
        if where == "random":
            # The parent kills it wherever it is then (a step, a checkpoint, evaluation, the end), counting from its
            # first checkpoint: a kill before that would only test starting over.
            child = process(run_dir, out)
            first = run_dir / "checkpoints" / "step-0000001" / "meta.json"
            while child.is_alive() and not first.is_file():
                time.sleep(0.005)
            time.sleep(at)
            child.kill()
            child.join()
        else:
            child = process(run_dir, out, (where, at))
            child.join(timeout=120)
            assert child.exitcode == -signal.SIGKILL, (where, at, child.exitcode)
        if run_dir.exists():
            only_complete_checkpoints(run_dir)
        if where == "checkpoint":  # the half-written one is not picked up: the newest complete one is the step before
            latest = latest_checkpoint(run_dir)
            assert (latest is None and at == 1) or latest.name == f"step-{at - 1:07d}", (at, latest)
        weights, resumed = finish(run_dir, out)
        assert weights.keys() == reference_weights.keys()
        for name, tensor in weights.items():
            assert torch.equal(tensor, reference_weights[name]), (where, at, name)
        tail = reference["loss_history"][len(reference["loss_history"]) - len(resumed["loss_history"]):]
        assert resumed["loss_history"] == tail, (where, at)  # exactly, not approximately
        ran = len(resumed["loss_history"])  # it resumed from the last complete checkpoint, not from the start
        if where == "checkpoint":
            assert ran == STEPS - (at - 1), (where, at, ran)
        if where == "step" and at > 2:  # the loss's n-th call is in training step n or before it (eval calls it too)
            assert 1 <= ran < STEPS, (where, at, ran)
        if where == "random":
            assert ran < STEPS, (where, at, ran)  # it went on from a checkpoint (or had finished: ran == 0)
