"""The training loop on accelerate: AdamW, cosine schedule with warmup, clipping, accumulation,
checkpoints with resume, held-out evaluation, W&B tracking (offline unless configured).

The loss normaliser is the position-weight sum of the whole optimizer step (all micro-batches,
all ranks), and gradients are summed across ranks, so the gradient of a 2-process run equals that
of a 1-process run on the same global batch. Each rank takes its share of every global batch;
anchors are seeded per sample. The drafter is not wrapped in DDP (its step calls several of its
methods, not one forward, so DDP's hooks would never fire): gradients are all-reduced explicitly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.train.checkpoint import (complete_partial, ensure_writable, latest_checkpoint, load_checkpoint, partial_path,
                                        save_checkpoint)
from specdraft.train.config import TrackingConfig, TrainerConfig
from specdraft.train.distributed import is_deepspeed, make_accelerator
from specdraft.train.signals import SignalCache, target_signals
from specdraft.train.step import Batch, LossSettings, distill_step, weight_sum


def make_batch(examples: list[dict], indices: list[int], epoch: int, seed: int, pad_id: int) -> Batch:
    """Right-padded batch of examples; anchor seeds derived from (seed, epoch, example index)."""
    rows = [examples[i] for i in indices]
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[b, :n] = torch.tensor(row["input_ids"])
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(row["loss_mask"], dtype=torch.bool)
    seeds = torch.tensor([(seed * 1_000_003 + epoch * 100_003 + i) % (2**62) for i in indices])
    return Batch(ids, attention, loss_mask, seeds)


def global_batch_indices(num_examples: int, step: int, per_step: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, example indices) of optimizer step `step`: a fresh seeded permutation each epoch."""
    steps_per_epoch = max(1, num_examples // per_step)
    epoch, offset = divmod(step, steps_per_epoch)
    order = list(range(num_examples))
    random.Random(seed * 7919 + epoch).shuffle(order)
    return epoch, order[offset * per_step : (offset + 1) * per_step]


def data_fingerprint(examples: list[dict]) -> str:
    """What a checkpoint was trained on: a hash of every example's tokens and loss mask, in order."""
    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example["input_ids"], [int(m) for m in example["loss_mask"]]]).encode())
    return f"{len(examples)}:{digest.hexdigest()[:16]}"


def start_tracking(tracking: TrackingConfig, run_dir: Path, config: dict):
    """A W&B run (offline unless configured) with the resolved config, or None when tracking is disabled."""
    if tracking.wandb_mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=tracking.project, name=tracking.run_name, tags=tracking.tags, config=config,
        dir=str(run_dir), mode=tracking.wandb_mode,
    )


@torch.no_grad()
def evaluate(drafter, target_model, examples, feature_layers, cfg: TrainerConfig, num_anchors: int, pad_id: int,
             signals=target_signals, accelerator=None) -> dict:
    """Held-out loss and tau estimates, averaged over fixed-seed batches (shared out across ranks)."""
    drafter.eval()
    keys = ("loss", "ce", "l1", "tau_estimate", "tau_greedy")
    totals = torch.zeros(len(keys) + 1)  # per key, then the batch count
    # Ranks share the batches out, except under ZeRO-3, where every forward gathers parameters collectively
    # and so must run on all ranks in lockstep.
    lockstep = accelerator is None or (is_deepspeed(accelerator) and accelerator.state.deepspeed_plugin.zero_stage == 3)
    rank, world = (0, 1) if lockstep else (accelerator.process_index, accelerator.num_processes)
    starts = list(range(0, len(examples), cfg.batch_size))
    for start in starts[rank::world]:
        indices = list(range(start, min(start + cfg.batch_size, len(examples))))
        batch = _to(make_batch(examples, indices, 0, cfg.seed + 1, pad_id), drafter.draft_to_target.device)
        # Always teacher-forced, so held-out figures compare across trainer.markov_inputs settings.
        settings = dataclasses.replace(_settings(cfg), markov_inputs="teacher")
        loss, metrics = distill_step(drafter, target_model, batch, feature_layers, num_anchors, settings, signals=signals)
        totals += torch.tensor([float(loss), *(metrics[k] for k in keys[1:]), 1.0])
    if world > 1:
        totals = accelerator.reduce(totals.to(accelerator.device), reduction="sum").cpu()
    drafter.train()
    return {f"eval/{k}": float(totals[i] / max(float(totals[-1]), 1.0)) for i, k in enumerate(keys)}


def _to(batch: Batch, device) -> Batch:
    return Batch(*(t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.loss_mask, batch.sample_seeds)))


def _all_reduce_gradients(params, world: int) -> None:
    """Sum gradients over ranks (the loss is already normalised by the global weight sum)."""
    if world == 1:
        return
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()


def _settings(cfg: TrainerConfig) -> LossSettings:
    if cfg.markov_inputs not in ("teacher", "sampled"):
        raise ValueError(f"trainer.markov_inputs={cfg.markov_inputs!r}; choose teacher or sampled")
    if cfg.ce_labels not in ("data", "target_argmax"):
        raise ValueError(f"trainer.ce_labels={cfg.ce_labels!r}; choose data or target_argmax")
    return LossSettings(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight, cfg.position_decay, cfg.kl_weight,
                        cfg.markov_inputs, cfg.ce_labels)


def _resume_from(cfg: TrainerConfig, run_dir: Path) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(run_dir)
    return Path(cfg.resume)


def _check_resumable(resume: Path, meta: dict, fingerprint: str, num_examples: int, layout: dict) -> None:
    """Refuse a checkpoint made from other data, or by another process layout (ZeRO shards do not re-split)."""
    if meta.get("data_fingerprint", fingerprint) != fingerprint:
        raise ValueError(
            f"checkpoint {resume} was trained on {meta['num_examples']} examples (fingerprint "
            f"{meta['data_fingerprint']}) but {num_examples} are given now ({fingerprint}): the data "
            "changed, so the batches would too. Resume with the same data, or start afresh "
            "(trainer.resume=never, or another hydra.run.dir)"
        )
    written = {key: meta.get(key, default) for key, default in (("deepspeed_zero_stage", None), ("world_size", 1))}
    if layout["deepspeed_zero_stage"] is not None or written["deepspeed_zero_stage"] is not None:
        if written != layout:
            raise ValueError(f"checkpoint {resume} was written by a run with {written}, this run has {layout}: "
                             "DeepSpeed's partitioned optimizer state only resumes under the same launch "
                             "(same accelerate config and number of processes)")


def _save(accelerator, engine, run_dir: Path, step: int, drafter, trainer_state: dict, meta: dict) -> None:
    """Checkpoint on rank 0; under DeepSpeed every rank first writes its optimizer shard."""
    if engine is None:
        if accelerator.is_main_process:
            save_checkpoint(run_dir, step, drafter, trainer_state, meta)
        return
    partial = partial_path(run_dir, step)
    if accelerator.is_main_process:
        for left in partial.parent.glob(".step-*.partial"):  # leftovers of a killed run (no rank writes one now)
            shutil.rmtree(left, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    engine.save_checkpoint(str(partial / "deepspeed"), tag="zero", save_latest=False)
    weights = accelerator.get_state_dict(engine)  # gathered across ranks under ZeRO-3 (a collective)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        complete_partial(run_dir, step, weights, trainer_state, meta)
    accelerator.wait_for_everyone()


def _deepspeed_backward(engine, loss: torch.Tensor, averaged_over: int, last: bool) -> None:
    """Backward of one micro-batch under DeepSpeed; the engine reduces, clips and steps after the last one.

    DeepSpeed averages gradients over ranks and micro-batches, but our loss is already this micro-batch's
    share of the global sum-normalised loss: scaling by their number keeps the gradient of a 1-process run.
    The boundary is set explicitly (accelerate's backward would step the engine after every micro-batch).
    """
    engine.set_gradient_accumulation_boundary(last)
    engine.backward(loss * averaged_over)
    engine.step()


def compile_layers(drafter, backend: str) -> int:
    """torch.compile every draft decoder layer in place; returns how many. The step calls the drafter's methods,
    never its own __call__, so compiling the drafter module itself would change nothing."""
    layers = list(getattr(drafter, "layers", [])) or [m for m in drafter.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    return len(layers)


def _by_position(metrics: dict) -> dict:
    """Acceptance estimate α_k of each block position, for the tracker's per-position curves."""
    return {f"train/alpha_{k + 1}": value for k, value in enumerate(metrics.get("alpha_by_position", []))}


def _throughput(tokens: int, seconds: float, samples: int) -> dict:
    import resource

    return {"train/tokens_per_s": tokens / max(seconds, 1e-9), "train/samples_per_s": samples / max(seconds, 1e-9),
            "train/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            **({"train/cuda_max_memory_gb": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available() else {})}


@dataclasses.dataclass
class TrainJob:
    """What a training run works on: the drafter (trained in place), its frozen target, the data, the run folder."""

    drafter: torch.nn.Module
    target_model: torch.nn.Module
    train_examples: list[dict]
    eval_examples: list[dict]
    feature_layers: tuple[int, ...]
    num_anchors: int
    pad_id: int
    run_dir: Path
    config: dict = dataclasses.field(default_factory=dict)  # the resolved run config (W&B, checkpoints)


@dataclasses.dataclass
class _Loop:
    """The loop's moving parts, set up once (optimizer, schedule, the DeepSpeed engine, where it resumes)."""

    model: torch.nn.Module
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: object  # a DeepSpeed engine, or None
    start_step: int
    per_step: int  # examples per optimizer step, all ranks
    layout: dict  # ZeRO stage and world size, recorded in (and checked against) every checkpoint
    fingerprint: str  # of the training data, same


def _set_up(job: TrainJob, cfg: TrainerConfig, accelerator) -> _Loop:
    """Optimizer and schedule, resume from the last complete checkpoint, DeepSpeed, torch.compile."""
    from transformers import get_cosine_schedule_with_warmup

    world = accelerator.num_processes
    layout = {"deepspeed_zero_stage": accelerator.state.deepspeed_plugin.zero_stage if is_deepspeed(accelerator) else None,
              "world_size": world}
    torch.manual_seed(cfg.seed)
    params = [p for p in job.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)
    start_step, fingerprint = 0, data_fingerprint(job.train_examples)
    resume = _resume_from(cfg, job.run_dir)
    if resume is not None:
        state, meta = load_checkpoint(resume, job.drafter)
        _check_resumable(resume, meta, fingerprint, len(job.train_examples), layout)
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start_step = meta["step"]
    job.target_model.to(accelerator.device)
    engine = None
    if is_deepspeed(accelerator):
        # DeepSpeed owns the reduction, clipping and optimizer step; the step function still calls the
        # drafter's own methods (ZeRO-1/2 hooks sit on the parameters, so that is enough).
        engine, _ = accelerator.prepare(job.drafter, optimizer)
        if resume is not None:
            engine.load_checkpoint(str(resume / "deepspeed"), tag="zero", load_optimizer_states=True,
                                   load_lr_scheduler_states=False, load_module_strict=False)
    if resume is not None:
        accelerator.print(f"resumed from {resume} at step {start_step}")
    model = job.drafter.to(accelerator.device)
    if cfg.compile:
        accelerator.print(f"torch.compile ({cfg.compile_backend}): {compile_layers(model, cfg.compile_backend)} draft layers")
    per_step = cfg.batch_size * cfg.grad_accum * world
    if len(job.train_examples) < per_step:
        raise ValueError(
            f"{len(job.train_examples)} training examples cannot fill one optimizer step of {per_step} "
            f"(trainer.batch_size x trainer.grad_accum x {world} processes); add data or lower the batch"
        )
    return _Loop(model, params, optimizer, scheduler, engine, start_step, per_step, layout, fingerprint)


def _optimizer_step(job: TrainJob, loop: _Loop, cfg: TrainerConfig, batches: list[Batch], signals, accelerator):
    """One global step over this rank's micro-batches: (summed local loss, grad norm, last metrics)."""
    device, world = accelerator.device, accelerator.num_processes
    local = sum(weight_sum(b, job.num_anchors, loop.model.block_size, cfg.position_decay, loop.model.mode) for b in batches)
    total = accelerator.reduce(torch.as_tensor(local, dtype=torch.float32, device=device), reduction="sum")
    step_loss = torch.zeros((), device=device)
    for position, batch in enumerate(batches):
        with accelerator.autocast():
            loss, metrics = distill_step(loop.model, job.target_model, batch, job.feature_layers, job.num_anchors,
                                         _settings(cfg), total, signals)
        if loop.engine is None:
            accelerator.backward(loss)
        else:
            _deepspeed_backward(loop.engine, loss, world * cfg.grad_accum, last=position == len(batches) - 1)
        step_loss += loss.detach()
    if loop.engine is None:
        _all_reduce_gradients(loop.params, world)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(loop.params, cfg.clip_grad_norm))
        loop.optimizer.step()
        loop.optimizer.zero_grad(set_to_none=True)
    else:  # the engine stepped (and clipped) inside the last backward of the step
        grad_norm = float(loop.engine.get_global_grad_norm() or 0.0)
    loop.scheduler.step()
    return step_loss, grad_norm, metrics


def _checkpoint(job: TrainJob, loop: _Loop, done: int, accelerator) -> None:
    state = {"scheduler": loop.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
             **({"optimizer": loop.optimizer.state_dict()} if loop.engine is None else {})}
    _save(accelerator, loop.engine, job.run_dir, done, loop.model, state, {
        "examples_seen": done * loop.per_step, "num_examples": len(job.train_examples),
        "data_fingerprint": loop.fingerprint, **loop.layout})


def train(job: TrainJob, cfg: TrainerConfig, tracking: TrackingConfig, time_budget_s: float | None = None,
          accelerator=None, signals=None, tracker=None, eval_signals=None) -> dict:
    """Train job.drafter in place; return a summary (steps done, last metrics, eval, seconds, this rank's examples).
    `signals` replaces the online target features (e.g. a train.feature_cache.FeatureCache); `tracker`, a W&B
    run the caller owns (rank 0), is logged to and left open; without it the trainer starts and finishes its own.
    `eval_signals` feeds held-out evaluation (default: `signals`; the exact target when training on a lossy cache)."""
    accelerator = accelerator or make_accelerator(cfg)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    if cfg.checkpoint_every and job.run_dir is not None:
        # every rank (one failing alone would leave the others waiting in the set-up's collectives): a read-only
        # folder fails here, not after the first steps' work
        ensure_writable(job.run_dir, probe=accelerator.is_main_process)
    loop = _set_up(job, cfg, accelerator)
    if signals is None:
        signals = SignalCache(cfg.cache_target_gb * 2**30) if cfg.cache_target_gb > 0 else target_signals
    own_tracker = tracker is None
    run = (start_tracking(tracking, job.run_dir, job.config) if own_tracker else tracker) if accelerator.is_main_process else None
    summary = {"steps": loop.start_step, "loss_history": [], "rank": rank, "world_size": world, "examples_seen": []}
    trained_tokens, began = 0, time.perf_counter()
    bar = tqdm(range(loop.start_step, cfg.steps), desc="train", disable=not accelerator.is_main_process, mininterval=5)
    loop.model.train()
    for step in bar:
        step_began = time.perf_counter()
        epoch, indices = global_batch_indices(len(job.train_examples), step, loop.per_step, cfg.seed)
        micro = [indices[i : i + cfg.batch_size] for i in range(0, len(indices), cfg.batch_size)]
        mine = micro[rank::world]  # this rank's micro-batches of the global step
        summary["examples_seen"].append([i for m in mine for i in m])
        batches = [_to(make_batch(job.train_examples, m, epoch, cfg.seed, job.pad_id), device) for m in mine]
        step_loss, grad_norm, metrics = _optimizer_step(job, loop, cfg, batches, signals, accelerator)
        # One collective for the global step loss, the tokens trained, and whether any rank is out of time
        # (every rank must agree on stopping, or one would wait forever in the next collective).
        late = time_budget_s is not None and time.perf_counter() - began > time_budget_s
        local_tokens = sum(int(b.attention_mask.sum()) for b in batches)
        step_loss, tokens, late_ranks = accelerator.reduce(
            torch.stack([step_loss, torch.tensor(float(local_tokens), device=device), torch.tensor(float(late), device=device)]),
            reduction="sum").tolist()
        out_of_time = late_ranks > 0
        done, trained_tokens = step + 1, trained_tokens + int(tokens)
        logged = {"train/loss": float(step_loss), "train/tau_estimate": metrics["tau_estimate"],
                  "train/tau_greedy": metrics["tau_greedy"], "train/lr": loop.scheduler.get_last_lr()[0],
                  "train/grad_norm": grad_norm, **_by_position(metrics),
                  **_throughput(int(tokens), time.perf_counter() - step_began, loop.per_step)}
        last = done == cfg.steps or out_of_time
        if done % cfg.checkpoint_every == 0 or last:  # before evaluating or logging: a failure there cannot lose the step
            _checkpoint(job, loop, done, accelerator)
        if job.eval_examples and (done % cfg.eval_every == 0 or last):
            logged.update(evaluate(loop.model, job.target_model, job.eval_examples, job.feature_layers, cfg,
                                   job.num_anchors, job.pad_id, eval_signals or signals, accelerator))
        if run is not None:
            run.log(logged, step=done)
        bar.set_postfix(loss=f"{logged['train/loss']:.3f}", tau=f"{metrics['tau_estimate']:.2f}")
        summary.update(steps=done, **logged)
        summary["loss_history"].append(logged["train/loss"])
        if out_of_time:
            accelerator.print(f"time budget of {time_budget_s:.0f}s reached at step {done}; stopping after a checkpoint")
            break
    accelerator.wait_for_everyone()
    if run is not None and own_tracker:
        run.finish()
    summary["seconds"] = time.perf_counter() - began
    summary["tokens_per_s"] = trained_tokens / max(summary["seconds"], 1e-9)  # all ranks, evaluation included
    return summary
