"""A ceiling for any verify-length schedule with a given drafter, from the steps of fixed-length runs.

At each step of a fixed-length run the drafter proposed ℓ positions and the first m survived. A
scheduler that knew m before drafting would draft and verify exactly m positions, and run no drafter
at all when m = 0: m + 1 tokens in t_draft(m) + t_verify(1 + m) at the step's context. Where step
costs grow with the length (as measured profiles do, up to noise), no stopping rule does better on
those steps: it sees confidences, not the outcome, and pays its probes. Every run is priced with
the same measured profile (decode/profile.py), so `oracle ÷ best fixed` says how much any scheduler
could gain over the best fixed length with this drafter, on this machine. It is a ceiling for those
steps only (another schedule moves the anchors) and prices steps by the profile instead of a clock.

Between the two sits `confidence_cut`: the best a rule that ranks steps by the confidence head's c_1
could do on fixed_1's steps, its cut chosen in hindsight. The oracle's gain over it is what the
confidence head cannot see; its gain over the cost scheduler is what the schedule leaves.
"""

from __future__ import annotations

from specdraft.decode.generate import Generation
from specdraft.decode.sweep_runs import fixed_setting, fixed_settings


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

    fixed = fixed_settings(results)
    priced = {kind: priced_rate(steps(kind), profile) for kind in ["plain", *fixed] if kind in results}
    oracle = {kind: priced_rate(steps(kind), profile, oracle=True) for kind in fixed}
    ran = [kind for kind in fixed if priced[kind] and oracle[kind]]
    best_fixed = max(ran, key=lambda kind: priced[kind], default=None)
    best_oracle = max(ran, key=lambda kind: oracle[kind], default=None)
    # Rules that rank by c_1 (every scheduler here decides ℓ = 0 from it) on fixed_1's steps, where every step drafts.
    confidence = {}
    if fixed_setting(1) in results:
        for name, probe in (("probed", True), ("probe_free", False)):
            bound = confidence_cut(results[fixed_setting(1)], prompt_lengths, profile, probe)
            if bound and ran:
                bound["vs_best_fixed"] = bound["decode_tokens_per_s"] / priced[best_fixed]
            confidence[name] = bound
    return {"priced_decode_tokens_per_s": priced, "oracle_decode_tokens_per_s": oracle,
            "best_fixed": best_fixed, "oracle_steps_of": best_oracle,
            "oracle_vs_best_fixed": oracle[best_oracle] / priced[best_fixed] if ran else None,
            "confidence_cut": confidence or None}


def first_position_steps(prompt_length: int, generation: Generation) -> list[tuple[int, float, bool, int]]:
    """(context length, raw confidence logit z_1, position 1 survived, tokens kept) of each step that
    drafted with a confidence head; the logits are recorded one per drafting step, in step order ([] for
    steps drafted without one, e.g. a hybrid's lookup steps)."""
    drafting = [step for step in step_contexts(prompt_length, generation) if step[1] > 0]
    return [(context, logits[0], accepted >= 1, kept)
            for (context, _, accepted, kept), logits in zip(drafting, generation.confidence_logits) if logits]


def confidence_cut(generations: list[Generation], prompt_lengths: list[int], profile, probe: bool = True) -> dict | None:
    """The best priced rate of "draft one position iff z_1 >= cut" on fixed_1's steps, the cut chosen in
    hindsight: what a scheduler that ranks steps by the confidence head's c_1 could reach at most, where
    the oracle above knows the outcomes. Calibration is a monotone map of z_1, so it moves no ranking and
    the result holds for any calibration. A step the rule does not draft keeps one token per plain step
    (the tokens its drafted position would have added come from plain steps too); with `probe` every
    step pays the backbone pass that gives c_1, without it the bound holds for rules that skip probes too.
    Steps that drafted nothing (no room left before the length limit) are left out. None when no step
    recorded a confidence."""
    steps = [s for length, g in zip(prompt_lengths, generations) for s in first_position_steps(length, g)]
    if not steps:
        return None
    probe_s = (lambda context: profile.draft_s(0, context)) if probe else (lambda context: 0.0)
    tokens = sum(kept for *_, kept in steps)
    # Per step: seconds when drafted (drafting includes the probe) and when not (a probed plain step per token kept).
    drafted = [step_seconds(profile, context, 1) for context, *_ in steps]
    plain = [sum(probe_s(context + i) + step_seconds(profile, context + i, 0) for i in range(kept))
             for context, _, _, kept in steps]
    order = sorted(range(len(steps)), key=lambda i: -steps[i][1])  # most confident first
    seconds = best_seconds = sum(plain)
    best_count = 0
    for rank, i in enumerate(order):  # drafting the rank + 1 most confident steps
        seconds += drafted[i] - plain[i]
        tied = rank + 1 < len(order) and steps[order[rank + 1]][1] == steps[i][1]  # a cut cannot split equal scores
        if not tied and seconds < best_seconds:
            best_seconds, best_count = seconds, rank + 1
    chosen = order[:best_count]
    return {"steps": len(steps), "probe_priced": probe,
            "survival_rate": sum(s[2] for s in steps) / len(steps),
            "drafted_fraction": best_count / len(steps),
            "precision": sum(steps[i][2] for i in chosen) / best_count if best_count else None,
            "cut_logit": steps[chosen[-1]][1] if chosen else None,
            "decode_tokens_per_s": tokens / best_seconds,
            "never_draft_tokens_per_s": tokens / sum(plain)}
