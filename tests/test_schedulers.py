"""Schedulers stay lossless: every rule decides position j from c_1..c_j only (goodness-of-fit at T=1,
exact at T=0), and a rule that looks ahead (DSpark App. A) biases the output, which the same test catches."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from specdraft.decode.batch_generate import LoadPolicy, Request, batched_generate
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import BlockDrafterProposer, Proposal
from specdraft.decode.sampling import Sampler, sample
from specdraft.decode.scheduler import (CostRule, FixedRule, ThresholdRule, can_pay, cut, expected_tokens, load_admits_any, load_pays,
                              load_schedule)
from tests.helpers import tiny_llama
from tests.helpers import cheap_profile, context_profile, dear_profile, synthetic_profile
from tests.helpers import (
    START,
    VOCAB,
    MarkovSession,
    expected_loop_joint,
    goodness_of_fit,
    markov_tables,
)

CONFIDENCE = torch.linspace(0.05, 0.95, VOCAB)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))]


class ConfidentDrafter:
    """A Markov drafter whose confidence of position j depends on x_{j-1}, as DSpark's does; it asks
    the rule before sampling each position."""

    max_draft = None
    feature_layers = ()

    def __init__(self, table):
        self.table = table

    def clone(self):
        return self

    def start(self, context_ids, features):
        pass

    def commit(self, context_ids, features):
        pass

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        tokens, probs, confidence, prev = [], [], [], context_ids[-1]
        for _ in range(num_draft):
            confidence.append(float(CONFIDENCE[prev]))
            if rule is not None and not rule.verify(confidence):
                confidence.pop()
                break
            q = sampler.probs(self.table[prev][None])[0]
            prev = int(sample(q[None], generator))
            tokens.append(prev)
            probs.append(q)
        return Proposal(tokens, torch.stack(probs) if probs else None, torch.tensor(confidence) if confidence else None)


class LookaheadDrafter(ConfidentDrafter):
    """The wrong rule of DSpark's App. A: verify x_j only if c_{j+1} (a function of x_j) is high."""

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        full = super().propose(context_ids, num_draft, sampler, generator)
        for j, token in enumerate(full.tokens):
            if float(CONFIDENCE[token]) < 0.5:
                return full.truncate(j)
        return full


def loop_samples(proposer, rule, n=3000, num_draft=2, seed=11):
    session = MarkovSession(markov_tables()[0])
    gen = torch.Generator().manual_seed(seed)
    s = Sampler(temperature=1.0)
    config = GenerateConfig(s, 3 + num_draft, num_draft, scheduler=rule)
    return np.array([speculative_generate(session, [START], proposer, config, generator=gen).output_ids[:3]
                     for _ in range(n)])


RULES = {
    "fixed": FixedRule(),
    "threshold": ThresholdRule(0.5),
    "cost": CostRule(synthetic_profile(length=3)),
    "cost_by_context": CostRule(context_profile(length=3)),
}


@pytest.mark.parametrize("name", list(RULES))
def test_every_rule_keeps_sampling_lossless(name):
    samples = loop_samples(ConfidentDrafter(markov_tables()[1]), RULES[name])
    assert goodness_of_fit(samples, expected_loop_joint(Sampler(temperature=1.0))) > 1e-4


def test_lookahead_rule_biases_the_output_and_the_test_catches_it():
    samples = loop_samples(LookaheadDrafter(markov_tables()[1]), FixedRule())
    assert goodness_of_fit(samples, expected_loop_joint(Sampler(temperature=1.0))) < 1e-6


def test_threshold_and_cost_rules_really_cut():
    proposal = Proposal([1, 2, 3], confidence=torch.tensor([0.9, 0.3, 0.9]))
    assert cut(proposal, ThresholdRule(0.5)) == 1
    # Verify costs 10 ms + 2 ms per token, drafting 3 ms + 1 ms per position: a position is worth
    # verifying when its survival adds more than its cost.
    rule = CostRule(synthetic_profile(length=4))
    assert cut(Proposal([1, 2, 3], confidence=torch.tensor([0.99, 0.99, 0.99])), rule) == 3
    assert cut(Proposal([1, 2, 3], confidence=torch.tensor([0.01, 0.99, 0.99])), rule) == 0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)


def test_load_schedule_admits_by_survival_and_stops_at_first_non_improvement():
    verify = lambda rows, length: 0.01 + 0.002 * rows * length  # noqa: E731
    # (0,1) then (0,2) widen the padded step and pay for it; (1,1) and (1,2) fit inside the width
    # request 0 already pays for, so they are admitted; (0,3) widens again and does not pay off.
    lengths = load_schedule([[0.9, 0.8, 0.1], [0.2, 0.1, 0.05]], 0.0, verify)
    assert lengths == [2, 2]
    # Nothing confident: plain decoding for everyone.
    assert load_schedule([[0.01], [0.02]], 0.0, verify) == [0, 0]
    # Free verification: everything is admitted.
    assert load_schedule([[0.5, 0.2], [0.3]], 0.0, lambda r, n: 1.0) == [2, 1]
    # Drafting is spent when admission runs: the bar is a plain step after it. Whether the admitted set
    # also paid for the drafting (what the backoff is told) is load_pays'.
    assert load_schedule([[0.3]], 0.0, verify) == [1]  # 1.3 tokens in 14 ms beat 1 in 12 ms
    assert load_schedule([[0.3]], 0.01, verify) == [1]  # 1.3 in 24 ms beat 1 in 22 ms ...
    assert not load_pays([[0.3]], [1], 0.01, verify)  # ... but not plain decoding's 1 in 12 ms
    assert load_pays([[0.3]], [1], 0.0, verify) and not load_pays([[0.3]], [0], 0.0, verify)
    assert load_schedule([[0.05]], 0.01, verify) == [0]  # 1.05 in 24 ms lose to 1 in 22 ms


def test_first_positions_settle_whether_load_admission_takes_anything():
    """load_admits_any reads only each request's a_{r,1} and answers what load_schedule over whole blocks
    decides: random survival curves, ties included, on a cheap, a padded and a compute-bound verify curve."""
    rng = random.Random(0)
    curves = [lambda r, n: 0.012 + 0.0005 * r * n, lambda r, n: 0.010 + 0.004 * r * n, lambda r, n: 0.01 * r * n]
    checked = {True: 0, False: 0}
    for _ in range(600):
        rows = rng.randint(1, 6)
        survival = []
        for _ in range(rows):
            c = [rng.choice([0.05, 0.3, 0.5, 0.9, 1.0, rng.random()]) for _ in range(rng.randint(0, 4))]
            survival.append([math.prod(c[: j + 1]) for j in range(len(c))])  # a_{r,j}: non-increasing
        draft_s, verify = rng.choice([0.0, 0.002, 0.02]), rng.choice(curves)
        whole = any(load_schedule(survival, draft_s, verify))
        assert load_admits_any([values[:1] for values in survival], draft_s, verify) == whole
        checked[whole] += 1
    assert min(checked.values()) > 50  # both answers were exercised
    # A NaN survival counts as 0 in both (a sort has no order for NaN): 0.9 is admitted either way.
    verify = lambda r, n: 0.012 + 0.0005 * r * n  # noqa: E731
    survival = [[0.5, 0.45, 0.4], [math.nan], [0.3], [0.9]]
    assert load_schedule(survival, 0.0, verify)[3] == 1
    assert load_admits_any([values[:1] for values in survival], 0.0, verify)


def test_cost_rule_decides_the_step_given_its_probe_and_tells_the_backoff_whether_it_paid():
    from specdraft.decode.scheduler import backoff_count

    # Verify 10 ms + 2 ms per token, drafting 3 ms + 1 ms per position (the probe, ℓ = 0, costs 3 ms).
    rule = CostRule(synthetic_profile(length=4))
    # ℓ = 1 with a_1 = 0.25: 1.25 tokens in 18 ms beat 1 in 15 ms after the probe, so it is verified,
    # but lose to plain decoding's 1 in 12 ms: the backoff hears "nothing paid".
    weak = Proposal([7], confidence=torch.tensor([0.25]))
    assert cut(weak, rule) == 1 and not rule.pays([0.25]) and backoff_count(rule, weak) == 0
    strong = Proposal([7, 8], confidence=torch.tensor([0.9, 0.9]))
    assert cut(strong, rule) == 2 and rule.pays([0.9, 0.9]) and backoff_count(rule, strong) == 2
    assert backoff_count(FixedRule(), weak) == 1  # rules that do not price steps: every verified position counts


def enumerated_joint(model, prompt, sampler, length=2) -> np.ndarray:
    """The target's own distribution of its first `length` tokens, enumerated with the model."""
    vocab = model.config.vocab_size
    joint = np.zeros((vocab,) * length)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=length):
            logits = model(torch.tensor([prompt + list(seq[:-1])])).logits[0, -length:].float()  # (length, V)
            probs = sampler.probs(logits)
            joint[seq] = float(np.prod([float(probs[i, t]) for i, t in enumerate(seq)]))
    return joint.ravel() / joint.sum()


def mixed_load_profile() -> object:
    """Batched drafting cheap, a verified position dear enough that admission pays on some steps only:
    the lazy load gate ends the others after c_1."""
    profile = synthetic_profile(rows=(1, 2, 4, 8), length=4, per_token=0.0001)
    profile.draft_batched = {"1": [0.0001] * 4, "8": [0.0008] * 4}
    return profile


@pytest.mark.parametrize("make_profile", [lambda: cheap_profile(rows=(1, 2, 4, 8), length=4), mixed_load_profile],
                         ids=["admits_often", "gated_steps"])
def test_load_scheduler_keeps_batched_sampling_lossless(make_profile, monkeypatch):
    """Requests decoded together under scheduler=load at T=1: each request's first two tokens follow
    the target's distribution (a small vocabulary lets us enumerate it), with steps that admit ragged
    lengths and, for the second profile, steps the gate ends after c_1."""
    from specdraft.decode import engine
    from specdraft.models.drafter import BlockDrafter

    answers = []
    spy = engine.load_admits_any
    monkeypatch.setattr(engine, "load_admits_any", lambda *a: answers.append(spy(*a)) or answers[-1])

    target = tiny_llama(0, vocab_size=VOCAB)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # a spread-out distribution: every cell gets counts
    torch.manual_seed(3)
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=3, mask_token_id=1,
                           markov_rank=4).eval()
    drafter.copy_target_weights(target)
    proposer = BlockDrafterProposer(drafter, (1, 2))
    prompt, s = [2, 5, 3], Sampler(temperature=1.0)
    load = LoadPolicy(make_profile())
    samples = []
    for batch in range(300):
        requests = [Request(prompt, 4, torch.Generator().manual_seed(1000 * batch + i)) for i in range(8)]
        for gen in batched_generate(target, requests, proposer, s, 3, (), None, load, 8):
            samples.append(gen.output_ids[:2])
    drafted = {d for d in load.admitted}
    assert len(drafted - {0}) > 1  # the scheduler really varied the admitted positions
    if make_profile is mixed_load_profile:
        assert answers.count(False) > 100 and answers.count(True) > 100  # gated steps and admitting steps
    assert goodness_of_fit(np.array(samples), enumerated_joint(target, prompt, s)) > 1e-4


def test_backoff_skips_the_drafter_after_empty_steps_and_probes_again():
    from specdraft.decode.scheduler import Backoff

    backoff = Backoff(max_skip=4)
    pattern = []
    for verified in [0, 0, 0, 0, 0, 2, 0]:
        skipped = 0
        while backoff.should_skip():
            skipped += 1
        pattern.append(skipped)
        backoff.observe(verified)
    assert pattern == [0, 1, 2, 4, 4, 4, 0]  # 1, 2, 4, capped at 4; a verified step resets the streak
    assert backoff.should_skip()  # the last empty step starts a new streak


class CountingDrafter(ConfidentDrafter):
    calls = 0

    def propose(self, *args, **kwargs):
        CountingDrafter.calls += 1
        return super().propose(*args, **kwargs)


def test_cost_rule_with_backoff_stays_lossless_and_skips_the_drafter():
    # Drafting is expensive in this profile, so the rule verifies little and the backoff skips often.
    rule = CostRule(synthetic_profile(length=3, per_token=0.02), max_skip=4)
    proposer = CountingDrafter(markov_tables()[1])
    samples = loop_samples(proposer, rule)
    assert goodness_of_fit(samples, expected_loop_joint(Sampler(temperature=1.0))) > 1e-4
    steps = len(samples) * 3  # at least 3 verify steps per generation of 3 + 2 tokens
    assert CountingDrafter.calls < steps


def test_can_pay_bounds_what_speculation_could_gain():
    verify = lambda rows, length: 0.01 + 0.002 * rows * length  # noqa: E731
    assert can_pay(1, 1, 3, lambda n: 0.002, verify)  # 2 sure tokens in 16 ms beat 1 in 12 ms
    assert not can_pay(1, 1, 3, lambda n: 0.05, verify)  # drafting dearer than any sure gain
    # Compute-bound: a step's time proportional to its tokens, so no verify length beats plain decoding.
    assert not can_pay(4, 4, 3, lambda n: 0.001, lambda rows, length: 0.01 * rows * length)
    # A few drafting requests in a wide batch add too little to pay for widening every row.
    assert can_pay(4, 4, 1, lambda n: 0.0, verify) and not can_pay(4, 1, 1, lambda n: 0.0, verify)


def test_cost_rule_runs_no_drafter_where_no_draft_can_pay():
    CountingDrafter.calls = 0
    samples = loop_samples(CountingDrafter(markov_tables()[1]), CostRule(dear_profile(length=3), max_skip=0), n=1000)
    assert CountingDrafter.calls == 0
    assert goodness_of_fit(samples, expected_loop_joint(Sampler(temperature=1.0))) > 1e-4


def skipped_share(make_backoff, gains, break_even: float = 1.0, verified: int = 1, requests: int = 20, steps: int = 100) -> float:
    """The share of steps that backoffs skip over `requests` requests of `steps` steps each (a fresh backoff per
    request, as the loops make them), whose drafting steps gain `gains` beyond break-even in turn."""
    skipped, gains = 0, iter(gains)
    for _ in range(requests):
        backoff = make_backoff()
        for _ in range(steps):
            if backoff.should_skip():
                skipped += 1
                continue
            backoff.observe(verified)
            backoff.settle(break_even + next(gains), break_even, verified)
    return skipped / (requests * steps)


def test_backoff_keeps_drafting_a_drafter_that_pays_on_average_and_drops_one_that_never_does():
    """At T=1 the default export's steps verify two positions with a break-even of 1.116 tokens and keep the first
    drafted token a fifth of the time: four steps in five lose 0.116 tokens, the rest win 0.884 or 1.884 (mean
    about +0.14). The noise test keeps drafting it in every request; a bare running mean held to zero (z = 0,
    the negative control) skips it after runs of misses. A drafter whose every step loses (the misses alone)
    is skipped most of the time, and one whose losses have no spread at all (every step cut to no position,
    its drafting spent) almost always."""
    from specdraft.decode.backoff import Backoff

    rng = random.Random(0)
    paying = [rng.choices([-0.116, 0.884, 1.884], [0.8, 0.15, 0.05])[0] for _ in range(2000)]
    assert sum(paying) / len(paying) > 0.1
    assert skipped_share(lambda: Backoff(max_skip=16), paying, 1.116, 2) < 0.02
    assert skipped_share(lambda: Backoff(max_skip=16, z=0.0), paying, 1.116, 2) > 0.2
    assert skipped_share(lambda: Backoff(max_skip=16), [-0.116] * 2000, 1.116, 2) > 0.6
    assert skipped_share(lambda: Backoff(max_skip=16), [-0.08] * 2000, 1.08, 0) > 0.85


def test_backoff_keeps_the_realized_record():
    """Steps the rule verified (a promise) but that made fewer tokens than plain decoding in their time count
    as failures once the record shows them beyond its noise; skips then double up to max_skip; steps that
    pay bring the record back above zero; unpriced steps leave it alone."""
    from specdraft.decode.backoff import Backoff, null_variance

    backoff, pattern = Backoff(max_skip=4), []
    for _ in range(12):
        skipped = 0
        while backoff.should_skip():
            skipped += 1
        pattern.append(skipped)
        backoff.observe(2)  # the rule verified two positions
        backoff.settle(1, 1.5, 2)  # neither survived: 1 token where plain decoding makes 1.5 in that time
    # no spread in the record, so the test uses a break-even drafter's (binomial: 0.5 * (1 - 0.5 / 2)) and
    # -0.5 + 1.64 * sqrt(0.375 / n) < 0 from the fifth settled step on
    assert null_variance(0.5, 2) == pytest.approx(0.375)
    assert pattern == [0, 0, 0, 0, 0, 1, 2, 4, 4, 4, 4, 4] and backoff.net == pytest.approx(-0.5)
    for _ in range(20):
        while backoff.should_skip():
            pass
        backoff.observe(2)
        backoff.settle(3, 1.5, 2)
    assert backoff.net > 0 and not backoff.should_skip()
    backoff.settle(1, None, 2)
    assert not backoff.should_skip()


def test_once_steps_settle_only_their_record_skips_the_drafter():
    """Half the steps promise nothing (observe(0): their confidences priced them below plain decoding) while
    every drafted step pays 0.2 tokens beyond break-even: the record keeps drafting every step. Before any
    step settles, a promise of nothing is all there is and still starts a skip; a step cut to no position
    settles as the loss of its drafting (1 token where plain decoding makes 1.08) and the record drops it."""
    from specdraft.decode.backoff import Backoff

    backoff, skipped = Backoff(max_skip=16), 0
    for step in range(400):
        if backoff.should_skip():
            skipped += 1
            continue
        backoff.observe(0 if step % 2 else 2)
        backoff.settle(1.2 + 1.0, 1.0 + 1.0, 2)
    assert skipped == 0
    fresh = Backoff(max_skip=16)
    fresh.observe(0)
    assert fresh.should_skip()
    cut_to_nothing = Backoff(max_skip=16)
    for _ in range(200):
        if not cut_to_nothing.should_skip():
            cut_to_nothing.observe(0)
            cut_to_nothing.settle(1, 1.08, 0)
    assert cut_to_nothing.net == pytest.approx(-0.08) and cut_to_nothing.skip > 0


def test_a_step_cut_to_no_position_is_priced_as_its_spent_drafting():
    from specdraft.decode.scheduler import break_even

    profile = synthetic_profile(length=3, per_token=0.002)
    rule = CostRule(profile, max_skip=4)
    assert break_even(rule, 0) == pytest.approx((profile.draft_s(0, None) + profile.verify_s(1, 1)) / profile.verify_s(1, 1))
    assert break_even(rule, 0) > 1 and break_even(FixedRule(), 0) is None


def test_the_loop_settles_a_drafted_step_cut_to_no_position_as_a_loss(monkeypatch):
    """A drafter run whose every position the rule declined still cost its drafting: the generate loop settles
    it (1 token against a break-even above 1), so a record of such steps turns the backoff off the drafter."""
    import specdraft.decode.generate as generate_module
    from specdraft.decode.backoff import Backoff

    class DeclinedDrafter(ConfidentDrafter):
        def propose(self, context_ids, num_draft, sampler, generator, rule=None):
            return Proposal([], confidence=torch.zeros(0), scheduled=True)  # the rule cut it to nothing

    settled = []

    class RecordingBackoff(Backoff):
        def settle(self, tokens, break_even, verified=1):
            settled.append((tokens, break_even, verified))
            super().settle(tokens, break_even, verified)

    monkeypatch.setattr(generate_module, "make_backoff", lambda rule, proposer=None: RecordingBackoff(rule.max_skip))
    loop_samples(DeclinedDrafter(markov_tables()[1]), CostRule(synthetic_profile(length=3), max_skip=4), n=20)
    assert settled and all(tokens == 1 and even > 1 and verified == 0 for tokens, even, verified in settled)


class PromisingDrafter(ConfidentDrafter):
    """Says every position survives (confidence 1) and drafts a token the target rarely samples, one-hot."""

    calls = 0

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        PromisingDrafter.calls += 1
        target = markov_tables()[0]
        tokens, prev = [], context_ids[-1]
        for _ in range(num_draft):
            prev = int(target[prev].argmin())
            tokens.append(prev)
        probs = torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float() if tokens else None
        return Proposal(tokens, probs, torch.ones(len(tokens)) if tokens else None)


def test_the_realized_record_backs_off_a_drafter_that_promises_and_sampling_stays_exact():
    PromisingDrafter.calls = 0
    rule = CostRule(synthetic_profile(length=3, per_token=0.001), max_skip=4)
    session, gen = MarkovSession(markov_tables()[0]), torch.Generator().manual_seed(3)
    config = GenerateConfig(Sampler(temperature=1.0), 8, 2, scheduler=rule)
    runs = [speculative_generate(session, [START], PromisingDrafter(None), config, generator=gen) for _ in range(3000)]
    samples = np.array([run.output_ids[:3] for run in runs])
    assert goodness_of_fit(samples, expected_loop_joint(Sampler(temperature=1.0))) > 1e-4
    steps = sum(len(run.drafted) for run in runs)  # the promise alone would draft on nearly every one
    assert PromisingDrafter.calls < 0.7 * steps


def test_a_noisy_profile_is_priced_non_decreasing_in_length():
    """A measured verify curve where 2 tokens cost more than 3 (noise on a shared host: 36.0 / 38.8 / 34.7 ms)
    is priced by its suffix minimum, so the cost rule does not stop at the noisy point; the file keeps the
    measurement."""
    from specdraft.decode.profile import CostProfile

    verify = [0.0360, 0.0388, 0.0347, 0.0366, 0.0385]
    profile = CostProfile(fingerprint={}, verify={"single": {"1": list(verify)}}, draft=[0.001, 0.003, 0.002, 0.004],
                          context_length=256, by_context={"64": {"verify": [0.03, 0.04, 0.03, 0.035, 0.036],
                                                                 "draft": [0.001] * 4}})
    priced = [profile.verify_s(1, n) for n in range(1, 6)]
    assert priced == pytest.approx([0.0347, 0.0347, 0.0347, 0.0366, 0.0385])
    assert [profile.draft_s(n) for n in range(4)] == pytest.approx([0.001, 0.002, 0.002, 0.004])
    assert profile.verify_s(1, 2, context=64) == pytest.approx(0.03)
    assert profile.to_json()["verify"]["single"]["1"] == verify
    profile.draft_batched = {"1": [0.003, 0.002, 0.004], "4": [0.008, 0.009, 0.007]}  # the batched engine's drafting
    assert profile.draft_rows_s([1]) == pytest.approx(0.002) and profile.draft_rows_s([2, 1, 1, 1]) == pytest.approx(0.007)
    # One drafted position with confidence 0.05 pays on the priced curve (2 tokens cost what 1 does) ...
    profile.draft = [0.0] * 4
    assert CostRule(profile, max_skip=0).verify([0.05])


def test_the_raw_noisy_curve_would_stop_the_cost_rule(monkeypatch):
    """Negative control of the test above: priced as measured, the noisy 2-token point (7.8% over a plain step)
    makes the rule decline a position that survives 5% of the time."""
    from specdraft.decode import profile as profile_module

    monkeypatch.setattr(profile_module, "suffix_min", list)
    profile = profile_module.CostProfile(fingerprint={}, verify={"single": {"1": [0.0360, 0.0388, 0.0347, 0.0366]}},
                                         draft=[0.0] * 4, context_length=256)
    assert not CostRule(profile, max_skip=0).verify([0.05])


def test_priced_curves_are_memoized_and_a_replaced_curve_is_priced_anew():
    """The profile memoizes its priced curves per context (a scheduler asks a dozen times a step); replacing a
    field (as tests and a re-measured profile do) drops the memo, so prices never go stale."""
    profile = context_profile()
    before = [profile.verify_s(1, n, context=40) for n in (1, 2, 3)], profile.draft_s(2, context=40)
    assert [profile.verify_s(1, n, context=40) for n in (1, 2, 3)] == before[0]
    profile.draft = [x * 10 for x in profile.draft]
    profile.by_context = {c: {"verify": [2 * x for x in curves["verify"]], "draft": [10 * x for x in curves["draft"]]}
                          for c, curves in profile.by_context.items()}
    profile.verify = {engine: {rows: [2 * x for x in s] for rows, s in table.items()}
                      for engine, table in profile.verify.items()}
    assert [profile.verify_s(1, n, context=40) for n in (1, 2, 3)] == pytest.approx([2 * x for x in before[0]])
    assert profile.draft_s(2, context=40) == pytest.approx(10 * before[1])
    assert profile.verify_s(2, 3) == pytest.approx(2 * context_profile().verify_s(2, 3))
