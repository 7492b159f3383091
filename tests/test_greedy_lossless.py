"""Greedy speculative decoding must equal HF `generate` greedy output token for token (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import ModelProposer, NgramProposer, NoProposer, Proposal
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from tests.helpers import hf_greedy

GREEDY = Sampler()


def random_prompt(rng: random.Random, length: int, vocab: int = 64) -> list[int]:
    # Repeated chunks give the n-gram proposer something to find.
    chunk = [rng.randrange(1, vocab) for _ in range(max(1, length // 3))]
    return (chunk * 4)[:length] if rng.random() < 0.5 else [rng.randrange(1, vocab) for _ in range(length)]


class ShiftedProposer:
    """Always wrong: proposes the target's own greedy tokens shifted by one id, so none can match."""

    feature_layers = ()
    max_draft = None

    def __init__(self, target_model):
        self.inner = ModelProposer(target_model)
        self.vocab = target_model.config.vocab_size

    def start(self, context_ids, features):
        self.inner.start(context_ids, features)

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        right = self.inner.propose(context_ids, num_draft, sampler, generator)
        return Proposal([(t + 1) % self.vocab for t in right.tokens])

    def commit(self, context_ids, features):
        pass


@pytest.mark.parametrize("num_draft", range(1, 9))
@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_greedy_equals_hf_generate(target_model, other_model, kind, num_draft):
    rng = random.Random(num_draft * 7 + (kind == "model"))
    session = CausalSession(target_model)
    proposer = NgramProposer() if kind == "ngram" else ModelProposer(other_model)
    for _ in range(4):
        prompt = random_prompt(rng, rng.randrange(1, 24))
        max_new = rng.randrange(1, 40)
        expected = hf_greedy(target_model, prompt, max_new)
        got = speculative_generate(session, prompt, proposer, GenerateConfig(GREEDY, max_new, num_draft))
        assert got.output_ids == expected
        assert len(got.output_ids) == max_new


def test_identical_drafter_accepts_everything(target_model):
    session = CausalSession(target_model)
    prompt = [5, 9, 13, 2, 7]
    got = speculative_generate(session, prompt, ModelProposer(target_model), GenerateConfig(GREEDY, 33, 4))
    assert got.output_ids == hf_greedy(target_model, prompt, 33)
    assert got.accepted == got.drafted  # every drafted token survived
    assert got.drafted[:-1] == [4] * (len(got.drafted) - 1)
    assert len(got.drafted) == 7  # 1 prefill token + 6 steps of 5 + a last step of 2 = 33


def test_always_wrong_drafter_accepts_nothing_and_output_still_equal(target_model):
    session = CausalSession(target_model)
    prompt = [3, 14, 15, 9, 26]
    got = speculative_generate(session, prompt, ShiftedProposer(target_model), GenerateConfig(GREEDY, 20, 5))
    assert got.output_ids == hf_greedy(target_model, prompt, 20)
    assert sum(got.accepted) == 0 and sum(got.drafted) > 0


@pytest.mark.parametrize("proposer_kind", ["model", "ngram"])
def test_eos_inside_accepted_block(target_model, proposer_kind):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = hf_greedy(target_model, prompt, 30)
    # Make a token that first appears a few positions in the EOS, so generation stops right there.
    eos_position = next(i for i in range(3, 30) if free[i] not in free[:i])
    eos = free[eos_position]
    expected = hf_greedy(target_model, prompt, 30, eos=[eos])
    assert expected[-1] == eos and len(expected) == eos_position + 1
    proposer = ModelProposer(target_model) if proposer_kind == "model" else NgramProposer()
    got = speculative_generate(CausalSession(target_model), prompt, proposer, GenerateConfig(GREEDY, 30, 8, [eos]))
    assert got.output_ids == expected
    if proposer_kind == "model":
        # The EOS was an accepted drafted token, not the target's bonus token: the last step kept
        # fewer tokens than it accepted + 1.
        before_last = 1 + sum(a + 1 for a in got.accepted[:-1])
        assert len(got.output_ids) - before_last < got.accepted[-1] + 1


def test_eos_as_first_token(target_model):
    prompt = [1, 2, 3]
    first = hf_greedy(target_model, prompt, 1)[0]
    got = speculative_generate(CausalSession(target_model), prompt, ModelProposer(target_model),
                               GenerateConfig(GREEDY, 10, 4, [first]))
    assert got.output_ids == [first] == hf_greedy(target_model, prompt, 10, eos=[first])
    assert got.drafted == []  # no verify step after prefill


def test_max_new_tokens_one_and_prompt_length_one(target_model):
    session = CausalSession(target_model)
    for prompt, max_new in [([7], 1), ([7], 12), ([7, 8, 9], 1)]:
        for proposer in (NgramProposer(), ModelProposer(target_model), NoProposer()):
            num_draft = 0 if isinstance(proposer, NoProposer) else 3
            got = speculative_generate(session, prompt, proposer, GenerateConfig(GREEDY, max_new, num_draft))
            assert got.output_ids == hf_greedy(target_model, prompt, max_new)


def test_plain_loop_equals_hf_generate(target_model):
    got = speculative_generate(CausalSession(target_model), [10, 20, 30], NoProposer(), GenerateConfig(GREEDY, 25, 0))
    assert got.output_ids == hf_greedy(target_model, [10, 20, 30], 25)
    assert got.drafted == [0] * 24


def test_num_draft_beyond_proposer_limit_is_refused(target_model):
    with pytest.raises(ValueError, match="drafts at most 0"):
        speculative_generate(CausalSession(target_model), [1, 2], NoProposer(), GenerateConfig(GREEDY, 5, 2))


class AtMostTwo:
    """A stopping rule that verifies the first two drafted positions only."""

    needs_confidence = False

    def verify(self, confidences):
        return len(confidences) <= 2


def test_scheduler_rule_truncates_blocks(target_model):
    session = CausalSession(target_model)
    config = GenerateConfig(GREEDY, 20, 6, scheduler=AtMostTwo())
    got = speculative_generate(session, [5, 6, 7], ModelProposer(target_model), config)
    assert set(got.drafted) <= {0, 1, 2}
    assert got.output_ids == hf_greedy(target_model, [5, 6, 7], 20)


def test_rollback_restores_exact_cache(target_model):
    """After a rejected block the cache must give the same logits as a fresh prefill."""
    session = CausalSession(target_model)
    session.forward([1, 2, 3, 4])
    session.forward([5, 6, 7])
    session.rollback(5)
    rolled, _ = session.forward([9])
    fresh = CausalSession(target_model)
    expected, _ = fresh.forward([1, 2, 3, 4, 5, 9])
    torch.testing.assert_close(rolled[-1], expected[-1], rtol=1e-5, atol=1e-5)


class FeatureRecorder:
    """Wraps a proposer and records the target features handed over at start and at every commit."""

    max_draft = None
    feature_layers = (1, 2)

    def __init__(self, inner):
        self.inner, self.chunks = inner, []

    def start(self, context_ids, features):
        self.chunks = [features]
        self.inner.start(context_ids, None)

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        return self.inner.propose(context_ids, num_draft, sampler, generator)

    def commit(self, context_ids, features):
        self.chunks.append(features)


@pytest.mark.parametrize("inner", ["model", "ngram"])
def test_verifier_hands_over_features_of_exactly_the_kept_positions(target_model, other_model, inner):
    """The drafter's context grows from the verify forward: features of pending + accepted tokens, in order."""
    recorder = FeatureRecorder(ModelProposer(other_model) if inner == "model" else NgramProposer())
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    got = speculative_generate(CausalSession(target_model, (1, 2)), prompt, recorder, GenerateConfig(GREEDY, 25, 4))
    features = torch.cat(recorder.chunks)  # (positions in the target cache, 2 * hidden)
    sequence = prompt + got.output_ids[:-1]  # everything but the pending last token is in the cache
    with torch.inference_mode():
        hidden = target_model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[1][0], hidden[2][0]], dim=-1)
    assert features.shape == expected.shape
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)


def test_partially_right_drafter(target_model):
    """A drafter close to the target: blocks are accepted in part, and the output is still exact."""
    import copy

    drafter = copy.deepcopy(target_model)
    with torch.no_grad():
        drafter.lm_head.weight.add_(torch.randn_like(drafter.lm_head.weight) * 0.8)
    session, proposer = CausalSession(target_model), ModelProposer(drafter)
    rng = random.Random(5)
    partial = 0
    for _ in range(6):
        prompt = random_prompt(rng, rng.randrange(1, 16))
        got = speculative_generate(session, prompt, proposer, GenerateConfig(GREEDY, 30, 5))
        assert got.output_ids == hf_greedy(target_model, prompt, 30)
        partial += sum(1 for d, a in zip(got.drafted, got.accepted) if 0 < a < d)
    assert partial > 0
