"""One distillation step for the block drafter, as a pure function of (drafter, target, batch).

For each sequence: one no-grad target forward gives the features of the chosen layers and the
next-token logits; anchors are sampled among positions followed by a response token (seeded per
sample, never per rank, so a 2-process run sees the same anchors as a 1-process run); every block
predicts tokens a+1 .. a+γ from the context before a. The Markov head is teacher-forced on the
true previous tokens by default, or on the drafter's own samples (train/on_policy.py).
accelerate/DeepSpeed appear only in the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.train.losses import argmax_labels, distill_loss, position_weights
from specdraft.train.on_policy import sample_block_tokens, target_probs_after_drafts
from specdraft.train.signals import target_signals
from specdraft.models.registry import kind
from specdraft.models.standalone import standalone_pieces


@dataclass
class Batch:
    """Token ids (B, T), attention mask (B, T), response mask (B, T), one anchor seed per sample (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    sample_seeds: torch.Tensor


@dataclass
class LossSettings:
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    decay: float = 4.0
    kl_weight: float = 0.0
    markov_inputs: str = "teacher"  # teacher: data tokens; sampled: the drafter's own samples (train/on_policy.py)
    ce_labels: str = "data"  # data: the data's next tokens; target_argmax: the target's most likely tokens


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, seed: int) -> torch.Tensor:
    """Up to `num_anchors` distinct anchor positions a with a response token at a+1, sorted."""
    # loss_mask (T,) bool -> (N,)
    candidates = torch.nonzero(loss_mask[1:], as_tuple=False).squeeze(-1)  # a such that loss_mask[a+1]
    generator = torch.Generator().manual_seed(int(seed))
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]]
    return chosen.sort().values


def slot_validity(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N, γ) bool: slot k of the block at a predicts a response token a+k+1 inside the sequence."""
    length = loss_mask.shape[0]
    predicted = anchors[:, None] + 1 + torch.arange(block_size, device=anchors.device)  # (N, γ)
    valid = (predicted < length) & loss_mask[predicted.clamp(max=length - 1)]
    return valid.long().cumprod(-1).bool()  # a block ends at its first invalid slot


def block_targets(input_ids, loss_mask, anchors, block_size: int):
    """Per block slot: the row of the target's prediction, its token, the Markov previous token, validity."""
    # input_ids, loss_mask (T,); anchors (N,) -> (N, γ) each
    last = input_ids.shape[0] - 1
    rows = (anchors[:, None] + torch.arange(block_size, device=anchors.device)).clamp(max=last)  # (N, γ)
    next_tokens = input_ids[(rows + 1).clamp(max=last)]
    return rows, next_tokens, input_ids[rows], slot_validity(loss_mask, anchors, block_size)


def target_to_draft_ids(draft_to_target: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Inverse vocabulary map: target id -> draft id, -1 where the draft vocabulary lacks it."""
    inverse = torch.full((target_vocab,), -1, dtype=torch.long, device=draft_to_target.device)
    inverse[draft_to_target] = torch.arange(len(draft_to_target), device=draft_to_target.device)
    return inverse


def unrolled_validity(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """(T, S) bool for Eagle-3: step s at position t predicts response token t+s+2 inside the sequence."""
    length = loss_mask.shape[0]
    positions = torch.arange(length, device=loss_mask.device)
    predicted = positions[:, None] + 2 + torch.arange(steps, device=loss_mask.device)[None, :]  # (T, S)
    valid = (predicted < length) & loss_mask[predicted.clamp(max=length - 1)]
    return valid.long().cumprod(-1).bool()


def weight_sum(batch: Batch, num_anchors: int, block_size: int, decay: float, mode: str = "dspark") -> torch.Tensor:
    """The loss normaliser of a batch: total position weight of its valid slots (a block drafter's blocks,
    Eagle-3's unrolled steps, or the positions a standalone drafter predicts)."""
    total = torch.zeros(())
    weights = position_weights(block_size, decay)
    for mask, seed in zip(batch.loss_mask.bool().cpu(), batch.sample_seeds.tolist()):  # a scalar: count on the CPU
        if kind(mode).standalone:
            total = total + mask[1:].sum() * weights[0]
            continue
        valid = unrolled_validity(mask, block_size) if kind(mode).unrolled else slot_validity(
            mask, sample_anchors(mask, num_anchors, seed), block_size)
        total = total + (valid * weights).sum()
    return total


def eagle3_pieces(drafter, features: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    """Training-time-test logits of one sequence, laid out like blocks (T, S, ...): draft logits, the
    rows of the target's predictions, tokens, validity."""
    steps, length = drafter.block_size, ids.shape[0]
    draft_logits = torch.stack(drafter.forward_ttt(features, ids, steps), dim=1)  # (T, S, V_draft)
    rows = (torch.arange(length, device=ids.device)[:, None] + 1 + torch.arange(steps, device=ids.device)[None, :])
    rows = rows.clamp(max=length - 1)  # (T, S)
    return draft_logits, rows, ids[(rows + 1).clamp(max=length - 1)], unrolled_validity(mask, steps)


def distill_step(
    drafter,
    target_model,
    batch: Batch,
    feature_layers: tuple[int, ...],
    num_anchors: int,
    settings: LossSettings = LossSettings(),
    normalizer: torch.Tensor | float | None = None,
    signals=target_signals,
) -> tuple[torch.Tensor, dict]:
    """Loss and metrics of one batch; `normalizer` is the (all-reduced) weight sum, else local.
    `signals` gives the target's features and distributions (online, or a train.signals.SignalCache)."""
    features, probs, outside = signals(target_model, batch.input_ids, batch.attention_mask, feature_layers,
                                       drafter.draft_to_target)  # (B, T, L*H), (B, T, V_draft), (B, T)
    to_draft = target_to_draft_ids(drafter.draft_to_target, drafter.embed_tokens.num_embeddings)
    pieces = []
    standalone_logits = drafter.logits(batch.input_ids, batch.attention_mask) if kind(drafter.mode).standalone else None
    for b in range(batch.input_ids.shape[0]):
        mask = batch.loss_mask[b].bool()
        if standalone_logits is not None:
            draft_logits, rows, tokens, valid = standalone_pieces(standalone_logits[b], batch.input_ids[b], mask)
            pieces.append((draft_logits, probs[b][rows], outside[b][rows], to_draft[tokens], valid, None))
            continue
        if kind(drafter.mode).unrolled:
            draft_logits, rows, tokens, valid = eagle3_pieces(
                drafter, features[b].to(drafter.fc.weight.dtype), batch.input_ids[b], mask)
            pieces.append((draft_logits, probs[b][rows], outside[b][rows], to_draft[tokens], valid, None))
            continue
        anchors = sample_anchors(mask, num_anchors, int(batch.sample_seeds[b]))
        if len(anchors) == 0:
            continue
        ids = batch.input_ids[b]
        rows, tokens, previous, valid = block_targets(ids, mask, anchors, drafter.block_size)
        context = drafter.project_context(features[b : b + 1].to(drafter.fc.weight.dtype))[0]  # (T, H)
        out = drafter.forward_packed(context, anchors, ids[anchors])
        draft_logits, confidence = out.logits, None
        slot_probs, slot_outside = probs[b][rows], outside[b][rows]
        if drafter.markov_head is not None and settings.markov_inputs == "sampled":
            generator = torch.Generator(device=ids.device).manual_seed(int(batch.sample_seeds[b]) * 7919 + 1)
            drafted = sample_block_tokens(drafter, out.logits.detach(), out.hidden.detach(), ids[anchors], generator)
            previous = torch.cat([ids[anchors][:, None], drafted[:, :-1]], dim=1)  # (N, γ): slot k follows x̂_k
            length = int(batch.attention_mask[b].sum())
            slot_probs, slot_outside = target_probs_after_drafts(target_model, ids[:length], anchors, drafted,
                                                                 drafter.draft_to_target)
            # The data's token continues the data prefix only: CE keeps slot 0 (its prefix is the data's).
            tokens = torch.where(torch.arange(tokens.shape[1], device=ids.device) == 0, tokens,
                                 torch.full_like(tokens, -1))
        if drafter.markov_head is not None:
            draft_logits = draft_logits + drafter.markov_head.block_bias(previous, out.hidden)
            embedding = drafter.markov_head.markov_w1(previous).to(out.hidden.dtype)
            confidence = drafter.confidence_head(torch.cat([out.hidden, embedding], dim=-1))
        draft_tokens = torch.where(tokens >= 0, to_draft[tokens.clamp_min(0)], tokens)
        pieces.append((draft_logits, slot_probs, slot_outside, draft_tokens, valid, confidence))
    if not pieces:
        raise ValueError("no sample in this batch has a response token to predict; check the loss masks")
    cat = lambda i: None if pieces[0][i] is None else torch.cat([p[i] for p in pieces])  # noqa: E731
    outside = cat(2).clamp_min(0)  # (fp rounding can leave it slightly negative)
    labels = cat(3) if settings.ce_labels == "data" else argmax_labels(cat(1), outside)
    return distill_loss(
        cat(0), cat(1), labels, cat(4), cat(5),
        ce_weight=settings.ce_weight, l1_weight=settings.l1_weight,
        confidence_weight=settings.confidence_weight, decay=settings.decay, normalizer=normalizer,
        kl_weight=settings.kl_weight,
        target_outside_mass=outside,
    )
