"""Calibration of the cumulative survival: metrics against hand-computed values, and per-position Platt maps
recovering known miscalibration on synthetic chains."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdraft.decode.calibrate import read_calibration
from specdraft.decode.calibration import (
    apply_map,
    auroc,
    brier_score,
    calibration_report,
    cumulative_survival,
    expected_calibration_error,
    fit_platt,
)


def test_metrics_on_hand_computed_cases():
    probs, labels = torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 1, 1, 1])
    # Two occupied bins: |0.1 - 0.5| * 2/4 + |0.9 - 1.0| * 2/4
    assert expected_calibration_error(probs, labels, bins=10) == pytest.approx(0.25)
    assert brier_score(probs, labels) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0, 1, 1])) == pytest.approx(0.5)  # ties
    assert math.isnan(auroc(torch.tensor([0.2, 0.3]), torch.tensor([1, 1])))


def synthetic_chains(rows=60000, scales=(0.5, 2.0, 1.0), shifts=(1.0, 0.0, -0.5), seed=0):
    """Per-position acceptance probabilities p (known); the head reports (logit(p) - shift) / scale, i.e. a
    known affine miscalibration (the fitted map must undo it: c = sigmoid(scale · z + shift) = p); a chain
    survives position j when positions 1..j are all accepted."""
    generator = torch.Generator().manual_seed(seed)
    k = len(scales)
    p = torch.rand(rows, k, generator=generator) * 0.9 + 0.05
    logits = (torch.logit(p) - torch.tensor(shifts)) / torch.tensor(scales)
    accepted = torch.rand(rows, k, generator=generator) < p
    survived = accepted.long().cumprod(-1).bool()
    # Verify lengths vary per row (a scheduler's choice, made before verification): position j is labelled
    # only in rows that drafted it, whatever happened to the positions before it.
    lengths = torch.randint(1, k + 1, (rows, 1), generator=generator)
    drafted = torch.arange(k)[None, :] < lengths
    return logits, survived, drafted, torch.tensor(scales), torch.tensor(shifts)


def test_platt_maps_recover_known_miscalibration_and_lower_ece():
    logits, survived, drafted, scales, shifts = synthetic_chains()
    scale, shift = fit_platt(logits, survived, drafted)
    assert torch.allclose(scale, scales, rtol=0.1, atol=0.05), scale
    assert torch.allclose(shift, shifts, atol=0.1), shift
    report = calibration_report(logits, survived, drafted, scale, shift)
    assert all(entry["ece_after"] < 0.5 * entry["ece_before"] for entry in report), report
    assert all(entry["ece_after"] < 0.02 for entry in report), report
    # A positive scale is monotone in z_1, so the ranking at position 1 cannot change.
    assert report[0]["auroc_after"] == pytest.approx(report[0]["auroc_before"])


def test_a_shift_fixes_an_over_confident_head_where_a_temperature_cannot():
    """The default export's case at T=0: the head says 0.27 where 0.19 survive, across its range. No scale alone
    brings the mean down to what survives and keeps the ranking; the fitted shift does."""
    generator = torch.Generator().manual_seed(1)
    p = torch.rand(40000, 1, generator=generator) * 0.4 + 0.05  # mean 0.25
    logits = torch.logit(p) + 0.6  # over-confident everywhere
    survived = torch.rand(40000, 1, generator=generator) < p
    drafted = torch.ones_like(survived)
    scale, shift = fit_platt(logits, survived, drafted)
    fitted = cumulative_survival(logits, scale, shift)
    assert float(fitted.mean()) == pytest.approx(float(survived.float().mean()), abs=0.01)
    assert float(shift[0]) < -0.3
    best_scale_only = min(expected_calibration_error(torch.sigmoid(logits * s), survived) for s in torch.linspace(0.1, 5, 50))
    assert expected_calibration_error(fitted, survived) < 0.5 * best_scale_only


def test_positions_without_rows_take_the_previous_map_and_thin_ones_lean_on_it():
    logits, survived, drafted, *_ = synthetic_chains(rows=2000)
    drafted[:, 2] = False
    scale, shift = fit_platt(logits, survived, drafted)
    assert (scale[2], shift[2]) == (scale[1], shift[1])
    assert cumulative_survival(logits, scale, shift).shape == logits.shape
    # One row of position 2 where every row survives: the prior keeps the map finite and near position 1's.
    few = torch.zeros_like(drafted)
    few[:, 0] = True
    few[0, 1] = True
    all_survive = torch.ones_like(survived)
    scale, shift = fit_platt(logits, all_survive, few)
    assert torch.isfinite(scale).all() and torch.isfinite(shift).all()
    assert abs(float(scale[1] - scale[0])) < 1.0 and abs(float(shift[1] - shift[0])) < 1.0


def test_files_from_before_the_maps_read_as_temperatures(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"greedy": [2.0, 0.5], "sampling": [1.0, 4.0]}))
    maps = read_calibration(path)
    assert maps["greedy"] == {"scale": [0.5, 2.0], "shift": [0.0, 0.0]}
    z = torch.tensor(0.8)
    assert float(apply_map(z, maps["greedy"], 0)) == pytest.approx(float(torch.sigmoid(z / 2.0)))
    assert float(apply_map(z, None, 0)) == pytest.approx(float(torch.sigmoid(z)))
    path.write_text(json.dumps({"greedy": {"scale": [1.0], "shift": [float("nan")]}}))
    with pytest.raises(ValueError, match="malformed map"):
        read_calibration(path)
    path.write_text(json.dumps({"greedy": [0.0, 1.0]}))
    with pytest.raises(ValueError, match="corrupt"):
        read_calibration(path)
