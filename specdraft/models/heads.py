"""DSpark's heads on top of the parallel block backbone: the Markov head and the confidence head.

The backbone drafts a whole block in one pass, so its position-k logits cannot see which token was
actually drafted at k-1. The Markov head adds that back cheaply: a low-rank bias
W2(W1[x_{k-1}]) on position k's logits (W1: target vocabulary -> rank r, W2: r -> draft
vocabulary). In training the previous tokens are the ground truth (teacher forcing, one batched
call); at inference they are the tokens just sampled, one position at a time. Both paths go
through `markov_step`, so they agree by construction, and a test checks it.

Parameter names follow vLLM's `speculators` DSpark checkpoints (markov_w1, markov_w2, gate_proj,
joint_proj, proj) so an export needs no renaming.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """Low-rank bias from the previous drafted token: vanilla, hidden-gated, or recurrent over the block."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden_size: int, head_type: str = "vanilla"):
        super().__init__()
        if head_type not in MARKOV_TYPES:
            raise ValueError(f"markov_head_type={head_type!r}; choose one of {list(MARKOV_TYPES)}")
        if rank <= 0:
            raise ValueError(f"markov_rank={rank}; it must be > 0 (use drafter=dflash for no Markov head)")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            # One projection of [state; previous-token embedding; hidden] into gate, candidate, output.
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        """The recurrent state before a block's first position (rnn only)."""
        return like.new_zeros(batch, self.rank) if self.head_type == "rnn" else None

    def markov_step(self, prev_embedding: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """Bias for one position from W1[x_{k-1}] and the backbone hidden state; returns (bias, state)."""
        # prev_embedding (N, r); hidden (N, H) -> bias (N, V_draft)
        if self.head_type == "vanilla":
            return self.markov_w2(prev_embedding), state
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embedding], dim=-1)))
            return self.markov_w2(gate * prev_embedding), state
        gate, candidate, output = self.joint_proj(torch.cat([state, prev_embedding, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state

    def block_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced biases for whole blocks, given each position's previous token."""
        # prev_tokens (N, γ); hidden (N, γ, H) -> (N, γ, V_draft)
        embeddings = self.markov_w1(prev_tokens).to(hidden.dtype)  # (N, γ, r)
        if self.head_type != "rnn":
            # Positions are independent given their previous token: one batched call.
            return self.markov_step(embeddings, hidden, None)[0]
        state, biases = self.initial_state(prev_tokens.shape[0], hidden), []
        for k in range(prev_tokens.shape[1]):
            bias, state = self.markov_step(embeddings[:, k], hidden[:, k], state)
            biases.append(bias)
        return torch.stack(biases, dim=1)


class ConfidenceHead(nn.Module):
    """P(position k survives verification) = sigmoid(w . [h_k; W1[x_{k-1}]]), as a logit."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        # (..., H [+ r]) -> (...)
        return self.proj(features).squeeze(-1)
