"""Eagle-3 head: training-time test equals step-by-step inference; decoding with it is lossless."""

from __future__ import annotations

import torch

from tests.helpers import hf_greedy
from tests.helpers import make_eagle


def test_training_time_test_equals_step_by_step_inference():
    _, drafter = make_eagle()
    torch.manual_seed(4)
    length, steps = 12, 4
    features, tokens = torch.randn(length, 64), torch.randint(0, 64, (length,))
    with torch.no_grad():
        unrolled = drafter.forward_ttt(features, tokens, steps)
        for t in (0, 3, 7):
            # Context: positions 0..t processed by the target; x_{t+1} is the pending token.
            out, prefix = drafter.context_step(features[: t + 1], tokens[1 : t + 2], 0, None)
            hidden = out[:, -1:]
            torch.testing.assert_close(drafter.logits(hidden)[0, -1], unrolled[0][t], rtol=1e-4, atol=1e-5)
            for step in range(1, steps):
                if t + step + 1 >= length:
                    break
                # Teacher-forced draft: the true token x_{t+step+1} at position t+step.
                hidden, (k, v) = drafter.draft_step(tokens[t + step + 1], hidden, t + step, prefix)
                prefix = (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
                torch.testing.assert_close(drafter.logits(hidden)[0, -1], unrolled[step][t], rtol=1e-4, atol=1e-5)


def test_eagle3_proposer_is_lossless_greedy_and_sampling_q_is_exact():
    from specdraft.decode.generate import GenerateConfig, speculative_generate
    from specdraft.decode.proposer import Eagle3Proposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession

    target, drafter = make_eagle(vocab=torch.arange(0, 64, 2))
    proposer = Eagle3Proposer(drafter, (1, 2))
    session = CausalSession(target, (1, 2))
    for prompt in ([3, 1, 4, 1, 5], [9], [6, 6, 6, 6]):
        for num_draft in (1, 2, 4):
            got = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 15, num_draft))
            assert got.output_ids == hf_greedy(target, prompt, 15)
    _, features = session.forward([5, 6, 7], last_only=True)
    session.reset()
    proposer.start([5, 6, 7, 9], features)
    proposal = proposer.propose([5, 6, 7, 9], 3, Sampler(temperature=1.0), torch.Generator().manual_seed(0))
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(3))
    assert all(t % 2 == 0 and float(proposal.draft_probs[k, t]) > 0 for k, t in enumerate(proposal.tokens))


def test_eagle3_step_learns_and_normalizer_matches():
    from tests.helpers import toy_batch
    from specdraft.train.step import LossSettings, distill_step, weight_sum

    target, drafter = make_eagle(steps=3)
    drafter.train()
    batch = toy_batch(batch=2)
    settings = LossSettings(decay=4.4814)  # exp(-s / 4.4814) = 0.8 ** s: Eagle-3's step decay
    total = weight_sum(batch, 0, 3, settings.decay, mode="eagle3")
    # One batch: the unrolled weight sum is exactly the normaliser the loss uses on its own.
    local, _ = distill_step(drafter, target, batch, (1, 2), 0, settings)
    given, _ = distill_step(drafter, target, batch, (1, 2), 0, settings, normalizer=total)
    torch.testing.assert_close(local, given)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=5e-3)
    losses = []
    for _ in range(30):
        loss, metrics = distill_step(drafter, target, batch, (1, 2), 0, settings, normalizer=total)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]
    assert len(metrics["alpha_by_position"]) == 3 and 1.0 <= metrics["tau_estimate"] <= 4.0
