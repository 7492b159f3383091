"""Calibrating a drafter's confidence head on held-out decoding, stored with the export.

Data: real verify steps. Each step drafted k positions with raw confidence logits z_1..z_k and
accepted n of them; position j "survived" when n >= j. Steps from half of the prompts fit the
per-position maps c_j = sigmoid(scale_j · z_j + shift_j) (decode/calibration.py), the other half measure
ECE/Brier/AUROC before and after, so the reported gain is out of sample. Greedy and sampled decoding draft
different tokens and survive by different rules (the head is trained on T=1's acceptance chance, and at
T=0 a position survives only where the drafter's top token is the target's), so each temperature bucket
gets its own maps: "greedy" (T = 0) and "sampling" (fitted at the sampling temperature given, applied to
every T > 0). Files from before the maps held one temperature per position; they read as scale = 1 / T,
shift = 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specdraft.io.files import write_text_atomically
from specdraft.decode.calibration import calibration_report, fit_platt
from specdraft.decode.generate import Generation

CALIBRATION_FILE = "calibration.json"


def survival_arrays(generations: list[Generation], positions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(z, survived, drafted), each (steps, positions), from the steps that recorded confidences."""
    rows_z, rows_survived, rows_drafted = [], [], []
    for gen in generations:
        # confidence_logits has one entry per step that drafted, in step order ([] without a confidence head).
        steps = [(d, a) for d, a in zip(gen.drafted, gen.accepted) if d > 0]
        for (drafted, accepted), z in zip(steps, gen.confidence_logits):
            if not z:
                continue
            padded = list(z[:positions]) + [0.0] * (positions - min(len(z), positions))
            rows_z.append(padded)
            rows_drafted.append([j < drafted for j in range(positions)])
            rows_survived.append([j < accepted for j in range(positions)])
    if not rows_z:
        raise ValueError("no verify step recorded confidences: calibration needs a dspark export (confidence head)")
    return torch.tensor(rows_z), torch.tensor(rows_survived), torch.tensor(rows_drafted)


def fit_bucket(fit_gens: list[Generation], eval_gens: list[Generation], positions: int) -> dict:
    """Maps from one half, the before/after report from the other."""
    z, survived, drafted = survival_arrays(fit_gens, positions)
    scale, shift = fit_platt(z, survived, drafted)
    ez, esurvived, edrafted = survival_arrays(eval_gens, positions)
    return {
        "maps": {"scale": scale.tolist(), "shift": shift.tolist()},
        "fit_steps": int(z.shape[0]),
        "eval_steps": int(ez.shape[0]),
        "report": calibration_report(ez, esurvived, edrafted, scale, shift),
        "_eval": (ez, esurvived, edrafted, scale, shift),
    }


def write_calibration(export_dir: Path, buckets: dict, meta: dict) -> Path:
    """EXPORT/calibration.json (atomic): {"greedy": {"scale": [..], "shift": [..]}, "sampling": {..}, "meta": ...,
    "report": ...}."""
    data = {name: bucket["maps"] for name, bucket in buckets.items()}
    data["report"] = {name: bucket["report"] for name, bucket in buckets.items()}
    data["meta"] = meta
    path = Path(export_dir) / CALIBRATION_FILE
    return write_text_atomically(path, json.dumps(data, indent=1))


def read_calibration(location: str | Path) -> dict | None:
    """The per-bucket maps in a calibration file (or an export folder's): {bucket: {"scale": [..], "shift": [..]}},
    None if there is none."""
    path = Path(location)
    path = path / CALIBRATION_FILE if path.is_dir() else path
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        buckets = {name: _bucket_maps(data[name]) for name in ("greedy", "sampling") if name in data}
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path} is corrupt ({type(err).__name__}: {err}); delete it or rerun bench.mode=calibrate") from None
    for maps in buckets.values():
        if len(maps["scale"]) != len(maps["shift"]) or not all(map(math.isfinite, maps["scale"] + maps["shift"])):
            raise ValueError(f"{path} holds a malformed map (scales and shifts must be finite and pair up); "
                             "delete it or rerun bench.mode=calibrate")
    return buckets


def _bucket_maps(entry) -> dict:
    """One bucket's maps; a list is a file from before the maps (a temperature per position: scale 1 / T)."""
    if isinstance(entry, list):
        temperatures = [float(t) for t in entry]
        if any(t <= 0 for t in temperatures):
            raise ValueError("a non-positive temperature")
        return {"scale": [1 / t for t in temperatures], "shift": [0.0] * len(temperatures)}
    return {"scale": [float(v) for v in entry["scale"]], "shift": [float(v) for v in entry["shift"]]}


def plot_reliability(buckets: dict, path: Path, bins: int = 10) -> Path:
    """Reliability diagram of a_j (all positions pooled) before/after, and ECE per position, per bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specdraft.decode.calibration import cumulative_survival

    fig, axes = plt.subplots(len(buckets), 2, figsize=(10, 4 * len(buckets)), squeeze=False)
    for row, (name, bucket) in enumerate(buckets.items()):
        z, survived, drafted, scale, shift = bucket["_eval"]
        for label, maps in (("before", ()), ("after", (scale, shift))):
            a = cumulative_survival(z, *maps)[drafted]
            y = survived[drafted].float()
            index = (a * bins).long().clamp(max=bins - 1)
            xs, ys = [], []
            for b in range(bins):
                mask = index == b
                if mask.any():
                    xs.append(float(a[mask].mean()))
                    ys.append(float(y[mask].mean()))
            axes[row, 0].plot(xs, ys, marker="o", label=label)
        axes[row, 0].plot([0, 1], [0, 1], color="gray", linestyle="--", linewidth=1)
        axes[row, 0].set(title=f"{name}: reliability of a_j", xlabel="predicted survival a_j", ylabel="observed survival")
        axes[row, 0].legend()
        report = bucket["report"]
        positions = [entry["position"] for entry in report]
        width = 0.4
        axes[row, 1].bar([p - width / 2 for p in positions], [e["ece_before"] for e in report], width, label="before")
        axes[row, 1].bar([p + width / 2 for p in positions], [e["ece_after"] for e in report], width, label="after")
        axes[row, 1].set(title=f"{name}: ECE by position", xlabel="position j", ylabel="ECE")
        axes[row, 1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
