"""The most speculation could gain on given outputs: an oracle's bound for prompt lookup.

A benchmark says what a proposer and a scheduler did; this says what any scheduler could have done with the
same drafts. On the target's own outputs (greedy decoding: the tokens every lossless method produces), each
step drafts what the lookup proposes, and an oracle verifies exactly the drafted prefix the target will
accept: nothing is ever rejected, so the step feeds 1 + a tokens and gains a + 1. Pricing each step on the
measured verify curve (decode/profile.py) gives a ceiling on the speedup over plain decoding that no
scheduler of this lookup can pass; pricing it on a flat curve (a verify costs one token's step) gives the
ceiling no faster verify step can pass either. The all-occurrences variant lets the oracle pick, among every
earlier occurrence of the last token, the continuation that matches longest (a tree of every candidate,
verified for the price of one branch): a ceiling for multi-candidate lookup too.

Drafting is priced at zero and the decode loop's own overhead is left out, so real runs stay below these.
decode/oracle.py bounds any drafter from the steps fixed-length runs took (their anchors, from a sweep); lookup's
drafts are a function of the context alone, so here the oracle's own schedule is replayed over the outputs,
from one greedy run of any proposer.
"""

from __future__ import annotations

from typing import Callable, Iterable

from specdraft.decode.proposer import ngram_match

Drafts = Callable[[list[int], int], list[list[int]]]  # (context, max_draft) -> candidate drafts


def lookup_drafts(max_ngram: int, min_ngram: int) -> Drafts:
    """The lookup proposer's one draft (decode/proposer.py's ngram_match)."""
    def drafts(context: list[int], max_draft: int) -> list[list[int]]:
        return [ngram_match(context, max_draft, max_ngram, min_ngram)[1]]
    return drafts


def every_occurrence(context: list[int], max_draft: int) -> list[list[int]]:
    """What followed each earlier occurrence of the context's last token, most recent first."""
    last = context[-1] if context else None
    return [context[end + 1 : end + 1 + max_draft] for end in range(len(context) - 2, -1, -1) if context[end] == last]


def accepted(draft: list[int], truth: list[int]) -> int:
    """How many leading tokens of `draft` equal the target's next tokens."""
    count = 0
    for got, want in zip(draft, truth):
        if got != want:
            break
        count += 1
    return count


def oracle_steps(prompt: list[int], output: list[int], drafts: Drafts, max_draft: int) -> list[int]:
    """Tokens fed per verify step (1 + accepted) when every step verifies exactly what will be accepted."""
    fed, done = [], 0
    while done < len(output):
        context, truth = prompt + output[:done], output[done : done + max_draft]
        best = max((accepted(d, truth) for d in drafts(context, max_draft)), default=0)
        best = min(best, len(output) - done - 1)  # the last token of the output is a step's own (bonus) token
        fed.append(1 + best)
        done += 1 + best
    return fed


def ceiling(samples: Iterable[tuple[list[int], list[int]]], drafts: Drafts, verify_s: Callable[[int], float] | None,
            max_draft: int) -> dict:
    """tau and the speedup ceilings (measured curve `verify_s(tokens)` and flat) over (prompt, output) pairs;
    verify_s None (no measured price for such long verifies): the measured-curve ceiling is None."""
    fed = [n for prompt, output in samples for n in oracle_steps(list(prompt), list(output), drafts, max_draft)]
    if not fed:
        raise ValueError("no output tokens to bound: the samples are empty")
    tokens = sum(fed)
    measured = None if verify_s is None else tokens * verify_s(1) / sum(verify_s(n) for n in fed)
    return {"tau": tokens / len(fed), "steps": len(fed), "tokens": tokens,
            "speedup_measured_curve": measured, "speedup_flat_curve": tokens / len(fed)}
