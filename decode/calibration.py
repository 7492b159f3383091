"""Calibration of the confidence head: per-position Platt scaling of the conditional survival.

The scheduler acts on a_j = Π_{i≤j} c_i, the predicted chance that drafted positions 1..j all survive
verification. By the chain rule a_j is calibrated when each c_j is calibrated as the chance that position j
survives given that 1..j-1 did, so each position gets its own affine map of the head's logit,
c_j = sigmoid(scale_j · z_j + shift_j), fitted by maximum likelihood (log-loss, a proper scoring rule) on the
rows that drafted position j after 1..j-1 survived. The shift is what a temperature alone lacks: the
default export's head at T=0 put c_1 at 0.27 on average where 0.19 survived, and a temperature can move
predictions only toward or away from one half, not down as a whole. Positions with few such rows lean on the
position before them (a prior worth `prior_rows` rows pulls each map toward the previous one, the identity
for position 1), so a deep position seen a handful of times does not get a wild map.

Plain functions over tensors: z (N, K) confidence logits, survived (N, K) bool (positions 1..j all
accepted), drafted (N, K) bool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Equal-width-bin ECE: Σ_b (n_b / n) · |mean prediction − mean label| over the bin."""
    probs, labels = probs.float().flatten(), labels.float().flatten()
    if probs.numel() == 0:
        return float("nan")
    index = (probs * bins).long().clamp(max=bins - 1)
    count = torch.zeros(bins).index_add_(0, index, torch.ones_like(probs))
    gap = torch.zeros(bins).index_add_(0, index, probs - labels)
    return float(gap.abs().sum() / probs.numel())


def brier_score(probs: torch.Tensor, labels: torch.Tensor) -> float:
    return float((probs.float() - labels.float()).pow(2).mean()) if probs.numel() else float("nan")


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney U with average ranks for ties); nan with one class only."""
    scores, labels = scores.float().flatten(), labels.bool().flatten()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = scores.argsort()
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float32)
    # Ties share the mean of their ranks.
    unique, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).float()
    mean_rank = ends - (counts.float() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def cumulative_survival(logits: torch.Tensor, scale: torch.Tensor | None = None,
                        shift: torch.Tensor | None = None) -> torch.Tensor:
    """a (N, K): running product of c_j = sigmoid(scale_j · z_j + shift_j); without maps, of the head as trained."""
    if scale is None:
        return torch.sigmoid(logits.float()).cumprod(-1)
    return torch.sigmoid(logits.float() * scale.float() + shift.float()).cumprod(-1)


def _fit_position(z: torch.Tensor, label: torch.Tensor, prior: tuple[float, float], prior_rows: float) -> tuple[float, float]:
    """(scale, shift) minimising the mean log-loss of sigmoid(scale · z + shift) against `label`, plus a
    quadratic pull toward `prior` worth `prior_rows` rows (it also keeps the fit finite when one class is absent)."""
    z, label = z.double(), label.double()
    start = torch.tensor(prior, dtype=torch.float64)
    params = start.clone().requires_grad_(True)
    weight = prior_rows / max(len(z), 1)
    optimizer = torch.optim.LBFGS([params], max_iter=100, line_search_fn="strong_wolfe")

    def loss_fn():
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(params[0] * z + params[1], label) + weight * (params - start).pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(loss_fn)
    scale, shift = params.detach().tolist()
    return scale, shift


def fit_platt(logits: torch.Tensor, survived: torch.Tensor, drafted: torch.Tensor,
              prior_rows: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale (K,), shift (K,)): per position j, the map of z_j fitted on the rows that drafted j after 1..j-1
    survived (labels: whether j survived too), pulled toward position j-1's map."""
    positions = logits.shape[1]
    scale, shift = torch.ones(positions), torch.zeros(positions)
    prior = (1.0, 0.0)  # position 1 leans on the head as trained
    for j in range(positions):
        rows = drafted[:, j].bool()
        if j:  # not in place: .bool() of a bool tensor is the caller's tensor itself
            rows = rows & survived[:, j - 1].bool()
        if rows.any():
            prior = _fit_position(logits[rows, j].float(), survived[rows, j].float(), prior, prior_rows)
        scale[j], shift[j] = prior  # no rows: the previous position's map
    return scale, shift


def calibration_report(logits: torch.Tensor, survived: torch.Tensor, drafted: torch.Tensor,
                       scale: torch.Tensor, shift: torch.Tensor, bins: int = 15) -> list[dict]:
    """Per position: rows, ECE, Brier and AUROC of a_j before (the head as trained) and after its maps."""
    raw = cumulative_survival(logits)
    scaled = cumulative_survival(logits, scale, shift)
    report = []
    for j in range(logits.shape[1]):
        mask = drafted[:, j].bool()
        label = survived[mask, j]
        entry = {"position": j + 1, "rows": int(mask.sum()), "scale": float(scale[j]), "shift": float(shift[j])}
        for name, probs in (("before", raw[mask, j]), ("after", scaled[mask, j])):
            entry[f"ece_{name}"] = expected_calibration_error(probs, label, bins)
            entry[f"brier_{name}"] = brier_score(probs, label)
            entry[f"auroc_{name}"] = auroc(probs, label)
        report.append(entry)
    return report


def apply_map(z: torch.Tensor, maps: dict | None, position: int) -> torch.Tensor:
    """c at a drafted `position` (0-based) from the head's logit z: sigmoid(scale · z + shift) with the stored map
    ({"scale": [...], "shift": [...]}, decode/calibrate.py), or sigmoid(z), the head as trained, without one."""
    if not maps:
        return torch.sigmoid(z)
    return torch.sigmoid(z * maps["scale"][position] + maps["shift"][position])
