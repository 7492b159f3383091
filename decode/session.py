"""A causal LM over one growing sequence with a KV cache that can be rolled back exactly.

Used for the target (verify forwards) and for standalone drafters. Rolling back crops the
cache to a prefix, so rejected drafted positions leave no trace in later forwards. The forward
itself is a backend's (decode/backend.py): the HF model (the reference) or the fast twin.
"""

from __future__ import annotations

import torch

from specdraft.decode.backend import as_backend
from specdraft.decode.tree import tree_mask, tree_rows


class CausalSession:
    """Feed tokens to a causal LM incrementally; keep, and roll back, its KV cache."""

    def __init__(self, model, feature_layers: tuple[int, ...] = ()):
        """`model`: a backend (decode/backend.py) or an HF causal LM (run by the reference backend)."""
        self.backend = as_backend(model)
        self.model = self.backend.model
        self.feature_layers = tuple(feature_layers)
        self.context_window = getattr(self.model.config, "max_position_embeddings", None)
        self.reset()

    def reset(self) -> None:
        self.cache = self.backend.new_cache()
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
        logits, features = self.backend(input_ids, self.cache, logits_to_keep=1 if last_only else 0,
                                        feature_layers=self.feature_layers)
        self.length += len(token_ids)
        return logits[0], None if features is None else features[0]  # (T, V), (T, L*H)

    @torch.inference_mode()
    def forward_tree(self, pending: int, branches: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append the pending token and the drafted branches below it as a token tree (decode/tree.py: each
        branch sees the context, the pending token and its own earlier tokens); logits (T, V) and features
        (T, L*H) in tree_rows' order. `keep` then leaves the pending token and one accepted path."""
        tokens, depths = tree_rows(branches)
        width = 1 + len(tokens)
        # The deepest path is the longest sequence the step can leave (side rows share positions).
        deepest = self.length + 1 + max(depths, default=0)
        if self.context_window and deepest > self.context_window:
            raise ValueError(
                f"sequence of {deepest} tokens exceeds the model's context window "
                f"({self.context_window}); shorten the prompt or lower decode.max_new_tokens"
            )
        device = self.model.device
        input_ids = torch.tensor([[pending, *tokens]], dtype=torch.long, device=device)  # (1, T)
        position_ids = torch.tensor([[self.length + d for d in (0, *depths)]], device=device)  # (1, T)
        mask = tree_mask(branches, self.length, self.model.dtype, device)  # (1, 1, T, S + T)
        logits, features = self.backend(input_ids, self.cache, position_ids=position_ids, attention_mask=mask,
                                        feature_layers=self.feature_layers)
        self.length += width
        return logits[0], None if features is None else features[0]

    @torch.inference_mode()
    def keep(self, start: int, rows: list[int]) -> None:
        """After a forward that began at cache length `start`: keep its rows `rows` (increasing), moved to
        slots start, start + 1, ...; drop the rest (a token tree's rejected branches)."""
        fed = self.length - start
        if rows != sorted(set(rows)) or any(not 0 <= r < fed for r in rows):
            raise ValueError(f"rows {rows} are not increasing rows of the last forward (it fed {fed} tokens)")
        if rows == list(range(len(rows))):  # a prefix (the main chain's): nothing moves
            self.rollback(start + len(rows))
            return
        index = torch.tensor([start + r for r in rows], device=self.model.device)
        for layer in self.cache.layers:
            # index gathers copies first, so moving rows down over slots still to be read is safe
            layer.keys[:, :, start : start + len(rows)] = layer.keys[:, :, index]
            layer.values[:, :, start : start + len(rows)] = layer.values[:, :, index]
        self.rollback(start + len(rows))

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions of the cache."""
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative argument removes that many positions
            self.length = length
