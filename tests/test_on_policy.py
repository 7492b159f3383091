"""trainer.markov_inputs=sampled: the drafter's own block samples, and the target's distributions after them."""

from __future__ import annotations

import torch

from tests.helpers import tiny_llama
from tests.helpers import greedy_block_and_training_pass, make_drafter
from specdraft.train.on_policy import prefix_mask, sample_block_tokens, target_probs_after_drafts


def test_target_scores_every_drafted_prefix_as_a_plain_forward_would():
    target = tiny_llama(0)
    ids = torch.tensor([5, 9, 2, 7, 7, 1, 3, 8, 4, 6])
    anchors = torch.tensor([2, 6])
    drafted = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
    vocab = torch.arange(64)
    probs, outside = target_probs_after_drafts(target, ids, anchors, drafted, vocab)  # (N, γ, V)
    with torch.no_grad():
        for n, a in enumerate(anchors.tolist()):
            explicit = torch.cat([ids[: a + 1], drafted[n, :3]])[None]  # data prefix, then x̂_1..x̂_3
            expected = target(explicit).logits[0, a:].float().softmax(-1)  # slots 0..3
            torch.testing.assert_close(probs[n], expected, rtol=1e-4, atol=1e-5)
    assert float(outside.abs().max()) < 1e-5  # full vocabulary: nothing outside


def test_prefix_mask_sees_the_sequence_up_to_the_anchor_and_earlier_drafts():
    mask = prefix_mask(4, torch.tensor([1]), 2)  # sequence 0..3, one block at a=1 with 2 drafted tokens
    assert mask[4].tolist() == [True, True, False, False, True, False]
    assert mask[5].tolist() == [True, True, False, False, True, True]
    assert mask[3, :4].tolist() == [True, True, True, True] and not mask[3, 4:].any()


def test_sampled_blocks_follow_the_inference_markov_chain():
    """With a near-deterministic drafter, training-time sampling drafts what greedy inference drafts."""
    target, drafter = make_drafter("dspark")
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.normal_()
        drafter.lm_head.weight.mul_(1e4)
        drafter.markov_head.markov_w2.weight.mul_(1e4)
    greedy, out, first = greedy_block_and_training_pass(target, drafter)
    sampled = sample_block_tokens(drafter, out.logits, out.hidden, torch.tensor([first]), torch.Generator().manual_seed(0))
    assert sampled[0].tolist() == greedy


def test_training_on_own_samples_learns_and_resumes_identically(tmp_path):
    """The sampled mode trains (loss falls), and its samples are seeded per sample so a resumed run
    repeats the same losses."""
    import shutil

    import pytest

    from tests.helpers import run

    target = tiny_llama(0)
    _, full = run(target, tmp_path / "a", markov_inputs="sampled")
    _, teacher = run(target, tmp_path / "t")
    assert full["loss_history"][-1] < full["loss_history"][0]
    assert full["loss_history"] != pytest.approx(teacher["loss_history"])  # really another objective
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-0000006")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-0000004")
    _, resumed = run(target, tmp_path / "b", markov_inputs="sampled")
    assert resumed["loss_history"] == pytest.approx(full["loss_history"][2:], rel=1e-5)
