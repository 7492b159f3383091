"""Losslessness fuzzing (hypothesis): random tiny targets and drafters, prompts, verify lengths, EOS placement,
proposers, schedulers, backends, batch sizes and join orders. Greedy output must equal target-only decoding (HF
`generate`) every time, and the batched engine must give every request its batch-1 output with the same generator
(greedy and sampled), with the cache compaction forced on every step.

Profiles (tests/conftest.py): `ci` (the default run, derandomized, a bounded number of examples) and `long`
(`HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py`: many more, fresh randomness). A failure shrinks to a minimal
case; pin it below as a regression example (`@example`).
"""

from __future__ import annotations

from functools import lru_cache

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
from tests.helpers import hf_greedy, synthetic_profile, tiny_llama

VOCAB = 48
# "self": the target drafting for itself (ModelProposer on the target): at T=0 every drafted token is accepted,
# so long accepted runs, and EOS inside an accepted draft, happen often (random drafters rarely get accepted).
PROPOSERS = ("none", "ngram", "model", "self", "dspark", "dflash", "dspark_reduced", "hybrid")
RULES = ("fixed", "threshold", "cost")


@lru_cache(maxsize=None)
def world(seed: int):
    """A tiny target, its fast twin, and drafters for it (cached: building them is most of an example's time)."""
    target = tiny_llama(seed, vocab_size=VOCAB, layers=1 + seed % 2)
    torch.manual_seed(100 + seed)
    drafters = {}
    for name, mode, vocab in (("dspark", "dspark", None), ("dflash", "dflash", None),
                              ("dspark_reduced", "dspark", torch.arange(0, VOCAB, 2))):  # every other token
        drafter = BlockDrafter(target.config, 1, 2, block_size=4, mask_token_id=1, mode=mode, markov_rank=4,
                               draft_vocab_ids=vocab).eval()
        drafter.copy_target_weights(target)
        drafters[name] = drafter
    small = tiny_llama(seed + 7, vocab_size=VOCAB, layers=1)
    return target, FastTarget(target, "torch"), drafters, small


def make_proposer(name: str, seed: int, max_ngram: int):
    event(f"proposer: {name}")
    target, _, drafters, small = world(seed)
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
