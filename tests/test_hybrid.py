"""proposer=hybrid: prompt lookup where the context repeats, the trained drafter elsewhere; exact decoding,
both parts in step with the accepted text, and the drafter backed off without stopping the lookup."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import BlockDrafterProposer, HybridProposer, NgramProposer, Proposal, gives_confidence
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, ThresholdRule
from specdraft.decode.session import CausalSession
from tests.helpers import hf_greedy
from tests.helpers import EOS, LIMITS, PROMPTS, batch1, batched, synthetic_profile
from tests.helpers import make_drafter


def hybrid(share_stats=True):
    target, drafter = make_drafter("dspark")
    return target, HybridProposer(NgramProposer(max_ngram=2, share_stats=share_stats), BlockDrafterProposer(drafter, (1, 2)))


def record_parts(monkeypatch) -> list:
    """A list that gets, per hybrid proposal (clones included), which part drafted it."""
    parts, propose = [], HybridProposer.propose

    def recorded(self, *args, **kwargs):
        proposal = propose(self, *args, **kwargs)
        parts.append(self.last)
        return proposal

    monkeypatch.setattr(HybridProposer, "propose", recorded)
    return parts


RULES = {"fixed": None, "threshold": ThresholdRule(0.3), "cost": CostRule(synthetic_profile(per_token=0.001), max_skip=4)}


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
def test_hybrid_greedy_equals_hf_generate_batch1_and_batched(rule, monkeypatch):
    target, proposer = hybrid()
    assert gives_confidence(proposer)
    parts = record_parts(monkeypatch)
    expected = batch1(target, proposer, Sampler(), 4, rule)
    for prompt, limit, out in zip(PROMPTS, LIMITS, expected):
        assert out == hf_greedy(target, prompt, limit, EOS)
    assert batched(target, proposer, Sampler(), 4, rule)[0] == expected
    if rule is None:  # both parts drafted in the fixed run
        assert {"lookup", "trained"} <= set(parts)


def test_hybrid_sampling_batched_equals_batch1_with_per_request_statistics():
    target, proposer = hybrid(share_stats=False)
    rule = RULES["threshold"]
    assert batched(target, proposer, Sampler(1.0), 4, rule)[0] == batch1(target, proposer, Sampler(1.0), 4, rule)


def test_both_parts_follow_the_accepted_text(monkeypatch):
    target, proposer = hybrid()
    parts = record_parts(monkeypatch)
    session = CausalSession(target, proposer.feature_layers)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 10, 11, 12, 13]
    gen = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 30, 4))
    assert {"lookup", "trained"} <= set(parts)
    trained = proposer.trained
    trained.flush()
    assert trained.length == session.length  # the drafter's context covers every position in the target's cache
    # Its next proposal equals a fresh drafter's that saw the whole text at once (no stale or missing features).
    fresh = BlockDrafterProposer(trained.drafter, (1, 2))
    context = prompt + gen.output_ids
    _, features = CausalSession(target, (1, 2)).forward(context[:-1])
    fresh.start(context, features)
    got = trained.propose(context, 4, Sampler(), None).tokens
    assert got == fresh.propose(context, 4, Sampler(), None).tokens


def test_the_drafter_part_backs_off_while_lookup_keeps_drafting(monkeypatch):
    target, proposer = hybrid()
    parts = record_parts(monkeypatch)
    calls = []
    inner = proposer.trained.propose
    proposer.trained.propose = lambda *a, **k: calls.append(1) or inner(*a, **k)
    session = CausalSession(target, proposer.feature_layers)
    profile = synthetic_profile(per_token=0.001)
    profile.draft = [0.5] * 5  # the drafter never pays here; lookup, priced without its drafting, does
    rule = CostRule(profile, max_skip=8)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 10]
    out = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 40, 4, scheduler=rule)).output_ids
    assert out == hf_greedy(target, prompt, 40)
    steps_without_lookup = sum(part != "lookup" for part in parts)
    assert "lookup" in parts and 0 < len(calls) < steps_without_lookup  # the drafter was probed, then skipped


def test_confidence_logits_stay_aligned_with_drafting_steps(monkeypatch):
    """One entry per drafting step ([] for lookup steps), so the oracle's confidence cut and calibration pair
    each drafter z_1 with its own step's outcome."""
    from specdraft.decode.oracle import first_position_steps

    target, proposer = hybrid()
    parts = record_parts(monkeypatch)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 10, 11, 12, 13]
    session = CausalSession(target, proposer.feature_layers)
    gen = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 30, 4))
    drafted_by = [part for part, d in zip(parts, gen.drafted) if d > 0]
    assert len(gen.confidence_logits) == len(drafted_by)
    assert [bool(z) for z in gen.confidence_logits] == [part == "trained" for part in drafted_by]
    assert len(first_position_steps(len(prompt), gen)) == drafted_by.count("trained")


def test_a_drafter_part_that_promises_but_does_not_deliver_is_backed_off_by_its_record():
    """Its confidence head says every position survives (so the rule verifies them), but its tokens are wrong:
    the realized record (Backoff.settle) stops it; the promise-only record would keep it drafting every step."""
    target, proposer = hybrid()
    vocab, calls = target.config.vocab_size, []
    inner = proposer.trained.propose

    def overconfident(context_ids, num_draft, sampler, generator, rule=None):
        calls.append(1)
        real = inner(context_ids, num_draft, sampler, generator, None)
        wrong = [(t + 1) % vocab for t in real.tokens]  # never the target's greedy token here
        return Proposal(wrong, confidence=torch.ones(len(wrong)), scheduled=True)

    proposer.trained.propose = overconfident
    rule = CostRule(synthetic_profile(per_token=0.001), max_skip=8)  # cheap drafting: a sure position pays
    prompt = [9, 3, 17, 4, 22, 1]  # no repeats: lookup rarely matches
    session = CausalSession(target, proposer.feature_layers)
    gen = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 40, 4, scheduler=rule))
    assert gen.output_ids == hf_greedy(target, prompt, 40)
    assert proposer.backoff.net < 0 and len(calls) < len(gen.drafted) / 2
