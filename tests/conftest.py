"""Shared test fixtures: tiny random Llama models built in the test, and small helpers."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings
from tests.helpers import save_tiny_model, tiny_llama

# Tiny models run fastest on one thread, and CI shares the machine with nothing else to use.
torch.set_num_threads(1)
# No tqdm monitor thread: tests fork training processes (tests/test_kill_resume.py), and a fork while that thread
# held tqdm's lock would leave the child waiting on it.
__import__("tqdm").tqdm.monitor_interval = 0

# Fuzzing profiles (tests/test_fuzz.py): `ci` is the default run's bounded, reproducible one; `long` is on demand
# (HYPOTHESIS_PROFILE=long), with fresh randomness each run.
settings.register_profile("ci", max_examples=1000, derandomize=True, deadline=None, print_blob=True)
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory, monkeypatch):
    """Cost profiles and kernel choices measured by tests go to a temporary folder, never to the user's cache
    (the environment variables reach the entry points that tests start as subprocesses)."""
    from specdraft.decode import profile

    folder = tmp_path_factory.getbasetemp() / "profiles"
    monkeypatch.setattr(profile, "CACHE_DIR", folder)
    monkeypatch.setenv("SPECDRAFT_PROFILE_DIR", str(folder))
    monkeypatch.setenv("SPECDRAFT_KERNEL_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def other_model():
    return tiny_llama(seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "w1 w2 w3 w1 w2 w3", "id": "a"}, {"prompt": "w7 w8 w9 w10"}, {"prompt": "w20"}]
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def tiny_export(tiny_model_dir, tmp_path, monkeypatch):
    """A dspark export for the tiny target; cost profiles go to a temporary cache."""
    from specdraft.models.drafter import BlockDrafter
    from specdraft.models.export import save_drafter
    from specdraft.io.target import load_target

    monkeypatch.setenv("SPECDRAFT_PROFILE_DIR", str(tmp_path / "profiles"))
    target = load_target(tiny_model_dir, "float32")
    torch.manual_seed(0)
    drafter = BlockDrafter(target.model.config, 1, 2, block_size=3, mask_token_id=0, markov_rank=8)
    drafter.copy_target_weights(target.model)
    return save_drafter(tmp_path / "export", drafter, (1, 2), target.model, tiny_model_dir, tiny_model_dir)
