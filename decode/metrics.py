"""Acceptance statistics over verify steps (prefill excluded), DeepSpec's definitions."""

from __future__ import annotations

import random

from specdraft.decode.generate import Generation


def acceptance_stats(generations: list[Generation]) -> dict:
    """tau, acceptance by position, mean drafted length and fallbacks over all verify steps."""
    drafted = [d for g in generations for d in g.drafted]
    accepted = [a for g in generations for a in g.accepted]
    steps = len(drafted)
    if steps == 0:
        return {"tau": None, "acceptance_by_position": [], "mean_draft_len": None, "fallbacks": 0, "empty_drafts": 0,
                "verify_steps": 0}
    longest = max(drafted)
    # Position k (1-based) is "reached" when it was drafted and all before it were accepted.
    reached = [sum(1 for d, a in zip(drafted, accepted) if d >= k and a >= k - 1) for k in range(1, longest + 1)]
    survived = [sum(1 for a in accepted if a >= k) for k in range(1, longest + 1)]
    return {
        "tau": sum(a + 1 for a in accepted) / steps,
        "acceptance_by_position": [s / r if r else None for s, r in zip(survived, reached)],
        "mean_draft_len": sum(drafted) / steps,
        "fallbacks": sum(1 for a in accepted if a == 0),
        "empty_drafts": sum(1 for d in drafted if d == 0),
        "verify_steps": steps,
    }


def timing_stats(generations: list[Generation]) -> dict:
    """Throughput and latency over a list of generations: tokens/s, mean TTFT, mean TPOT."""
    tokens = sum(len(g.output_ids) for g in generations)
    seconds = sum(g.total_s for g in generations)
    tpots = [(g.total_s - g.ttft_s) / (len(g.output_ids) - 1) for g in generations if len(g.output_ids) > 1]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "ttft_s": sum(g.ttft_s for g in generations) / len(generations) if generations else None,
        "tpot_s": sum(tpots) / len(tpots) if tpots else None,
    }


def speed(generations: list[Generation], decode: bool = False) -> float | None:
    """`timing_stats`' tokens/s end to end, or with `decode` after the first token (1 / mean TPOT)."""
    stats = timing_stats(generations)
    if decode:
        return 1 / stats["tpot_s"] if stats["tpot_s"] else None
    return stats["tokens_per_s"]


def paired_speed_interval(faster: list[Generation], slower: list[Generation], decode: bool = False,
                          level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """A percentile bootstrap interval of speed(faster) ÷ speed(slower) over prompts resampled in pairs (each
    prompt's two runs stay together: the interleaved runs of one prompt share the machine's state, so the pair is
    the unit of noise). Speed is `timing_stats`' tokens/s, or with `decode` its 1 / mean TPOT (after the first
    token). A sweep's ratio of two settings moves by a percent or two between runs of the same code on a shared
    host; this says how far the prompts alone let it move. None with fewer than two prompts."""
    if len(faster) != len(slower):
        raise ValueError(f"paired runs differ in length: {len(faster)} and {len(slower)} prompts")
    pairs = list(zip(faster, slower))
    if len(pairs) < 2 or not 0 < level < 1:
        return None
    rng, ratios = random.Random(seed), []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        a, b = speed([p[0] for p in sample], decode), speed([p[1] for p in sample], decode)
        if a and b:
            ratios.append(a / b)
    if not ratios:
        return None
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * (len(ratios) - 1))], ratios[int((1 - tail) * (len(ratios) - 1))]
