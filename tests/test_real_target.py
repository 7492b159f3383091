"""Slow: fp32 greedy speculative decoding on the real embedded target equals HF `generate`."""

from __future__ import annotations

import pytest
import torch

from decode.bench import eos_ids, hf_generate
from decode.generate import speculative_generate
from decode.proposer import NgramProposer, load_model_proposer
from decode.sampling import Sampler
from decode.session import CausalSession
from train.data import chat_prompt_ids, load_prompts
from train.target import load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_target("smollm2-135m-instruct", "float32")


def test_greedy_equals_hf_generate_on_mtbench(smollm2):
    sampler, stop = Sampler(), eos_ids(smollm2)
    session = CausalSession(smollm2.model)
    drafters = {"ngram": NgramProposer(), "model": load_model_proposer(smollm2.path, 4, smollm2)[0]}
    for item in load_prompts("mtbench", num_prompts=3):
        ids = chat_prompt_ids(smollm2.tokenizer, item["prompt"])
        expected = hf_generate(smollm2.model, ids, sampler, 40, stop, stop[0]).output_ids
        for name, proposer in drafters.items():
            got = speculative_generate(session, ids, proposer, sampler, 40, 4, stop)
            assert got.output_ids == expected, f"{name} differs from HF generate on {item['id']}"


def test_chat_template_and_coherent_answer(smollm2):
    ids = chat_prompt_ids(smollm2.tokenizer, "What is the capital of France?")
    got = speculative_generate(CausalSession(smollm2.model), ids, NgramProposer(), Sampler(), 20, 4, eos_ids(smollm2))
    assert "Paris" in smollm2.tokenizer.decode(got.output_ids)
