"""Speculative decoding of a fixed list of concurrent requests on the batched engine (decode/engine.py):
requests join from a queue whenever fewer than `max_concurrency` are active (closed-loop load), and leave
when done. In float32 every request's output equals its batch-1 output (tests/test_batch.py).
"""

from __future__ import annotations

import torch

from specdraft.decode.engine import BatchEngine, LoadPolicy, Request
from specdraft.decode.generate import Generation
from specdraft.decode.proposer import NoProposer
from specdraft.decode.sampling import Sampler

__all__ = ["LoadPolicy", "Request", "batched_generate", "generate_plain"]


def batched_generate(
    model,
    requests: list[Request],
    proposer,
    sampler: Sampler,
    num_draft: int,
    eos_token_ids=(),
    scheduler=None,
    load: LoadPolicy | None = None,
    max_concurrency: int = 8,
    pad_id: int = 0,
) -> list[Generation]:
    """Generate every request (in the batch-1 loop's distribution); returns Generations in request order.

    `model`: the target's backend (decode/backend.py) or an HF causal LM. `proposer` is a template: each request
    gets `proposer.clone()`. `scheduler` is a per-request stopping rule; `load` replaces it with DSpark's
    batch-wide admission over calibrated survival."""
    engine = BatchEngine(model, proposer, sampler, num_draft, eos_token_ids, scheduler, load, max_concurrency, pad_id)
    rids = [engine.submit(request) for request in requests]
    results: dict[int, Generation] = {}
    while not engine.idle:
        for event in engine.step():
            if event.finished:
                results[event.rid] = event.result
    return [results[rid] for rid in rids]


def generate_plain(backend, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_token_ids,
                   seed: int = 0, max_concurrency: int = 16) -> list[list[int]]:
    """Target-only decoding of many prompts with continuous batching (the regeneration stage's generator):
    rows join as others finish, each sampled with its own generator (seed + index); greedy at temperature 0."""
    sampler = Sampler(temperature)
    requests = [Request(list(ids), max_new_tokens, torch.Generator(device=backend.device).manual_seed(seed + i))
                for i, ids in enumerate(prompts)]
    gens = batched_generate(backend, requests, NoProposer(), sampler, 0, eos_token_ids, max_concurrency=max_concurrency)
    return [gen.output_ids for gen in gens]
