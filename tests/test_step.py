"""The distillation step on a 2-layer random target: anchors, targets, normalisation, learning."""

from __future__ import annotations

import torch

from tests.helpers import tiny_llama
from specdraft.models.drafter import BlockDrafter
from specdraft.train.step import Batch, LossSettings, block_targets, distill_step, sample_anchors, weight_sum
from tests.helpers import toy_batch


def test_anchors_are_seeded_per_sample_and_precede_response_tokens():
    mask = torch.zeros(20, dtype=torch.bool)
    mask[5:] = True
    a = sample_anchors(mask, 6, seed=7)
    assert torch.equal(a, sample_anchors(mask, 6, seed=7)) and len(a) == 6
    assert bool(mask[a + 1].all()) and len(set(a.tolist())) == 6
    assert not torch.equal(a, sample_anchors(mask, 6, seed=8))


def test_block_targets_align_slots_with_next_tokens():
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)
    rows, tokens, previous, valid = block_targets(ids, mask, torch.tensor([1, 5]), 4)
    assert tokens[0].tolist() == [2, 3, 4, 5] and previous[0].tolist() == [1, 2, 3, 4]
    assert rows[0].tolist() == [1, 2, 3, 4]  # slot k uses the target's prediction at a+k
    assert valid[1].tolist() == [True, True, False, False]  # response ends after position 7


def test_distill_step_learns_on_a_tiny_target():
    target = tiny_llama(0)
    torch.manual_seed(1)
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1, markov_rank=8)
    drafter.copy_target_weights(target)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    batch = toy_batch()
    losses = []
    for _ in range(25):
        loss, metrics = distill_step(drafter, target, batch, (1, 2), num_anchors=6)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert 1.0 <= metrics["tau_estimate"] <= 5.0 and not drafter.lm_head.weight.requires_grad


def test_global_normalizer_splits_batch_exactly():
    """Two half-batches normalised by the full batch's weight sum give the full-batch gradient."""
    target = tiny_llama(0)
    torch.manual_seed(2)
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1, markov_rank=8)
    drafter.copy_target_weights(target)
    batch = toy_batch(batch=4)
    total = weight_sum(batch, 5, 4, 4.0)
    full, _ = distill_step(drafter, target, batch, (1, 2), 5, LossSettings(), normalizer=total)
    halves = [
        distill_step(drafter, target, Batch(*(t[s] for t in (batch.input_ids, batch.attention_mask, batch.loss_mask,
                                                               batch.sample_seeds))), (1, 2), 5, normalizer=total)[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-6)


def test_target_argmax_labels_equal_data_labels_on_the_targets_own_greedy_text():
    """ce_labels=target_argmax labels each slot with the target's most likely token: on text the target wrote
    greedily that is the data's next token (same loss as ce_labels=data); on other text the CE term differs."""
    target = tiny_llama(0)
    torch.manual_seed(3)
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1, markov_rank=8)
    drafter.copy_target_weights(target)
    prompt = toy_batch(batch=2, length=8).input_ids
    greedy = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, eos_token_id=None)  # (2, 24): 16 tokens the target chose
    loss_mask = torch.zeros_like(greedy, dtype=torch.bool)
    loss_mask[:, 8:] = True
    own = Batch(greedy, torch.ones_like(greedy), loss_mask, torch.arange(2))
    data_labels = LossSettings(ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)
    argmax_labels = LossSettings(ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0, ce_labels="target_argmax")
    torch.testing.assert_close(distill_step(drafter, target, own, (1, 2), 6, data_labels)[0],
                               distill_step(drafter, target, own, (1, 2), 6, argmax_labels)[0])
    other = toy_batch(batch=2)
    assert not torch.isclose(distill_step(drafter, target, other, (1, 2), 6, data_labels)[0],
                             distill_step(drafter, target, other, (1, 2), 6, argmax_labels)[0])
