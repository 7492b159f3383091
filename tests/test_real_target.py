"""Slow: fp32 greedy speculative decoding on the real embedded target equals HF `generate`."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.bench_setup import hf_generate
from specdraft.io.target import eos_ids
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import NgramProposer, load_model_proposer
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from specdraft.io.data import chat_prompt_ids, load_prompts
from specdraft.io.target import load_target
from specdraft.decode.linear_kernels import candidates
from tests.helpers import every_kernel_plan, threads_for_tests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(threads_for_tests())
    return load_target("smollm2-135m-instruct", "float32")


def test_greedy_equals_hf_generate_on_mtbench(smollm2):
    sampler, stop = Sampler(), eos_ids(smollm2)
    session = CausalSession(smollm2.model)
    drafters = {"ngram": NgramProposer(), "model": load_model_proposer(smollm2.path, 4, smollm2)[0]}
    for item in load_prompts("mtbench", num_prompts=3):
        ids = chat_prompt_ids(smollm2.tokenizer, item["prompt"])
        expected = hf_generate(smollm2.model, ids, sampler, 40, stop, stop[0]).output_ids
        for name, proposer in drafters.items():
            got = speculative_generate(session, ids, proposer, GenerateConfig(sampler, 40, 4, eos_token_ids=stop))
            assert got.output_ids == expected, f"{name} differs from HF generate on {item['id']}"


def test_chat_template_and_coherent_answer(smollm2):
    ids = chat_prompt_ids(smollm2.tokenizer, "What is the capital of France?")
    config = GenerateConfig(Sampler(), 20, 4, eos_ids(smollm2))
    got = speculative_generate(CausalSession(smollm2.model), ids, NgramProposer(), config)
    assert "Paris" in smollm2.tokenizer.decode(got.output_ids)


def test_fast_backend_matches_hf_on_the_real_target(smollm2):
    """Logits on real prompts (prefill and 1-16-token steps) as close to exact (a float64 forward) as float32
    allows: within the HF model's own float32 error plus 1e-5 of the logits' scale (about 170 float32 ulps of
    the largest logit; a bf16 or tf32 kernel slipping in errs by 1e-2), and within 2e-4 of the HF forward (both
    are fp32 roundings of the same sums in other orders; how far apart depends on the CPU's kernels: fast ÷ HF
    error up to 2.5x on an AVX512-BF16 EPYC, 3.2x on an AVX512-FP16 Xeon); greedy tokens equal to HF generate's
    with every proposer, batch-1 and batched.

    One plan holds every kernel this machine runs, each at its own verify width (the widths below hit each
    one), so every kernel meets the real weights; what `kernel=auto` picks among them is measured and tested
    on tiny models (tests/test_linear_kernels.py), and measuring it here would cost most of this test."""
    import copy

    from specdraft.decode.backend import HFBackend
    from specdraft.decode.batch_generate import Request, batched_generate
    from specdraft.decode.fast_target import FastTarget

    plan = every_kernel_plan(torch.float32, smollm2.model.device)
    fast, ref = FastTarget(smollm2.model, plan), HFBackend(smollm2.model)
    assert set(fast.plan.kernels) == set(candidates(torch.float32, smollm2.model.device))
    exact = HFBackend(copy.deepcopy(smollm2.model).double())
    sampler, stop = Sampler(), eos_ids(smollm2)
    prompts = [chat_prompt_ids(smollm2.tokenizer, item["prompt"]) for item in load_prompts("mtbench", num_prompts=4)]
    widths = (1, 2, 3, 4, 5, 6, 8, 12, 16)
    for ids in prompts[:2]:
        caches = fast.new_cache(), ref.new_cache(), exact.new_cache()
        starts = [sum(widths[:i]) for i in range(len(widths))]
        for chunk in [ids] + [ids[start : start + n] for start, n in zip(starts, widths)]:
            tokens = torch.tensor([chunk])
            got, got_f = fast(tokens, caches[0], feature_layers=(4, 30))
            want, want_f = ref(tokens, caches[1], feature_layers=(4, 30))
            truth = exact(tokens, caches[2])[0].double()  # its float32 cast adds under 4e-6 at these magnitudes
            hf_error = float((want.double() - truth).abs().max())
            assert float((got.double() - truth).abs().max()) <= hf_error + 1e-5 * float(truth.abs().max())
            assert float((got - want).abs().max()) <= 2e-4
            torch.testing.assert_close(got_f, want_f, rtol=1e-5, atol=1e-4)
    session = CausalSession(fast)
    drafters = {"ngram": NgramProposer(), "model": load_model_proposer(smollm2.path, 4, smollm2)[0]}
    expected = [hf_generate(smollm2.model, ids, sampler, 32, stop, stop[0]).output_ids for ids in prompts]
    for index, (ids, want) in enumerate(zip(prompts, expected)):
        for name, proposer in drafters.items():
            if name == "model" and index >= 2:  # its HF-eager drafting is most of this test's time
                continue
            got = speculative_generate(session, ids, proposer, GenerateConfig(sampler, 32, 4, stop)).output_ids
            assert got == want, name
    requests = [Request(ids, 32) for ids in prompts]
    for gen, want in zip(batched_generate(fast, requests, NgramProposer(), sampler, 4, stop, max_concurrency=4), expected):
        assert gen.output_ids == want
