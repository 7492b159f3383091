"""Distillation losses: position weights, normalisation, the tau estimates, confidence labels."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.train.losses import argmax_labels, distill_loss, expected_tau, position_weights


def test_position_weights_decay_exponentially():
    w = position_weights(7, decay=4.0)
    assert w[0] == 1.0
    torch.testing.assert_close(w[3], torch.tensor(math.exp(-3 / 4)))


def test_loss_is_weighted_mean_of_per_position_terms():
    torch.manual_seed(0)
    logits, target_logits = torch.randn(3, 4, 6), torch.randn(3, 4, 6)
    target_probs = target_logits.softmax(-1)
    tokens = target_probs.argmax(-1)
    valid = torch.ones(3, 4, dtype=torch.bool)
    valid[2, 2:] = False
    loss, _ = distill_loss(logits, target_probs, tokens, valid, ce_weight=0.1, l1_weight=0.9)
    # Hand computation, position by position.
    num = den = 0.0
    for n in range(3):
        for k in range(4):
            if not valid[n, k]:
                continue
            q = logits[n, k].softmax(-1)
            term = 0.1 * -math.log(q[tokens[n, k]]) + 0.9 * float((q - target_probs[n, k]).abs().sum())
            num += math.exp(-k / 4) * term
            den += math.exp(-k / 4)
    assert float(loss) == pytest.approx(num / den, rel=1e-5)


def test_global_normalizer_makes_shards_add_up():
    """Two shards normalised by the all-reduced weight sum add up to the full-batch loss."""
    torch.manual_seed(1)
    logits, probs = torch.randn(4, 5, 8), torch.randn(4, 5, 8).softmax(-1)
    tokens, valid = probs.argmax(-1), torch.rand(4, 5) > 0.3
    full, _ = distill_loss(logits, probs, tokens, valid)
    total = float((position_weights(5) * valid.float()).sum())
    halves = [distill_loss(logits[s], probs[s], tokens[s], valid[s], normalizer=total)[0] for s in (slice(0, 2), slice(2, 4))]
    assert float(sum(halves)) == pytest.approx(float(full), rel=1e-5)


def test_tau_estimates_for_perfect_and_useless_drafts():
    probs = torch.randn(2, 7, 10).softmax(-1)
    valid = torch.ones(2, 7, dtype=torch.bool)
    _, perfect = distill_loss(probs.log(), probs, probs.argmax(-1), valid)
    assert perfect["tau_estimate"] == pytest.approx(8.0, abs=1e-4) and perfect["tau_greedy"] == 8.0
    disjoint_target = torch.zeros(2, 7, 10)
    disjoint_target[..., 0] = 1
    draft = torch.full((2, 7, 10), -30.0)
    draft[..., 1] = 30.0
    _, useless = distill_loss(draft, disjoint_target, torch.zeros(2, 7, dtype=torch.long), valid)
    assert useless["tau_estimate"] == pytest.approx(1.0, abs=1e-4) and useless["tau_greedy"] == 1.0


def test_expected_tau_stops_at_invalid_positions():
    alpha = torch.tensor([[1.0, 1.0, 1.0]])
    assert float(expected_tau(alpha, torch.tensor([[1.0, 0.0, 1.0]]))) == 2.0


def test_confidence_is_trained_towards_the_acceptance_rate():
    torch.manual_seed(2)
    logits, probs = torch.randn(8, 3, 5), torch.randn(8, 3, 5).softmax(-1)
    confidence = torch.zeros(8, 3, requires_grad=True)
    optimizer = torch.optim.SGD([confidence], lr=5.0)
    for _ in range(300):
        loss, _ = distill_loss(logits, probs, probs.argmax(-1), torch.ones(8, 3, dtype=torch.bool), confidence)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    alpha = 1 - 0.5 * (logits.softmax(-1) - probs).abs().sum(-1)
    torch.testing.assert_close(confidence.sigmoid().detach(), alpha, atol=2e-3, rtol=0)


def test_non_finite_loss_is_refused():
    logits = torch.full((1, 2, 4), float("nan"))
    with pytest.raises(FloatingPointError, match="loss is nan"):
        distill_loss(logits, torch.full((1, 2, 4), 0.25), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))


def test_reduced_vocabulary_counts_outside_mass_in_l1_and_skips_ce():
    full = torch.tensor([[[0.5, 0.2, 0.3]]])  # target over 3 tokens; draft vocabulary = tokens 0, 1
    draft_logits = torch.log(torch.tensor([[[0.5, 0.5]]]))
    valid = torch.ones(1, 1, dtype=torch.bool)
    loss, metrics = distill_loss(draft_logits, full[..., :2], torch.tensor([[-1]]), valid, ce_weight=1.0,
                                 l1_weight=1.0, target_outside_mass=full[..., 2])
    # L1 = |0.5-0.5| + |0.5-0.2| + 0.3 (mass the drafter cannot propose) = 0.6; CE skipped.
    assert float(loss) == pytest.approx(0.6, rel=1e-5)
    assert metrics["tau_estimate"] == pytest.approx(1 + (1 - 0.3), rel=1e-5)


def test_kl_option_adds_forward_kl_per_position():
    torch.manual_seed(0)
    logits, target = torch.randn(3, 4, 10), torch.randn(3, 4, 10).softmax(-1)
    tokens, valid = torch.randint(0, 10, (3, 4)), torch.ones(3, 4, dtype=torch.bool)
    base, _ = distill_loss(logits, target, tokens, valid)
    with_kl, _ = distill_loss(logits, target, tokens, valid, kl_weight=2.0)
    kl = torch.nn.functional.kl_div(logits.log_softmax(-1), target, reduction="none").sum(-1)  # (3, 4)
    weights = position_weights(4)[None].expand(3, 4)
    assert float(with_kl - base) == pytest.approx(float(2.0 * (kl * weights).sum() / weights.sum()), rel=1e-5)
    # Zero where the draft equals the target.
    same, _ = distill_loss(target.log(), target, tokens, valid, ce_weight=0, l1_weight=0, kl_weight=1.0)
    assert float(same) == pytest.approx(0.0, abs=1e-6)


def test_argmax_labels_skip_positions_whose_argmax_lies_outside_the_draft_vocabulary():
    probs = torch.tensor([[[0.5, 0.2, 0.1], [0.1, 0.2, 0.1]]])  # (1, 2, 3): 0.2 and 0.6 outside
    labels = argmax_labels(probs, torch.tensor([[0.2, 0.6]]))
    assert labels.tolist() == [[0, -1]]
    assert argmax_labels(probs).tolist() == [[0, 1]]
