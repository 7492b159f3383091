"""The batched speculative engine: R concurrent requests, one target forward per step for all of them.

Each request keeps what the batch-1 loop (decode/generate.py) keeps: its own context, its own
proposer (a clone sharing the drafter's weights, so the drafter's KV rollback is per request), its
own random generator, sampler and stop conditions. Per step every active request drafts (block
drafters all in one backbone pass, decode/batch_draft.py), a scheduler picks each request's verify
length, the target verifies all rows in one ragged forward (decode/batch_session.py), and each row is
accepted and rolled back on its own. Requests join from the queue between steps whenever fewer than
`max_concurrency` are active, and leave when done or cancelled (their row and KV slots are dropped at
the next step). Per request the random draws happen in the same order as in the batch-1 loop, so in
float32 every request's output equals its batch-1 output (tests/test_batch.py).

Two drivers step it: `batched_generate` (decode/batch_generate.py: a fixed list of requests, closed
loop) and the server (decode/serve.py: requests arrive and leave while it runs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdraft.decode.batch_draft import can_batch, propose_blocks
from specdraft.decode.batch_session import BatchedSession
from specdraft.decode.generate import Generation, _greedy_step, _pick, _sampling_step, draft, record_step
from specdraft.decode.proposer import Proposal
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import (FixedRule, at, backoff_count, break_even, can_pay, cut, load_admits_any, load_pays,
                                        load_schedule, make_backoff, worth_drafting)


@dataclass
class Request:
    """One generation request: prompt, length limit and its own random stream."""

    prompt_ids: list[int]
    max_new_tokens: int
    generator: torch.Generator | None = None
    sampler: Sampler | None = None  # None: the engine's sampler
    speculate: bool = True  # False: decoded plainly in the same batch (the A/B split's plain arm)


@dataclass
class StepEvent:
    """What one engine step did for one request."""

    rid: int
    new_tokens: list[int]  # appended to the output this step (the first token on joining)
    drafted: int  # tokens drafted and verified this step (0: the request decoded plainly)
    accepted: int  # of those, accepted
    finished: bool
    result: Generation  # the request's whole output so far
    cancelled: bool = False
    joined: bool = False  # the request joined this step (new_tokens: the prefill's token)


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


@dataclass
class _Active:
    rid: int
    request: Request
    sampler: Sampler
    proposer: object
    context: list[int]
    result: Generation
    start: float
    proposal: Proposal | None = None
    done: bool = False
    cancelled: bool = False
    backoff: object = None
    drafted: bool = False  # this step ran its drafter (its own backoff settles it, whatever was verified)


class BatchEngine:
    """Continuous batching over one BatchedSession; `step()` runs one join + verify step."""

    def __init__(self, model, proposer, sampler: Sampler, num_draft: int, eos_token_ids=(), scheduler=None,
                 load: LoadPolicy | None = None, max_concurrency: int = 8, pad_id: int = 0):
        """`model`: the target's backend (decode/backend.py) or an HF causal LM. `proposer` is a template: each
        request gets `proposer.clone()`. `scheduler` is a per-request stopping rule; `load` replaces it with
        DSpark's batch-wide admission over calibrated survival."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency}; it must be >= 1")
        if num_draft < 0 or (proposer.max_draft is not None and num_draft > proposer.max_draft):
            raise ValueError(f"decode.num_draft={num_draft} but this proposer drafts at most {proposer.max_draft} tokens")
        self.proposer, self.sampler, self.num_draft = proposer, sampler, num_draft
        self.eos = set(eos_token_ids)
        self.rule, self.load, self.max_concurrency = scheduler or FixedRule(), load, max_concurrency
        self.session = BatchedSession(model, proposer.feature_layers, pad_id)
        self.queue: list[tuple[int, Request]] = []
        self.active: list[_Active] = []
        self.next_rid = 0  # ids go on across engines a server rebuilds, so a stale cancel cannot hit a new request
        # scheduler=load admits batch-wide, so it backs off batch-wide too: after a step that admitted nothing,
        # nobody drafts for 1, 2, 4, ... steps, and requests that join inherit that state. Per-request
        # backoffs would probe out of phase, so under load nearly every step would pay a batched probe.
        self.engine_backoff = make_backoff(load.rule, proposer) if load is not None else None

    @property
    def idle(self) -> bool:
        return not self.queue and not self.active

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def submit(self, request: Request) -> int:
        """Queue a request; it joins at the start of a later step. Returns its id."""
        if request.max_new_tokens < 1 or not request.prompt_ids:
            raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.queue.append((rid, request))
        return rid

    def cancel(self, rid: int) -> bool:
        """Drop a request: from the queue at once, from the batch (row and KV slots) at the next step.
        False when it is not known (finished already)."""
        for i, (queued, _) in enumerate(self.queue):
            if queued == rid:
                del self.queue[i]
                return True
        for item in self.active:
            if item.rid == rid and not item.done:
                item.done = item.cancelled = True
                return True
        return False

    def kv_bytes(self) -> int:
        """Bytes held by the batch's KV cache now (0 when no request runs)."""
        cache = self.session.cache
        if cache is None or self.session.rows == 0:
            return 0
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor))

    def step(self) -> list[StepEvent]:
        """Join queued requests (prefill, first token), then one speculative step for every active request."""
        events: list[StepEvent] = []
        cancelled = [i for i, item in enumerate(self.active) if item.cancelled]
        if cancelled:
            events += self._leave(cancelled)
        while self.queue and len(self.active) < self.max_concurrency:  # join: prefill alone, merge as the last row
            events.append(self._join(*self.queue.pop(0)))
        finished = [i for i, item in enumerate(self.active) if item.done]
        if finished:
            self._leave(finished)
            return events
        if not self.active:
            return events

        active, load, rule = self.active, self.load, self.rule
        drafting, limits = self._drafting()
        # scheduler=load admits batch-wide below; its gate ends the step after c_1 when nothing would be admitted.
        gate = _load_gate(load, limits) if load is not None and load.lazy else None
        _draft_all(drafting, limits, None if load else rule, gate)
        if load is not None:
            admitted = _admit(active, load)
            if self.engine_backoff is not None and any(limits):
                self.engine_backoff.observe(admitted)
        for item, limit in zip(drafting, limits):
            item.drafted = limit > 0
            if item.backoff is not None and limit > 0:
                item.backoff.observe(backoff_count(at(rule, len(item.context)), item.proposal))

        rows = [[item.context[-1]] + item.proposal.tokens for item in active]
        logits, features = self.session.forward(rows)  # (R, L, V)
        counts = []
        for r, item in enumerate(active):  # accept row by row with each request's own generator and sampler
            k = len(item.proposal.tokens)
            accept_fn = _greedy_step if item.sampler.greedy else _sampling_step
            accepted, next_token = accept_fn(item.proposal, logits[r, : k + 1], item.sampler, item.request.generator)
            counts.append(1 + accepted)
            if item.backoff is not None and item.drafted:  # as the batch-1 loop: the step's record, about later steps
                item.backoff.settle(1 + accepted, break_even(at(rule, len(item.context)), k), k)
            room = item.request.max_new_tokens - len(item.result.output_ids)
            before = len(item.result.output_ids)
            at_eos = record_step(item.result, item.context, item.proposal, accepted, next_token, self.eos, room)
            item.done = at_eos or len(item.result.output_ids) >= item.request.max_new_tokens
            if not item.done and item.request.speculate:
                item.proposer.commit(item.context, None if features is None else features[r, : 1 + accepted])
            events.append(StepEvent(item.rid, item.result.output_ids[before:], k, accepted, item.done, item.result))
        self.session.keep(counts)
        finished = [i for i, item in enumerate(active) if item.done]
        if finished:
            self._leave(finished)
        return events

    def _join(self, rid: int, request: Request) -> StepEvent:
        started = time.perf_counter()
        sampler = request.sampler or self.sampler
        logits, features = self.session.add(list(request.prompt_ids))
        first = _pick(sampler, logits[-1:], request.generator)
        item = _Active(rid, request, sampler, self.proposer.clone(), list(request.prompt_ids) + [first],
                       Generation(output_ids=[first]), started)
        item.result.ttft_s = time.perf_counter() - started
        if request.speculate:  # the plain arm never drafts: its proposer keeps no state (and costs nothing)
            item.proposer.start(list(item.context), features)
        item.backoff = make_backoff(self.rule, self.proposer) if self.load is None else None
        item.done = first in self.eos or request.max_new_tokens == 1
        self.active.append(item)
        return StepEvent(rid, [first], 0, 0, item.done, item.result, joined=True)

    def _leave(self, finished: list[int]) -> list[StepEvent]:
        now = time.perf_counter()
        events = []
        for i in finished:
            item = self.active[i]
            item.result.total_s = now - item.start
            if item.cancelled:
                events.append(StepEvent(item.rid, [], 0, 0, True, item.result, cancelled=True))
        self.session.remove(finished)
        gone = set(finished)
        self.active[:] = [item for i, item in enumerate(self.active) if i not in gone]
        return events

    def _drafting(self) -> tuple[list, list]:
        """The requests that draft this step and at most how many positions each; the others decode plainly.
        Decided from finished steps, shapes and the profile only, before anything of this step is drafted."""
        active, load, rule = self.active, self.load, self.rule
        for item in active:
            item.proposal = Proposal([])  # plain decoding for this request this step, unless it drafts
            item.drafted = False
        room = [min(self.num_draft, item.request.max_new_tokens - len(item.result.output_ids) - 1)
                if item.request.speculate else 0 for item in active]
        if load is not None:
            if self.engine_backoff is not None and self.engine_backoff.should_skip():
                return [], []
            # No admission could pay at this load (a compute-bound batch): nobody drafts this step.
            return (list(active), room) if _load_can_pay(load, len(active), room) else ([], [])
        drafting, limits = [], []
        for item, limit in zip(active, room):
            if not item.request.speculate:
                continue
            if item.backoff is not None and item.backoff.should_skip():
                continue
            if limit > 0 and not worth_drafting(at(rule, len(item.context)), limit, item.proposer):
                continue
            drafting.append(item)
            limits.append(limit)
        return drafting, limits


def _draft_all(items: list[_Active], limits: list[int], rule, gate=None) -> None:
    """Each drafting request's proposal: block drafters in one batched backbone pass per sampler (requests
    with other decoding settings draw from other distributions), others one by one (`gate`: see
    propose_blocks; drafters that cannot batch draw whole blocks and leave the cut to admission)."""
    if can_batch([item.proposer for item in items]):
        groups: dict[Sampler, list[int]] = {}
        for i, item in enumerate(items):  # greedy drafting reads no sampling setting: one group for all greedy
            groups.setdefault(Sampler() if item.sampler.greedy else item.sampler, []).append(i)
        # The load gate answers for the whole step; with several samplers no group sees every row, so the
        # blocks are drawn whole and admission cuts them (the lazy=False twin: the same admitted positions).
        gate = gate if len(groups) == 1 else None
        for sampler, members in groups.items():
            group = [items[i] for i in members]
            rules = [at(rule, len(item.context)) for item in group]  # each request's step at its own context
            proposals = propose_blocks([item.proposer for item in group], [item.context for item in group],
                                       [limits[i] for i in members], sampler, [item.request.generator for item in group],
                                       rules, gate)
            for item, proposal, own in zip(group, proposals, rules):
                item.proposal = proposal if own is None else proposal.truncate(cut(proposal, own))
        return
    for item, limit in zip(items, limits):
        item.proposal = draft(item.proposer, item.context, limit, item.sampler, item.request.generator,
                              at(rule, len(item.context)))


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
        if hasattr(item.proposer, "admitted"):
            item.proposer.admitted(length)  # proposers that learn from verified steps learn from these only
    load.admitted.append(sum(lengths))
    return sum(lengths) if load_pays(survival, lengths, draft_s, load.verify_s) else 0
