"""Launched by tests/test_distributed.py under `accelerate launch`: trains a tiny drafter with the real trainer.

Argument: a JSON object {run_dir, report_dir, trainer: {TrainerConfig fields}}. Each rank writes
report_dir/rank{R}.json (world size, rank, examples seen, losses, files it wrote under run_dir) and
report_dir/rank{R}.safetensors (its drafter weights), so the test can compare ranks and runs.
Optional `kill: {rank, where, at, spare}` (tests/test_kill_resume.py): that rank SIGKILLs the launcher and every
rank (`kill_tree` of its parent, as when the machine goes) at the point `die_in_training` names; `spare` is the
test's own process id, refused as the launcher.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# Run as a script, Python puts tests/ first on sys.path; use the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.helpers import tiny_llama  # noqa: E402
from tests.helpers import die_in_training, examples, fresh_drafter, kill_tree  # noqa: E402
from specdraft.train.config import TrackingConfig, TrainerConfig  # noqa: E402
from specdraft.train.distributed import end_launched_process, full_parameters, make_accelerator, shutdown  # noqa: E402


def record_writes(run_dir: Path, log: list) -> None:
    """Log every file this process writes under run_dir (torch.save, write_bytes: our checkpoint files, write_text)."""
    def wrap(fn, path_arg):
        def inner(*args, **kwargs):
            path = Path(str(args[path_arg])).resolve()
            if path.is_relative_to(run_dir.resolve()):
                log.append(str(path.relative_to(run_dir.resolve())))
            return fn(*args, **kwargs)
        return inner

    torch.save = wrap(torch.save, 1)
    Path.write_bytes = wrap(Path.write_bytes, 0)
    Path.write_text = wrap(Path.write_text, 0)


def kill_launch_at(kill: dict) -> None:
    """Arrange for this rank to SIGKILL the whole launch at kill["where"], kill["at"] (never the test itself)."""
    launcher = os.getppid()
    if launcher == kill["spare"]:
        raise RuntimeError("this rank's parent is the test, not an accelerate launcher")
    die_in_training(kill["where"], kill["at"], die=lambda: kill_tree(launcher))


def main() -> None:
    spec = json.loads(sys.argv[1])
    run_dir, report_dir = Path(spec["run_dir"]), Path(spec["report_dir"])
    cfg = TrainerConfig(**spec["trainer"])
    accelerator = make_accelerator(cfg)
    writes: list[str] = []
    record_writes(run_dir, writes)
    kill = spec.get("kill")
    if kill and kill["rank"] == accelerator.process_index:
        kill_launch_at(kill)
    from specdraft.train.trainer import TrainJob, train

    target = tiny_llama(0)
    drafter = fresh_drafter(target)
    summary = train(TrainJob(drafter, target, examples(8), examples(2), (1, 2), 4, 0, run_dir), cfg,
                    TrackingConfig(wandb_mode="disabled"), accelerator=accelerator)
    rank = accelerator.process_index
    report_dir.mkdir(parents=True, exist_ok=True)
    with full_parameters(accelerator, drafter):  # ZeRO-3 leaves each rank a shard
        weights = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    save_file(weights, str(report_dir / f"rank{rank}.safetensors"))
    report = {key: summary[key] for key in ("rank", "world_size", "examples_seen", "loss_history", "steps")}
    report["writes"] = writes
    report["distributed_type"] = str(accelerator.distributed_type)
    (report_dir / f"rank{rank}.json").write_text(json.dumps(report))
    shutdown(accelerator)
    end_launched_process()


if __name__ == "__main__":
    main()
