"""Multi-process training on CPU, really launched: `accelerate launch` with the shipped recipes runs two
processes (DDP over gloo, DeepSpeed ZeRO-2/3) whose result equals a one-process run on the same global
batch; ranks stay in sync on distinct shards; only rank 0 writes (ZeRO's own optimizer shards aside);
a ZeRO checkpoint resumes; a DeepSpeed config that disagrees with the trainer config is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import tiny_llama
from tests.helpers import examples, fresh_drafter
from specdraft.train.config import TrackingConfig, TrainerConfig
from specdraft.train.distributed import checked_deepspeed_config, deepspeed_config

REPO = Path(__file__).resolve().parents[1]
TRAINER = {"steps": 4, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 2, "eval_every": 100}


def launch(recipe: str, processes: int, run_dir: Path, report_dir: Path, **trainer) -> list[dict]:
    """Train tests/dist_train.py under `accelerate launch --config_file conf/accelerate/RECIPE.yaml`; rank reports."""
    spec = {"run_dir": str(run_dir), "report_dir": str(report_dir), "trainer": {**TRAINER, **trainer}}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf" / "accelerate" / f"{recipe}.yaml"),
           "--num_processes", str(processes), str(REPO / "tests" / "dist_train.py"), json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((report_dir / f"rank{r}.json").read_text()) for r in range(processes)]


def weights(report_dir: Path, rank: int) -> dict:
    return load_file(str(report_dir / f"rank{rank}.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same global batch (2 per micro-batch x 2 accumulated): losses and final weights."""
    target = tiny_llama(0)
    drafter = fresh_drafter(target)
    cfg = TrainerConfig(**{**TRAINER, "grad_accum": 2})
    summary = train_reference(drafter, target, cfg, tmp_path_factory.mktemp("reference"))
    return summary, {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def train_reference(drafter, target, cfg, run_dir):
    from specdraft.train.trainer import TrainJob, train

    return train(TrainJob(drafter, target, examples(8), examples(2), (1, 2), 4, 0, run_dir), cfg,
                 TrackingConfig(wandb_mode="disabled"))


def assert_matches_reference(reports, report_dir, reference, atol=1e-5):
    summary, ref_weights = reference
    world = len(reports)
    assert [r["world_size"] for r in reports] == [world] * world and [r["rank"] for r in reports] == list(range(world))
    for step in range(len(summary["examples_seen"])):
        shards = [set(r["examples_seen"][step]) for r in reports]
        if world == 2:  # distinct shards whose union is the one-process global batch
            assert not shards[0] & shards[1]
        assert set().union(*shards) == set(summary["examples_seen"][step])
    for report in reports:
        assert report["loss_history"] == pytest.approx(summary["loss_history"], rel=1e-5)
    for rank in range(world):
        got = weights(report_dir, rank)
        assert max(float((got[k] - ref_weights[k]).abs().max()) for k in ref_weights) < atol


def test_ddp_two_processes_equal_one_process(tmp_path, reference):
    reports = launch("ddp", 2, tmp_path / "run", tmp_path / "report")
    assert {r["distributed_type"] for r in reports} == {"DistributedType.MULTI_CPU"}
    assert_matches_reference(reports, tmp_path / "report", reference)
    rank0, rank1 = weights(tmp_path / "report", 0), weights(tmp_path / "report", 1)
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # in sync, bit for bit
    assert reports[1]["writes"] == [] and any(w.endswith("meta.json") for w in reports[0]["writes"])
    assert (tmp_path / "run" / "checkpoints" / "step-0000004" / "meta.json").is_file()


def test_deepspeed_zero2_one_and_two_processes_and_resume(tmp_path, reference):
    one = launch("zero2", 1, tmp_path / "one", tmp_path / "one_report", grad_accum=2)
    assert one[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    assert_matches_reference(one, tmp_path / "one_report", reference)

    two = launch("zero2", 2, tmp_path / "two", tmp_path / "two_report")
    assert_matches_reference(two, tmp_path / "two_report", reference)
    # Rank 1 writes only its own ZeRO optimizer shard into the checkpoints rank 0 completes.
    assert two[1]["writes"] and all("deepspeed/zero/zero_pp_rank_1_" in w and w.endswith("optim_states.pt")
                                    for w in two[1]["writes"])
    checkpoint = tmp_path / "two" / "checkpoints" / "step-0000002"
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert (meta["deepspeed_zero_stage"], meta["world_size"]) == (2, 2)
    assert (checkpoint / "deepspeed" / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()

    # Resume: as if killed after step 3, the relaunch continues from step 2 with identical losses and weights.
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-0000004")
    resumed = launch("zero2", 2, tmp_path / "resumed", tmp_path / "resumed_report")
    assert resumed[0]["loss_history"] == pytest.approx(two[0]["loss_history"][2:], rel=1e-6)
    final, again = weights(tmp_path / "two_report", 0), weights(tmp_path / "resumed_report", 0)
    assert max(float((final[k] - again[k]).abs().max()) for k in final) < 1e-6


def test_deepspeed_zero3_two_processes(tmp_path, reference):
    reports = launch("zero3", 2, tmp_path / "run", tmp_path / "report")
    assert_matches_reference(reports, tmp_path / "report", reference)
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-0000004" / "drafter.safetensors"))
    assert all(v.numel() > 0 for v in saved.values())  # gathered, not rank 0's shard


# ---- refusals, before anything is launched or loaded ----

def test_derived_deepspeed_config_follows_trainer_config():
    cfg = TrainerConfig(batch_size=3, grad_accum=4, clip_grad_norm=0.5, bf16=True)
    ds = deepspeed_config(cfg, world=2, zero_stage=3, offload_optimizer="cpu")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (3, 4, 24)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_disagreeing_deepspeed_config_file_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto",
                                "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    with pytest.raises(ValueError) as err:
        checked_deepspeed_config(TrainerConfig(batch_size=4), world=2, env=env)
    message = str(err.value)
    assert "train_micro_batch_size_per_gpu: DeepSpeed config 8 vs trainer config 4" in message
    assert "bf16.enabled: DeepSpeed config True vs trainer config False" in message
    assert "gradient_accumulation_steps" not in message  # "auto" agrees
    agreeing = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto", "communication_data_type": "fp32"}
    path.write_text(json.dumps(agreeing))
    merged = checked_deepspeed_config(TrainerConfig(batch_size=4), world=2, env=env)
    assert merged["train_batch_size"] == 8 and merged["communication_data_type"] == "fp32"  # extras kept


def test_disagreeing_launcher_flags_are_refused():
    env = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4", "ACCELERATE_MIXED_PRECISION": "fp16",
           "ACCELERATE_GRADIENT_CLIPPING": "1.0"}
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps: launcher 4 vs trainer.grad_accum 1(.|\n)*"
                                         r"mixed_precision: launcher fp16 vs trainer.bf16 False"):
        checked_deepspeed_config(TrainerConfig(), world=1, env=env)


def test_zero_checkpoint_refused_under_another_layout(tmp_path):
    from specdraft.train.trainer import _check_resumable

    meta = {"data_fingerprint": "x", "num_examples": 1, "deepspeed_zero_stage": 2, "world_size": 2}
    with pytest.raises(ValueError, match="only resumes under the same launch"):
        _check_resumable(tmp_path, meta, "x", 1, {"deepspeed_zero_stage": 2, "world_size": 4})
    with pytest.raises(ValueError, match="only resumes under the same launch"):
        _check_resumable(tmp_path, meta, "x", 1, {"deepspeed_zero_stage": None, "world_size": 1})
    _check_resumable(tmp_path, {"data_fingerprint": "x"}, "x", 1, {"deepspeed_zero_stage": None, "world_size": 2})


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (REPO / "conf" / "accelerate").glob("*.yaml")))
def test_every_accelerate_recipe_loads(recipe):
    """accelerate's own loader reads each recipe; DeepSpeed ones name their stage and offload as their file name says."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "conf" / "accelerate" / f"{recipe}.yaml"))
    assert config.num_processes >= 2 and config.mixed_precision == "no"  # precision comes from trainer.bf16
    if recipe.startswith(("zero", "multinode")):
        ds = config.deepspeed_config
        assert str(config.distributed_type).endswith("DEEPSPEED") and ds["zero_stage"] == (3 if "zero3" in recipe else 2)
        assert (ds["offload_optimizer_device"] == "cpu") == recipe.endswith("offload")
        assert "gradient_accumulation_steps" not in ds and "gradient_clipping" not in ds  # the trainer config decides


def test_a_launched_process_ends_at_once_with_status_0_and_its_output_flushed():
    """end_launched_process skips interpreter teardown (where gloo's threads can abort a finished run) only
    under a multi-process launch; stdout is a pipe here, so unflushed output would be lost."""
    script = ("from specdraft.train.distributed import end_launched_process\n"
              "print('written')\nend_launched_process()\nraise SystemExit(3)\n")
    for world, status in (("2", 0), ("1", 3)):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "WORLD_SIZE": world})
        assert (proc.returncode, proc.stdout) == (status, "written\n"), (world, proc.stderr)
