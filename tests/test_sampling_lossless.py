"""Rejection sampling must reproduce the target's distribution exactly (goodness-of-fit tests).

A Markov target p(x_t | x_{t-1}) and a drafter q far from it on a vocabulary of 8. The expected
joint distribution of the first three generated tokens is enumerated from the target with a
reference implementation of temperature/top-k/top-p written here (independent of HF's warpers).
Wrong rules (accept when r < p(x); resample from p instead of the residual) are negative controls:
the same test, with the same N, must reject them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import Proposal
from specdraft.decode.sampling import Sampler, sample
from specdraft.decode.verifier import rejection_accept, residual_probs
from tests.helpers import MarkovSession, START, VOCAB, expected_loop_joint, goodness_of_fit, markov_tables, reference_probs

SETTINGS = [
    Sampler(temperature=1.0),
    Sampler(temperature=0.7),
    Sampler(temperature=1.3, top_k=4),
    Sampler(temperature=1.0, top_p=0.8),
    Sampler(temperature=0.8, top_k=5, top_p=0.9),
]


def expected_joint(target: torch.Tensor, s: Sampler, length: int) -> np.ndarray:
    rows = torch.stack([reference_probs(target[v], s) for v in range(VOCAB)]).numpy()  # (V, V)
    joint = np.zeros((VOCAB,) * length)
    for seq in itertools.product(range(VOCAB), repeat=length):
        prob, prev = 1.0, START
        for token in seq:
            prob *= rows[prev, token]
            prev = token
        joint[seq] = prob
    return joint.ravel()


# ---- the acceptance rule alone, thousands of rows in one batched call -------------------------


def wrong_accept_r_below_p(draft_tokens, draft_probs, target_probs, generator):
    """Negative control: accept when r < p(x) (ignores q)."""
    batch, k = draft_tokens.shape
    p_drafted = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    r = torch.rand((batch, k), generator=generator)
    num_accepted = (r < p_drafted).long().cumprod(-1).sum(-1)
    index = num_accepted[:, None, None].expand(batch, 1, VOCAB)
    padded_q = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], 1)
    residual = (target_probs.gather(1, index) - padded_q.gather(1, index)).squeeze(1).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs.gather(1, index).squeeze(1))
    return num_accepted, sample(residual / residual.sum(-1, keepdim=True), generator)


def wrong_resample_from_p(draft_tokens, draft_probs, target_probs, generator):
    """Negative control: correct acceptance test, but resample from p instead of norm(max(0, p - q))."""
    num_accepted, _ = rejection_accept(draft_tokens, draft_probs, target_probs, generator)
    batch = draft_tokens.shape[0]
    index = num_accepted[:, None, None].expand(batch, 1, VOCAB)
    return num_accepted, sample(target_probs.gather(1, index).squeeze(1), generator)


def batched_step_samples(rule, s: Sampler, n: int, k: int, seed: int) -> np.ndarray:
    """N independent one-step trials from START, completed to 3 tokens with the target where short."""
    target, drafter = markov_tables()
    gen = torch.Generator().manual_seed(seed)
    p_rows, q_rows = s.probs(target), s.probs(drafter)  # (V, V) each
    # Draft k tokens from q, autoregressively, for every trial at once.
    prev = torch.full((n,), START)
    drafts, q = [], []
    for _ in range(k):
        q.append(q_rows[prev])  # (N, V)
        prev = sample(q[-1], gen)
        drafts.append(prev)
    drafts = torch.stack(drafts, 1)  # (N, k)
    q = torch.stack(q, 1)  # (N, k, V)
    prevs = torch.cat([torch.full((n, 1), START), drafts], 1)  # (N, k+1): context of each verified position
    p = p_rows[prevs]  # (N, k+1, V)
    num_accepted, next_token = rule(drafts, q, p, gen)
    # Emitted tokens are drafts[:n] then next_token; columns past that are completed from the target.
    columns = []
    for j in range(3):
        drafted = drafts[:, j] if j < k else torch.zeros(n, dtype=torch.long)
        completed = sample(p_rows[columns[-1]], gen) if j > 0 else torch.zeros(n, dtype=torch.long)
        columns.append(torch.where(j < num_accepted, drafted, torch.where(j == num_accepted, next_token, completed)))
    out = torch.stack(columns, 1)  # (N, 3)
    return out.numpy()


@pytest.mark.parametrize("s", SETTINGS, ids=str)
def test_rejection_sampling_matches_target_distribution(s):
    expected = expected_joint(markov_tables()[0], s, 3)
    for k in (1, 2, 3):
        pvalue = goodness_of_fit(batched_step_samples(rejection_accept, s, 20000, k, seed=k), expected)
        assert pvalue > 1e-4, f"k={k}: p-value {pvalue:.2e}"


@pytest.mark.parametrize("rule", [wrong_accept_r_below_p, wrong_resample_from_p], ids=lambda f: f.__name__)
def test_wrong_rules_fail_the_same_test(rule):
    s = SETTINGS[0]
    expected = expected_joint(markov_tables()[0], s, 3)
    pvalue = goodness_of_fit(batched_step_samples(rule, s, 20000, 2, seed=2), expected)
    assert pvalue < 1e-6


def test_draft_equal_to_target_accepts_everything_and_empty_residual_is_safe():
    s = Sampler(temperature=1.0)
    target = markov_tables()[0]
    p_rows = s.probs(target)
    gen = torch.Generator().manual_seed(0)
    drafts = sample(p_rows[[START] * 5000], gen)[:, None]  # (N, 1) drafted from q = p
    p = p_rows[torch.cat([torch.full((5000, 1), START), drafts], 1)]  # (N, 2, V)
    q = p[:, :1].clone()
    num_accepted, next_token = rejection_accept(drafts, q, p, gen)
    assert bool((num_accepted == 1).all())  # q == p: never rejected, residual never needed
    assert int(next_token.min()) >= 0 and int(next_token.max()) < VOCAB


def test_disjoint_supports_accept_nothing():
    p = torch.zeros(100, 2, VOCAB)
    p[:, :, :4] = 0.25
    q = torch.zeros(100, 1, VOCAB)
    q[:, :, 4:] = 0.25
    drafts = torch.full((100, 1), 5)
    num_accepted, next_token = rejection_accept(drafts, q, p, torch.Generator().manual_seed(0))
    assert bool((num_accepted == 0).all()) and bool((next_token < 4).all())


# ---- the whole generate loop with a Markov target session and a stochastic stub drafter ----------


class MarkovDrafter:
    """A stochastic drafter with its own Markov table; returns the exact q it sampled from."""

    max_draft = None
    feature_layers = ()

    def __init__(self, table: torch.Tensor):
        self.table = table

    def start(self, context_ids, features):
        pass

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        tokens, probs, prev = [], [], context_ids[-1]
        for _ in range(num_draft):
            q = sampler.probs(self.table[prev][None])[0]
            prev = int(sample(q[None], generator))
            tokens.append(prev)
            probs.append(q)
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def commit(self, context_ids, features):
        pass


def loop_samples(s: Sampler, n: int, num_draft: int, seed: int, accept_fn=None, proposer=None, scheduler=None) -> np.ndarray:
    """First three tokens of N generations; max_new_tokens leaves room for full blocks of num_draft."""
    target, drafter = markov_tables()
    session, proposer = MarkovSession(target), proposer or MarkovDrafter(drafter)
    gen = torch.Generator().manual_seed(seed)
    config = GenerateConfig(s, 3 + num_draft, num_draft, scheduler=scheduler)
    out = [
        speculative_generate(session, [START], proposer, config, generator=gen, accept_fn=accept_fn).output_ids[:3]
        for _ in range(n)
    ]
    return np.array(out)


class ArgmaxDrafter(MarkovDrafter):
    """Deterministic drafting (q = None, i.e. one-hot), like prompt lookup."""

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        tokens, prev = [], context_ids[-1]
        for _ in range(num_draft):
            prev = int(self.table[prev].argmax())
            tokens.append(prev)
        return Proposal(tokens)


@pytest.mark.parametrize("s", [SETTINGS[0], SETTINGS[4]], ids=str)
@pytest.mark.parametrize("drafter", ["stochastic", "deterministic"])
def test_generate_loop_sampling_matches_target_distribution(s, drafter):
    proposer = ArgmaxDrafter(markov_tables()[1]) if drafter == "deterministic" else None
    pvalue = goodness_of_fit(loop_samples(s, 4000, 2, seed=11, proposer=proposer), expected_loop_joint(s))
    assert pvalue > 1e-4


def test_hybrid_and_scheduled_prompt_lookup_match_target_distribution():
    """Lookup where the context repeats (q one-hot), the stochastic drafter elsewhere (its own q); and lookup
    cut by a threshold on confidences learned from earlier steps, shared across all generations."""
    from specdraft.decode.proposer import HybridProposer, NgramProposer
    from specdraft.decode.scheduler import ThresholdRule

    s = SETTINGS[0]
    expected = expected_loop_joint(s)
    hybrid = HybridProposer(NgramProposer(max_ngram=2), MarkovDrafter(markov_tables()[1]))
    assert goodness_of_fit(loop_samples(s, 4000, 2, seed=12, proposer=hybrid), expected) > 1e-4
    lookup = NgramProposer(max_ngram=2)
    samples = loop_samples(s, 4000, 3, seed=13, proposer=lookup, scheduler=ThresholdRule(0.3))
    assert goodness_of_fit(samples, expected) > 1e-4
    assert sum(map(sum, lookup.stats.tries)) > 1000  # the rule did read learned confidences


def test_generate_loop_with_wrong_rule_fails():
    def wrong(proposal, logits, sampler, generator):
        tokens = torch.tensor([proposal.tokens], dtype=torch.long).reshape(1, -1)  # (1, k), k may be 0
        q = proposal.draft_probs if proposal.draft_probs is not None else torch.zeros(0, VOCAB)
        n, nxt = wrong_accept_r_below_p(tokens, q[None], sampler.probs(logits)[None], generator)
        return int(n), int(nxt)

    expected = expected_loop_joint(SETTINGS[0])
    assert goodness_of_fit(loop_samples(SETTINGS[0], 4000, 2, seed=11, accept_fn=wrong), expected) < 1e-6


def test_generate_loop_deterministic_drafter_with_wrong_residual_fails():
    def wrong(proposal, logits, sampler, generator):
        tokens = torch.tensor([proposal.tokens], dtype=torch.long).reshape(1, -1)
        q = torch.nn.functional.one_hot(tokens, VOCAB).float()
        n, nxt = wrong_resample_from_p(tokens, q, sampler.probs(logits)[None], generator)
        return int(n), int(nxt)

    proposer = ArgmaxDrafter(markov_tables()[1])
    samples = loop_samples(SETTINGS[0], 4000, 2, seed=11, accept_fn=wrong, proposer=proposer)
    assert goodness_of_fit(samples, expected_loop_joint(SETTINGS[0])) < 1e-6


def test_empty_residual_falls_back_to_target():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0]])
    torch.testing.assert_close(residual_probs(p, p.clone()), p)
    torch.testing.assert_close(residual_probs(p, torch.tensor([[1.0, 0, 0, 0]])), torch.tensor([[0, 0.5, 0.5, 0]]))


def test_sampler_matches_reference_warping():
    logits = markov_tables()[0]
    for s in SETTINGS:
        ours = s.probs(logits).double()
        ref = torch.stack([reference_probs(row, s) for row in logits])
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
