"""Prompt lookup as a token tree (proposer=ngram, proposer.branches > 1): the side branches it offers, the
statistics it keeps, how a pricing rule counts its rows, and greedy decoding over its trees equal to HF
`generate` on the reference and the fast backend, under a fixed length and the cost scheduler."""

from __future__ import annotations

import json
import random

import pytest
import torch

import specdraft.decode.generate as generate_module
from specdraft.decode.config import ProposerConfig
from specdraft.decode.factory import make_proposer
from specdraft.decode.fast_target import FastTarget
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import NgramProposer, ngram_match, ngram_siblings
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, with_tree
from specdraft.decode.session import CausalSession
from specdraft.decode.tree import side_record, side_rows
from tests.helpers import hf_greedy, synthetic_profile

GREEDY = Sampler()


def test_siblings_start_with_distinct_tokens_longest_match_first_then_most_recent():
    # the last token 7 occurred after (1, 2) three times and after (5, 2) once; the context ends in 1, 2, 7
    context = [1, 2, 7, 8, 8, 5, 2, 7, 9, 9, 1, 2, 7, 4, 4, 1, 2, 7, 3, 3, 0, 1, 2, 7]
    matched, main = ngram_match(context, 3, max_ngram=3, min_ngram=1)
    assert (matched, main) == (3, [3, 3, 0])  # the most recent occurrence of the longest suffix
    siblings = ngram_siblings(context, main[0], count=5, length=2, max_ngram=3)
    # 4 4 (match 3, more recent) before 8 8 (match 3), then 9 9 (match 2); 3 is the main chain's own first token
    assert siblings == [[4, 4], [8, 8], [9, 9]]
    assert ngram_siblings(context, main[0], count=1, length=1, max_ngram=3) == [[4]]
    assert ngram_siblings(context, 4, count=5, length=1, max_ngram=3) == [[3], [8], [9]]
    assert ngram_siblings([5, 6], 6, count=3, length=2, max_ngram=3) == []  # the last token never occurred before
    assert ngram_siblings(context, main[0], count=0, length=2, max_ngram=3) == []


def test_the_main_chain_is_unchanged_and_side_branches_are_greedy_only():
    context = [1, 2, 7, 8, 8, 1, 2, 7, 4, 4, 1, 2, 7, 3, 3, 0, 1, 2, 7]
    chain, tree = NgramProposer(), NgramProposer(branches=3, side_length=2)
    plain = chain.propose(context, 3, GREEDY, None)
    greedy = tree.propose(context, 3, GREEDY, None)
    assert greedy.tokens == plain.tokens == [3, 3, 0] and greedy.alternatives == [[4, 4], [8, 8]]
    sampled = tree.propose(context, 3, Sampler(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.tokens == plain.tokens and sampled.alternatives == []
    # a side branch is never longer than the main chain verifies
    assert tree.propose(context, 1, GREEDY, None).alternatives == [[4], [8]]
    assert greedy.truncate(1).alternatives == [[4], [8]]
    with pytest.raises(ValueError, match="proposer.branches=0"):
        NgramProposer(branches=0)


def test_a_step_a_side_branch_took_counts_as_a_rejected_first_position():
    context = [1, 2, 7, 4, 4, 1, 2, 7, 3, 3, 0, 1, 2, 7]
    proposer = NgramProposer(branches=2)
    proposal = proposer.propose(context, 2, GREEDY, None)
    assert proposal.tokens == [3, 3] and proposal.alternatives == [[4]]
    proposer.commit(context + [4, 5], None)  # the side branch's 4 was the target's token, then the target's 5
    tries, hits = proposer.stats.tries[3], proposer.stats.hits[3]
    assert (tries[0], hits[0], tries[1]) == (1, 0, 0)
    proposer.propose(context, 2, GREEDY, None)
    proposer.commit(context + [3, 3, 6], None)  # a chain step: both accepted
    assert (tries[0], hits[0], tries[1], hits[1]) == (2, 1, 1, 1)


def test_pricing_counts_side_branches_as_long_as_the_main_chain_at_most():
    profile = synthetic_profile(length=12)
    tree = with_tree(CostRule(profile), (0.2, 0.2), side_length=3)
    assert tree._width(1) == 1 + 1 + 2 and tree._width(4) == 1 + 4 + 2 * 3 and tree._width(0) == 1
    assert tree.rate([0.5]) == pytest.approx((1 + 0.5 + 0.4) / (profile.draft_s(1) + profile.verify_s(1, 4)))
    record = side_record(NgramProposer(branches=3, side_length=2), greedy=True)
    assert (record.side_branches, record.side_length) == (2, 2)
    record.observe(2, branch=1)  # the first side branch gave two tokens
    assert record.rate() == pytest.approx(3 / 9)
    assert side_rows(NgramProposer(branches=3, side_length=2), greedy=True) == 4
    assert side_rows(NgramProposer(branches=3, side_length=2), greedy=False) == 0
    assert side_rows(NgramProposer(), greedy=True) == 0


def test_the_factory_builds_lookup_trees_and_refuses_them_for_a_standalone_model():
    proposer, _ = make_proposer(ProposerConfig(name="ngram", branches=3, side_length=2), None, "tiny")
    assert (proposer.branches, proposer.side_length) == (3, 2)
    assert (proposer.clone().branches, proposer.clone().side_length) == (3, 2)
    with pytest.raises(ValueError, match="proposer.branches=2 applies to trained drafters and prompt lookup"):
        make_proposer(ProposerConfig(name="model", branches=2), None, "tiny")


def repetitive_prompt(rng: random.Random) -> list[int]:
    """A prompt whose tokens recur with different continuations, so lookup has siblings to offer."""
    words = [rng.randrange(1, 64) for _ in range(12)]
    return [rng.choice(words) for _ in range(rng.randrange(16, 40))]


@pytest.fixture
def side_wins(monkeypatch):
    """Counts tree steps whose accepted branch was a side one."""
    wins = []
    accept = generate_module.greedy_tree_accept

    def counting(branches, logits):
        branch, accepted, token = accept(branches, logits)
        wins.append(branch > 0)
        return branch, accepted, token
    monkeypatch.setattr(generate_module, "greedy_tree_accept", counting)
    return wins


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("num_draft,side_length", [(1, 1), (3, 2)])
def test_lookup_tree_decoding_equals_hf_generate(target_model, backend, num_draft, side_length, side_wins):
    rng = random.Random(num_draft)
    model = target_model if backend == "hf" else FastTarget(target_model)
    for case in range(60):  # a random model's text seldom leaves its loops: until a side branch was taken
        prompt = repetitive_prompt(rng)
        proposer = NgramProposer(branches=4, side_length=side_length)
        got = speculative_generate(CausalSession(model), prompt, proposer, GenerateConfig(GREEDY, 32, num_draft))
        assert got.output_ids == hf_greedy(target_model, prompt, 32), (backend, case)
        if case >= 4 and any(side_wins):
            break
    assert any(side_wins)  # side branches held the target's token, and were taken


def test_cost_scheduled_lookup_tree_decoding_equals_hf_generate(target_model, side_wins):
    rng = random.Random(11)
    for case in range(4):
        prompt = repetitive_prompt(rng)
        for model in (target_model, FastTarget(target_model)):
            rule = CostRule(synthetic_profile(length=10, per_token=0.0002), max_skip=4)
            proposer = NgramProposer(branches=3, side_length=2)
            got = speculative_generate(CausalSession(model), prompt, proposer,
                                       GenerateConfig(GREEDY, 32, 3, scheduler=rule))
            assert got.output_ids == hf_greedy(target_model, prompt, 32), case
    assert side_wins  # the rule verified trees


def test_bench_prices_lookup_trees_on_a_profile_as_wide_as_the_tree(tiny_model_dir, prompts_file, tmp_path):
    from specdraft.decode.bench import run_bench
    from tests.helpers import bench_config

    summary = run_bench(bench_config([
        f"target.name_or_path={tiny_model_dir}", "target.dtype=float32", "data=jsonl", f"data.path={prompts_file}",
        "proposer=ngram", "proposer.branches=3", "proposer.side_length=2", "scheduler=cost", "decode.num_draft=3",
        "decode.max_new_tokens=12", "bench.num_prompts=2", "bench.concurrency=[1]", "bench.baselines=false",
        "scheduler.profile_contexts=[]", f"out_dir={tmp_path}"]))
    assert summary["lossless"] is True
    profile = json.loads(open(summary["profile"]["path"]).read())
    assert profile["fingerprint"]["tree_rows"] == 4  # two side branches of up to two tokens
    assert len(profile["verify"]["single"]["1"]) == 1 + 3 + 4  # the pending token, the chain, the side rows
