"""Acceptance rules: greedy argmax matching and exact rejection sampling.

Both take a batch of drafted blocks and the target's scores for every drafted position plus one
(the bonus position) and return, per row, how many drafted tokens survive and the token the target
contributes after them. Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept
drafted x with probability min(1, p(x)/q(x)); at the first rejection sample from
norm(max(0, p - q)); if every drafted token survives, sample a bonus token from p. That makes
the output distributed exactly as sampling from p alone.
"""

from __future__ import annotations

import torch

from specdraft.decode.sampling import sample


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the drafted token equals the target's argmax; return (num_accepted, next_token)."""
    # draft_tokens (B, k); target_logits (B, k+1, V)
    k = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(dim=-1)  # (B, k+1)
    matches = (target_tokens[:, :k] == draft_tokens).long()  # (B, k)
    num_accepted = matches.cumprod(dim=-1).sum(dim=-1)  # (B,)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # (B,)
    return num_accepted, next_token


def one_hot_probs(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for a deterministic proposer (n-gram lookup): all mass on the drafted token."""
    return torch.nn.functional.one_hot(draft_tokens, vocab_size).float()  # (B, k, V)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise; where p == q (residual empty) fall back to p (a zero-probability event)."""
    residual = (target_probs - draft_probs).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), target_probs)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling; return (num_accepted, next_token) per row."""
    # draft_tokens (B, k); draft_probs (B, k, V) or None (deterministic); target_probs (B, k+1, V)
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = one_hot_probs(draft_tokens, vocab)
    p_drafted = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    q_drafted = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    r = torch.rand((batch, k), generator=generator, device=target_probs.device)
    # r < p/q, written without the division so q = 0 cannot produce NaN.
    accepted = (r * q_drafted < p_drafted).long()
    num_accepted = accepted.cumprod(dim=-1).sum(dim=-1)  # (B,)
    # Distribution of the token after the accepted prefix: residual at a rejection, p for the bonus.
    padded_q = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)  # (B, k+1, V)
    index = num_accepted[:, None, None].expand(batch, 1, vocab)
    p_next = target_probs.gather(1, index).squeeze(1)  # (B, V)
    q_next = padded_q.gather(1, index).squeeze(1)  # (B, V); zeros at the bonus position
    next_token = sample(residual_probs(p_next, q_next), generator)
    return num_accepted, next_token
