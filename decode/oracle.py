"""A ceiling for any verify-length schedule with a given drafter, from the steps of fixed-length runs.

At each step of a fixed-length run the drafter proposed ℓ positions and the first m survived. A
scheduler that knew m before drafting would draft and verify exactly m positions, and run no drafter
at all when m = 0: m + 1 tokens in t_draft(m) + t_verify(1 + m) at the step's context. Where step
costs grow with the length (as measured profiles do, up to noise), no stopping rule does better on
those steps: it sees confidences, not the outcome, and pays its probes. Every run is priced with
the same measured profile (decode/profile.py), so `oracle ÷ best fixed` says how much any scheduler
could gain over the best fixed length with this drafter, on this machine. It is a ceiling for those
steps only (another schedule moves the anchors) and prices steps by the profile instead of a clock.
"""

from __future__ import annotations

from decode.generate import Generation


def step_contexts(prompt_length: int, generation: Generation) -> list[tuple[int, int, int, int]]:
    """(context length, drafted, accepted, tokens kept) of each verify step; the prompt and the first
    token come from prefill. A step cut at EOS or at the length limit keeps fewer than accepted + 1."""
    steps, context, left = [], prompt_length + 1, len(generation.output_ids) - 1
    for drafted, accepted in zip(generation.drafted, generation.accepted):
        kept = min(accepted + 1, left)
        steps.append((context, drafted, accepted, kept))
        context, left = context + kept, left - kept
    return steps


def step_seconds(profile, context: int, length: int) -> float:
    """A one-request step that drafts and verifies `length` positions (none: no drafter pass)."""
    draft = profile.draft_s(length, context) if length else 0.0
    return draft + profile.verify_s(1, 1 + length, context=context)


def priced_rate(steps: list[tuple[int, int, int, int]], profile, oracle: bool = False) -> float | None:
    """Tokens per second of these steps as the profile prices them: as run (each step's drafted length),
    or as the oracle would run them (each step's accepted length); None without steps."""
    tokens = seconds = 0.0
    for context, drafted, accepted, kept in steps:
        seconds += step_seconds(profile, context, accepted if oracle else drafted)
        tokens += kept
    return tokens / seconds if seconds else None


def oracle_ceiling(results: dict[str, list[Generation]], prompt_lengths: list[int], profile) -> dict:
    """Priced decode tokens/s (after the first token) of plain decoding, of every fixed_k setting, and of
    the oracle on each fixed_k's steps; the ceiling is the best oracle over the best fixed setting
    (None when no fixed setting ran a verify step, e.g. every output ended at its first token)."""
    def steps(kind):
        return [s for length, g in zip(prompt_lengths, results[kind]) for s in step_contexts(length, g)]

    fixed = [kind for kind in results if kind.startswith("fixed_")]
    priced = {kind: priced_rate(steps(kind), profile) for kind in ["plain", *fixed] if kind in results}
    oracle = {kind: priced_rate(steps(kind), profile, oracle=True) for kind in fixed}
    ran = [kind for kind in fixed if priced[kind] and oracle[kind]]
    best_fixed = max(ran, key=lambda kind: priced[kind], default=None)
    best_oracle = max(ran, key=lambda kind: oracle[kind], default=None)
    return {"priced_decode_tokens_per_s": priced, "oracle_decode_tokens_per_s": oracle,
            "best_fixed": best_fixed, "oracle_steps_of": best_oracle,
            "oracle_vs_best_fixed": oracle[best_oracle] / priced[best_fixed] if ran else None}
