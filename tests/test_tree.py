"""Token-tree verification (decode/tree.py): the mask, the greedy walk, the cache keeping one path, and greedy
decoding over trees equal to HF `generate`, on the reference and the fast backend; a negative control shows
the cache compaction is what keeps it exact."""

from __future__ import annotations

import random

import pytest
import torch

from specdraft.decode.factory import make_proposer
from specdraft.decode.config import ProposerConfig
from specdraft.decode.fast_target import FastTarget
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import BlockDrafterProposer, ModelProposer, Proposal
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from specdraft.decode.tree import greedy_tree_accept, kept_rows, tree_mask, tree_rows
from tests.helpers import hf_greedy, make_drafter, make_eagle

GREEDY = Sampler()


def test_mask_lets_each_branch_see_the_context_the_pending_token_and_its_own_prefix():
    branches = [[5, 6], [7], [8, 9]]
    visible = tree_mask(branches, past=3, dtype=torch.float32)[0, 0] == 0  # (6, 9)
    assert tree_rows(branches) == ([5, 6, 7, 8, 9], [1, 2, 1, 1, 2])
    expected = {0: [], 1: [1], 2: [1, 2], 3: [3], 4: [4], 5: [4, 5]}  # verify rows each row sees beyond row 0
    for row, own in expected.items():
        seen = [r for r in range(1, 6) if visible[row, 3 + r]]
        assert seen == own, row
        assert visible[row, : 3 + 1].all()  # context and pending token


def test_greedy_walk_follows_the_branch_the_target_takes():
    branches = [[5, 6], [7, 2], [8]]
    def logits_for(argmaxes):
        out = torch.zeros(len(argmaxes), 10)
        out[range(len(argmaxes)), argmaxes] = 1.0
        return out
    # rows: pending, 5, 6, 7, 2, 8
    assert greedy_tree_accept(branches, logits_for([5, 6, 1, 0, 0, 0])) == (0, 2, 1)  # main chain, bonus 1
    assert greedy_tree_accept(branches, logits_for([7, 0, 0, 2, 4, 0])) == (1, 2, 4)
    assert greedy_tree_accept(branches, logits_for([7, 0, 0, 3, 0, 0])) == (1, 1, 3)
    assert greedy_tree_accept(branches, logits_for([8, 0, 0, 0, 0, 9])) == (2, 1, 9)
    assert greedy_tree_accept(branches, logits_for([4, 0, 0, 0, 0, 0])) == (0, 0, 4)
    assert kept_rows(branches, 1, 2) == [0, 3, 4] and kept_rows(branches, 0, 0) == [0]


def backends(model):
    return {"hf": model, "fast": FastTarget(model)}


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_keeping_a_side_branch_leaves_the_cache_a_chain_step_would_leave(target_model, backend):
    prompt, pending, side = [3, 1, 4, 1, 5], 9, 2
    tree = CausalSession(backends(target_model)[backend], feature_layers=(1, 2))
    tree.forward(prompt)
    logits, features = tree.forward_tree(pending, [[7, 8], [side], [6]])
    tree.keep(len(prompt), kept_rows([[7, 8], [side], [6]], 1, 1))
    chain = CausalSession(backends(target_model)[backend], feature_layers=(1, 2))
    chain.forward(prompt)
    chain_logits, chain_features = chain.forward([pending, side])
    # the tree's rows for the pending token and the side branch are the chain's rows
    torch.testing.assert_close(logits[[0, 3]], chain_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features[[0, 3]], chain_features, atol=1e-5, rtol=1e-5)
    assert tree.length == chain.length == len(prompt) + 2
    # and so is every later forward over the kept cache
    after, _ = tree.forward([11, 12])
    torch.testing.assert_close(after, chain.forward([11, 12])[0], atol=1e-5, rtol=1e-5)


class TreeProposer:
    """Drafts another model's greedy chain, plus one-token alternatives for position 1: the target's own next
    token at some steps (so side branches get accepted) and random tokens at others."""

    feature_layers = ()
    max_draft = None

    def __init__(self, draft_model, target_model, seed: int, alternatives: int = 2):
        self.inner, self.oracle = ModelProposer(draft_model), ModelProposer(target_model)
        self.rng, self.alternatives, self.vocab = random.Random(seed), alternatives, target_model.config.vocab_size
        self.side_steps = 0

    def start(self, context_ids, features):
        self.inner.start(context_ids, features)
        self.oracle.start(context_ids, features)

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        main = self.inner.propose(context_ids, num_draft, sampler, generator).tokens
        right = self.oracle.propose(context_ids, 1, sampler, generator).tokens[0]
        pool = [t for t in range(self.vocab) if t != main[0]]
        alternatives = self.rng.sample(pool, self.alternatives)
        if right != main[0] and self.rng.random() < 0.6:
            alternatives[self.rng.randrange(self.alternatives)] = right
            alternatives = list(dict.fromkeys(alternatives))
            self.side_steps += 1
        return Proposal(main, alternatives=[[t] for t in alternatives])

    def commit(self, context_ids, features):
        pass

    def clone(self):
        return self


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("num_draft", [1, 3])
def test_greedy_tree_decoding_equals_hf_generate(target_model, other_model, backend, num_draft):
    rng = random.Random(num_draft)
    for case in range(4):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(2, 12))]
        proposer = TreeProposer(other_model, target_model, seed=case)
        session = CausalSession(backends(target_model)[backend])
        got = speculative_generate(session, prompt, proposer, GenerateConfig(GREEDY, 24, num_draft))
        assert got.output_ids == hf_greedy(target_model, prompt, 24), (backend, case)
        assert proposer.side_steps > 0  # side branches were offered with the right token, and taken


def test_without_moving_the_kept_rows_the_output_breaks(target_model, other_model, monkeypatch):
    """Negative control: a keep that only crops (the side branch's slots stay behind the main chain's) must
    change the output: the equality above depends on the compaction."""
    monkeypatch.setattr(CausalSession, "keep", lambda self, start, rows: self.rollback(start + len(rows)))
    rng, broken = random.Random(5), 0
    for case in range(4):
        prompt = [rng.randrange(1, 64) for _ in range(8)]
        got = speculative_generate(CausalSession(target_model), prompt, TreeProposer(other_model, target_model, case),
                                   GenerateConfig(GREEDY, 24, 2))
        broken += got.output_ids != hf_greedy(target_model, prompt, 24)
    assert broken > 0


def test_block_drafter_offers_runner_up_first_tokens_greedy_only(target_model):
    target, drafter = make_drafter("dspark")
    proposer = BlockDrafterProposer(drafter, (1, 2), branches=3)
    context = [3, 1, 4, 1, 5, 9, 2, 6]
    _, features = CausalSession(target, (1, 2)).forward(context[:-1])
    proposer.start(context, features)
    plain = BlockDrafterProposer(drafter, (1, 2))
    plain.start(context, features)
    greedy = proposer.propose(context, 2, GREEDY, None)
    assert greedy.tokens == plain.propose(context, 2, GREEDY, None).tokens  # the main chain is unchanged
    firsts = [branch[0] for branch in greedy.alternatives]
    assert len(greedy.alternatives) == 2 and all(len(b) == 1 for b in greedy.alternatives)
    assert len(set(firsts + greedy.tokens[:1])) == 3
    sampled = proposer.propose(context, 2, Sampler(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.alternatives == []
    assert greedy.truncate(0).alternatives == [] and greedy.truncate(1).alternatives == greedy.alternatives


@pytest.mark.parametrize("num_draft", [1, 3])
def test_block_drafter_tree_decoding_equals_hf_generate(num_draft):
    target, drafter = make_drafter("dspark")
    rng = random.Random(num_draft)
    for case in range(3):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 10))]
        for backend in ("hf", "fast"):
            session = CausalSession(backends(target)[backend], (1, 2))
            got = speculative_generate(session, prompt, BlockDrafterProposer(drafter, (1, 2), branches=4),
                                       GenerateConfig(GREEDY, 20, num_draft))
            assert got.output_ids == hf_greedy(target, prompt, 20), (backend, case)


def test_branches_are_refused_where_they_do_not_apply(target_model):
    with pytest.raises(ValueError, match="proposer.branches=2 applies to trained drafters"):
        make_proposer(ProposerConfig(name="model", branches=2), None, "tiny")
    _, drafter = make_drafter("dspark")
    with pytest.raises(ValueError, match="proposer.branches=0"):
        BlockDrafterProposer(drafter, (1, 2), branches=0)
    with pytest.raises(ValueError, match="verified greedily only"):
        session = CausalSession(target_model)
        proposer = TreeProposer(target_model, target_model, seed=0)
        speculative_generate(session, [1, 2, 3], proposer, GenerateConfig(Sampler(temperature=1.0), 5, 2),
                             generator=torch.Generator().manual_seed(0))


def test_cost_rule_prices_a_tree_by_its_width_and_its_side_hits():
    from specdraft.decode.scheduler import CostRule, with_tree
    from tests.helpers import synthetic_profile

    profile = synthetic_profile(length=8)
    chain, tree = CostRule(profile), with_tree(CostRule(profile), (0.15, 0.15))
    assert tree.rate([]) == chain.rate([])  # no drafted position: no tree either
    assert tree.rate([0.2]) == pytest.approx((1 + 0.2 + 0.3) / (profile.draft_s(1) + profile.verify_s(1, 4)))
    assert tree.break_even(1) == pytest.approx((profile.draft_s(1) + profile.verify_s(1, 4)) / profile.verify_s(1, 1))
    # a first position too weak to pay alone (chain: c > 0.2 pays here) pays with likely side hits (c > 0.167)
    assert not chain.verify([0.18]) and tree.verify([0.18])
    assert tree.at(12).side_hits == (0.15, 0.15) and tree.without_drafting().side_branches == 0
    assert with_tree(object, (0.15, 0.15)) is object  # rules that do not price steps are left as they are


def test_side_record_starts_cautious_and_learns_the_requests_rate():
    from specdraft.decode.tree import SideRecord, side_record

    record = SideRecord(3)
    assert record.rate() == pytest.approx(1 / 8)
    for hit in [True] * 6 + [False] * 2:
        record.observe(int(hit), branch=int(hit))
    assert record.rate() == pytest.approx(7 / 16)
    _, drafter = make_drafter("dspark")
    assert side_record(BlockDrafterProposer(drafter, (1, 2), branches=3), greedy=True).side_branches == 2
    assert side_record(BlockDrafterProposer(drafter, (1, 2), branches=3), greedy=False) is None
    assert side_record(BlockDrafterProposer(drafter, (1, 2)), greedy=True) is None


def test_cost_scheduled_tree_decoding_equals_hf_generate():
    from specdraft.decode.scheduler import CostRule
    from tests.helpers import synthetic_profile

    target, drafter = make_drafter("dspark")
    rng = random.Random(7)
    for case in range(3):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 10))]
        for backend in ("hf", "fast"):
            session = CausalSession(backends(target)[backend], (1, 2))
            rule = CostRule(synthetic_profile(length=8, per_token=0.0002), max_skip=4)
            got = speculative_generate(session, prompt, BlockDrafterProposer(drafter, (1, 2), branches=3),
                                       GenerateConfig(GREEDY, 20, 3, scheduler=rule))
            assert got.output_ids == hf_greedy(target, prompt, 20), (backend, case)


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_a_tree_step_hands_the_proposer_the_features_a_chain_step_would(target_model, backend):
    from specdraft.decode.generate import _tree_step

    prompt, pending, side = [3, 1, 4, 1, 5], 9, 2
    tree = CausalSession(backends(target_model)[backend], feature_layers=(1, 2))
    tree.forward(prompt)
    logits, _ = CausalSession(target_model).forward(prompt + [pending])
    right = int(logits[-1].argmax())  # the target's token after the pending one: offered as a side branch
    wrong = (right + 1) % target_model.config.vocab_size
    taken, accepted, _, features, was_side = _tree_step(tree, pending, Proposal([wrong, 7], alternatives=[[right]]),
                                                         GREEDY)
    assert (taken.tokens, accepted, was_side) == ([right], 1, True) and taken.confidence_logits is None
    chain = CausalSession(backends(target_model)[backend], feature_layers=(1, 2))
    chain.forward(prompt)
    _, chain_features = chain.forward([pending, right])
    torch.testing.assert_close(features, chain_features, atol=1e-5, rtol=1e-5)


def test_tree_decoding_stops_at_eos_and_at_the_token_limit_as_hf_generate(target_model, other_model):
    rng = random.Random(11)
    for case in range(6):
        prompt = [rng.randrange(1, 64) for _ in range(6)]
        free = hf_greedy(target_model, prompt, 12)
        eos = free[rng.randrange(1, 6)]  # a token the target does generate, so EOS comes mid-output
        for limit in (1, 2, 7):
            proposer = TreeProposer(other_model, target_model, seed=case)
            got = speculative_generate(CausalSession(target_model), prompt, proposer,
                                       GenerateConfig(GREEDY, limit, 3, [eos]))
            assert got.output_ids == hf_greedy(target_model, prompt, limit, [eos]), (case, limit)


def test_the_context_window_bounds_a_tree_by_its_deepest_path(target_model):
    session = CausalSession(target_model)
    session.forward([3, 1, 4])
    session.context_window = 3 + 1 + 1  # room for the pending token and one drafted position
    logits, _ = session.forward_tree(9, [[5], [6], [7]])  # three side rows, each one position deep: fits
    assert logits.shape[0] == 4
    session.keep(3, [0])
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        session.forward_tree(9, [[5, 6], [7]])


def test_the_hybrid_prices_its_drafter_part_s_tree():
    from specdraft.decode.proposer import HybridProposer, NgramProposer
    from specdraft.decode.tree import side_record

    _, drafter = make_drafter("dspark")
    hybrid = HybridProposer(NgramProposer(3, 1), BlockDrafterProposer(drafter, (1, 2), branches=3))
    assert hybrid.branches == 3 and side_record(hybrid, greedy=True).side_branches == 2


def test_cost_rule_keeps_the_side_branches_that_pay_for_their_rows():
    from specdraft.decode.scheduler import CostRule, with_tree
    from tests.helpers import synthetic_profile

    flat = synthetic_profile(length=8, per_token=0.0)  # a verify of any width costs one plain step
    steep = synthetic_profile(length=8, per_token=0.002)  # each row costs a sixth of a plain step
    ranked = (0.2, 0.02, 0.01)  # the first runner-up is often the target's token, the others rarely
    assert with_tree(CostRule(flat), ranked).side_count([0.5]) == 3  # free rows: every branch rides along
    rule = with_tree(CostRule(steep), ranked)
    assert rule.side_count([0.5]) == 1 and rule.side_count([]) == 0
    assert rule.rate([0.5]) == pytest.approx((1.5 + 0.2) / (steep.draft_s(1) + steep.verify_s(1, 3)))
    assert with_tree(CostRule(steep), (0.01,) * 3).side_count([0.5]) == 0  # none buys its row
    assert with_tree(CostRule(steep), (0.01,) * 3, probing=True).side_count([0.5]) == 3
    assert rule.break_even(1, 0) == pytest.approx((steep.draft_s(1) + steep.verify_s(1, 2)) / steep.verify_s(1, 1))


def test_side_record_learns_each_rank_only_where_it_was_verified_and_probes_the_dropped_ones():
    from specdraft.decode.tree import SideRecord

    record = SideRecord(3, probe_every=4)
    record.observe(1, branch=1, offered=1, dropped=2)  # only the first side branch verified; it held the token
    assert record.steps == [9.0, 8.0, 8.0] and record.rates()[0] == pytest.approx((1 / 3 + 1) / 9)
    for _ in range(3):
        assert not record.probing()
        record.observe(0, offered=0, dropped=3)
    assert record.probing()  # four steps in a row dropped branches: the next carries the whole tree
    record.observe(0, offered=3)
    assert not record.probing() and record.steps == [10.0, 9.0, 9.0]


def test_a_tree_pruned_by_the_cost_rule_still_decodes_as_hf_generate():
    from specdraft.decode.scheduler import CostRule
    from tests.helpers import synthetic_profile

    target, drafter = make_drafter("dspark")
    prompt = [5, 9, 2, 33, 7]
    session = CausalSession(backends(target)["fast"], (1, 2))
    trees = []
    tree_forward = session.forward_tree
    session.forward_tree = lambda pending, branches: trees.append(len(branches)) or tree_forward(pending, branches)
    rule = CostRule(synthetic_profile(length=8, per_token=0.002), max_skip=0)  # side rows too dear for a 1/24 hit
    got = speculative_generate(session, prompt, BlockDrafterProposer(drafter, (1, 2), branches=4),
                               GenerateConfig(GREEDY, 48, 2, scheduler=rule))
    assert got.output_ids == hf_greedy(target, prompt, 48)
    drafting_steps = sum(1 for k in got.drafted if k)
    assert drafting_steps > 17  # enough steps to need a probe
    # the probes (every 17th drafting step) and any step whose record earned its rows; not every step
    assert 1 <= len(trees) < drafting_steps / 2


def test_an_unset_branch_count_takes_each_proposers_default():
    from specdraft.decode.factory import DEFAULT_BRANCHES, default_branches, drafter_proposer
    from specdraft.decode.proposer import Eagle3Proposer

    assert make_proposer(ProposerConfig(name="ngram"), None, "tiny")[0].branches == DEFAULT_BRANCHES["ngram"] > 1
    assert make_proposer(ProposerConfig(name="ngram", branches=1), None, "tiny")[0].branches == 1
    _, block = make_drafter("dspark")
    assert drafter_proposer(block, (1, 2), None).branches == DEFAULT_BRANCHES["drafter"] > 1
    _, eagle = make_eagle()
    assert isinstance(drafter_proposer(eagle, (1, 2), None), Eagle3Proposer)  # one chain, no error
    with pytest.raises(ValueError, match="needs a block drafter"):
        drafter_proposer(eagle, (1, 2), 2)
    assert default_branches("model", None) == 1 and default_branches("drafter", 2) == 2
