"""The speculative decoding loop, written once for plain, greedy and sampled decoding.

Invariant: the target's KV cache holds every token of the sequence except the newest one (the
"pending" token). Each step drafts k tokens, feeds [pending, d_1..d_k] to the target in one
forward (k+1 positions), accepts a prefix of the draft with the acceptance rule, takes the
target's token after it, and crops the cache back to pending + accepted drafts. With k = 0 this
is plain decoding, one token per forward. Greedy and sampling differ only in the acceptance
function. Batch size is 1; the acceptance rules already work on batches of rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdraft.decode.proposer import Proposal, Proposer
from specdraft.decode.sampling import Sampler, sample
from specdraft.decode.scheduler import (at, backoff_count, break_even, cut, make_backoff, side_count, with_tree,
                                        worth_drafting)
from specdraft.decode.session import CausalSession
from specdraft.decode.tree import greedy_tree_accept, kept_rows, side_record
from specdraft.decode.verifier import greedy_accept, rejection_accept


@dataclass
class Generation:
    """One request's output and per-step statistics."""

    output_ids: list[int]
    drafted: list[int] = field(default_factory=list)  # per verify step: tokens drafted and verified
    accepted: list[int] = field(default_factory=list)  # per verify step: drafted tokens accepted
    # per verify step that drafted: the confidence head's raw logits for the positions drafted (calibration
    # data), [] where the proposal had none (lookup, a hybrid's lookup steps, standalone models)
    confidence_logits: list[list[float]] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    repeats_differ: int = 0  # bench.repeats: repeated runs of this prompt whose tokens differed from these


def _stop_index(tokens: list[int], eos_ids: set[int], room: int) -> int:
    """How many of `tokens` to keep: up to and including the first EOS, at most `room`."""
    for i, token in enumerate(tokens[:room]):
        if token in eos_ids:
            return i + 1
    return min(len(tokens), room)


@dataclass(frozen=True)
class GenerateConfig:
    """What one generation asks for: how to sample, how long, how many tokens to draft, where to stop."""

    sampler: Sampler = field(default_factory=Sampler)
    max_new_tokens: int = 128
    num_draft: int = 0  # tokens drafted per step at most (0: plain decoding)
    eos_token_ids: frozenset[int] | tuple[int, ...] | list[int] = ()
    scheduler: object | None = None  # a stopping rule from decode/scheduler.py (None: verify every drafted token)


def speculative_generate(
    target: CausalSession,
    prompt_ids: list[int],
    proposer: Proposer,
    config: GenerateConfig,
    *,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,  # streaming: called with each step's new tokens
    accept_fn: Callable | None = None,  # tests: another acceptance rule (negative controls)
) -> Generation:
    """Generate up to `config.max_new_tokens` tokens; the output is distributed as target-only decoding."""
    sampler, max_new_tokens, num_draft, scheduler = (config.sampler, config.max_new_tokens, config.num_draft,
                                                      config.scheduler)
    if max_new_tokens < 1:
        raise ValueError(f"decode.max_new_tokens={max_new_tokens}; it must be >= 1")
    if num_draft < 0 or (proposer.max_draft is not None and num_draft > proposer.max_draft):
        raise ValueError(f"decode.num_draft={num_draft} but this proposer drafts at most {proposer.max_draft} tokens")
    if not prompt_ids:
        raise ValueError("the prompt is empty; the target needs at least one token to condition on")
    eos_ids = set(config.eos_token_ids)
    if accept_fn is None:
        accept_fn = _greedy_step if sampler.greedy else _sampling_step
    start = time.perf_counter()

    target.reset()
    logits, features = target.forward(list(prompt_ids), last_only=True)
    first = _pick(sampler, logits[-1:], generator)
    result = Generation(output_ids=[first], ttft_s=time.perf_counter() - start)
    if on_tokens is not None:
        on_tokens([first])
    context = list(prompt_ids) + [first]
    proposer.start(list(context), features)  # features cover the prompt; context adds the pending token
    backoff = make_backoff(scheduler, proposer)
    sides = side_record(proposer, sampler.greedy)  # token trees: how often their side branches paid so far

    while first not in eos_ids and len(result.output_ids) < max_new_tokens:
        room = max_new_tokens - len(result.output_ids)
        # Draft at most room - 1: a fully accepted block plus the target's token then fills `room` exactly.
        limit = min(num_draft, room - 1)
        rule = at(scheduler, len(context))
        if sides is not None:
            rule = with_tree(rule, sides.rates(), sides.side_length, sides.probing())
        drafted = False
        if (backoff is not None and backoff.should_skip()) or not worth_drafting(rule, limit, proposer):
            proposal = Proposal([])  # plain decoding this step (or no room to draft); the drafter is not run
        else:
            proposal = draft(proposer, context, limit, sampler, generator, rule)
            drafted = True
            if backoff is not None:
                backoff.observe(backoff_count(rule, proposal))
        kept_length = target.length  # cache covers context[:-1]; the pending token is context[-1]
        verified = len(proposal.tokens)  # main-chain positions: what a pricing rule priced the step by
        drafted_sides = len(proposal.alternatives)
        offered = side_count(rule, proposal)  # the side branches worth their verify rows (greedy: any set is exact)
        proposal.alternatives = proposal.alternatives[:offered]
        branch = 0  # the accepted branch: 0 the main chain, r the r-th side branch
        if proposal.alternatives:  # greedy: a token tree of the main chain and its sibling branches
            proposal, num_accepted, next_token, features, branch = _tree_step(target, context[-1], proposal, sampler)
        else:
            logits, features = target.forward([context[-1]] + proposal.tokens)  # (k+1, V)
            num_accepted, next_token = accept_fn(proposal, logits, sampler, generator)
            target.rollback(kept_length + 1 + num_accepted)
        if sides is not None and drafted_sides:
            sides.observe(num_accepted if branch else 0, branch, offered, drafted_sides - offered)
        if backoff is not None and drafted:  # about the next steps only
            backoff.settle(num_accepted + 1, break_even(rule, verified, offered), verified)

        done = len(result.output_ids)
        stop = record_step(result, context, proposal, num_accepted, next_token, eos_ids, room)
        if on_tokens is not None:
            on_tokens(result.output_ids[done:])
        if stop:
            break
        proposer.commit(context, None if features is None else features[: 1 + num_accepted])
    result.total_s = time.perf_counter() - start
    return result


def _tree_step(target: CausalSession, pending: int, proposal: Proposal, sampler: Sampler):
    """One greedy verify step over a token tree (decode/tree.py): (the accepted branch as the step's proposal,
    its accepted count, the target's next token, the features of the rows kept, that branch's index: 0 for the
    main chain, r for the r-th side branch). The cache keeps the pending token and the accepted path, in order,
    as a chain step would have left it."""
    if not sampler.greedy:
        raise ValueError("a proposal with alternative branches is verified greedily only; draft one chain for "
                         "decode.temperature > 0 (proposer.branches=1)")
    start = target.length
    branches = [proposal.tokens, *proposal.alternatives]
    logits, features = target.forward_tree(pending, branches)  # (T, V), (T, L*H)
    branch, num_accepted, next_token = greedy_tree_accept(branches, logits)
    rows = kept_rows(branches, branch, num_accepted)
    target.keep(start, rows)
    if branch:  # the statistics describe the side branch taken: one drafted token, accepted, no confidences (the
        # main chain's describe positions that were rejected; calibration and the oracle skip such steps, as lookup's)
        proposal = Proposal(branches[branch], scheduled=True)
    return proposal, num_accepted, next_token, None if features is None else features[rows], branch


def draft(proposer, context: list[int], limit: int, sampler: Sampler, generator, rule) -> Proposal:
    """A proposal of at most `limit` tokens, cut by the stopping rule (proposers without confidences
    ignore the rule while drafting; it is applied to their block here)."""
    proposal = proposer.propose(context, limit, sampler, generator, rule)
    if len(proposal.tokens) > limit:
        raise RuntimeError(f"proposer returned {len(proposal.tokens)} tokens where at most {limit} were asked for")
    return proposal if rule is None or proposal.scheduled else proposal.truncate(cut(proposal, rule))


def record_step(result: Generation, context: list[int], proposal: Proposal, num_accepted: int, next_token: int,
                eos_ids: set[int], room: int) -> bool:
    """Append a verify step's accepted tokens (up to EOS, at most `room`) and statistics; True at EOS."""
    new_tokens = proposal.tokens[:num_accepted] + [next_token]
    kept = new_tokens[: _stop_index(new_tokens, eos_ids, room)]
    result.output_ids.extend(kept)
    context.extend(kept)
    result.drafted.append(len(proposal.tokens))
    result.accepted.append(num_accepted)
    if proposal.tokens:  # one entry per drafting step keeps them aligned with `drafted` (oracle, calibration)
        logits = proposal.confidence_logits
        result.confidence_logits.append([] if logits is None else logits.tolist())
    return any(t in eos_ids for t in kept)


def _pick(sampler: Sampler, logits: torch.Tensor, generator) -> int:
    """The target's own next token from (1, V) logits."""
    if sampler.greedy:
        return int(logits[0].argmax())
    return int(sample(sampler.probs(logits), generator))


def _greedy_step(proposal: Proposal, logits: torch.Tensor, sampler: Sampler, generator) -> tuple[int, int]:
    tokens = torch.tensor([proposal.tokens], dtype=torch.long, device=logits.device).reshape(1, -1)  # (1, k)
    num_accepted, next_token = greedy_accept(tokens, logits[None])
    return int(num_accepted), int(next_token)


def _sampling_step(proposal: Proposal, logits: torch.Tensor, sampler: Sampler, generator) -> tuple[int, int]:
    tokens = torch.tensor([proposal.tokens], dtype=torch.long, device=logits.device).reshape(1, -1)  # (1, k)
    q = None if proposal.draft_probs is None else proposal.draft_probs[None]  # (1, k, V)
    num_accepted, next_token = rejection_accept(tokens, q, sampler.probs(logits)[None], generator)
    return int(num_accepted), int(next_token)
