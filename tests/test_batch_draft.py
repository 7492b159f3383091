"""Batched drafting (decode/batch_draft.py) equals drafting each request alone (its reference twin)."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.batch_draft import can_batch, propose_blocks
from specdraft.decode.proposer import BlockDrafterProposer
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import ThresholdRule
from tests.helpers import tiny_llama
from specdraft.models.drafter import BlockDrafter

LENGTHS = [5, 11, 1, 8]  # context positions per request: the caches are ragged
LIMITS = [4, 2, 0, 3]  # one request drafts nothing this step


def drafter_for(mode: str, markov: str) -> BlockDrafter:
    target = tiny_llama(0)
    torch.manual_seed(3)
    drafter = BlockDrafter(target.config, num_layers=2, num_feature_layers=2, block_size=4, mask_token_id=1,
                           mode=mode, markov_rank=8, markov_head_type=markov).eval()
    drafter.copy_target_weights(target)
    if drafter.markov_head is not None:  # a sharper Markov bias, so the stopping rule cuts rows at different places
        with torch.no_grad():
            drafter.markov_head.markov_w1.weight.normal_(std=1.0)
            drafter.confidence_head.proj.weight.normal_(std=1.0)
    return drafter


def requests(drafter: BlockDrafter, calibration: dict | None):
    torch.manual_seed(5)
    proposers, contexts = [], []
    for length in LENGTHS:
        proposer = BlockDrafterProposer(drafter, (1, 2), calibration)
        proposer.start(None, torch.randn(length, 2 * 32))  # features (C, L*H)
        proposers.append(proposer)
        contexts.append(torch.randint(0, 64, (length + 1,)).tolist())
    return proposers, contexts


def close(a, b):
    if a is None or b is None:
        assert a is None and b is None
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float32, batched vs one-row matmuls


@pytest.mark.parametrize("mode,markov", [("dspark", "vanilla"), ("dspark", "rnn"), ("dspark", "gated"), ("dflash", "vanilla")])
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0, top_k=20)], ids=["greedy", "T1"])
@pytest.mark.parametrize("rule", [None, ThresholdRule(0.5)], ids=["whole_blocks", "threshold"])
def test_batched_drafting_equals_drafting_each_request_alone(mode, markov, sampler, rule):
    drafter = drafter_for(mode, markov)
    calibration = {"greedy": {"scale": [1.4, 0.8, 1.0, 0.5], "shift": [-0.7, 0.2, 0.0, -1.0]},
                   "sampling": {"scale": [0.7, 1.0, 2.0, 1.0], "shift": [0.3, -0.4, 0.0, 0.1]}}
    proposers, contexts = requests(drafter, calibration)
    assert can_batch(proposers)
    alone_gens = [torch.Generator().manual_seed(10 + r) for r in range(len(LIMITS))]
    batch_gens = [torch.Generator().manual_seed(10 + r) for r in range(len(LIMITS))]
    rule = rule if mode == "dspark" else None  # a rule on confidences needs the confidence head
    expected = [p.propose(c, n, sampler, g, rule) for p, c, n, g in zip(proposers, contexts, LIMITS, alone_gens)]
    got = propose_blocks(proposers, contexts, LIMITS, sampler, batch_gens, rule)
    for want, have in zip(expected, got):
        assert have.tokens == want.tokens
        close(have.draft_probs, want.draft_probs)
        close(have.confidence, want.confidence)
        close(have.confidence_logits, want.confidence_logits)
    # Each request's generator made exactly the draws it makes alone.
    assert [torch.rand(1, generator=g).item() for g in batch_gens] == [torch.rand(1, generator=g).item() for g in alone_gens]
    assert len({len(p.tokens) for p in got}) > 1, "rows should draft ragged lengths"
    if rule is not None:
        assert any(len(p.tokens) < n for p, n in zip(got, LIMITS)), "the rule should stop a row before its limit"


def test_can_batch_needs_one_block_drafter_with_context():
    drafter = drafter_for("dspark", "vanilla")
    proposers, _ = requests(drafter, None)
    assert can_batch(proposers)
    assert not can_batch([BlockDrafterProposer(drafter, (1, 2))])  # no context yet
    other, _ = requests(drafter_for("dspark", "vanilla"), None)
    assert not can_batch(proposers[:1] + other[:1])  # two different drafters
    calibrated = BlockDrafterProposer(drafter, (1, 2), {"greedy": {"scale": [0.5] * 4, "shift": [0.0] * 4}})
    calibrated.start(None, torch.randn(3, 2 * 32))
    assert not can_batch(proposers[:1] + [calibrated])  # two calibrations: confidences would be wrong for one
