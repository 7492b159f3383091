"""Sampling settings with Hugging Face's own semantics.

Temperature, top-k and top-p are applied with transformers' logits warpers, in the order
`generate` applies them, to float32 logits (as `generate` does). Applying the same warpers to the
target's p and the drafter's q is what makes "same distribution as target-only decoding" mean
"same distribution as `model.generate(do_sample=True, ...)` with these settings".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class Sampler:
    """Decoding settings; temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"decode.temperature={self.temperature} is negative; use 0 for greedy or a value > 0 to sample")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decode.top_p={self.top_p} is outside (0, 1]; use 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise ValueError(f"decode.top_k={self.top_k} is negative; use 0 to disable top-k")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped float32 scores (-inf where filtered), row-wise over a (..., V) tensor."""
        scores = logits.float().reshape(-1, logits.shape[-1])  # (N, V)
        # HF's warpers ignore input_ids; they are passed only to satisfy the signature.
        no_ids = scores.new_empty((scores.shape[0], 0), dtype=torch.long)
        if self.temperature not in (0.0, 1.0):
            scores = TemperatureLogitsWarper(self.temperature)(no_ids, scores)
        if self.top_k:
            scores = TopKLogitsWarper(top_k=self.top_k)(no_ids, scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(top_p=self.top_p)(no_ids, scores)
        return scores.reshape(logits.shape)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution over the vocabulary, float32, row-wise."""
        return torch.softmax(self.warp(logits), dim=-1)

    def hf_generate_kwargs(self) -> dict:
        """The `generate` arguments that select exactly this distribution.

        Every field is explicit: `generate` fills a None field from the model's generation config
        or its global defaults (top_k=50), which would sample from another distribution.
        """
        if self.greedy:
            return {"do_sample": False}  # no warper runs without sampling; explicit values would only warn
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of a (N, V) distribution."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
