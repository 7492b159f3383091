"""Speculative decoding of R concurrent requests: one target forward per step for all of them.

Each request keeps what the batch-1 loop (decode/generate.py) keeps: its own context, its own
proposer (a clone sharing the drafter's weights, so the drafter's KV rollback is per request), its
own random generator, its own stop conditions. Per step every active request drafts (block drafters
all in one backbone pass, decode/batch_draft.py), a scheduler
picks each request's verify length, the target verifies all rows in one ragged forward
(decode/batch_session.py), and each row is accepted and rolled back on its own. Requests join from
a queue whenever fewer than `max_concurrency` are active (closed-loop load), and leave when done.
Per request the random draws happen in the same order as in the batch-1 loop, so in float32 every
request's output equals its batch-1 output (tests/test_batch.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdraft.decode.batch_draft import can_batch, propose_blocks
from specdraft.decode.batch_session import BatchedSession
from specdraft.decode.generate import Generation, _greedy_step, _pick, _sampling_step, draft, record_step
from specdraft.decode.proposer import NoProposer, Proposal
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import (FixedRule, at, backoff_count, break_even, can_pay, cut, load_admits_any, load_pays, load_schedule, make_backoff,
                              worth_drafting)


@dataclass
class Request:
    """One generation request: prompt, length limit and its own random stream."""

    prompt_ids: list[int]
    max_new_tokens: int
    generator: torch.Generator | None = None


@dataclass
class _Active:
    index: int
    request: Request
    proposer: object
    context: list[int]
    result: Generation
    start: float
    proposal: Proposal | None = None
    done: bool = False
    backoff: object = None


@dataclass
class LoadPolicy:
    """scheduler=load: the measured cost profile (each request offers its whole drafted block)."""

    profile: object
    rule: object = None  # the LoadRule (its max_skip drives the batch-wide backoff), None: no backoff
    # Stop a step after c_1 when admission would take nothing (_load_gate); False drafts whole blocks and
    # lets admission cut them (the reference twin: same admitted positions, more drafting).
    lazy: bool = True
    admitted: list[int] = field(default_factory=list)  # per step: verify positions admitted, for reports

    def verify_s(self, rows: int, length: int) -> float:
        """The batched engine's verify-step seconds for its padded (rows, length) shape."""
        return self.profile.verify_s(rows, length, "batched")


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

    `model`: the target's backend (decode/backend.py) or an HF causal LM. `proposer` is a template: each request gets `proposer.clone()`. `scheduler` is a per-request stopping
    rule; `load` replaces it with DSpark's batch-wide admission over calibrated survival."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}; it must be >= 1")
    if num_draft < 0 or (proposer.max_draft is not None and num_draft > proposer.max_draft):
        raise ValueError(f"decode.num_draft={num_draft} but this proposer drafts at most {proposer.max_draft} tokens")
    for request in requests:
        if request.max_new_tokens < 1 or not request.prompt_ids:
            raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
    eos = set(eos_token_ids)
    rule = scheduler or FixedRule()
    accept_fn = _greedy_step if sampler.greedy else _sampling_step
    session = BatchedSession(model, proposer.feature_layers, pad_id)
    results: list[Generation | None] = [None] * len(requests)
    queue = list(enumerate(requests))
    active: list[_Active] = []
    # scheduler=load admits batch-wide, so it backs off batch-wide too: after a step that admitted nothing,
    # nobody drafts for 1, 2, 4, ... steps, and requests that join inherit that state. Per-request
    # backoffs would probe out of phase, so under load nearly every step would pay a batched probe.
    engine_backoff = make_backoff(load.rule, proposer) if load is not None else None

    while queue or active:
        while queue and len(active) < max_concurrency:  # join: prefill alone, merge as the last row
            index, request = queue.pop(0)
            started = time.perf_counter()
            logits, features = session.add(list(request.prompt_ids))
            first = _pick(sampler, logits[-1:], request.generator)
            item = _Active(index, request, proposer.clone(), list(request.prompt_ids) + [first],
                           Generation(output_ids=[first]), started)
            item.result.ttft_s = time.perf_counter() - started
            item.proposer.start(list(item.context), features)
            item.backoff = make_backoff(rule, proposer) if load is None else None
            item.done = first in eos or request.max_new_tokens == 1
            active.append(item)
        finished = [i for i, item in enumerate(active) if item.done]
        if finished:
            _leave(session, active, finished, results)
            continue

        drafting, limits = _drafting(active, num_draft, rule, load, engine_backoff)
        # scheduler=load admits batch-wide below; its gate ends the step after c_1 when nothing would be admitted.
        gate = _load_gate(load, limits) if load is not None and load.lazy else None
        _draft_all(drafting, limits, sampler, None if load else rule, gate)
        if load is not None:
            admitted = _admit(active, load)
            if engine_backoff is not None and any(limits):
                engine_backoff.observe(admitted)
        for item, limit in zip(drafting, limits):
            if item.backoff is not None and limit > 0:
                item.backoff.observe(backoff_count(at(rule, len(item.context)), item.proposal))

        rows = [[item.context[-1]] + item.proposal.tokens for item in active]
        logits, features = session.forward(rows)  # (R, L, V)
        counts = []
        for r, item in enumerate(active):  # accept row by row with each request's own generator
            k = len(item.proposal.tokens)
            accepted, next_token = accept_fn(item.proposal, logits[r, : k + 1], sampler, item.request.generator)
            counts.append(1 + accepted)
            if item.backoff is not None and k:  # as the batch-1 loop: the step's record, about later steps
                item.backoff.settle(1 + accepted, break_even(at(rule, len(item.context)), k))
            room = item.request.max_new_tokens - len(item.result.output_ids)
            at_eos = record_step(item.result, item.context, item.proposal, accepted, next_token, eos, room)
            item.done = at_eos or len(item.result.output_ids) >= item.request.max_new_tokens
            if not item.done:
                item.proposer.commit(item.context, None if features is None else features[r, : 1 + accepted])
        session.keep(counts)
        finished = [i for i, item in enumerate(active) if item.done]
        if finished:
            _leave(session, active, finished, results)
    return results


def _drafting(active: list[_Active], num_draft: int, rule, load: LoadPolicy | None, engine_backoff) -> tuple[list, list]:
    """The requests that draft this step and at most how many positions each; the others decode plainly.
    Decided from finished steps, shapes and the profile only, before anything of this step is drafted."""
    for item in active:
        item.proposal = Proposal([])  # plain decoding for this request this step, unless it drafts
    room = [min(num_draft, item.request.max_new_tokens - len(item.result.output_ids) - 1) for item in active]
    if load is not None:
        if engine_backoff is not None and engine_backoff.should_skip():
            return [], []
        # No admission could pay at this load (a compute-bound batch): nobody drafts this step.
        return (list(active), room) if _load_can_pay(load, len(active), room) else ([], [])
    drafting, limits = [], []
    for item, limit in zip(active, room):
        if item.backoff is not None and item.backoff.should_skip():
            continue
        if limit > 0 and not worth_drafting(at(rule, len(item.context)), limit, item.proposer):
            continue
        drafting.append(item)
        limits.append(limit)
    return drafting, limits


def _draft_all(items: list[_Active], limits: list[int], sampler: Sampler, rule, gate=None) -> None:
    """Each drafting request's proposal: block drafters in one batched backbone pass, others one by one
    (`gate`: see propose_blocks; drafters that cannot batch draw whole blocks and leave the cut to admission)."""
    if can_batch([item.proposer for item in items]):
        rules = [at(rule, len(item.context)) for item in items]  # each request's step at its own context
        proposals = propose_blocks([item.proposer for item in items], [item.context for item in items], limits, sampler,
                                   [item.request.generator for item in items], rules, gate)
        for item, proposal, own in zip(items, proposals, rules):
            item.proposal = proposal if own is None else proposal.truncate(cut(proposal, own))
        return
    for item, limit in zip(items, limits):
        item.proposal = draft(item.proposer, item.context, limit, sampler, item.request.generator, at(rule, len(item.context)))


def _leave(session: BatchedSession, active: list[_Active], finished: list[int], results: list) -> None:
    now = time.perf_counter()
    for i in finished:
        active[i].result.total_s = now - active[i].start
        results[active[i].index] = active[i].result
    session.remove(finished)
    active[:] = [item for i, item in enumerate(active) if i not in set(finished)]


def _load_can_pay(load: LoadPolicy, rows: int, limits: list[int]) -> bool:
    """Whether any admission could beat plain decoding on this step's shape (DSpark's Θ with every drafted
    position sure to survive); on a compute-bound batch it cannot, and probing would only cost time."""
    lengths = [limit for limit in limits if limit > 0]
    if not lengths:
        return True  # nothing would be drafted anyway
    draft_s = load.profile.draft_rows_s(lengths)  # whole blocks, one pass
    return can_pay(rows, len(lengths), max(lengths), lambda length: draft_s, load.verify_s)


def _load_gate(load: LoadPolicy, limits: list[int]):
    """scheduler=load's gate for propose_blocks: whether admission would take any pair, asked with c_1 alone.
    It prices the step as `_admit` does (the whole blocks' drafting), so it answers exactly what `_admit` would
    decide first (load_admits_any): a step that admits nothing stops after the backbone pass instead of
    drawing whole blocks only to cut them to nothing. Under load every active request drafts, or none does
    (`_drafting`), so the gate sees every row of the step. The reference twin is LoadPolicy(lazy=False)."""
    draft_s = load.profile.draft_rows_s([limit for limit in limits if limit > 0])
    return lambda first: load_admits_any(first, draft_s, load.verify_s)


def _admit(active: list[_Active], load: LoadPolicy) -> int:
    """DSpark's load-aware admission: cut each request's block to its admitted length. Returns what the
    batch-wide backoff is told: the positions admitted, or 0 when they did not pay for the drafting."""
    survival = []
    for item in active:
        if item.proposal.tokens and item.proposal.confidence is None:
            raise ValueError("scheduler=load needs a proposer with a confidence head (proposer=drafter, dspark export)")
        values = [] if item.proposal.confidence is None else item.proposal.confidence.float().cumprod(0).tolist()
        survival.append(values)
    if not any(survival):  # nothing drafted (the gate ended the step after c_1, or no request drafted)
        load.admitted.append(0)
        return 0
    draft_s = load.profile.draft_rows_s([len(values) for values in survival if values])  # already spent when admission runs
    lengths = load_schedule(survival, draft_s, load.verify_s)
    for item, length in zip(active, lengths):
        item.proposal = item.proposal.truncate(length)
    load.admitted.append(sum(lengths))
    return sum(lengths) if load_pays(survival, lengths, draft_s, load.verify_s) else 0


def generate_plain(backend, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos_token_ids,
                   seed: int = 0, max_concurrency: int = 16) -> list[list[int]]:
    """Target-only decoding of many prompts with continuous batching (the regeneration stage's generator):
    rows join as others finish, each sampled with its own generator (seed + index); greedy at temperature 0."""
    sampler = Sampler(temperature)
    requests = [Request(list(ids), max_new_tokens, torch.Generator(device=backend.device).manual_seed(seed + i))
                for i, ids in enumerate(prompts)]
    gens = batched_generate(backend, requests, NoProposer(), sampler, 0, eos_token_ids, max_concurrency=max_concurrency)
    return [gen.output_ids for gen in gens]
