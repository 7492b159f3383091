"""What the losses need from the frozen target, per sequence: the chosen layers' hidden states and the
target's next-token distribution restricted to the draft vocabulary (plus the mass outside it).

`target_signals` is the reference: one no-grad forward per batch. `SignalCache` is its optimized twin
for small data sets trained for several epochs (the CPU default): the first visit of a sequence runs
the forward, later visits read the stored tensors, so an epoch after the first costs the drafter only.
A parity test checks the two agree. It keeps float32 and stops storing at `max_bytes`.
"""

from __future__ import annotations

import torch

from specdraft.io.target import target_features


@torch.no_grad()
def target_signals(target_model, input_ids, attention_mask, feature_layers, draft_to_target):
    """features (B, T, L*H), target probabilities over the draft vocabulary (B, T, V_draft), mass outside it (B, T)."""
    features, logits = target_features(target_model, input_ids, attention_mask, feature_layers)
    draft_probs = logits.float().softmax(-1)[..., draft_to_target]  # (B, T, V_draft)
    return features, draft_probs, 1 - draft_probs.sum(-1)


def pad_rows(rows: list[tuple], batch: int, width: int) -> tuple:
    """Per-sequence (features, probs, outside) right-padded to (B, T, ...) each; padded positions carry no loss."""
    out = []
    for part in range(len(rows[0])):
        first = rows[0][part]
        padded = first.new_zeros((batch, width, *first.shape[1:]))
        for b, row in enumerate(rows):
            padded[b, : row[part].shape[0]] = row[part]
        out.append(padded)
    return tuple(out)


class SignalCache:
    """`target_signals` with per-sequence results kept in memory (keyed by the sequence's tokens)."""

    def __init__(self, max_bytes: float):
        self.max_bytes, self.bytes, self.store = max_bytes, 0, {}
        self.hits = self.misses = 0

    def __call__(self, target_model, input_ids, attention_mask, feature_layers, draft_to_target):
        lengths = attention_mask.sum(-1).tolist()
        keys = [(tuple(feature_layers), tuple(row[:n].tolist())) for row, n in zip(input_ids, lengths)]
        missing = [i for i, key in enumerate(keys) if key not in self.store]
        self.hits, self.misses = self.hits + len(keys) - len(missing), self.misses + len(missing)
        fresh = {}
        if missing:
            width = max(lengths[i] for i in missing)
            computed = target_signals(target_model, input_ids[missing, :width], attention_mask[missing, :width],
                                      feature_layers, draft_to_target)
            for j, i in enumerate(missing):
                fresh[keys[i]] = tuple(t[j, : lengths[i]] for t in computed)
        rows = [self.store.get(key) or fresh[key] for key in keys]
        for key, value in fresh.items():
            size = sum(t.numel() * t.element_size() for t in value)
            if self.bytes + size <= self.max_bytes:
                self.store[key] = tuple(t.clone() for t in value)
                self.bytes += size
        return pad_rows(rows, *input_ids.shape)
