"""Training the Markov and confidence heads on the drafter's own samples (`trainer.markov_inputs=sampled`).

DeepSpec teacher-forces the heads: slot k's previous token is the data's token x_{a+k}, and its target
distribution is the target's p(· | data prefix). At inference the previous token is the drafter's own
sample x̂_{a+k}; when sampling (T > 0) an accepted x̂ often differs from the data's token, so the heads
meet prefixes they were never trained on. Here each block's tokens are drawn left to right from the
drafter's own Markov-biased distribution (no gradient), and the target scores those prefixes: one extra
target forward per sequence over the sequence plus every block's drafted tokens, each drafted token
seeing the sequence up to its anchor and its own block's earlier drafts (a 4D mask; RoPE positions
a+1, a+2, ...). Slot 0's previous token is the anchor itself, identical in both modes.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def sample_block_tokens(drafter, logits: torch.Tensor, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
                        generator: torch.Generator) -> torch.Tensor:
    """Draft every block left to right at T=1 as inference does; returns target ids (N, γ)."""
    # logits (N, γ, V_draft) backbone logits; hidden (N, γ, H); anchor_tokens (N,)
    heads = drafter.markov_head
    state = heads.initial_state(logits.shape[0], hidden[:, 0])
    previous, drafted = anchor_tokens, []
    for k in range(logits.shape[1]):
        bias, state = heads.markov_step(heads.markov_w1(previous).to(hidden.dtype), hidden[:, k], state)
        probs = (logits[:, k] + bias).float().softmax(-1)  # (N, V_draft)
        token = drafter.draft_to_target[torch.multinomial(probs, 1, generator=generator).squeeze(-1)]
        drafted.append(token)
        previous = token
    return torch.stack(drafted, dim=1)  # (N, γ)


def prefix_mask(length: int, anchors: torch.Tensor, extra: int) -> torch.Tensor:
    """Boolean (T + N*e, T + N*e): the sequence is causal; drafted token i of the block at a sees the
    sequence up to a and its block's drafted tokens up to itself."""
    device = anchors.device
    blocks = anchors.shape[0]
    total = length + blocks * extra
    mask = torch.zeros((total, total), dtype=torch.bool, device=device)
    mask[:length, :length] = torch.ones((length, length), dtype=torch.bool, device=device).tril()
    block_of = torch.arange(blocks * extra, device=device) // extra  # (N*e,)
    mask[length:, :length] = torch.arange(length, device=device)[None, :] <= anchors[block_of][:, None]
    within = torch.arange(blocks * extra, device=device) % extra
    same = block_of[:, None] == block_of[None, :]
    mask[length:, length:] = same & (within[None, :] <= within[:, None])
    return mask


@torch.no_grad()
def target_probs_after_drafts(target_model, ids: torch.Tensor, anchors: torch.Tensor, drafted: torch.Tensor,
                              draft_to_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution (over the draft vocabulary) and mass outside it for every block slot,
    given the drafted prefix: slot 0 from the data prefix up to the anchor, slot k from x̂_1..x̂_k."""
    # ids (T,) the sequence; anchors (N,); drafted (N, γ) -> (N, γ, V_draft), (N, γ)
    length, (blocks, gamma) = ids.shape[0], drafted.shape
    extra = gamma - 1
    feed = torch.cat([ids, drafted[:, :extra].reshape(-1)])[None]  # (1, T + N*(γ-1))
    positions = torch.cat([torch.arange(length, device=ids.device),
                           (anchors[:, None] + 1 + torch.arange(extra, device=ids.device)).reshape(-1)])[None]
    dtype = target_model.dtype
    visible = prefix_mask(length, anchors, extra)
    mask = torch.zeros(visible.shape, dtype=dtype, device=ids.device).masked_fill(~visible, torch.finfo(dtype).min)
    logits = target_model(input_ids=feed, attention_mask=mask[None, None], position_ids=positions,
                          use_cache=False).logits[0].float()
    probs = logits.softmax(-1)[:, draft_to_target]  # (T + N*(γ-1), V_draft)
    first = probs[anchors][:, None]  # (N, 1, V): slot 0 predicts after the anchor
    rest = probs[length:].reshape(blocks, extra, -1)  # (N, γ-1, V)
    slot_probs = torch.cat([first, rest], dim=1)
    return slot_probs, (1 - slot_probs.sum(-1)).clamp_min(0)
