"""The drafter's fast twin (Linear layers packed for the chosen kernels) shares the drafter's tensors and drafts what the
reference modules draft: same tokens, q and confidences within fp32 rounding, batch-1 and batched."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.batch_draft import propose_blocks
from specdraft.decode.fast_drafter import (MIN_PACKED_OUTPUTS, FusedContextAttention, FusedGatedMLP, PackedLinearModule,
                                          _linear_shapes, drafter_for_backend, fast_drafter)
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.linear_kernels import candidates
from specdraft.decode.proposer import BlockDrafterProposer, Eagle3Proposer
from specdraft.decode.sampling import Sampler
from specdraft.models.drafter import BlockDrafter
from specdraft.decode.session import CausalSession
from tests.helpers import hf_greedy
from tests.helpers import make_drafter
from tests.helpers import make_eagle

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def start(target, proposer, context):
    _, features = CausalSession(target, proposer.feature_layers).forward(context[:-1])
    proposer.start(context, features)
    return proposer


def test_the_twin_shares_every_tensor_and_packs_only_linears():
    _, drafter = make_drafter("dspark")
    drafter.fc.input_scale.uniform_(0.5, 2.0)  # the fusion projection's scale is folded into its packed weight
    twin = fast_drafter(drafter)
    mine = {id(t) for t in drafter.parameters()} | {id(t) for t in drafter.buffers()}
    assert {id(t) for t in twin.parameters()} | {id(t) for t in twin.buffers()} <= mine
    # Per draft layer, q/k/v run as one matmul (and the context's k/v as another) and gate/up as one: what is
    # packed on its own is every other wide Linear (the fusion projection, o, down, the LM head, Markov W2).
    layers = len(drafter.layers)
    assert sum(isinstance(m, FusedContextAttention) for m in twin.modules()) == layers
    assert sum(isinstance(m, FusedGatedMLP) for m in twin.modules()) == layers
    packed = [m for m in twin.modules() if isinstance(m, PackedLinearModule)]
    wide = [m for m in drafter.modules() if isinstance(m, torch.nn.Linear) and m.out_features >= MIN_PACKED_OUTPUTS]
    assert len(packed) == len(wide) - 5 * layers and packed
    assert sum(_linear_shapes(drafter).values()) == len(packed) + 3 * layers  # the plan is measured on these
    hidden, block = torch.randn(1, 4, 32), torch.randn(1, 4, 32)
    for mine_layer, twin_layer in zip(drafter.layers, twin.layers):
        torch.testing.assert_close(twin_layer.mlp(hidden), mine_layer.mlp(hidden), atol=1e-5, rtol=1e-5)
        for got, want in zip(twin_layer.self_attn.project_qkv(block), mine_layer.self_attn.project_qkv(block)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The confidence head's one output stays on F.linear (a packed call costs more than its arithmetic).
    assert type(twin.confidence_head.proj) is torch.nn.Linear and twin.confidence_head.proj.weight is drafter.confidence_head.proj.weight
    features = torch.randn(5, 2 * 32)
    torch.testing.assert_close(twin.project_context(features), drafter.project_context(features), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["dspark", "dflash"])
@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "T1"])
def test_block_drafter_twin_proposes_what_the_reference_proposes(mode, sampler):
    target, drafter = make_drafter(mode)
    proposals = []
    for module in (drafter, fast_drafter(drafter)):
        proposer = start(target, BlockDrafterProposer(module, (1, 2)), PROMPT)
        proposals.append(proposer.propose(PROMPT, 4, sampler, torch.Generator().manual_seed(1)))
    ref, got = proposals
    assert got.tokens == ref.tokens
    for a, b in ((got.draft_probs, ref.draft_probs), (got.confidence, ref.confidence)):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Batched drafting over the twin: the same blocks as the reference's, row by row.
    rows = []
    for module in (drafter, fast_drafter(drafter)):
        proposers = [start(target, BlockDrafterProposer(module, (1, 2)), PROMPT[: n]) for n in (10, 7, 4)]
        blocks = propose_blocks(proposers, [PROMPT[:10], PROMPT[:7], PROMPT[:4]], [4, 2, 3], sampler,
                                [torch.Generator().manual_seed(r) for r in range(3)])
        rows.append([b.tokens for b in blocks])
    assert rows[0] == rows[1]


def test_eagle3_twin_decodes_exactly():
    target, drafter = make_eagle(vocab=torch.arange(0, 64, 2))
    proposer = Eagle3Proposer(fast_drafter(drafter), (1, 2))
    session = CausalSession(target, (1, 2))
    for prompt in ([3, 1, 4, 1, 5], [6, 6, 6, 6]):
        got = speculative_generate(session, prompt, proposer, GenerateConfig(Sampler(), 15, 3)).output_ids
        assert got == hf_greedy(target, prompt, 15)


def test_backend_setting_picks_the_twin_or_the_reference():
    _, drafter = make_drafter("dspark")
    assert drafter_for_backend(drafter, "hf") is drafter
    assert any(isinstance(m, PackedLinearModule) for m in drafter_for_backend(drafter, "auto", log=pytest.fail).modules())
    half = make_drafter("dspark")[1].to(torch.float16)
    lines = []
    assert drafter_for_backend(half, "auto", log=lines.append) is half and "float16" in lines[0]
    with pytest.raises(ValueError, match="target.backend=fast cannot run the drafter"):
        drafter_for_backend(half, "fast")


@pytest.mark.parametrize("kernel", [*candidates(torch.float32, torch.device("cpu")), "torch"])
def test_every_kernel_drafts_what_the_reference_drafts(kernel):
    target, drafter = make_drafter("dspark")
    proposals = []
    for module in (drafter, fast_drafter(drafter, kernel)):
        proposer = start(target, BlockDrafterProposer(module, (1, 2)), PROMPT)
        proposals.append(proposer.propose(PROMPT, 4, Sampler(temperature=1.0), torch.Generator().manual_seed(1)))
    assert proposals[1].tokens == proposals[0].tokens
    torch.testing.assert_close(proposals[1].draft_probs, proposals[0].draft_probs, atol=1e-5, rtol=1e-5)
    assert fast_drafter(drafter, kernel).kernel_plan.one_row == kernel


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=1.0)], ids=["greedy", "T1"])
def test_the_markov_memo_drafts_bit_for_bit_what_the_head_computes(sampler):
    """The memo of a vanilla Markov head's bias per previous token against the head computed every time: the same
    tokens, q and confidences exactly, step after step; clones share it; other head types keep none."""
    target, drafter = make_drafter("dspark")
    for module in (drafter, fast_drafter(drafter)):
        memo, plain = (start(target, BlockDrafterProposer(module, (1, 2), markov_memo=m), PROMPT) for m in (True, False))
        assert memo.markov_memo is not None and plain.markov_memo is None
        context = list(PROMPT)
        for step in range(4):
            got, want = (p.propose(context, 4, sampler, torch.Generator().manual_seed(step)) for p in (memo, plain))
            assert got.tokens == want.tokens
            for a, b in ((got.draft_probs, want.draft_probs), (got.confidence, want.confidence)):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
            context = context + got.tokens[:2]
            for p in (memo, plain):
                p.commit(context, CausalSession(target, (1, 2)).forward(context[:-1])[1][-2:])
        assert memo.markov_memo.hits > 0  # the steps' previous tokens repeat (the anchor, drafted tokens)
        assert memo.clone().markov_memo is memo.markov_memo
        if not sampler.greedy:  # negative control: a memo holding other tokens' biases drafts from another q
            entries = memo.markov_memo.entries
            biases = list(entries.values())
            for key, bias in zip(list(entries), biases[1:] + biases[:1]):
                entries[key] = bias
            got, want = (p.propose(context, 4, sampler, torch.Generator().manual_seed(9)) for p in (memo, plain))
            assert len(biases) > 1 and not torch.equal(got.draft_probs[: len(want.tokens)], want.draft_probs[: len(got.tokens)])
    gated = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1,
                         markov_rank=8, markov_head_type="gated")  # its bias reads the hidden state too
    assert BlockDrafterProposer(gated, (1, 2)).markov_memo is None
    assert BlockDrafterProposer(make_drafter("dflash")[1], (1, 2)).markov_memo is None


def test_a_drafter_in_another_dtype_than_the_target_stays_lossless():
    """proposer.dtype=bfloat16 beside a float32 target: features cast in, q sampled in float32, greedy output equal
    to the target's own; the setting's names resolve and a wrong one is refused."""
    from specdraft.decode.factory import drafter_dtype

    target, drafter = make_drafter("dspark")
    assert drafter_dtype("target", target) == torch.float32 and drafter_dtype("bfloat16", target) == torch.bfloat16
    assert drafter_dtype("auto", target) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="proposer.dtype='half'"):
        drafter_dtype("half", target)
    half = make_drafter("dspark")[1].to(torch.bfloat16)
    session = CausalSession(target, (1, 2))
    for module in (half, drafter_for_backend(half, "auto", log=lambda *a: None)):
        proposer = BlockDrafterProposer(module, (1, 2))
        got = speculative_generate(session, PROMPT, proposer, GenerateConfig(Sampler(), 15, 3)).output_ids
        assert got == hf_greedy(target, PROMPT, 15)
        start(target, proposer, PROMPT)
        sampled = proposer.propose(PROMPT, 3, Sampler(temperature=1.0), torch.Generator().manual_seed(0))
        assert sampled.draft_probs.dtype == torch.float32
        torch.testing.assert_close(sampled.draft_probs.sum(-1), torch.ones(len(sampled.tokens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_twin_fuses_its_norms_and_reads_rotary_rows_from_a_table(dtype):
    from specdraft.decode.fast_drafter import CachedRotary, FusedRMSNorm

    _, drafter = make_drafter()
    drafter = drafter.to(dtype)
    twin = fast_drafter(drafter, "torch")
    norms = [name for name, m in drafter.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(twin.get_submodule(name), FusedRMSNorm) for name in norms)
    assert twin.get_submodule(norms[0]).weight is drafter.get_submodule(norms[0]).weight
    x = torch.randn(3, 7, drafter.config.hidden_size).to(dtype)
    reference, fused = drafter.get_submodule(norms[0]), twin.get_submodule(norms[0])
    if dtype == torch.float32:
        torch.testing.assert_close(fused(x), reference(x), atol=1e-6, rtol=1e-6)
    else:  # HF's own order of roundings in bf16: the same tensor
        assert torch.equal(fused(x), reference(x))
    assert isinstance(twin.rotary, CachedRotary)
    like = x[:1]
    for positions in (torch.arange(5, 12)[None], torch.tensor([[3, 700, 1500]]), torch.arange(0, 4).reshape(2, 2)):
        got, want = twin.rotary(like, positions), drafter.rotary(like, positions)
        assert all(torch.equal(g, w) and g.dtype == dtype for g, w in zip(got, want))  # bit for bit, past the first table
    assert twin.rotary.tables[(dtype, like.device)][0].shape[0] >= 1501
    drafter.rotary.rope_type = "dynamic"  # cos/sin rescaled by the longest position of a call: no table
    assert not isinstance(fast_drafter(drafter, "torch").rotary, CachedRotary)


def test_a_drafter_cast_to_bf16_keeps_its_rotary_frequencies_in_float32():
    from specdraft.io.target import to_dtype

    _, drafter = make_drafter()
    before = {name: b.clone() for name, b in drafter.named_buffers() if name.endswith("inv_freq")}
    assert before
    rounded = make_drafter()[1].to(torch.bfloat16)  # nn.Module.to rounds them: the negative control
    assert any(b.dtype == torch.bfloat16 for name, b in rounded.named_buffers() if name.endswith("inv_freq"))
    cast = to_dtype(drafter, torch.bfloat16)
    assert cast is drafter and drafter.fc.weight.dtype == torch.bfloat16
    after = dict(drafter.named_buffers())
    assert all(after[name].dtype == torch.float32 and torch.equal(after[name], b) for name, b in before.items())
    positions = torch.arange(300, 307)[None]
    like = torch.zeros(1, dtype=torch.bfloat16)
    exact = [t.to(torch.bfloat16) for t in make_drafter()[1].rotary(torch.zeros(1), positions)]
    assert all(torch.equal(a, b) for a, b in zip(drafter.rotary(like, positions), exact))
    assert not all(torch.equal(a, b) for a, b in zip(rounded.rotary(like, positions), exact))
