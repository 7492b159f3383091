"""Calibration of the cumulative survival: metrics against hand-computed values, and sequential temperature
scaling recovering known miscalibration on synthetic chains."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.decode.calibration import (
    auroc,
    brier_score,
    calibration_report,
    cumulative_survival,
    expected_calibration_error,
    fit_sequential_temperatures,
)


def test_metrics_on_hand_computed_cases():
    probs, labels = torch.tensor([0.1, 0.1, 0.9, 0.9]), torch.tensor([0, 1, 1, 1])
    # Two occupied bins: |0.1 - 0.5| * 2/4 + |0.9 - 1.0| * 2/4
    assert expected_calibration_error(probs, labels, bins=10) == pytest.approx(0.25)
    assert brier_score(probs, labels) == pytest.approx((0.01 + 0.81 + 0.01 + 0.01) / 4)
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0, 1, 1])) == pytest.approx(0.5)  # ties
    assert math.isnan(auroc(torch.tensor([0.2, 0.3]), torch.tensor([1, 1])))


def synthetic_chains(rows=60000, true_temperatures=(2.0, 0.5, 1.0), seed=0):
    """Per-position acceptance probabilities p (known); the head reports logit(p) * T_true, i.e. miscalibrated
    by a known temperature; a chain survives position j when positions 1..j are all accepted."""
    generator = torch.Generator().manual_seed(seed)
    k = len(true_temperatures)
    p = torch.rand(rows, k, generator=generator) * 0.9 + 0.05
    logits = torch.logit(p) * torch.tensor(true_temperatures)
    accepted = torch.rand(rows, k, generator=generator) < p
    survived = accepted.long().cumprod(-1).bool()
    # Verify lengths vary per row (a scheduler's choice, made before verification): position j is labelled
    # only in rows that drafted it, whatever happened to the positions before it.
    lengths = torch.randint(1, k + 1, (rows, 1), generator=generator)
    drafted = torch.arange(k)[None, :] < lengths
    return logits, survived, drafted, torch.tensor(true_temperatures)


def test_sequential_scaling_recovers_known_temperatures_and_lowers_ece():
    logits, survived, drafted, truth = synthetic_chains()
    temperatures = fit_sequential_temperatures(logits, survived, drafted)
    assert torch.allclose(temperatures, truth, rtol=0.2), temperatures  # a_3 is small: ECE is flat near its optimum
    report = calibration_report(logits, survived, drafted, temperatures)
    assert report[0]["ece_after"] < 0.5 * report[0]["ece_before"] and report[1]["ece_after"] < 0.5 * report[1]["ece_before"]
    assert all(entry["ece_after"] < 0.02 for entry in report), report
    # Scaling by a positive temperature is monotone in z_1, so the ranking at position 1 cannot change.
    assert report[0]["auroc_after"] == pytest.approx(report[0]["auroc_before"])


def test_never_drafted_positions_keep_unit_temperature():
    logits, survived, drafted, _ = synthetic_chains(rows=2000)
    drafted[:, 2] = False
    temperatures = fit_sequential_temperatures(logits, survived, drafted)
    assert temperatures[2] == 1.0
    assert cumulative_survival(logits, temperatures).shape == logits.shape
