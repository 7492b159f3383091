"""A causal LM over one growing sequence with a KV cache that can be rolled back exactly.

Used for the target (verify forwards) and for standalone drafters. Rolling back crops the
cache to a prefix, so rejected drafted positions leave no trace in later forwards.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class CausalSession:
    """Feed tokens to a causal LM incrementally; keep, and roll back, its KV cache."""

    def __init__(self, model: torch.nn.Module, feature_layers: tuple[int, ...] = ()):
        self.model = model
        self.feature_layers = tuple(feature_layers)
        self.context_window = getattr(model.config, "max_position_embeddings", None)
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append tokens; return float32 logits (T, V) (or (1, V) if last_only) and chosen-layer features."""
        if self.context_window and self.length + len(token_ids) > self.context_window:
            raise ValueError(
                f"sequence of {self.length + len(token_ids)} tokens exceeds the model's context window "
                f"({self.context_window}); shorten the prompt or lower decode.max_new_tokens"
            )
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.model.device)  # (1, T)
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=bool(self.feature_layers),
        )
        self.length += len(token_ids)
        features = None
        if self.feature_layers:
            # hidden_states[0] is the embedding output; index i is the output of decoder layer i-1,
            # except the last index, which HF returns after the final norm.
            features = torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1)  # (T, L*H)
        return out.logits[0].float(), features  # (T, V)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions of the cache."""
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative argument removes that many positions
            self.length = length
