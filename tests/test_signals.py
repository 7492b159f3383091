"""The in-memory target-signal cache is a twin of the online forward: same tensors, hits after the first visit."""

from __future__ import annotations

import torch

from tests.helpers import tiny_llama
from specdraft.train.signals import SignalCache, target_signals


def ragged_batch(rows):
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    return ids, mask


def test_cache_equals_online_forward_on_real_positions():
    target = tiny_llama(0)
    vocab = torch.arange(0, 64, 3)
    cache = SignalCache(max_bytes=1e9)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (9, 14, 5, 11)]
    for batch_rows in ([seqs[0], seqs[1]], [seqs[1], seqs[2], seqs[3]], [seqs[3], seqs[0]]):  # misses, then mixed, then hits
        ids, mask = ragged_batch(batch_rows)
        online = target_signals(target, ids, mask, (1, 2), vocab)
        cached = cache(target, ids, mask, (1, 2), vocab)
        for b, row in enumerate(batch_rows):
            n = len(row)
            for got, want in zip(cached, online):
                torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-5, atol=1e-6)
    assert (cache.misses, cache.hits) == (4, 3)
    assert online[1].shape == (2, 11, len(vocab)) and torch.all(online[2] >= -1e-6)


def test_cache_stops_storing_at_its_memory_cap():
    target = tiny_llama(0)
    vocab = torch.arange(64)
    ids, mask = ragged_batch([[1, 2, 3, 4], [5, 6, 7, 8]])
    one_row = sum(t[0].numel() * t.element_size() for t in target_signals(target, ids[:1], mask[:1], (1,), vocab))
    cache = SignalCache(max_bytes=one_row * 1.5)
    cache(target, ids, mask, (1,), vocab)
    assert len(cache.store) == 1 and cache.bytes <= cache.max_bytes
    cache(target, ids, mask, (1,), vocab)
    assert (cache.misses, cache.hits) == (3, 1)  # the row that did not fit is computed again
