"""The attention pattern of the parallel block drafter (DFlash / DSpark).

Training packs many blocks per sequence. The keys are the sequence's T context positions (the
projected target features) followed by every block's γ slots. A block anchored at position a
(its first slot holds the token x_a, the rest mask tokens) sees the context strictly before a
(the target features exist only for tokens the target has already processed) and its own γ slots
in both directions, and nothing of other blocks.
"""

from __future__ import annotations

import torch


def block_attention_mask(anchors: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """Boolean (N*γ, T + N*γ) mask, True where a block slot may attend, for anchors (N,)."""
    num_blocks = anchors.shape[0]
    slots = num_blocks * block_size
    block_of_query = torch.arange(slots, device=anchors.device) // block_size  # (N*γ,)
    # Context keys: position j is visible to a query of a block anchored at a iff j < a.
    context = torch.arange(context_length, device=anchors.device)[None, :] < anchors[block_of_query][:, None]
    # Block keys: visible iff they belong to the query's own block.
    own_block = block_of_query[:, None] == block_of_query[None, :]  # (N*γ, N*γ)
    return torch.cat([context, own_block], dim=1)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rotary positions of the block slots: anchor a's slots sit at a, a+1, ..., a+γ-1."""
    # (N,) -> (N*γ,)
    return (anchors[:, None] + torch.arange(block_size, device=anchors.device)[None, :]).reshape(-1)
