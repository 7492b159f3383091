"""Markov head: teacher-forced block logits equal step-by-step inference logits; confidence head shapes."""

from __future__ import annotations

import pytest
import torch

from specdraft.models.heads import MARKOV_TYPES, ConfidenceHead, MarkovHead


@pytest.mark.parametrize("head_type", MARKOV_TYPES)
def test_teacher_forced_equals_step_by_step(head_type):
    torch.manual_seed(0)
    head = MarkovHead(target_vocab=50, draft_vocab=30, rank=8, hidden_size=16, head_type=head_type)
    with torch.no_grad():
        head.markov_w1.weight.normal_()  # realistic magnitudes, not the tiny init
    prev_tokens = torch.randint(0, 50, (5, 7))  # (N, γ)
    hidden = torch.randn(5, 7, 16)
    base_logits = torch.randn(5, 7, 30)
    teacher_forced = base_logits + head.block_bias(prev_tokens, hidden)
    # Inference: walk the block left to right, feeding the same previous tokens one at a time.
    state, stepped = head.initial_state(5, hidden), []
    for k in range(7):
        bias, state = head.markov_step(head.markov_w1(prev_tokens[:, k]), hidden[:, k], state)
        stepped.append(base_logits[:, k] + bias)
    torch.testing.assert_close(teacher_forced, torch.stack(stepped, 1), rtol=1e-5, atol=1e-6)


def test_bias_depends_on_previous_token():
    torch.manual_seed(1)
    head = MarkovHead(20, 20, 4, 8)
    hidden = torch.randn(1, 2, 8)
    a = head.block_bias(torch.tensor([[1, 2]]), hidden)
    b = head.block_bias(torch.tensor([[1, 3]]), hidden)
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, 1], b[:, 1])


def test_bad_head_settings_are_refused():
    with pytest.raises(ValueError, match="markov_head_type='lstm'"):
        MarkovHead(10, 10, 4, 8, "lstm")
    with pytest.raises(ValueError, match="markov_rank=0"):
        MarkovHead(10, 10, 0, 8)


def test_confidence_head_shape():
    head = ConfidenceHead(24)
    assert head(torch.randn(3, 7, 24)).shape == (3, 7)
