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
import time
from pathlib import Path

import torch
from tqdm import tqdm

from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.config import TrackingConfig, TrainerConfig
from train.signals import SignalCache, target_signals
from train.step import Batch, LossSettings, distill_step, weight_sum


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


def _start_tracking(tracking: TrackingConfig, run_dir: Path, config: dict):
    if tracking.wandb_mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=tracking.project, name=tracking.run_name, tags=tracking.tags, config=config,
        dir=str(run_dir), mode=tracking.wandb_mode,
    )


@torch.no_grad()
def evaluate(drafter, target_model, examples, feature_layers, cfg: TrainerConfig, num_anchors: int, pad_id: int,
             signals=target_signals) -> dict:
    """Held-out loss and tau estimates, averaged over fixed-seed batches."""
    drafter.eval()
    totals, batches = {}, 0
    for start in range(0, len(examples), cfg.batch_size):
        indices = list(range(start, min(start + cfg.batch_size, len(examples))))
        batch = _to(make_batch(examples, indices, 0, cfg.seed + 1, pad_id), drafter.draft_to_target.device)
        # Always teacher-forced, so held-out figures compare across trainer.markov_inputs settings.
        settings = dataclasses.replace(_settings(cfg), markov_inputs="teacher")
        loss, metrics = distill_step(drafter, target_model, batch, feature_layers, num_anchors, settings, signals=signals)
        for key in ("ce", "l1", "tau_estimate", "tau_greedy"):
            totals[key] = totals.get(key, 0.0) + metrics[key]
        totals["loss"] = totals.get("loss", 0.0) + float(loss)
        batches += 1
    drafter.train()
    return {f"eval/{k}": v / max(batches, 1) for k, v in totals.items()}


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
    return LossSettings(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight, cfg.position_decay, cfg.kl_weight,
                        cfg.markov_inputs)


def _resume_from(cfg: TrainerConfig, run_dir: Path) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(run_dir)
    return Path(cfg.resume)


def train(drafter, target_model, train_examples, eval_examples, feature_layers, num_anchors: int,
          cfg: TrainerConfig, tracking: TrackingConfig, run_dir: Path, config: dict, pad_id: int,
          time_budget_s: float | None = None) -> dict:
    """Train the drafter in place; return a summary (steps done, last metrics, eval, seconds)."""
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    accelerator = Accelerator(mixed_precision="bf16" if cfg.bf16 else "no", cpu=not torch.cuda.is_available())
    torch.manual_seed(cfg.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, cfg.steps)
    start_step = 0
    fingerprint = data_fingerprint(train_examples)
    resume = _resume_from(cfg, run_dir)
    if resume is not None:
        state, meta = load_checkpoint(resume, drafter)
        if meta.get("data_fingerprint", fingerprint) != fingerprint:
            raise ValueError(
                f"checkpoint {resume} was trained on {meta['num_examples']} examples (fingerprint "
                f"{meta['data_fingerprint']}) but {len(train_examples)} are given now ({fingerprint}): the data "
                "changed, so the batches would too. Resume with the same data, or start afresh "
                "(trainer.resume=never, or another hydra.run.dir)"
            )
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        start_step = meta["step"]
        accelerator.print(f"resumed from {resume} at step {start_step}")
    device = accelerator.device
    model = drafter.to(device)
    target_model.to(device)
    world, rank = accelerator.num_processes, accelerator.process_index
    per_step = cfg.batch_size * cfg.grad_accum * world
    if len(train_examples) < per_step:
        raise ValueError(
            f"{len(train_examples)} training examples cannot fill one optimizer step of {per_step} "
            f"(trainer.batch_size x trainer.grad_accum x {world} processes); add data or lower the batch"
        )
    signals = SignalCache(cfg.cache_target_gb * 2**30) if cfg.cache_target_gb > 0 else target_signals
    run = _start_tracking(tracking, run_dir, config) if accelerator.is_main_process else None
    summary, began = {"steps": start_step, "loss_history": []}, time.perf_counter()
    bar = tqdm(range(start_step, cfg.steps), desc="train", disable=not accelerator.is_main_process, mininterval=5)
    model.train()
    for step in bar:
        epoch, indices = global_batch_indices(len(train_examples), step, per_step, cfg.seed)
        micro = [indices[i : i + cfg.batch_size] for i in range(0, len(indices), cfg.batch_size)]
        mine = micro[rank::world]  # this rank's micro-batches of the global step
        batches = [_to(make_batch(train_examples, m, epoch, cfg.seed, pad_id), device) for m in mine]
        local = sum(weight_sum(b, num_anchors, model.block_size, cfg.position_decay, model.mode == "eagle3") for b in batches)
        total = accelerator.reduce(torch.as_tensor(local, dtype=torch.float32, device=device), reduction="sum")
        step_loss = torch.zeros((), device=device)
        for batch in batches:
            with accelerator.autocast():
                loss, metrics = distill_step(model, target_model, batch, feature_layers, num_anchors, _settings(cfg), total, signals)
            accelerator.backward(loss)
            step_loss += loss.detach()
        _all_reduce_gradients(params, world)
        step_loss = accelerator.reduce(step_loss, reduction="sum")  # the global step loss
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        logged = {"train/loss": float(step_loss), "train/tau_estimate": metrics["tau_estimate"],
                  "train/tau_greedy": metrics["tau_greedy"], "train/lr": scheduler.get_last_lr()[0],
                  "train/grad_norm": float(grad_norm)}
        # Every rank must agree on stopping, or one would wait forever in the next collective.
        late = time_budget_s is not None and time.perf_counter() - began > time_budget_s
        out_of_time = bool(accelerator.reduce(torch.tensor(float(late), device=device), reduction="sum") > 0)
        # Checkpoint before evaluating or logging, so a failure there cannot lose the step.
        if accelerator.is_main_process and (done % cfg.checkpoint_every == 0 or done == cfg.steps or out_of_time):
            state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
            save_checkpoint(run_dir, done, model, state, {"examples_seen": done * per_step, "num_examples": len(train_examples),
                                                                "data_fingerprint": fingerprint})
        if eval_examples and (done % cfg.eval_every == 0 or done == cfg.steps or out_of_time):
            logged.update(evaluate(model, target_model, eval_examples, feature_layers, cfg, num_anchors, pad_id, signals))
        if run is not None:
            run.log(logged, step=done)
        bar.set_postfix(loss=f"{logged['train/loss']:.3f}", tau=f"{metrics['tau_estimate']:.2f}")
        summary.update(steps=done, **logged)
        summary["loss_history"].append(logged["train/loss"])
        if out_of_time:
            accelerator.print(f"time budget of {time_budget_s:.0f}s reached at step {done}; stopping after a checkpoint")
            break
    accelerator.wait_for_everyone()
    if run is not None:
        run.finish()
    summary["seconds"] = time.perf_counter() - began
    return summary

