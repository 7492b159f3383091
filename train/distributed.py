"""How a training run is spread over processes: one process, DDP, or DeepSpeed ZeRO, chosen by the launcher.

`accelerate launch --config_file conf/accelerate/NAME.yaml train/distill.py ...` sets the process group up
and, for DeepSpeed, the ZeRO stage and offload devices. Everything that must agree with the trainer
(micro-batch, accumulation, global batch, clipping, precision, optimizer settings) is derived from
`TrainerConfig` here, never taken from the launcher: a DeepSpeed config file or launcher flag that says
otherwise is refused, naming both values, before any model is loaded.

On a machine without a GPU the process group uses gloo (accelerate would otherwise find no backend and
each rank would think it is alone, see ../shared/ENVIRONMENT.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager

import torch

from specdraft.train.config import TrainerConfig

DS_FIXED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "gradient_clipping")


def world_size() -> int:
    """Processes of this run, from the launcher's environment (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def deepspeed_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def deepspeed_config(cfg: TrainerConfig, world: int, zero_stage: int, offload_optimizer: str = "none",
                     offload_param: str = "none") -> dict:
    """The DeepSpeed config of a run, every batch/precision/optimizer key from the trainer config."""
    zero = {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param}
    if zero_stage == 3:
        # The drafter is small: gather its weights for saving rather than keep 16-bit shards only.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world,
        "gradient_clipping": cfg.clip_grad_norm,
        "bf16": {"enabled": bool(cfg.bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        # Our own AdamW and cosine schedule are handed to DeepSpeed as client objects (torch's AdamW
        # avoids compiling fused kernels on CPU); the schedule is stepped by the trainer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _disagreements(derived: dict, given: dict, prefix: str = "") -> list[str]:
    """Keys of a user's DeepSpeed config whose values differ from the derived ones ("auto" agrees)."""
    found = []
    for key, value in given.items():
        if key not in derived or value == "auto":
            continue
        if isinstance(value, dict) and isinstance(derived[key], dict):
            found += _disagreements(derived[key], value, f"{prefix}{key}.")
        elif value != derived[key]:
            found.append(f"{prefix}{key}: DeepSpeed config {value!r} vs trainer config {derived[key]!r}")
    return found


def _launcher_disagreements(cfg: TrainerConfig, env: dict) -> list[str]:
    """Launcher flags (accelerate config file or CLI) that contradict the trainer config."""
    found = []
    accumulation = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if accumulation not in (None, "auto") and int(accumulation) != cfg.grad_accum:
        found.append(f"gradient_accumulation_steps: launcher {accumulation} vs trainer.grad_accum {cfg.grad_accum}")
    clipping = env.get("ACCELERATE_GRADIENT_CLIPPING")
    if clipping not in (None, "auto", "none") and float(clipping) != float(cfg.clip_grad_norm):
        found.append(f"gradient_clipping: launcher {clipping} vs trainer.clip_grad_norm {cfg.clip_grad_norm}")
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")  # "no" is also the launcher's default: not a choice
    if precision not in ("no", "bf16" if cfg.bf16 else "no"):
        found.append(f"mixed_precision: launcher {precision} vs trainer.bf16 {cfg.bf16}")
    return found


def checked_deepspeed_config(cfg: TrainerConfig, world: int, env: dict | None = None) -> dict:
    """The derived DeepSpeed config for this launch, after refusing any launcher or file disagreement."""
    env = dict(os.environ) if env is None else env
    derived = deepspeed_config(cfg, world, int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")),
                               env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
                               env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"))
    problems = _launcher_disagreements(cfg, env)
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        given = json.loads(open(path).read())
        problems += _disagreements(derived, given)
        # The user's file may add settings we do not derive (e.g. communication tuning); ours win on overlap.
        derived = {**given, **derived, "zero_optimization": {**given.get("zero_optimization", {}), **derived["zero_optimization"]}}
        if "stage" in given.get("zero_optimization", {}):
            derived["zero_optimization"]["stage"] = given["zero_optimization"]["stage"]
    if problems:
        raise ValueError("the DeepSpeed settings disagree with the trainer config (the trainer config decides; "
                         "drop these from the launcher/DeepSpeed config or set them to 'auto'):\n  " + "\n  ".join(problems))
    return derived


def make_accelerator(cfg: TrainerConfig):
    """The run's Accelerator: gloo without a GPU; DeepSpeed with the derived config when launched for it."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    cpu = not torch.cuda.is_available()
    plugin = None
    if deepspeed_requested():
        ds_config = checked_deepspeed_config(cfg, world_size())
        # The launcher's DeepSpeed fields (stage, offload, ...) are folded into ds_config above; tell
        # accelerate so it does not refuse a full config given beside them.
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""
        plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    if plugin is not None and cpu and world_size() > 1:
        PartialState(backend="gloo")  # must come first: the Accelerator reuses this state
    # Without DeepSpeed, cpu=True makes accelerate set up gloo (MULTI_CPU) itself.
    accelerator = Accelerator(mixed_precision="bf16" if cfg.bf16 else "no", cpu=cpu and plugin is None,
                              deepspeed_plugin=plugin)
    if plugin is not None:
        # accelerate registers a ZeRO-3 config with transformers, whose from_pretrained would then partition
        # every model it loads and whose generate would sync every rank per token. The target is frozen and
        # runs inference on each rank alone (regeneration and validation on rank 0), so keep it whole; only
        # the drafter, handed to DeepSpeed by the trainer, is partitioned.
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    if world_size() > 1 and (accelerator.num_processes != world_size() or accelerator.distributed_type == DistributedType.NO):
        raise RuntimeError(f"launched with {world_size()} processes but accelerate set up {accelerator.num_processes} "
                           f"({accelerator.distributed_type}): each rank would train alone. Use a conf/accelerate/ recipe (README)")
    return accelerator


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


@contextmanager
def full_parameters(accelerator, module):
    """Inside, every rank sees the module's complete parameters (ZeRO-3 partitions them; elsewhere a no-op).
    A collective: every rank must enter."""
    if is_deepspeed(accelerator) and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def broadcast_object(accelerator, value):
    """Rank 0's value on every rank (e.g. the run folder, whose default name holds a timestamp)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def shutdown(accelerator) -> None:
    """Leave the process group cleanly (DeepSpeed on CPU aborts at exit otherwise)."""
    import torch.distributed as dist

    if accelerator.num_processes > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_launched_process() -> None:
    """End this process now, with status 0, when a launcher started it as one of several (WORLD_SIZE > 1).

    Call it last, after `shutdown` and once everything the run writes is written. destroy_process_group leaves
    the gloo groups alive: DeepSpeed's engine, its ZeRO optimizer, its groups module and every ZeRO-3 parameter
    keep references, so the groups' worker threads are torn down with the interpreter, and that teardown now and
    then aborts a finished run (SIGABRT, "terminate called without an active exception"), failing the launch.
    Our files are written atomically and the tracker is finished by then, so nothing is lost by skipping it."""
    if world_size() <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()  # Hydra's log file
    os._exit(0)
