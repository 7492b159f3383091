"""Losslessness fuzzing (hypothesis): random tiny targets and drafters, prompts, verify lengths, EOS placement,
proposers, schedulers, backends, batch sizes and join orders. Greedy output must equal target-only decoding (HF
`generate`) every time, and the batched engine must give every request its batch-1 output with the same generator
(greedy and sampled), with the cache compaction forced on every step. On a target of 8 tokens, sampled output
(temperature, top-k and top-p drawn too) has the target's exact distribution of its first two tokens (chi-square
over the 64 cells), and the same test fails "accept if r < p".

Profiles (tests/conftest.py): `ci` (the default run, derandomized, a bounded number of examples) and `long`
(`HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py`: many more, fresh randomness). A failure shrinks to a minimal
case; pin it below as a regression example (`@example`).
"""

from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from specdraft.decode import batch_session
from specdraft.decode.batch_generate import Request, batched_generate
from specdraft.decode.fast_target import FastTarget
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import (BlockDrafterProposer, HybridProposer, ModelProposer, NgramProposer, NoProposer,
                                       gives_confidence)
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, ThresholdRule
from specdraft.decode.session import CausalSession
from specdraft.models.drafter import BlockDrafter
from tests.helpers import VOCAB as SMALL_VOCAB, goodness_of_fit, hf_greedy, synthetic_profile, tiny_llama

VOCAB = 48
# "self": the target drafting for itself (ModelProposer on the target): at T=0 every drafted token is accepted,
# so long accepted runs, and EOS inside an accepted draft, happen often (random drafters rarely get accepted).
PROPOSERS = ("none", "ngram", "model", "self", "dspark", "dflash", "dspark_reduced", "hybrid")
RULES = ("fixed", "threshold", "cost")


def build_world(target, drafter_seed: int, other):
    """The target, its fast twin, drafters for it (dspark, dflash, dspark on every other token) and another model."""
    vocab_size = target.config.vocab_size
    torch.manual_seed(drafter_seed)
    drafters = {}
    for name, mode, vocab in (("dspark", "dspark", None), ("dflash", "dflash", None),
                              ("dspark_reduced", "dspark", torch.arange(0, vocab_size, 2))):
        drafter = BlockDrafter(target.config, 1, 2, block_size=4, mask_token_id=1, mode=mode, markov_rank=4,
                               draft_vocab_ids=vocab).eval()
        drafter.copy_target_weights(target)
        drafters[name] = drafter
    return target, FastTarget(target, "torch"), drafters, other


@lru_cache(maxsize=None)
def world(seed: int):
    """A tiny target and what goes with it (cached: building them is most of an example's time)."""
    target = tiny_llama(seed, vocab_size=VOCAB, layers=1 + seed % 2)
    return build_world(target, 100 + seed, tiny_llama(seed + 7, vocab_size=VOCAB, layers=1))


def make_proposer(name: str, seed: int, max_ngram: int, worlds=world):
    event(f"proposer: {name}")
    target, _, drafters, small = worlds(seed)
    if name == "none":
        return NoProposer()
    if name == "ngram":
        return NgramProposer(max_ngram, share_stats=False)
    if name == "model":
        return ModelProposer(small)
    if name == "self":
        return ModelProposer(target)
    if name == "hybrid":
        return HybridProposer(NgramProposer(max_ngram, share_stats=False), BlockDrafterProposer(drafters["dspark"], (0, 1)))
    return BlockDrafterProposer(drafters[name], (0, 1))


def make_rule(name: str, proposer, threshold: float):
    if name == "fixed" or not gives_confidence(proposer):
        event("rule: fixed")
        return None
    event(f"rule: {name}")
    if name == "threshold":
        return ThresholdRule(threshold)
    return CostRule(synthetic_profile(per_token=0.002), max_skip=3)


tokens = st.integers(2, VOCAB - 1)
case = st.fixed_dictionaries({
    "seed": st.integers(0, 2),
    "proposer": st.sampled_from(PROPOSERS),
    "rule": st.sampled_from(RULES),
    "threshold": st.floats(0.05, 0.95),
    "max_ngram": st.integers(1, 3),
    "num_draft": st.integers(1, 4),
    "backend": st.sampled_from(("hf", "fast")),
    # EOS: none, or the target's own k-th greedy token after the prompt (so it is generated, often inside a
    # drafted block), or an arbitrary token
    "eos": st.one_of(st.none(), st.integers(0, 20).map(lambda k: ("own", k)), tokens),
})


def eos_for(case, target, prompt) -> list[int]:
    """The case's EOS ids: [] or one token; ("own", k) picks the target's k-th greedy token for this prompt."""
    eos = case["eos"]
    if eos is None:
        return []
    if isinstance(eos, tuple):
        own = hf_greedy(target, prompt, eos[1] + 1)
        event("eos: in the output")
        return [own[min(eos[1], len(own) - 1)]]
    return [eos]


def _num_draft(proposer, wanted: int) -> int:
    if isinstance(proposer, NoProposer):
        return 0
    return min(wanted, proposer.max_draft or wanted)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(case=case, prompt=st.lists(tokens, min_size=1, max_size=12), max_new=st.integers(1, 24))
def test_greedy_output_equals_target_only_decoding(case, prompt, max_new):
    target, fast, _, _ = world(case["seed"])
    proposer = make_proposer(case["proposer"], case["seed"], case["max_ngram"])
    rule = make_rule(case["rule"], proposer, case["threshold"])
    eos = eos_for(case, target, prompt)
    model = fast if case["backend"] == "fast" else target
    session = CausalSession(model, proposer.feature_layers)
    config = GenerateConfig(Sampler(), max_new, _num_draft(proposer, case["num_draft"]), eos, rule)
    result = speculative_generate(session, prompt, proposer, config)
    if any(result.accepted):
        event("drafted tokens accepted")
    assert result.output_ids == hf_greedy(target, prompt, max_new, eos or None), case


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(case=case, requests=st.lists(st.tuples(st.lists(tokens, min_size=1, max_size=10), st.integers(1, 16)),
                                     min_size=1, max_size=5),
       concurrency=st.integers(1, 4), temperature=st.sampled_from((0.0, 1.0)), compact=st.booleans())
def test_batched_engine_gives_every_request_its_batch1_output(case, requests, concurrency, temperature, compact):
    target, fast, _, _ = world(case["seed"])
    proposer = make_proposer(case["proposer"], case["seed"], case["max_ngram"])
    rule = make_rule(case["rule"], proposer, case["threshold"])
    eos = eos_for(case, target, requests[0][0])
    model = fast if case["backend"] == "fast" else target
    num_draft = _num_draft(proposer, case["num_draft"])
    sampler = Sampler(temperature)
    session = CausalSession(model, proposer.feature_layers)
    alone = [speculative_generate(session, prompt, proposer.clone(), GenerateConfig(sampler, limit, num_draft, eos, rule),
                                  generator=torch.Generator().manual_seed(50 + i)).output_ids
             for i, (prompt, limit) in enumerate(requests)]
    batch = [Request(prompt, limit, torch.Generator().manual_seed(50 + i)) for i, (prompt, limit) in enumerate(requests)]
    keep = batch_session.BatchedSession.keep

    def keep_and_compact(self, counts):  # the compaction that rarely triggers on its own, on every step
        keep(self, counts)
        if self.cache is not None and self.rows:
            self.compact()

    batch_session.BatchedSession.keep = keep_and_compact if compact else keep
    try:
        together = batched_generate(model, batch, proposer, sampler, num_draft, eos, rule, max_concurrency=concurrency)
    finally:
        batch_session.BatchedSession.keep = keep
    assert [g.output_ids for g in together] == alone, case
    if temperature == 0:
        for (prompt, limit), out in zip(requests, alone):
            assert out == hf_greedy(target, prompt, limit, eos or None), case


def test_the_fuzzer_finds_a_wrong_acceptance_rule():
    """Negative control: the same search over the same space finds a case where an acceptance rule that keeps
    every drafted token differs from target-only decoding (so a pass above means something)."""
    from hypothesis import find

    def keep_everything(proposal, logits, sampler, generator):
        return len(proposal.tokens), int(logits[len(proposal.tokens)].argmax())

    def wrong(example) -> bool:
        case, prompt, max_new = example
        target, _, _, _ = world(case["seed"])
        proposer = make_proposer(case["proposer"], case["seed"], case["max_ngram"])
        config = GenerateConfig(Sampler(), max_new, _num_draft(proposer, case["num_draft"]), ())
        got = speculative_generate(CausalSession(target, proposer.feature_layers), prompt, proposer, config,
                                   accept_fn=keep_everything).output_ids
        return got != hf_greedy(target, prompt, max_new)

    found = find(st.tuples(case, st.lists(tokens, min_size=1, max_size=12), st.integers(1, 24)), wrong,
                 settings=settings(max_examples=500, deadline=None, database=None))
    assert found[0]["proposer"] != "none"  # plain decoding drafts nothing, so it cannot be wrong this way


# ---- sampling: the output's exact distribution, on a target small enough to enumerate ----

SAMPLED_PROPOSERS = ("ngram", "model", "self", "dspark", "dflash", "dspark_reduced", "hybrid")
SAMPLES = 1500  # generations per example: the batched engine draws them, each with its own generator


@lru_cache(maxsize=None)
def small_world(seed: int):
    """A target over SMALL_VOCAB tokens (so the joint of its first two sampled tokens is 64 cells), and drafters."""
    target = tiny_llama(seed + 20, vocab_size=SMALL_VOCAB, layers=1)
    return build_world(target, 120 + seed, tiny_llama(seed + 27, vocab_size=SMALL_VOCAB, layers=1))


@torch.inference_mode()
def target_joint(target, prompt: list[int], sampler: Sampler) -> np.ndarray:
    """P(first two sampled tokens) under target-only sampling with `sampler`: (SMALL_VOCAB ** 2,)."""
    first = sampler.probs(target(torch.tensor([prompt])).logits[0, -1])  # (V,)
    rows = torch.tensor([prompt + [t] for t in range(SMALL_VOCAB)])  # (V, P + 1)
    second = sampler.probs(target(rows).logits[:, -1])  # (V, V)
    joint = (first[:, None].double() * second.double()).reshape(-1).numpy()
    return joint / joint.sum()  # float32 probabilities: renormalised, as the chi-square test checks the total


sampled_case = st.fixed_dictionaries({
    "seed": st.integers(0, 1),
    "proposer": st.sampled_from(SAMPLED_PROPOSERS),
    "rule": st.sampled_from(RULES),
    "threshold": st.floats(0.05, 0.95),
    "max_ngram": st.integers(1, 2),
    "num_draft": st.integers(1, 4),
    "backend": st.sampled_from(("hf", "fast")),
    "temperature": st.sampled_from((0.6, 1.0, 1.7)),
    "top_k": st.sampled_from((0, 3, 5)),
    "top_p": st.sampled_from((1.0, 0.8)),
    # repeated prompts give prompt lookup something to draft
    "prompt": st.lists(st.integers(2, SMALL_VOCAB - 1), min_size=1, max_size=3).map(lambda p: p * 3),
})


def sampled_pvalue(case) -> float:
    """Chi-square p-value of the first two tokens of SAMPLES batched generations against the target's joint."""
    target, fast, _, _ = small_world(case["seed"])
    proposer = make_proposer(case["proposer"], case["seed"], case["max_ngram"], worlds=small_world)
    rule = make_rule(case["rule"], proposer, case["threshold"])
    sampler = Sampler(case["temperature"], case["top_k"], case["top_p"])
    num_draft = _num_draft(proposer, case["num_draft"])
    # room for whole drafted blocks past the two tokens counted, so accepted runs end inside them too
    batch = [Request(case["prompt"], 2 + num_draft, torch.Generator().manual_seed(1000 + i)) for i in range(SAMPLES)]
    model = fast if case["backend"] == "fast" else target
    out = batched_generate(model, batch, proposer, sampler, num_draft, (), rule, max_concurrency=64)
    samples = np.array([g.output_ids[:2] for g in out])
    return goodness_of_fit(samples, target_joint(target, case["prompt"], sampler))


@settings(max_examples=max(4, settings.default.max_examples // 100), suppress_health_check=[HealthCheck.too_slow],
          deadline=None)
@given(case=sampled_case)
def test_sampled_output_has_the_targets_exact_distribution(case):
    assert sampled_pvalue(case) > 1e-4, case


def test_the_distribution_test_fails_a_wrong_acceptance_rule(monkeypatch):
    """Negative control: "accept if r < p" (not min(1, p/q)) in the same engine, on the same kind of case."""
    from specdraft.decode import engine

    def accept_if_r_below_p(proposal, logits, sampler, generator):
        p = sampler.probs(logits)  # (k + 1, V)
        for i, token in enumerate(proposal.tokens):
            if torch.rand((), generator=generator) >= p[i, token]:
                return i, int(torch.multinomial(p[i], 1, generator=generator))
        return len(proposal.tokens), int(torch.multinomial(p[len(proposal.tokens)], 1, generator=generator))

    case = {"seed": 0, "proposer": "model", "rule": "fixed", "threshold": 0.5, "max_ngram": 1, "num_draft": 2,
            "backend": "hf", "temperature": 0.6, "top_k": 0, "top_p": 1.0, "prompt": [3, 5, 3, 5]}
    monkeypatch.setattr(sys.modules[__name__], "event", lambda *_: None)  # hypothesis records events in tests only
    assert sampled_pvalue(case) > 1e-4  # the right rule passes this case
    monkeypatch.setattr(engine, "_sampling_step", accept_if_r_below_p)
    assert sampled_pvalue(case) < 1e-6
