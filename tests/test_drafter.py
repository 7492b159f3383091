"""The block drafter: the packed training pass equals the cached inference pass (reference twin)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama
from specdraft.models.drafter import BlockDrafter
from tests.helpers import greedy_block_and_training_pass, make_drafter


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_packed_training_pass_equals_cached_inference_pass(mode):
    _, drafter = make_drafter(mode)
    torch.manual_seed(4)
    features = torch.randn(1, 12, 2 * 32)  # (B, T, L*H)
    tokens = torch.randint(0, 64, (12,))
    anchors = torch.tensor([0, 3, 7, 11])
    with torch.no_grad():
        context = drafter.project_context(features)[0]  # (T, H)
        packed = drafter.forward_packed(context, anchors, tokens[anchors])
        for b, anchor in enumerate(anchors.tolist()):
            cache = drafter.context_cache(context[None, :anchor], 0)
            single = drafter.forward_block(cache, anchor, tokens[anchor : anchor + 1])
            torch.testing.assert_close(packed.logits[b], single.logits[0], rtol=1e-4, atol=1e-5)


def test_cache_built_in_pieces_equals_cache_built_at_once():
    _, drafter = make_drafter()
    context = torch.randn(1, 9, 32)
    with torch.no_grad():
        whole = drafter.context_cache(context, 0)
        first, second = drafter.context_cache(context[:, :5], 0), drafter.context_cache(context[:, 5:], 5)
    for (k, v), (k1, v1), (k2, v2) in zip(whole, first, second):
        torch.testing.assert_close(k, torch.cat([k1, k2], dim=2))
        torch.testing.assert_close(v, torch.cat([v1, v2], dim=2))


def test_block_does_not_see_context_at_or_after_its_anchor():
    _, drafter = make_drafter()
    torch.manual_seed(5)
    context = torch.randn(10, 32)
    changed = context.clone()
    changed[6:] += 5.0  # perturb positions >= anchor 6
    with torch.no_grad():
        a = drafter.forward_packed(context, torch.tensor([6]), torch.tensor([9])).logits
        b = drafter.forward_packed(changed, torch.tensor([6]), torch.tensor([9])).logits
        c = drafter.forward_packed(changed, torch.tensor([8]), torch.tensor([9])).logits
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_frozen_target_weights_and_heads_by_mode():
    target, dspark = make_drafter("dspark")
    assert not dspark.embed_tokens.weight.requires_grad and not dspark.lm_head.weight.requires_grad
    torch.testing.assert_close(dspark.lm_head.weight, target.lm_head.weight)
    assert dspark.markov_head is not None and dspark.confidence_head is not None
    _, dflash = make_drafter("dflash")
    assert dflash.markov_head is None and dflash.confidence_head is None


def test_reduced_draft_vocabulary_maps_rows():
    target = tiny_llama(0)
    with pytest.raises(ValueError, match="sorted and unique"):
        BlockDrafter(tiny_llama(0).config, num_feature_layers=2, draft_vocab_ids=torch.tensor([5, 2, 40]))
    ids = torch.tensor([2, 5, 40])
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=3, draft_vocab_ids=ids, markov_rank=4)
    drafter.copy_target_weights(target)
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight[ids])
    assert drafter.markov_head.markov_w2.out_features == 3


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
def test_block_drafter_proposer_is_lossless_greedy(mode):
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import BlockDrafterProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession
    from tests.helpers import hf_greedy

    target, drafter = make_drafter(mode)
    proposer = BlockDrafterProposer(drafter, feature_layers=(1, 2))
    session = CausalSession(target, proposer.feature_layers)
    for prompt in ([3, 1, 4, 1, 5], [9], [7, 7, 7, 7, 7, 7, 7, 7]):
        for num_draft in (1, 3, 4):
            got = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 20, num_draft))
            assert got.output_ids == hf_greedy(target, prompt, 20)
    with pytest.raises(ValueError, match="drafts at most 4"):
        speculative_generate(session, [1, 2], proposer, GenerateConfig(Sampler(), 5, 5))


def test_block_drafter_proposer_sampling_returns_its_q():
    from specdraft.decode.proposer import BlockDrafterProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession

    target, _ = make_drafter()
    torch.manual_seed(6)
    ids = torch.tensor([1, 2, 3, 8, 20, 41, 60])
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, draft_vocab_ids=ids, markov_rank=4)
    drafter.copy_target_weights(target)
    proposer = BlockDrafterProposer(drafter, (1, 2))
    session = CausalSession(target, (1, 2))
    _, features = session.forward([5, 6, 7], last_only=True)
    proposer.start([5, 6, 7], features)
    proposal = proposer.propose([5, 6, 7, 9], 4, Sampler(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(proposal.tokens) == 4 and set(proposal.tokens) <= set(ids.tolist())
    q = proposal.draft_probs  # (4, V_target)
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    assert bool((q[:, [i for i in range(64) if i not in ids.tolist()]] == 0).all())
    assert all(float(q[k, t]) > 0 for k, t in enumerate(proposal.tokens))
    assert proposal.confidence.shape == (4,) and bool(((proposal.confidence > 0) & (proposal.confidence < 1)).all())


def test_default_feature_layers_are_spread_and_never_the_last():
    from specdraft.io.target import default_feature_layers

    assert default_feature_layers(30) == (2, 8, 14, 21, 27)
    for layers in (4, 8, 16, 30, 64):
        chosen = default_feature_layers(layers, min(5, layers - 1))
        assert len(set(chosen)) == len(chosen) and max(chosen) < layers and min(chosen) >= 1
    with pytest.raises(ValueError, match="no 5 distinct"):
        default_feature_layers(3)


def test_target_features_are_the_chosen_hidden_states():
    from specdraft.io.target import target_features

    target = tiny_llama(0)
    ids = torch.randint(0, 64, (2, 6))
    features, logits = target_features(target, ids, None, (1, 2))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    torch.testing.assert_close(features, torch.cat([out.hidden_states[1], out.hidden_states[2]], -1))
    torch.testing.assert_close(logits, out.logits)


def test_threshold_scheduler_cuts_at_first_low_confidence_and_stays_lossless():
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import BlockDrafterProposer, Proposal
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.scheduler import build_scheduler, cut
    from specdraft.decode.session import CausalSession
    from tests.helpers import hf_greedy

    rule = build_scheduler("threshold", 0.5)
    assert cut(Proposal([1, 2, 3], confidence=torch.tensor([0.9, 0.4, 0.8])), rule) == 1
    assert cut(Proposal([1, 2], confidence=torch.tensor([0.9, 0.6])), rule) == 2
    with pytest.raises(ValueError, match="confidence head"):
        cut(Proposal([1]), rule)
    target, drafter = make_drafter("dspark")
    proposer = BlockDrafterProposer(drafter, (1, 2))
    session = CausalSession(target, (1, 2))
    for threshold in (0.0, 0.5, 1.0):
        config = GenerateConfig(Sampler(), 18, 4, scheduler=build_scheduler("threshold", threshold))
        got = speculative_generate(session, [2, 7, 1, 8], proposer, config)
        assert got.output_ids == hf_greedy(target, [2, 7, 1, 8], 18)
        if threshold == 1.0:
            assert set(got.drafted) == {0}  # confidence < 1 always: plain decoding


def test_proposer_drafts_what_the_training_pass_predicts_at_the_anchor():
    """Inference wiring (anchor, positions, cache, Markov chain) equals the training computation."""
    target, drafter = make_drafter("dspark")
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_()
    drafted, out, first = greedy_block_and_training_pass(target, drafter)
    with torch.no_grad():
        expected, previous = [], torch.tensor([[first]])
        for k in range(4):
            bias = drafter.markov_head.block_bias(previous, out.hidden[:, k : k + 1])
            token = int((out.logits[0, k] + bias[0, 0]).argmax())
            expected.append(token)
            previous = torch.tensor([[token]])
    assert drafted == expected
