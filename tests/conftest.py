"""Shared test fixtures: tiny random Llama models built in the test, and small helpers."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

# Tiny models run fastest on one thread, and CI shares the machine with nothing else to use.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _profile_cache(tmp_path_factory, monkeypatch):
    """Cost profiles measured by tests go to a temporary folder, never to the user's cache (the environment
    variable reaches the entry points that tests start as subprocesses)."""
    import decode.profile

    folder = tmp_path_factory.getbasetemp() / "profiles"
    monkeypatch.setattr(decode.profile, "CACHE_DIR", folder)
    monkeypatch.setenv("SPECDRAFT_PROFILE_DIR", str(folder))


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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer(vocab_size: int = 64, shift: int = 0):
    """A word-level tokenizer with a chat template: specials, role names, then words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    words = [f"w{i + shift}" for i in range(vocab_size - len(specials))]
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(path, seed: int = 0, vocab_size: int = 64, layers: int = 2, shift: int = 0) -> str:
    """A tiny Llama + tokenizer saved as a model folder, EOS = <|im_end|>."""
    model = tiny_llama(seed, vocab_size=vocab_size, layers=layers)
    tokenizer = tiny_tokenizer(vocab_size, shift)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "w1 w2 w3 w1 w2 w3", "id": "a"}, {"prompt": "w7 w8 w9 w10"}, {"prompt": "w20"}]
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    return str(path)
