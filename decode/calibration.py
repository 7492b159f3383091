"""Calibration of the confidence head: sequential temperature scaling of the cumulative survival.

The scheduler acts on a_j = Π_{i≤j} c_i, the predicted chance that drafted positions 1..j all survive
verification, so that product is what must be calibrated, not each c_i alone. Position by position,
left to right, a temperature T_j is chosen (grid search: ECE is piecewise constant in T) to minimise the
expected calibration error of a_j = a_{j-1} · sigmoid(z_j / T_j) against the observed survival of 1..j,
with the earlier temperatures fixed. Rows where position j was not drafted are left out of its fit.

Plain functions over tensors: z (N, K) confidence logits, survived (N, K) bool (positions 1..j all
accepted), drafted (N, K) bool.
"""

from __future__ import annotations

import torch

DEFAULT_GRID = torch.logspace(-1.0, 1.0, 81)  # temperatures 0.1 .. 10


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


def cumulative_survival(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """a (N, K): running product of sigmoid(z_i / T_i)."""
    return torch.sigmoid(logits.float() / temperatures.float()).cumprod(-1)


def fit_sequential_temperatures(logits: torch.Tensor, survived: torch.Tensor, drafted: torch.Tensor,
                                grid: torch.Tensor = DEFAULT_GRID, bins: int = 15) -> torch.Tensor:
    """T (K,): for j = 1..K in order, the grid temperature minimising the ECE of a_j (earlier T fixed)."""
    rows, positions = logits.shape
    temperatures = torch.ones(positions)
    before = torch.ones(rows)  # a_{j-1}
    for j in range(positions):
        mask = drafted[:, j].bool()
        if mask.sum() == 0:
            continue  # never drafted: keep T = 1
        z, prefix, label = logits[mask, j].float(), before[mask], survived[mask, j]
        errors = torch.tensor([expected_calibration_error(prefix * torch.sigmoid(z / t), label, bins) for t in grid])
        temperatures[j] = grid[int(errors.argmin())]  # first minimum: ties go to the smaller temperature
        before = before * torch.sigmoid(logits[:, j].float() / temperatures[j])
    return temperatures


def calibration_report(logits: torch.Tensor, survived: torch.Tensor, drafted: torch.Tensor,
                       temperatures: torch.Tensor, bins: int = 15) -> list[dict]:
    """Per position: rows, ECE, Brier and AUROC of a_j before (T = 1) and after scaling."""
    raw = cumulative_survival(logits, torch.ones(logits.shape[1]))
    scaled = cumulative_survival(logits, temperatures)
    report = []
    for j in range(logits.shape[1]):
        mask = drafted[:, j].bool()
        label = survived[mask, j]
        entry = {"position": j + 1, "rows": int(mask.sum()), "temperature": float(temperatures[j])}
        for name, probs in (("before", raw[mask, j]), ("after", scaled[mask, j])):
            entry[f"ece_{name}"] = expected_calibration_error(probs, label, bins)
            entry[f"brier_{name}"] = brier_score(probs, label)
            entry[f"auroc_{name}"] = auroc(probs, label)
        report.append(entry)
    return report
