"""The block drafter: the packed training pass equals the cached inference pass (reference twin)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from train.drafter import BlockDrafter


def make_drafter(mode="dspark", layers=2):
    target = tiny_llama(0)
    torch.manual_seed(3)
    drafter = BlockDrafter(target.config, num_layers=layers, num_feature_layers=2, block_size=4, mask_token_id=1,
                           mode=mode, markov_rank=8).eval()
    drafter.copy_target_weights(target)
    return target, drafter


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
    ids = torch.tensor([5, 2, 40])
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=3, draft_vocab_ids=ids, markov_rank=4)
    drafter.copy_target_weights(target)
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight[ids])
    assert drafter.markov_head.markov_w2.out_features == 3
