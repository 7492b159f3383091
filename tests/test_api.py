"""The library API (specdraft.SpecDecoder, SamplingParams, load_drafter, distill) on a tiny saved target:
outputs equal HF `generate` at T=0 in float32, streaming joins to the same text, bad input is refused."""

from __future__ import annotations

import json

import pytest

import specdraft
from specdraft import SamplingParams, SpecDecoder
from tests.helpers import hf_greedy


@pytest.fixture(scope="module")
def ngram_decoder(tiny_model_dir):
    return SpecDecoder.from_pretrained(tiny_model_dir, proposer="ngram", dtype="float32", num_draft=3)


def oracle(decoder, prompt, max_new):
    return hf_greedy(decoder.target.model, decoder.encode(prompt), max_new, sorted(decoder.stop))


@pytest.mark.parametrize("proposer", ["ngram", "none", "drafter", "hybrid"])
def test_generate_equals_hf_generate(tiny_model_dir, tiny_export, proposer):
    drafter = str(tiny_export) if proposer in ("drafter", "hybrid") else None
    decoder = SpecDecoder.from_pretrained(tiny_model_dir, drafter=drafter, proposer=proposer, dtype="float32")
    prompts = ["w1 w2 w3 w1 w2 w3", "w7 w8 w9 w10"]
    outputs = decoder.generate(prompts, SamplingParams(max_new_tokens=12))
    assert len(outputs) == 2
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == oracle(decoder, prompt, 12)
        assert out.text == decoder.target.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        stats = out.stats
        assert stats["steps"] >= 1 and stats["finish_reason"] in ("stop", "length")
        assert stats["tau"] == pytest.approx((len(out.token_ids) - 1) / stats["steps"])
        if proposer == "none":
            assert stats["drafted"] == 0 and stats["tau"] == 1.0


def test_one_prompt_messages_and_token_ids(ngram_decoder):
    [by_text] = ngram_decoder.generate("w1 w2 w3", SamplingParams(max_new_tokens=6))
    [by_messages] = ngram_decoder.generate([{"role": "user", "content": "w1 w2 w3"}], SamplingParams(max_new_tokens=6))
    [by_ids] = ngram_decoder.generate(ngram_decoder.encode("w1 w2 w3"), SamplingParams(max_new_tokens=6))
    assert by_text.token_ids == by_messages.token_ids == by_ids.token_ids
    with pytest.raises(TypeError, match="a prompt is a string"):
        ngram_decoder.generate([3.5])


def test_stream_joins_to_generate_text(ngram_decoder):
    params = SamplingParams(max_new_tokens=10)
    pieces = list(ngram_decoder.stream("w1 w2 w3 w1 w2", params))
    [full] = ngram_decoder.generate("w1 w2 w3 w1 w2", params)
    assert len(pieces) >= 2 and "".join(pieces) == full.text


def test_a_stream_closed_early_frees_the_decoder(ngram_decoder):
    pieces = ngram_decoder.stream("w1 w2 w3 w1 w2", SamplingParams(max_new_tokens=10))
    next(pieces)
    pieces.close()  # stops the generation thread before it finishes
    [out] = ngram_decoder.generate("w7 w8 w9", SamplingParams(max_new_tokens=8))
    assert out.token_ids == oracle(ngram_decoder, "w7 w8 w9", 8)


def test_sampling_is_seeded(ngram_decoder):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    first = ngram_decoder.generate(["w1 w2", "w1 w2"], params)
    again = ngram_decoder.generate(["w1 w2", "w1 w2"], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # request i uses seed + i


def test_bad_settings_are_refused(tiny_model_dir, tiny_export):
    with pytest.raises(ValueError, match="choose fixed, threshold or cost"):
        SpecDecoder.from_pretrained(tiny_model_dir, scheduler="load")
    with pytest.raises(ValueError, match="needs proposer.path=EXPORT"):
        SpecDecoder.from_pretrained(tiny_model_dir, proposer="drafter", dtype="float32")
    drafter, layers = specdraft.load_drafter(str(tiny_export), tiny_model_dir)
    assert layers == (1, 2) and drafter.block_size == 3


def test_cost_scheduler_plans_on_a_measured_profile(tiny_model_dir, tiny_export):
    decoder = SpecDecoder.from_pretrained(tiny_model_dir, drafter=str(tiny_export), scheduler="cost", dtype="float32")
    [out] = decoder.generate("w1 w2 w3 w1 w2 w3", SamplingParams(max_new_tokens=10))
    assert out.token_ids == oracle(decoder, "w1 w2 w3 w1 w2 w3", 10)


def test_distill_api_runs_the_pipeline(tiny_model_dir, prompts_file, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"w{i} w{i + 1} w{i + 2}", "response": "w1 w2"}) + "\n"
                            for i in range(8)))
    results = specdraft.distill(["experiment=smoke", f"target.name_or_path={tiny_model_dir}", "data=jsonl",
                                 f"data.path={chat}", "drafter.draft_vocab_size=32", "drafter.feature_layers=[0,1]",
                                 "validate.data=jsonl", f"validate.data_path={prompts_file}", "trainer.steps=2"],
                                run_dir=str(tmp_path / "run"))
    assert results["lossless"] is True and results["train_steps"] == 2
    assert (tmp_path / "run" / "export" / "config.json").is_file() and (tmp_path / "run" / "results.json").is_file()


def test_an_export_names_its_own_target(tiny_model_dir, tiny_export):
    """Without a target, the decoder and load_drafter take the one the export records."""
    decoder = SpecDecoder.from_pretrained(drafter=str(tiny_export), dtype="float32", num_draft=2)
    assert decoder.target.path == tiny_model_dir
    [out] = decoder.generate("w1 w2 w3 w1 w2", SamplingParams(max_new_tokens=8))
    assert out.token_ids == oracle(decoder, "w1 w2 w3 w1 w2", 8)
    drafter, layers = specdraft.load_drafter(str(tiny_export))
    assert layers == (1, 2)
