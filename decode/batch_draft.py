"""Drafting for R concurrent requests in one backbone pass (the batched engine's drafter step).

`BlockDrafterProposer.propose` drafts one request; under load the engine would call it R times, and
on a CPU most of a draft's time is per-call overhead (a 1-layer backbone over 7 slots, then 7 small
Markov/LM-head steps), so the probes a scheduler needs cost R times what they should. Here every
active request's block goes through the backbone together, then the Markov head samples position k
for all rows at once. Per row everything happens as in `propose`, the reference twin
(tests/test_batch_draft.py holds them equal): the same confidences, the same stopping rule asked before
x_k is drawn, and one draw per drafted position from that request's own generator, in the same
order, so a request's random stream does not depend on which other requests share its step (requests
without a generator draw from torch's global stream, then position by position across requests). A batch-wide
`gate` (scheduler=load) is the exception: when it ends a step after c_1, no request draws at all.
"""

from __future__ import annotations

import torch

from specdraft.decode.calibration import apply_map
from specdraft.decode.proposer import BlockDrafterProposer, Proposal, pick_draft_token
from specdraft.decode.sampling import Sampler


def can_batch(proposers: list) -> bool:
    """True when every proposer is a block drafter with a context, sharing one drafter's weights and calibration."""
    return (bool(proposers) and all(isinstance(p, BlockDrafterProposer) and p.cache is not None for p in proposers)
            and len({id(p.drafter) for p in proposers}) == 1 and len({id(p.calibration) for p in proposers}) == 1)


@torch.inference_mode()
def propose_blocks(proposers: list[BlockDrafterProposer], contexts: list[list[int]], limits: list[int], sampler: Sampler,
                   generators: list, rule=None, gate=None) -> list[Proposal]:
    """One proposal per request (at most limits[r] tokens, cut by the stopping rule as `propose` cuts it;
    `rule` is one rule for every request or a list of one per request).

    `gate(first)`, for batch-wide rules: asked once, after the backbone pass, with [c_1] of each request in
    `proposers` order ([] for those that draft nothing); False ends the step for every request before any
    token is drawn (no LM head, no Markov step, no draw), and every proposal comes back empty."""
    rules = rule if isinstance(rule, list) else [rule] * len(proposers)
    rows = [r for r, limit in enumerate(limits) if limit > 0]
    proposals = [Proposal([]) for _ in proposers]
    if not rows:
        return proposals
    for r in rows:
        proposers[r].flush()
    drafter = proposers[rows[0]].drafter
    device = drafter.draft_to_target.device
    anchors = torch.tensor([contexts[r][-1] for r in rows], device=device)  # (R,)
    out = drafter.forward_blocks([proposers[r].cache for r in rows], [proposers[r].length for r in rows], anchors,
                                 logits=False)  # hidden (R, γ, H); the LM head runs once drafting starts, as in `propose`
    block_logits = None
    heads = drafter.markov_head
    state = heads.initial_state(len(rows), out.hidden[:, 0]) if heads is not None else None
    maps = proposers[rows[0]].calibration_maps(sampler)
    target_vocab = drafter.embed_tokens.num_embeddings
    previous = anchors
    tokens = {r: [] for r in rows}
    draft_probs, confidence, raw = ({r: [] for r in rows} for _ in range(3))
    live = list(range(len(rows)))  # indices into `rows` of requests still drafting
    for k in range(max(limits[r] for r in rows)):
        live = [i for i in live if k < limits[rows[i]]]
        if not live:
            break
        hidden = out.hidden[:, k]  # (R, H)
        if heads is not None:
            embedding = heads.markov_w1(previous)  # (R, r)
            z = drafter.confidence_head(torch.cat([hidden, embedding], -1)).float()  # (R,)
            scores = apply_map(z, maps, k)
            if k == 0 and gate is not None:
                first = [[] for _ in proposers]
                for i in live:
                    first[rows[i]] = [float(scores[i])]
                if not gate(first):
                    return proposals  # nothing drawn: the requests' random streams are untouched
            for i in live:  # the rule sees c_1..c_k before x_k is drawn, as in `propose`
                raw[rows[i]].append(z[i])
                confidence[rows[i]].append(scores[i])
            stopped = [i for i in live if rules[rows[i]] is not None
                       and not rules[rows[i]].verify([float(c) for c in confidence[rows[i]]])]
            for i in stopped:
                confidence[rows[i]].pop(), raw[rows[i]].pop()
            live = [i for i in live if i not in stopped]
            bias, state = heads.markov_step(embedding, hidden, state)
        if not live:
            break
        if block_logits is None:  # every row's and position's LM head in one matmul
            block_logits = drafter.lm_head(out.hidden[:, : max(limits[r] for r in rows)])  # (R, k, V_draft)
        logits = block_logits[:, k]  # (R, V_draft)
        if heads is not None:
            logits = logits + bias
        if sampler.greedy:
            picked = drafter.draft_to_target[logits.argmax(-1)]  # (R,)
        else:
            picked = previous.clone()
            for i in live:  # each request's own generator, one draw per drafted position, as in `propose`
                picked[i], q = pick_draft_token(logits[i : i + 1], drafter.draft_to_target, target_vocab, sampler,
                                                generators[rows[i]])
                draft_probs[rows[i]].append(q)
        for i in live:
            tokens[rows[i]].append(int(picked[i]))
        previous = picked
    for r in rows:
        proposals[r] = Proposal(
            tokens[r],
            torch.stack(draft_probs[r]) if draft_probs[r] else None,
            torch.stack(confidence[r]) if confidence[r] else None,
            torch.stack(raw[r]) if raw[r] else None,
        )
    return proposals
