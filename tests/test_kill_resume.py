"""Kill anywhere, resume exactly: training processes SIGKILLed mid-step, mid-checkpoint-write and at random
moments, each resumed with trainer.resume=auto, end with the same weights (bit for bit, CPU) and the same
losses as one uninterrupted run; a half-written checkpoint is never picked up. The same holds for a two-process
run (accelerate launch, its whole process group killed), for regeneration (killed mid-batch and mid-line, rerun:
the file one uninterrupted run writes) and for the export (killed before any of its file-system steps: the
destination holds the old export, the new one or nothing, never a part of either; a rerun writes it whole)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.io.files import current_umask
from specdraft.io.target import load_target
from specdraft.models.export import load_drafter, save_drafter
from specdraft.train.checkpoint import latest_checkpoint
from tests.helpers import (REPO, export_drafter, frozen, kill_tree, killable_export, killable_regeneration,
                           killable_training)

STEPS = 6


# forkserver: children fork from a fresh server process that imported torch and the helpers once, so a kill costs
# no import (a spawn would spend seconds each), and no lock held by a thread of the pytest process (earlier
# tests leave threads behind) can be inherited locked, as a plain fork from pytest could.
CONTEXT = multiprocessing.get_context("forkserver")
# What the regeneration and export children import (the pipeline, speculators: seconds each) comes through it too.
CONTEXT.set_forkserver_preload(["tests.helpers", "specdraft.pipeline", "specdraft.models.export", "speculators.models.dspark"])


def process(run_dir: Path, out: Path, kill=None):
    return start(killable_training, str(run_dir), str(out), kill)


def start(body, *args):
    child = CONTEXT.Process(target=frozen, args=(body, *args))
    child.start()
    return child


def kill_when(child, marker: Path, after_s: float) -> None:
    """SIGKILL the child `after_s` seconds after `marker` appears (or let it be, if it ended before)."""
    while child.is_alive() and not marker.exists():
        time.sleep(0.005)
    time.sleep(after_s)
    child.kill()
    child.join()


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
            kill_when(process(run_dir, out), run_dir / "checkpoints" / "step-0000001" / "meta.json", at)
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


# ---- two processes: accelerate launch (DDP over gloo), the launcher and both ranks SIGKILLed ----

TWO_TRAINER = {"steps": STEPS, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1, "eval_every": 3}


def launch_two(run_dir: Path, report_dir: Path, kill: dict | None = None) -> subprocess.Popen:
    """tests/dist_train.py on two processes; kill: dist_train's hook (that rank kills the whole launch there)."""
    spec = {"run_dir": str(run_dir), "report_dir": str(report_dir), "trainer": TWO_TRAINER}
    if kill:
        spec["kill"] = {**kill, "spare": os.getpid()}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf" / "accelerate" / "ddp.yaml"),
           "--num_processes", "2", str(REPO / "tests" / "dist_train.py"), json.dumps(spec)]
    with open(str(report_dir) + ".log", "w") as log:  # the launcher keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"},
                                stdout=log, stderr=subprocess.STDOUT)


def end_launch(launcher: subprocess.Popen, kill: bool = False) -> int:
    """The launcher's exit status, after SIGKILLing it and its ranks with kill=True (or when it hangs)."""
    if kill:
        kill_tree(launcher.pid)
    try:
        return launcher.wait(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(launcher.pid)
        raise


def wait_for(launcher: subprocess.Popen, marker: Path) -> None:
    while launcher.poll() is None and not marker.is_file():
        time.sleep(0.005)


def two_process_result(report_dir: Path) -> tuple[dict, list]:
    """Rank 0's final weights (rank 1's are the same, bit for bit) and the losses of the steps the launch ran."""
    weights = [load_file(str(report_dir / f"rank{rank}.safetensors")) for rank in (0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    return weights[0], json.loads((report_dir / "rank0.json").read_text())["loss_history"]


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted two-process run: weights, losses, and the seconds from its first checkpoint to its end."""
    root = tmp_path_factory.mktemp("two-reference")
    launcher = launch_two(root / "run", root / "report")
    wait_for(launcher, root / "run" / "checkpoints" / "step-0000001" / "meta.json")
    began = time.perf_counter()
    assert end_launch(launcher) == 0, Path(str(root / "report") + ".log").read_text()[-3000:]
    weights, losses = two_process_result(root / "report")
    assert len(losses) == STEPS
    return weights, losses, time.perf_counter() - began


@pytest.mark.parametrize("where,at,rank", [
    ("checkpoint", 3, 0),  # rank 0 between checkpoint 3's weights and its meta.json
    pytest.param("step", 4, 1, marks=pytest.mark.slow),  # rank 1 inside the loss's 4th call (step 3 or 4)
    pytest.param("random", 0.5, None, marks=pytest.mark.slow),  # the test, half way from checkpoint 1 to the end
])
def test_two_processes_killed_resume_to_the_same_weights_and_losses(tmp_path, two_process_reference, where, at, rank):
    reference_weights, reference_losses, span_s = two_process_reference
    run_dir = tmp_path / "run"
    if where == "random":
        launcher = launch_two(run_dir, tmp_path / "killed")
        wait_for(launcher, run_dir / "checkpoints" / "step-0000001" / "meta.json")
        time.sleep(at * span_s)
        status = end_launch(launcher, kill=True)
    else:
        status = end_launch(launch_two(run_dir, tmp_path / "killed", {"rank": rank, "where": where, "at": at}))
    assert status == -signal.SIGKILL, Path(str(tmp_path / "killed") + ".log").read_text()[-3000:]
    only_complete_checkpoints(run_dir)
    if where == "checkpoint":
        assert latest_checkpoint(run_dir).name == f"step-{at - 1:07d}"  # the half-written one is not picked up
    resumed = launch_two(run_dir, tmp_path / "resumed")  # trainer.resume=auto, the default
    assert end_launch(resumed) == 0, Path(str(tmp_path / "resumed") + ".log").read_text()[-3000:]
    weights, losses = two_process_result(tmp_path / "resumed")
    assert weights.keys() == reference_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference_weights[name]), (where, name)
    assert losses == reference_losses[len(reference_losses) - len(losses):]  # exactly
    if where == "checkpoint":
        assert len(losses) == STEPS - (at - 1)
    else:
        assert len(losses) < STEPS  # it went on from a checkpoint (or had finished)


# ---- regeneration: killed between batches, mid-batch and mid-line, then run again ----

REGEN_PROMPTS = [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 50}" for j in range(1 + i % 5))} for i in range(12)]


def records(path: Path) -> list[dict]:
    """Every line of a regeneration file as JSON (a torn line fails here)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("settings", [
    {"engine": False, "temperature": 0.0, "max_new_tokens": 8, "batch_size": 3},  # HF generate, greedy
    {"engine": False, "temperature": 0.8, "max_new_tokens": 8, "batch_size": 3},  # HF generate, sampling
    {"engine": True, "temperature": 0.8, "max_new_tokens": 8, "batch_size": 3},  # the pipeline's engine, sampling
], ids=["hf-greedy", "hf-sampled", "engine-sampled"])
def test_regeneration_killed_anywhere_reruns_to_the_same_file(tiny_model_dir, tmp_path, settings):
    def regeneration(out_dir: Path, tear=None):
        return start(killable_regeneration, tiny_model_dir, str(out_dir), REGEN_PROMPTS, settings, tear)

    span_s = timed(regeneration(tmp_path / "reference"), tmp_path / "reference" / "responses.jsonl")
    reference = records(tmp_path / "reference" / "responses.jsonl")
    assert sorted(r["id"] for r in reference) == sorted(p["id"] for p in REGEN_PROMPTS)
    # the n-th record torn: the first, mid-batch, a batch's first, the last; then three random moments
    rng = random.Random(1)
    points = [("tear", n) for n in (1, 2, 4, 8, 12)] + [("random", rng.uniform(0.0, 1.0) * span_s) for _ in range(3)]
    for i, (where, at) in enumerate(points):
        out_dir = tmp_path / f"run-{i}"
        if where == "tear":
            child = regeneration(out_dir, at)
            child.join(timeout=120)
            assert child.exitcode == -signal.SIGKILL, (where, at, child.exitcode)
            assert not (out_dir / "responses.jsonl").read_text().endswith("\n")  # the torn line is there
        else:
            kill_when(regeneration(out_dir), out_dir / "responses.jsonl", at)
        timed(regeneration(out_dir), out_dir / "responses.jsonl")  # the rerun, a fresh process
        assert records(out_dir / "responses.jsonl") == reference, (where, at)  # same ids, tokens, order; once each


def timed(child, marker: Path) -> float:
    """Seconds from `marker`'s appearance to the child's successful end (the span random kills are drawn in)."""
    while child.is_alive() and not marker.exists():
        time.sleep(0.005)
    began = time.perf_counter()
    child.join(timeout=120)
    assert child.exitcode == 0
    return time.perf_counter() - began


# ---- export: killed before each of save_drafter's file-system steps and at random moments ----

def snapshot(folder: Path) -> dict[str, bytes] | None:
    """Every file of a folder by name, with its bytes (None: no folder)."""
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.is_dir() else None


def test_export_killed_anywhere_leaves_old_new_or_nothing_and_reruns_whole(tiny_model_dir, tmp_path):
    target = load_target(tiny_model_dir, "float32")
    old_export = save_drafter(tmp_path / "old" / "export", export_drafter(target.model, 1), (1, 2), target.model,
                              tiny_model_dir, tiny_model_dir)
    old = snapshot(old_export)
    new_drafter = export_drafter(target.model, 0)
    for with_old in (False, True):
        # An uninterrupted export to the same place tells how many file-system steps it takes, and how long.
        reference_dir = tmp_path / f"reference-{with_old}"
        signals = reference_dir / "signals"
        prepare(reference_dir, signals, old_export if with_old else None)
        child = start(killable_export, tiny_model_dir, str(reference_dir / "out" / "export"), 0, None, str(signals))
        child.join(timeout=120)
        assert child.exitcode == 0
        new = snapshot(reference_dir / "out" / "export")
        assert new != old and new.keys() == old.keys()
        steps = json.loads((signals / "events.json").read_text())
        rng = random.Random(2)
        points = [("step", k) for k in range(1, steps["events"] + 1)]
        points += [("random", rng.uniform(0.0, 1.2) * steps["seconds"]) for _ in range(2)]
        seen = set()
        for i, (where, at) in enumerate(points):
            case, signals = tmp_path / f"case-{with_old}-{i}", tmp_path / f"case-{with_old}-{i}" / "signals"
            dest = case / "out" / "export"
            prepare(case, signals, old_export if with_old else None)
            child = start(killable_export, tiny_model_dir, str(dest), 0, at if where == "step" else None, str(signals))
            if where == "step":
                child.join(timeout=120)
                assert child.exitcode == -signal.SIGKILL, (with_old, where, at, child.exitcode)
            else:
                kill_when(child, signals / "started", at)
            state = snapshot(dest)
            # Whole or not there: the old export, the new one (killed after it was in place), or nothing at all.
            assert state in ((old, new) if with_old else (new,)) or state is None, (with_old, where, at, state and sorted(state))
            if state is not None:
                load_drafter(dest, target.model, tiny_model_dir)
            seen.add("absent" if state is None else "old" if state == old else "new")
            # What a kill leaves beside it (a part-written folder, the old export on its way out) is hidden by its
            # name, and a rerun neither reads it nor stops at it: the export it writes is the uninterrupted one.
            assert all(p.name.startswith(".") for p in dest.parent.iterdir() if p != dest), (with_old, where, at)
            save_drafter(dest, new_drafter, (1, 2), target.model, tiny_model_dir, tiny_model_dir)
            assert snapshot(dest) == new, (with_old, where, at)
            # and clears the killed writer's leftovers; the export is a plain folder (mkdir's mode, not mkdtemp's 0700)
            assert [p.name for p in dest.parent.iterdir()] == ["export"], (with_old, where, at)
            assert dest.stat().st_mode & 0o777 == 0o777 & ~current_umask()
        # The kills came before and after the export landed (and the old one was kept until it had).
        assert seen >= ({"old", "new"} if with_old else {"absent"}), (with_old, seen)


def prepare(case: Path, signals: Path, old_export: Path | None) -> None:
    """A case's folders; the older export at its destination, when there is one."""
    signals.mkdir(parents=True)
    (case / "out").mkdir()
    if old_export is not None:
        shutil.copytree(old_export, case / "out" / "export")
