"""Prompt lookup: the longest recurring suffix, confidences learned from verified steps, and schedulers
that cut its proposals while decoding stays equal to target-only decoding."""

from __future__ import annotations

import random

import pytest

from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import NgramProposer, SurvivalStats, ngram_match
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, ThresholdRule
from specdraft.decode.session import CausalSession
from tests.helpers import hf_greedy
from tests.helpers import EOS, LIMITS, PROMPTS, batch1, batched, synthetic_profile


def reference_match(context, num_draft, max_ngram, min_ngram):
    """The definition, written plainly: for n from longest to shortest, the most recent earlier occurrence."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n :]
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return n, context[start + n : start + n + num_draft]
    return 0, []


def test_match_equals_the_plain_definition_on_random_contexts():
    rng = random.Random(0)
    for _ in range(2000):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        max_ngram = rng.randrange(1, 7)
        min_ngram = rng.randrange(1, max_ngram + 1)
        num_draft = rng.randrange(1, 9)
        assert ngram_match(context, num_draft, max_ngram, min_ngram) == reference_match(context, num_draft, max_ngram, min_ngram)


def test_survival_stats_learn_per_match_length():
    stats = SurvivalStats(buckets=3, positions=4)
    assert stats.confidences(2, 3).tolist() == [0.5, 0.5, 0.5]  # the prior
    stats.observe(2, verified=4, accepted=1)  # position 1 kept, position 2 rejected, 3-4 never tried
    stats.observe(2, verified=2, accepted=2)  # both verified positions kept
    assert stats.confidences(2, 4).tolist() == pytest.approx([3 / 4, 2 / 4, 0.5, 0.5])
    assert stats.confidences(1, 1).tolist() == [0.5]  # other match lengths untouched
    stats.observe(3, verified=6, accepted=6)  # positions past the tracked ones share the last estimate
    assert stats.confidences(3, 6).tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 4 / 5, 4 / 5, 4 / 5])


def test_proposer_learns_from_what_the_loop_kept(target_model):
    proposer = NgramProposer(max_ngram=3)
    session = CausalSession(target_model)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 20, 4))
    assert sum(map(sum, proposer.stats.tries)) > 0
    # Clones share what was learned; each keeps its own pending step.
    clone = proposer.clone()
    assert clone.stats is proposer.stats and clone.pending is None


def test_a_rule_cuts_inside_propose_and_only_verified_positions_are_counted():
    proposer = NgramProposer(max_ngram=2)
    context = [1, 2, 3, 4, 1, 2]
    proposal = proposer.propose(context, 4, Sampler(), None, ThresholdRule(0.6))  # prior 0.5 < 0.6: nothing
    assert proposal.tokens == [] and proposer.pending == (6, 2, [])
    proposal = proposer.propose(context, 4, Sampler(), None, None)
    assert proposal.tokens == [3, 4, 1, 2] and proposal.confidence.tolist() == [0.5] * 4
    proposer.commit(context + [3, 4, 9], None)  # two drafts accepted, then the target's own token
    assert proposer.stats.tries[2][:4] == [1, 1, 1, 0] and proposer.stats.hits[2][:4] == [1, 1, 0, 0]


RULES = {"threshold": ThresholdRule(0.4), "cost": CostRule(synthetic_profile(per_token=0.001))}


@pytest.mark.parametrize("rule", list(RULES.values()), ids=list(RULES))
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "T1"])
def test_schedulers_on_prompt_lookup_keep_decoding_exact(target_model, rule, sampler):
    # Per-request statistics: batched requests then cut exactly where they do alone, so the same generators
    # draw the same tokens (shared statistics would differ by the order requests teach them, at T > 0).
    proposer = NgramProposer(max_ngram=3, share_stats=False)
    expected = batch1(target_model, proposer, sampler, 6, rule)
    assert batched(target_model, proposer, sampler, 6, rule)[0] == expected
    if sampler.greedy:
        shared = NgramProposer(max_ngram=3)  # shared statistics: other cuts, the same greedy tokens
        assert batched(target_model, shared, sampler, 6, rule)[0] == expected
        for prompt, limit, out in zip(PROMPTS, LIMITS, expected):
            assert out == hf_greedy(target_model, prompt, limit, EOS)


def test_no_backoff_for_prompt_lookup(target_model):
    """A step the cost rule declines (or one without a match) costs nothing to try again next step."""
    from specdraft.decode.scheduler import make_backoff

    rule = CostRule(synthetic_profile(), max_skip=8)
    assert make_backoff(rule, NgramProposer()) is None and make_backoff(rule, object()) is not None


def test_a_declined_match_length_is_probed_now_and_then_so_its_estimate_can_recover(target_model):
    """A threshold above every current estimate would otherwise switch lookup off for good."""
    proposer = NgramProposer(max_ngram=2)
    context = [1, 2, 3, 4, 1, 2]
    rule = ThresholdRule(0.6)  # above the 0.5 prior
    kept = [len(proposer.propose(context, 4, Sampler(), None, rule).tokens) for _ in range(16)]
    assert kept == ([0] * 7 + [1]) * 2  # every PROBE_EVERY-th declined proposal verifies its first position
    proposer.commit(context + [3, 4], None)  # the probe was accepted (then the target's own token)
    assert proposer.stats.confidences(2, 1).item() == pytest.approx(2 / 3)
    assert len(proposer.propose(context, 4, Sampler(), None, rule).tokens) >= 1  # now above the threshold


def test_the_probe_reaches_the_target(target_model):
    """The loop does not recut a proposal the lookup already cut with the step's rule (its probe included)."""
    from specdraft.decode.generate import draft

    proposer = NgramProposer(max_ngram=2)
    proposer.stats.declined[2] = NgramProposer.PROBE_EVERY - 1
    assert draft(proposer, [1, 2, 3, 4, 1, 2], 4, Sampler(), None, ThresholdRule(0.6)).tokens == [3]


def test_positions_cut_by_load_admission_do_not_count_as_rejections():
    """scheduler=load cuts a lookup proposal after propose(); only the admitted positions were verified, so
    only they teach the statistics (else a declined proposal would read as a rejection at position 1, and
    admission, which reads those statistics, would never try lookup again)."""
    proposer = NgramProposer(3)
    context = [5, 6, 7, 8, 5, 6, 7]
    proposal = proposer.propose(context, 3, Sampler(), None)
    assert proposal.tokens == [8, 5, 6]
    proposer.admitted(0)  # admission declined all of it: the step decoded plainly
    proposer.commit(context + [9], None)
    assert proposer.stats.tries == SurvivalStats(3).tries  # nothing learned
    proposer.propose(context, 3, Sampler(), None)
    proposer.admitted(2)  # two positions verified, the first accepted, the second rejected
    proposer.commit(context + [8, 1], None)
    matched = 3
    assert proposer.stats.tries[matched][:3] == [1, 1, 0] and proposer.stats.hits[matched][:3] == [1, 0, 0]
