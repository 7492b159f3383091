"""Batched speculative decoding equals batch-1 decoding for every request (float32)."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.batch_generate import LoadPolicy
from specdraft.decode import batch_session
from specdraft.decode.batch_session import BatchedSession, row_mask
from specdraft.decode.proposer import BlockDrafterProposer, ModelProposer, NoProposer, Proposal
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import CostRule, ThresholdRule, cut
from specdraft.decode.session import CausalSession
from tests.helpers import hf_greedy, tiny_llama
from tests.helpers import make_drafter
from tests.helpers import EOS, LIMITS, PROMPTS, batch1, batched, cheap_profile, context_profile, dear_profile, synthetic_profile


def test_profile_prices_a_step_at_its_context():
    profile = context_profile()
    assert profile.verify_s(1, 1) == pytest.approx(0.014)  # no context given: the base curve
    assert profile.verify_s(1, 1, context=2) == pytest.approx(0.014)
    assert profile.verify_s(1, 1, context=7) == pytest.approx(0.02225)  # halfway between the contexts
    assert profile.verify_s(1, 1, context=22) == pytest.approx(0.047)  # beyond them: the same line
    assert profile.verify_s(1, 1, context=1) == pytest.approx(0.014)  # never below the shortest context's
    assert profile.draft_s(2, context=12) == pytest.approx(0.005)
    assert profile.verify_s(2, 1, "batched", context=12) == pytest.approx(0.018)  # batched steps: by rows only
    # The cost rule verifies more where one more position is cheap relative to the step.
    rule, block = CostRule(profile), Proposal([1, 2, 3], confidence=torch.tensor([0.2, 0.9, 0.9]))
    assert cut(block, rule.at(2)) == 0  # 1.2 tokens in 22 ms lose to a probed plain step's 1 in 17 ms
    assert cut(block, rule.at(12)) == 3


def test_batched_draft_time_comes_from_its_own_curve():
    profile = synthetic_profile()  # per-request drafts only: one draft per request
    assert profile.draft_rows_s([3, 3]) == pytest.approx(2 * profile.draft_s(3))
    # measured: one pass for 1 and for 4 requests, at drafted lengths 1..3
    profile.draft_batched = {"1": [0.006, 0.008, 0.010], "4": [0.010, 0.013, 0.016]}
    assert profile.draft_rows_s([3]) == pytest.approx(0.010)
    assert profile.draft_rows_s([1]) == pytest.approx(0.006)  # one position costs less than the block
    assert profile.draft_rows_s([3, 1]) == pytest.approx(0.012)  # the longest sets the pass; between row counts
    assert profile.draft_rows_s([3] * 8) == pytest.approx(0.032)  # beyond them: proportional to rows
    assert profile.draft_rows_s([7]) == pytest.approx(0.010)  # past the measured lengths: the longest measured
    assert profile.draft_rows_s([]) == 0


def proposers():
    target, drafter = make_drafter("dspark")
    yield "dspark", target, BlockDrafterProposer(drafter, (1, 2))
    # A drafter that is often right (the target cut to one layer): accepted lengths vary per row.
    draft_model = tiny_llama(0, layers=1)
    draft_model.load_state_dict(target.state_dict(), strict=False)
    yield "model", target, ModelProposer(draft_model)


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "T1"])
def test_batched_equals_batch1_for_every_request(sampler):
    accepted = set()
    for name, target, proposer in proposers():
        expected = batch1(target, proposer, sampler, 4)
        got, gens = batched(target, proposer, sampler, 4)
        assert got == expected, name
        accepted |= {a for g in gens for a in g.accepted}
        if sampler.greedy:
            for prompt, limit, out in zip(PROMPTS, LIMITS, got):
                assert out == hf_greedy(target, prompt, limit, EOS)
    assert len(accepted) > 2, "rows should accept ragged lengths"


@pytest.mark.parametrize("rule", [ThresholdRule(0.5), CostRule(synthetic_profile(per_token=0.004), max_skip=4),
                                  CostRule(context_profile(), max_skip=4), CostRule(dear_profile())],
                         ids=["threshold", "cost_with_backoff", "cost_by_context", "cost_never_pays"])
def test_batched_with_stopping_rules_equals_batch1(rule):
    target, drafter = make_drafter("dspark")
    proposer = BlockDrafterProposer(drafter, (1, 2))
    for sampler in (Sampler(), Sampler(temperature=1.0)):
        assert batched(target, proposer, sampler, 4, rule)[0] == batch1(target, proposer, sampler, 4, rule)


def test_load_scheduler_is_lossless_at_T0_and_admits_ragged_lengths():
    target, drafter = make_drafter("dspark")
    proposer = BlockDrafterProposer(drafter, (1, 2))
    load = LoadPolicy(cheap_profile())
    got, gens = batched(target, proposer, Sampler(), 4, load=load)
    for prompt, limit, out in zip(PROMPTS, LIMITS, got):
        assert out == hf_greedy(target, prompt, limit, EOS)
    assert load.admitted and len({d for g in gens for d in g.drafted}) > 1


def count_backbone_passes(monkeypatch, drafter) -> list:
    """A list that grows by one per batched backbone pass of `drafter`."""
    passes, forward_blocks = [], drafter.forward_blocks
    monkeypatch.setattr(drafter, "forward_blocks", lambda *a, **k: passes.append(1) or forward_blocks(*a, **k))
    return passes


def test_load_scheduler_runs_no_drafter_where_no_admission_can_pay(monkeypatch):
    target, drafter = make_drafter("dspark")
    passes = count_backbone_passes(monkeypatch, drafter)
    proposer = BlockDrafterProposer(drafter, (1, 2))
    load = LoadPolicy(dear_profile())
    got, gens = batched(target, proposer, Sampler(), 4, load=load)
    for prompt, limit, out in zip(PROMPTS, LIMITS, got):
        assert out == hf_greedy(target, prompt, limit, EOS)
    assert not passes and not any(d for g in gens for d in g.drafted)
    # The same engine with a profile where admissions pay does run the drafter.
    batched(target, proposer, Sampler(), 4, load=LoadPolicy(cheap_profile()))
    assert passes


def test_load_scheduler_backs_off_batch_wide_when_nothing_is_admitted(monkeypatch):
    from specdraft.decode.scheduler import LoadRule

    target, drafter = make_drafter("dspark")
    passes = count_backbone_passes(monkeypatch, drafter)
    # Sure survival would pay (probing is allowed), but no real confidence can: one more position
    # widens every row's step by more than a whole token is worth.
    profile = synthetic_profile(per_token=0.004)
    profile.draft_batched = {"1": [0.001] * 5, "4": [0.004] * 5}
    load = LoadPolicy(profile, LoadRule(max_skip=4))
    got, _ = batched(target, BlockDrafterProposer(drafter, (1, 2)), Sampler(), 4, load=load)
    for prompt, limit, out in zip(PROMPTS, LIMITS, got):
        assert out == hf_greedy(target, prompt, limit, EOS)
    assert not any(load.admitted) and passes
    # Probes at steps 0, 1, 3, 7, then every 5th: requests that join do not restart the probing.
    assert len(passes) <= 4 + max(0, len(load.admitted) - 8) // 5


def test_plain_batched_decoding_equals_hf_greedy():
    target = tiny_llama(0)
    got, _ = batched(target, NoProposer(), Sampler(), 0, concurrency=5)
    for prompt, limit, out in zip(PROMPTS, LIMITS, got):
        assert out == hf_greedy(target, prompt, limit, EOS)


def test_session_rollback_and_compaction_keep_each_row_exact():
    """Logits after ragged keeps, removals and compaction equal a fresh batch-1 prefill of each row."""
    model = tiny_llama(0)
    session = BatchedSession(model)
    rows = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for row in rows:
        session.add(row)
    session.forward([[10, 11, 12], [13], [14, 15]])
    session.keep([1, 1, 2])
    rows = [rows[0] + [10], rows[1] + [13], rows[2] + [14, 15]]
    session.remove([1])
    rows = [rows[0], rows[2]]
    session.compact()
    logits, _ = session.forward([[16, 17], [18]])
    for r, (row, fed) in enumerate(zip(rows, [[16, 17], [18]])):
        fresh = CausalSession(model)
        expected, _ = fresh.forward(row + fed)
        torch.testing.assert_close(logits[r, : len(fed)], expected[-len(fed):], rtol=1e-5, atol=1e-5)


def test_maskless_step_equals_the_masked_step(monkeypatch):
    """Parity for the fast path: a step with no hole and no padding runs on the model's own causal mask;
    forcing the explicit 4D row mask gives the same logits, for one row and for rows of equal length."""
    model = tiny_llama(0)
    original = BatchedSession._plain

    def run(prompts):
        session = BatchedSession(model)
        for prompt in prompts:
            session.add(prompt)
        outputs = []
        for feed in ([[7, 8, 9]] * len(prompts), [[10]] * len(prompts)):
            assert session._plain(feed) == (BatchedSession._plain is original)  # the path under test runs
            logits, _ = session.forward(feed)
            session.keep([1] * len(prompts))  # reject the rest: a rollback each step
            outputs.append(logits)
        return outputs

    masks = []  # the steps that built an explicit 4D mask
    monkeypatch.setattr(batch_session, "row_mask", lambda *args: masks.append(1) or row_mask(*args))
    for prompts in ([[1, 2, 3, 4]], [[1, 2, 3], [4, 5, 6]]):
        fast = run(prompts)
        assert not masks  # the fast path passed no mask at all
        with monkeypatch.context() as patch:
            patch.setattr(BatchedSession, "_plain", lambda self, rows: False)
            masked = run(prompts)
        assert len(masks) == 2
        masks.clear()
        for a, b in zip(fast, masked):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_one_row_rollback_leaves_no_dead_slots():
    """Rejected positions at a row's end are cropped, not masked: one request's cache holds exactly its tokens."""
    model = tiny_llama(0)
    session = BatchedSession(model)
    session.add([1, 2, 3])
    session.forward([[4, 5, 6, 7]])
    session.keep([2])
    assert session.cache.get_seq_length() == session.lengths[0] == 5
    assert bool(session.valid.all())
    session.add([9, 9])  # a second, shorter row: its slots past its length are holes, kept and masked
    session.forward([[8], [10, 11]])
    session.keep([1, 0])
    assert session.valid.shape == (2, 6) and session.cache.get_seq_length() == 6 and session.lengths == [6, 2]
    assert not session._plain([[1], [1]])  # holes: the next step needs its 4D mask


def test_the_row_left_after_a_longer_one_leaves_runs_without_holes():
    """When the longer row leaves, its slots would stay as holes inside the short row's history: they are
    squeezed out, the lone row runs mask-free, and its logits equal a fresh batch-1 prefill."""
    model = tiny_llama(0)
    session = BatchedSession(model)
    session.add([1, 2, 3, 4, 5, 6])
    session.add([7, 8])
    session.forward([[9], [10]])
    session.keep([1, 1])
    session.remove([0])
    assert session.lengths == [3] and session.cache.get_seq_length() == 3 and session._plain([[11]])
    logits, _ = session.forward([[11]])
    expected, _ = CausalSession(model).forward([7, 8, 10, 11])
    torch.testing.assert_close(logits[0, :1], expected[-1:], rtol=1e-5, atol=1e-5)


def test_load_gate_admits_as_whole_blocks_would_and_draws_nothing_where_nothing_is_admitted():
    """scheduler=load stops a step after c_1 when admission would take nothing (LoadPolicy(lazy=True), the
    default); its reference twin drafts whole blocks and lets admission cut them (lazy=False). Both admit the
    same positions at every step and give the same tokens at T=0; where nothing is admitted, the lazy
    engine runs no LM head (no drafted token is drawn)."""
    target, drafter = make_drafter("dspark")
    never = synthetic_profile(per_token=0.004)  # probing allowed (sure survival would pay), admission never pays
    never.draft_batched = {"1": [0.001] * 5, "4": [0.004] * 5}
    mixed = synthetic_profile(per_token=0.001)  # admission pays on some steps, not on others
    mixed.draft_batched = {"1": [0.0001] * 5, "4": [0.0004] * 5}
    for profile in (mixed, never):
        runs = {}
        for lazy in (True, False):
            heads = []
            handle = drafter.lm_head.register_forward_hook(lambda *_: heads.append(1))
            load = LoadPolicy(profile, lazy=lazy)
            got, _ = batched(target, BlockDrafterProposer(drafter, (1, 2)), Sampler(), 4, load=load)
            handle.remove()
            runs[lazy] = (got, load.admitted, len(heads))
        assert runs[True][:2] == runs[False][:2]
        for prompt, limit, out in zip(PROMPTS, LIMITS, runs[True][0]):
            assert out == hf_greedy(target, prompt, limit, EOS)
        if profile is never:
            assert not any(runs[True][1]) and runs[True][2] == 0 < runs[False][2]
        else:  # steps of both kinds: the gate let some through and stopped others before their LM heads
            assert any(runs[True][1]) and not all(runs[True][1]) and 0 < runs[True][2] < runs[False][2]


def test_a_draft_is_timed_as_the_loop_meets_it_after_a_verify_step_with_a_position_to_take_in(monkeypatch):
    from specdraft.decode import profile as profile_module

    target, drafter = make_drafter()
    proposer = BlockDrafterProposer(drafter, (1, 2))
    events = []

    class Recording(BlockDrafterProposer):
        def commit(self, context_ids, features):
            events.append(("commit", len(context_ids)))
            super().commit(context_ids, features)

        def propose(self, *args, **kwargs):
            events.append(("propose", len(self.pending)))
            return super().propose(*args, **kwargs)

    monkeypatch.setattr(BlockDrafterProposer, "clone", lambda self: Recording(self.drafter, self.feature_layers))
    forward = CausalSession.forward
    monkeypatch.setattr(CausalSession, "forward",
                        lambda self, ids, last_only=False: events.append(("verify", len(ids))) or forward(self, ids, last_only))
    seconds = profile_module.measure_draft(proposer, target, context_length=6, max_draft=3, repeats=2)
    assert len(seconds) == 4 and all(s > 0 for s in seconds)
    timed = events[events.index(("verify", 6)) + 1 + 4:]  # after the context's prefill and one warm-up draft per length
    # every timed draft follows a one-token verify step and meets one committed position not yet taken in
    # (the context holds the pending token beyond the 6 prefilled positions, as the loop's does)
    assert timed == [event for i in range(8) for event in (("verify", 1), ("commit", 8 + i), ("propose", 1))]


def test_a_proposer_without_features_is_timed_the_same_way():
    from specdraft.decode import profile as profile_module
    from specdraft.decode.proposer import NgramProposer

    seconds = profile_module.measure_draft(NgramProposer(3), tiny_llama(0), context_length=6, max_draft=3, repeats=2)
    assert len(seconds) == 4 and all(s >= 0 for s in seconds)  # no target features to commit: None, as the loop does
