"""Distillation losses as plain functions (DSpark's recipe; DFlash is the CE-only setting).

Per drafted position k of a block (k = 0 is the anchor slot):
  CE_k   = -log p_draft(target token)                     (weight `ce_weight`, default 0.1)
  L1_k   = || p_draft - p_target ||_1                      (weight `l1_weight`, default 0.9)
  BCE_k  = BCE(sigmoid(confidence_k), 1 - L1_k / 2)        (weight `confidence_weight`, default 1.0)
  KL_k   = KL(p_target || p_draft) over the draft vocabulary (weight `kl_weight`, default 0: an option;
           its gradient does not vanish where the draft is far from the target, unlike L1's)
Each position is weighted by exp(-k / decay): early positions matter most because a block is only
as long as its first rejection. The sum is normalised by the total position weight, which the
caller passes in already all-reduced across ranks so every rank divides by the same number.
1 - L1_k / 2 = sum_x min(p, q) is the exact chance that rejection sampling accepts position k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def position_weights(block_size: int, decay: float = 4.0) -> torch.Tensor:
    """exp(-k / decay) for slots k = 0 .. block_size - 1."""
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)  # (γ,)


def acceptance_rates(draft_logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """alpha = 1 - ||p_draft - p_target||_1 / 2 per position."""
    # (N, γ, V) -> (N, γ)
    return 1 - 0.5 * (draft_logits.float().softmax(-1) - target_probs.float()).abs().sum(-1)


def expected_tau(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over blocks of 1 + sum_k prod_{i<=k} alpha_i (invalid positions end the block)."""
    # alpha, valid: (N, γ) -> scalar
    survival = torch.cumprod(alpha * valid, dim=-1)  # (N, γ)
    return (1 + survival.sum(-1)).mean()


def argmax_labels(target_probs: torch.Tensor, target_outside_mass: torch.Tensor | None = None) -> torch.Tensor:
    """The target's most likely token per position (draft ids), -1 where it lies outside the draft vocabulary.

    CE labels for data the target did not write: a ShareGPT response's next token is another model's
    choice, while greedy verification accepts exactly the target's argmax."""
    # target_probs (N, γ, V_draft), target_outside_mass (N, γ) -> (N, γ)
    top = target_probs.max(-1)
    if target_outside_mass is None:
        return top.indices
    return torch.where(top.values > target_outside_mass, top.indices, torch.full_like(top.indices, -1))


def distill_loss(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    target_tokens: torch.Tensor,
    valid: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    ce_weight: float = 0.1,
    l1_weight: float = 0.9,
    confidence_weight: float = 1.0,
    decay: float = 4.0,
    normalizer: float | torch.Tensor | None = None,
    target_outside_mass: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """Weighted CE + L1 (+ confidence BCE) over drafted positions; returns (loss, metrics).

    With a reduced draft vocabulary, `target_probs` are the target's probabilities of the draft
    vocabulary's tokens and `target_outside_mass` (N, γ) the target mass on all other tokens: the
    drafter can never propose those, so that mass adds to the L1 distance; a target token outside
    the draft vocabulary is given as -1 and has no CE term.
    """
    # draft_logits (N, γ, V); target_probs (N, γ, V); target_tokens (N, γ); valid (N, γ) bool;
    # confidence_logits (N, γ) or None.
    valid = valid.float()
    weights = position_weights(draft_logits.shape[1], decay).to(draft_logits.device) * valid  # (N, γ)
    total_weight = weights.sum() if normalizer is None else normalizer
    log_q = draft_logits.float().log_softmax(-1)  # (N, γ, V)
    ce = -log_q.gather(-1, target_tokens[..., None].clamp_min(0)).squeeze(-1) * (target_tokens >= 0)  # (N, γ)
    l1 = (log_q.exp() - target_probs.float()).abs().sum(-1)  # (N, γ)
    if target_outside_mass is not None:
        l1 = l1 + target_outside_mass.float()
    alpha = (1 - 0.5 * l1).detach()
    per_position = ce_weight * ce + l1_weight * l1
    if kl_weight:
        # Σ_x p log p − Σ_x p log q over the draft vocabulary (mass outside it cannot be matched).
        p = target_probs.float()
        kl = (torch.xlogy(p, p) - p * log_q).sum(-1)  # (N, γ)
        per_position = per_position + kl_weight * kl
    metrics = {}
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), alpha.clamp(0, 1), reduction="none")
        per_position = per_position + confidence_weight * bce
        metrics["confidence_bce"] = float((bce.detach() * weights).sum() / weights.sum().clamp_min(1e-12))
    loss = (per_position * weights).sum() / total_weight
    greedy_match = (log_q.argmax(-1) == target_probs.argmax(-1)).float()  # (N, γ)
    if target_outside_mass is not None:  # the target's argmax may lie outside the draft vocabulary
        greedy_match = greedy_match * (target_probs.max(-1).values > target_outside_mass).float()
    with torch.no_grad():
        metrics.update(
            ce=float((ce.detach() * weights).sum() / weights.sum().clamp_min(1e-12)),
            l1=float((l1.detach() * weights).sum() / weights.sum().clamp_min(1e-12)),
            tau_estimate=float(expected_tau(alpha, valid)),
            tau_greedy=float(expected_tau(greedy_match, valid)),
            alpha_by_position=((alpha * valid).sum(0) / valid.sum(0).clamp_min(1)).tolist(),
        )
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"distillation loss is {value}; metrics: {metrics}")
    return loss, metrics
