"""Regeneration by the target: batched output equals one-by-one greedy output; resumable after a kill."""

from __future__ import annotations

from tests.helpers import hf_greedy
from specdraft.io.data import chat_prompt_ids, response_ids_from_text, training_example
from specdraft.train.regenerate import load_regenerated, read_done, regenerate
from specdraft.io.target import load_target


def test_batched_regeneration_matches_single_greedy_and_resumes(tiny_model_dir, tmp_path):
    target = load_target(tiny_model_dir, "float32")
    prompts = [{"id": f"p{i}", "prompt": " ".join(f"w{j}" for j in range(i, 2 * i + 1))} for i in range(5)]
    path = regenerate(target.model, target.tokenizer, prompts[:3], tmp_path, max_new_tokens=6, batch_size=2)
    # Simulate a kill mid-write: a torn last line.
    with path.open("a") as f:
        f.write('{"id": "p3", "prom')
    regenerate(target.model, target.tokenizer, prompts, tmp_path, max_new_tokens=6, batch_size=2)
    done = read_done(path)
    assert sorted(done) == [f"p{i}" for i in range(5)]
    eos = target.tokenizer.eos_token_id
    for item in prompts:
        ids = chat_prompt_ids(target.tokenizer, item["prompt"])
        assert done[item["id"]]["response_ids"] == hf_greedy(target.model, ids, 6, eos=[eos])
    assert len(load_regenerated(path)) == 5
    assert len(path.read_text().splitlines()) == 5  # nothing generated twice


def test_regeneration_on_the_decode_engine_equals_single_greedy(tiny_model_dir, tmp_path):
    """The distill pipeline's generator: continuous batching on the fast backend, same greedy responses."""
    from specdraft.pipeline import engine_generator

    target = load_target(tiny_model_dir, "float32")
    generate = engine_generator(target, "auto", concurrency=2)
    assert engine_generator(target, "hf", concurrency=2) is None  # the reference: HF generate
    prompts = [{"id": f"p{i}", "prompt": " ".join(f"w{j}" for j in range(i, 3 * i + 1))} for i in range(5)]
    path = regenerate(target.model, target.tokenizer, prompts, tmp_path, max_new_tokens=9, batch_size=3, generate=generate)
    done = read_done(path)
    eos = target.tokenizer.eos_token_id
    for item in prompts:
        ids = chat_prompt_ids(target.tokenizer, item["prompt"])
        assert done[item["id"]]["response_ids"] == hf_greedy(target.model, ids, 9, eos=[eos])


def test_training_example_masks_the_prompt(tiny_model_dir):
    target = load_target(tiny_model_dir, "float32")
    response = response_ids_from_text(target.tokenizer, "w5 w6")
    example = training_example(target.tokenizer, "w1 w2", response, max_length=100)
    prompt_len = len(chat_prompt_ids(target.tokenizer, "w1 w2"))
    assert example["input_ids"][prompt_len:] == response and response[-1] == target.tokenizer.eos_token_id
    assert example["loss_mask"] == [False] * prompt_len + [True] * len(response)
    cut = training_example(target.tokenizer, "w1 w2", response, max_length=prompt_len + 1)
    assert len(cut["input_ids"]) == len(cut["loss_mask"]) == prompt_len + 1
