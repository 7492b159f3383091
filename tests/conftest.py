"""Shared test fixtures: tiny random Llama models built in the test, and small helpers."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

# Tiny models run fastest on one thread, and CI shares the machine with nothing else to use.
torch.set_num_threads(1)


def tiny_llama(seed: int, vocab_size: int = 64, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    """A random 2-layer Llama in float32 eval mode, deterministic for a seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    # Scale the output layer up so argmaxes are far from ties, as in a trained model.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """The oracle: HF generate, greedy, generated tokens only (EOS included when generated)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def other_model():
    return tiny_llama(seed=1)
