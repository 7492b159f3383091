"""The target over R concurrent sequences in one KV cache, with ragged lengths and per-row rollback.

Rows share physical cache slots: every forward appends L slots to all rows (L = the longest row's
input; shorter rows are padded). A per-row `valid` mask says which slots hold that row's tokens;
rejected drafted positions and padding simply become invalid, and a 4D attention mask hides them,
so rolling back one row never touches another. RoPE positions are each row's logical positions
(its count of valid slots), so a row attends exactly as it would alone. Slots past every row's last
valid one are cropped at once, and rows left alike by leavers are compacted, so one request has no
hole: its steps attend over no dead slots and need no 4D mask. Other holes are squeezed out
(`compact`) when they outnumber the longest row. Requests join (prefilled alone, then merged) and
leave (their row dropped) between steps.
"""

from __future__ import annotations

import torch

from specdraft.decode.backend import as_backend


class BatchedSession:
    """Append ragged rows of tokens to R sequences; keep a prefix of each row's new slots."""

    def __init__(self, model, feature_layers: tuple[int, ...] = (), pad_id: int = 0):
        """`model`: a backend (decode/backend.py) or an HF causal LM (run by the reference backend)."""
        self.backend = as_backend(model)
        model = self.backend.model
        config = model.config
        attention = getattr(config, "_attn_implementation", None)
        if attention not in (None, "eager", "sdpa"):
            raise ValueError(f"batched decoding passes 4D attention masks, which attn_implementation={attention!r} "
                             "does not take; load the target with attn_implementation='sdpa' or 'eager'")
        if getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("batched decoding does not support sliding-window attention (its cache trims slots the "
                             "row masks index); decode such targets one request at a time")
        self.model, self.feature_layers, self.pad_id = model, tuple(feature_layers), pad_id
        self.context_window = getattr(model.config, "max_position_embeddings", None)
        self.cache = None  # the backend's cache over every row
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=model.device)  # (R, S)
        self.lengths: list[int] = []  # logical length (valid slots) per row
        self._pending: list[int] | None = None  # input lengths of the last forward, until `keep`

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @torch.inference_mode()
    def add(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill a new row alone (exactly as batch 1), then merge it in as the last row.
        Returns float32 logits of its last position (1, V) and its features (T, L*H)."""
        if self.context_window and len(token_ids) > self.context_window:
            raise ValueError(f"prompt of {len(token_ids)} tokens exceeds the model's context window ({self.context_window})")
        cache = self.backend.new_cache()
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.model.device)
        logits, features = self.backend(input_ids, cache, logits_to_keep=1, feature_layers=self.feature_layers)
        self.add_cache(cache, len(token_ids))
        return logits[0], None if features is None else features[0]

    @torch.inference_mode()
    def add_cache(self, cache, length: int) -> None:
        """Merge a batch-1 cache of `length` positions in as the last row."""
        if self.cache is None or self.rows == 0:
            self.cache = cache
            self.valid = torch.ones((1, length), dtype=torch.bool, device=self.model.device)
            self.lengths = [length]
            return
        slots = max(self.valid.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_slots(mine.keys, slots), _pad_slots(theirs.keys, slots)], dim=0)
            mine.values = torch.cat([_pad_slots(mine.values, slots), _pad_slots(theirs.values, slots)], dim=0)
        new_valid = torch.zeros((1, slots), dtype=torch.bool, device=self.valid.device)
        new_valid[0, :length] = True
        self.valid = torch.cat([_pad_valid(self.valid, slots), new_valid], dim=0)
        self.lengths.append(length)

    @torch.inference_mode()
    def remove(self, rows: list[int]) -> None:
        """Drop finished rows (indices into the current rows)."""
        keep = [r for r in range(self.rows) if r not in set(rows)]
        index = torch.tensor(keep, dtype=torch.long, device=self.valid.device)
        if self.cache is not None:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid = self.valid[index]
        self.lengths = [self.lengths[r] for r in keep]
        if not keep:
            self.cache, self.valid = None, torch.zeros((0, 0), dtype=torch.bool, device=self.valid.device)
        elif len(set(self.lengths)) == 1 and not self._no_holes():
            # The rows left are alike but hold the leavers' slots as holes: squeeze them out once, so
            # the steps that follow (a lone last request, typically) run without a 4D mask.
            self.compact()
        else:
            self._crop_tail()

    @torch.inference_mode()
    def forward(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append rows[r] to sequence r (every row non-empty); float32 logits (R, L, V) and features
        (R, L, L*H), where positions past a row's own length are padding to ignore."""
        if len(rows) != self.rows or any(not row for row in rows):
            raise ValueError(f"forward needs one non-empty token list per active row ({self.rows})")
        width = max(len(row) for row in rows)
        for r, row in enumerate(rows):
            if self.context_window and self.lengths[r] + len(row) > self.context_window:
                raise ValueError(f"row {r} would reach {self.lengths[r] + len(row)} tokens, past the context window "
                                 f"({self.context_window}); lower decode.max_new_tokens")
        device = self.model.device
        input_ids = torch.tensor([row + [self.pad_id] * (width - len(row)) for row in rows], device=device)  # (R, L)
        # Logical positions continue each row; padding repeats the row's last position, so no row ever
        # shows a position past its own (RoPE variants that scale with the largest position stay per row).
        lengths = torch.tensor([len(row) for row in rows], device=device)
        steps = torch.minimum(torch.arange(width, device=device)[None, :], lengths[:, None] - 1)
        position_ids = torch.tensor(self.lengths, device=device)[:, None] + steps  # (R, L)
        new_valid = torch.arange(width, device=device)[None, :] < lengths[:, None]  # (R, L)
        # Every slot valid and rows alike: the model's own causal mask is the same mask, built cheaper
        # (one request always runs so; the parity test compares the two).
        mask = None if self._plain(rows) else row_mask(self.valid, new_valid, self.model.dtype)
        logits, features = self.backend(input_ids, self.cache, position_ids=position_ids, attention_mask=mask,
                                        feature_layers=self.feature_layers)
        self.valid = torch.cat([self.valid, torch.zeros_like(new_valid)], dim=1)
        self._pending = [len(row) for row in rows]
        return logits, features

    def _no_holes(self) -> bool:
        """Every slot valid in every row (a row's length counts its valid slots; no device sync)."""
        return all(length == self.valid.shape[1] for length in self.lengths)

    def _plain(self, rows: list[list[int]]) -> bool:
        """Whether this step's 4D mask is the plain causal one: no hole in any row's history, no padding."""
        return self._no_holes() and len({len(row) for row in rows}) == 1

    @torch.inference_mode()
    def keep(self, counts: list[int]) -> None:
        """Of the last forward's new slots, row r keeps its first counts[r] (the rest are rolled back)."""
        if self._pending is None:
            raise RuntimeError("keep() follows a forward()")
        width = max(self._pending)
        start = self.valid.shape[1] - width
        for r, count in enumerate(counts):
            if not 0 <= count <= self._pending[r]:
                raise ValueError(f"row {r} fed {self._pending[r]} tokens; cannot keep {count}")
            self.valid[r, start : start + count] = True
            self.lengths[r] += count
        self._pending = None
        self._crop_tail()
        if self.valid.shape[1] > 2 * max(self.lengths) + 64:
            self.compact()

    def _crop_tail(self) -> None:
        """Drop the slots after every row's last valid one: rejected drafts and padding at the end cost
        every later step attention over dead slots, and for one row they are the only holes there are."""
        used = self.valid.any(dim=0).nonzero()
        slots = int(used[-1]) + 1 if len(used) else 0
        if slots < self.valid.shape[1]:
            self.cache.crop(slots - self.valid.shape[1])  # a negative argument removes that many slots
            self.valid = self.valid[:, :slots]

    @torch.inference_mode()
    def compact(self) -> None:
        """Move each row's valid slots to the front (order kept) and drop the slots no row uses."""
        slots = max(self.lengths)
        # For each row: its valid slot indices, padded with 0 (masked anyway).
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :slots]  # (R, slots)
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.valid = torch.arange(slots, device=self.valid.device)[None, :] < torch.tensor(self.lengths, device=self.valid.device)[:, None]


def row_mask(valid: torch.Tensor, new_valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4D mask of a step: query i of row r sees row r's valid history slots `valid` (R, S)
    and its own new slots up to i that are not padding (`new_valid`, (R, L)). Returns (R, 1, L, S + L)."""
    width = new_valid.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool, device=valid.device).tril()  # (L, L)
    visible = torch.cat(
        [valid[:, None, :].expand(-1, width, -1), causal[None] & new_valid[:, None, :]], dim=2
    )  # (R, L, S + L)
    # A padding query may see nothing valid among the new slots; it still sees the row's history,
    # so no row of the mask is empty (an all-masked softmax row would be NaN).
    mask = torch.zeros(visible.shape, dtype=dtype, device=valid.device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def _pad_slots(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, heads, S, D) -> (B, heads, slots, D) with zero slots appended."""
    extra = slots - tensor.shape[2]
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], tensor.shape[1], extra, tensor.shape[3])], dim=2)


def _pad_valid(valid: torch.Tensor, slots: int) -> torch.Tensor:
    extra = slots - valid.shape[1]
    return valid if extra == 0 else torch.cat([valid, valid.new_zeros(valid.shape[0], extra)], dim=1)
