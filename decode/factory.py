"""The one proposer factory: a ProposerConfig (and the target it drafts for) → a proposer, with its
calibration attached. decode/bench_setup.py, specdraft/api.py and the scripts all build proposers here."""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.decode.config import PROPOSERS, ProposerConfig
from specdraft.decode.fast_drafter import drafter_for_backend
from specdraft.decode.proposer import (BlockDrafterProposer, Eagle3Proposer, HybridProposer, NgramProposer, NoProposer,
                                       load_model_proposer)
from specdraft.io.target import choose_dtype, parse_dtype, to_dtype
from specdraft.models.export import load_drafter
from specdraft.models.registry import kind


def proposer_modules(name: str) -> list[str]:
    """The packages a proposer needs installed (specdraft.io.assets): speculators for trained drafters."""
    return ["speculators"] if name in ("drafter", "hybrid") else []


# proposer.branches when it is not set (None), per proposer: the first-position candidates of a greedy token tree.
# A block drafter's runners-up hold the target's token about as often as its top-1 does (decode/tree.py), prompt
# lookup's other continuations less often; both ride free where a verify of a few more rows costs what one row
# costs, and scheduler=cost drops them per step where it does not. Eagle-3 and standalone models draft one chain.
DEFAULT_BRANCHES = {"drafter": 4, "hybrid": 4, "ngram": 3}


def default_branches(name: str, branches: int | None) -> int:
    """proposer.branches as given, else the proposer's default."""
    return DEFAULT_BRANCHES.get(name, 1) if branches is None else branches


def drafter_proposer(drafter, feature_layers, branches: int | None = None):
    """The proposer that runs a trained drafter (an Eagle-3 head drafts token by token, block drafters in one pass).
    branches: proposer.branches, the greedy token tree's first-position candidates (block drafters; None: the
    default, one chain for an Eagle-3 head)."""
    if kind(drafter.mode).unrolled:
        if branches not in (None, 1):
            raise ValueError(f"proposer.branches={branches} needs a block drafter (dspark, dflash); an Eagle-3 export "
                             "drafts one chain: set proposer.branches=1")
        return Eagle3Proposer(drafter, feature_layers)
    return BlockDrafterProposer(drafter, feature_layers, branches=default_branches("drafter", branches))


DRAFTER_DTYPES = ("target", "auto", "float32", "bfloat16")


def drafter_dtype(name: str, target_model) -> torch.dtype:
    """proposer.dtype: the trained drafter's torch dtype beside this target."""
    if name not in DRAFTER_DTYPES:
        raise ValueError(f"proposer.dtype={name!r}; choose one of {list(DRAFTER_DTYPES)}")
    if name == "target":
        return target_model.dtype
    if name == "auto":
        chosen, _ = choose_dtype("auto", target_model.device)
        return chosen if chosen == torch.bfloat16 else target_model.dtype
    return parse_dtype(name)


def make_proposer(cfg: ProposerConfig, target, target_name: str, backend: str = "auto", kernel: str = "auto"):
    """The configured proposer; for name=model also the standalone HF model it drafts with (else None).
    name=none is plain decoding (no drafting). backend/kernel: target.backend and target.kernel, which a
    trained drafter's fast twin follows."""
    name = cfg.name
    if cfg.branches not in (None, 1) and name not in ("drafter", "hybrid", "ngram"):
        raise ValueError(f"proposer.branches={cfg.branches} applies to trained drafters and prompt lookup (proposer="
                         f"drafter, hybrid or ngram); proposer={name} drafts one chain: set proposer.branches=1")
    # prompt lookup; a hybrid's lookup part drafts one chain (its branches are the drafter's)
    lookup = lambda branches=1: NgramProposer(cfg.max_ngram, cfg.min_ngram, share_stats=cfg.share_stats,  # noqa: E731
                                              branches=branches, side_length=cfg.side_length)
    if name == "none":
        return NoProposer(), None
    if name == "ngram":
        return lookup(default_branches(name, cfg.branches)), None
    if name == "model":
        return load_model_proposer(cfg.path or target.path, cfg.num_layers, target)
    if name in ("drafter", "hybrid"):
        if not cfg.path:
            raise ValueError(f"proposer={name} needs proposer.path=EXPORT (the export folder of a distill run)")
        drafter, feature_layers = load_drafter(cfg.path, target.model, target_name)
        drafter = to_dtype(drafter, drafter_dtype(cfg.dtype, target.model))  # rotary frequencies stay float32
        proposer = drafter_proposer(drafter_for_backend(drafter, backend, kernel=kernel), feature_layers,  # the target's kernels
                                    cfg.branches)
        # hybrid: prompt lookup where it matches, the drafter elsewhere
        return (HybridProposer(lookup(), proposer) if name == "hybrid" else proposer), None
    raise ValueError(f"unknown proposer {name!r}; choose one of {[*PROPOSERS, 'none']}")


def attach_calibration(proposer, export: str | None, setting: str = "auto") -> str | None:
    """Give a block drafter (a hybrid's drafter part too) its stored confidence maps: setting auto =
    EXPORT/calibration.json where present, none, or a file. Returns the file used (None: uncalibrated)."""
    from specdraft.decode.calibrate import CALIBRATION_FILE, read_calibration

    drafter = getattr(proposer, "trained", proposer)
    if not isinstance(drafter, BlockDrafterProposer) or setting == "none":
        return None
    if setting == "auto":
        path = Path(export) / CALIBRATION_FILE
    else:
        path = Path(setting)
        if not path.is_file():
            raise FileNotFoundError(f"calibration file {path} does not exist; use auto, none or a calibration.json")
    calibration = read_calibration(path)
    for bucket, maps in (calibration or {}).items():
        if len(maps["scale"]) < drafter.max_draft:
            raise ValueError(f"{path} holds {len(maps['scale'])} {bucket} maps but this drafter drafts "
                             f"{drafter.max_draft} positions: it was made for another export; rerun bench.mode=calibrate")
    proposer.calibration = calibration
    return str(path) if calibration else None
