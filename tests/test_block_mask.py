"""The block attention mask: context strictly before the anchor, the whole own block, nothing else."""

from __future__ import annotations

import torch

from specdraft.models.block_mask import block_attention_mask, block_positions


def reference_mask(anchors: list[int], context_length: int, block_size: int) -> torch.Tensor:
    """Plain loops over every (query, key) pair."""
    n = len(anchors)
    mask = torch.zeros(n * block_size, context_length + n * block_size, dtype=torch.bool)
    for b, anchor in enumerate(anchors):
        for slot in range(block_size):
            query = b * block_size + slot
            for j in range(context_length):
                mask[query, j] = j < anchor
            for other in range(block_size):
                mask[query, context_length + b * block_size + other] = True
    return mask


def test_mask_equals_reference():
    anchors = [0, 3, 9, 4]
    got = block_attention_mask(torch.tensor(anchors), 12, 5)
    assert torch.equal(got, reference_mask(anchors, 12, 5))


def test_anchor_row_properties():
    mask = block_attention_mask(torch.tensor([6]), 10, 4)
    assert mask[:, :6].all() and not mask[:, 6:10].any()  # context strictly before the anchor
    assert mask[:, 10:].all()  # the block sees itself bidirectionally, anchor slot included


def test_block_positions():
    assert block_positions(torch.tensor([2, 7]), 3).tolist() == [2, 3, 4, 7, 8, 9]
