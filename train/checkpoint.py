"""Checkpoints of a training run: drafter weights as safetensors, trainer state as a torch file.

A checkpoint is a folder `checkpoints/step-NNNNNNN/` written under a temporary name and renamed
into place only when complete, so a kill mid-save never leaves a checkpoint that looks usable.
Trainer state (optimizer, scheduler, RNG, data position) is loaded with `weights_only=True` and
only from a run folder of ours (it must carry our `meta.json`).

Under DeepSpeed ZeRO the optimizer state is partitioned: every rank writes its shard with DeepSpeed's
own `save_checkpoint` into `deepspeed/` of the same partial folder (`.step-NNNNNNN.partial`, a name all
ranks know), then rank 0 adds our files and renames it into place. DeepSpeed reads those shards with
pickle, so they are only ever loaded from a folder that carries our `meta.json` (never from an export).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from specdraft.io.files import move_into_place, write_folder_atomically
from specdraft.models.layouts import EXPORTS, EXTERNAL, folder_kind

FORMAT = "specdraft-checkpoint-1"
FROZEN_PREFIXES = ("embed_tokens.",)  # reloaded from the target; not worth a copy per checkpoint


def tied_aliases(state: dict[str, torch.Tensor]) -> set[str]:
    """Keys whose tensor is the same storage as an earlier key's (tied embeddings / LM head): saved once."""
    seen, aliases = set(), set()
    for key, value in state.items():
        pointer = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if value.numel() and pointer in seen:
            aliases.add(key)
        seen.add(pointer)
    return aliases


def trainable_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A drafter state dict without the frozen target embeddings or tied duplicates, contiguous for safetensors."""
    aliases = tied_aliases(state)
    return {k: v.detach().contiguous().cpu() for k, v in state.items()
            if not k.startswith(FROZEN_PREFIXES) and k not in aliases}


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:07d}"


def partial_path(run_dir: Path, step: int) -> Path:
    """Where every rank of a DeepSpeed run writes its shard before rank 0 completes the checkpoint."""
    return Path(run_dir) / "checkpoints" / f".step-{step:07d}.partial"


def write_checkpoint_files(folder: Path, step: int, weights: dict, trainer_state: dict, meta: dict) -> None:
    """Our files of a checkpoint (`weights`: the drafter's state dict); meta.json last, it marks the folder complete.
    Each file is built in memory and written with one plain write, so a failing disk raises OSError (safetensors
    and torch.save raise their own types when the disk fails under them)."""
    (folder / "drafter.safetensors").write_bytes(safetensors_bytes(trainable_state(weights)))
    state = io.BytesIO()
    torch.save(trainer_state, state)
    (folder / "trainer_state.pt").write_bytes(state.getvalue())
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, **meta}, indent=2))


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only folder); the run folder keeps the complete ones."""

    def __init__(self, error: OSError, message: str):
        super().__init__(*((error.errno, message) if error.errno is not None else (message,)))


def save_checkpoint(run_dir: Path, step: int, model, trainer_state: dict, meta: dict) -> Path:
    """Write checkpoints/step-NNNNNNN atomically; return its path. A failed write leaves no part of it behind
    and ends the run with an error that says what is kept and how to go on."""
    try:
        return write_folder_atomically(checkpoint_path(run_dir, step),
                                       lambda tmp: write_checkpoint_files(tmp, step, model.state_dict(), trainer_state, meta))
    except OSError as err:
        kept = latest_checkpoint(run_dir)
        raise CheckpointWriteError(
            err, f"checkpoint step-{step:07d} could not be written in {Path(run_dir) / 'checkpoints'} "
            f"({err.strerror or err}); {'the newest complete one, ' + kept.name + ', is kept' if kept else 'no checkpoint is kept yet'}. "
            "Free space (or make the folder writable) and run the same command again: trainer.resume=auto goes on "
            "from the newest complete checkpoint") from None


def ensure_writable(run_dir: Path, probe: bool = True) -> None:
    """Fail before any work when the run folder cannot take checkpoints (read-only, not a folder). probe=False
    (ranks other than 0, which write nothing there): the permission check alone, no file written."""
    folder = Path(run_dir) / "checkpoints"
    try:
        if not probe:
            existing = next(p for p in (folder, *folder.parents) if p.exists())
            if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
                raise PermissionError(13, "not a writable folder", str(existing))
            return
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".write-probe-{os.getpid()}"
        marker.write_text("")
        marker.unlink()
    except OSError as err:
        raise CheckpointWriteError(err, f"the run folder {run_dir} cannot take checkpoints ({err.strerror or err}); "
                                   "choose a writable one (hydra.run.dir=DIR) before training starts") from None


def complete_partial(run_dir: Path, step: int, weights: dict, trainer_state: dict, meta: dict) -> Path:
    """Rank 0: add our files to the partial folder the ranks wrote their DeepSpeed shards into, rename it."""
    partial, final = partial_path(run_dir, step), checkpoint_path(run_dir, step)
    write_checkpoint_files(partial, step, weights, trainer_state, meta)
    return move_into_place(partial, final)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder, or None."""
    root = Path(run_dir) / "checkpoints"
    complete = [p for p in root.glob("step-*") if (p / "meta.json").is_file()] if root.is_dir() else []
    return max(complete, key=lambda p: p.name) if complete else None


def _what_instead(path: Path) -> str:
    """The rest of the error for a folder given as a checkpoint that is not one: what it is, what to pass."""
    found = folder_kind(path)
    if found == "run":
        newest = latest_checkpoint(path)
        return (f" but a distill run folder: resume it with hydra.run.dir={path} trainer.resume=auto"
                + (f", or pass trainer.resume={newest}" if newest else " (it has no complete checkpoint yet)"))
    if found in EXPORTS:
        newest = latest_checkpoint(path.parent)  # an export sits in its run folder, RUN/export
        resume = newest or "RUN/checkpoints/step-N of the run that made it"
        return (" but a drafter export, which keeps no optimizer, schedule or data position and so cannot be resumed: "
                f"pass trainer.resume={resume}; to decode with it, proposer.path={path}")
    if found in EXTERNAL:
        return (f" but a {EXTERNAL[found]} checkpoint from another project; training resumes only from its own "
                "checkpoints: pass a checkpoints/step-* folder of a specdraft run, or trainer.resume=never")
    return "; pass a checkpoints/step-* folder of our run"


def load_checkpoint(path: Path, model) -> tuple[dict, dict]:
    """Load weights into `model`; return (trainer_state, meta). Clear errors for foreign or corrupt folders."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a specdraft checkpoint (no meta.json){_what_instead(path)}")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        weights = load_file(str(path / "drafter.safetensors"))
        state = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    except Exception as err:  # safetensors/torch raise many types for truncated or garbled files
        raise ValueError(f"checkpoint {path} is corrupt or incomplete ({type(err).__name__}: {err}); delete it to resume from an earlier one") from None
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shape mismatches: another block size, rank, vocabulary, ...
        raise ValueError(f"checkpoint {path} does not fit this drafter (another architecture?): {err}") from None
    aliases = tied_aliases(model.state_dict())  # loaded through the key they are tied to
    missing = [k for k in missing if not k.startswith(FROZEN_PREFIXES) and k not in aliases]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this drafter: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return state, meta
