"""The batched engine as the server drives it (decode/engine.py): requests with their own samplers and A/B
arms in one batch equal their batch-1 outputs, requests joining while others run, cancellation frees the
row and the KV memory; and the server's text stream (decode/textstream.py): stop strings, held-back text."""

from __future__ import annotations

import pytest
import torch

from specdraft.decode.engine import BatchEngine, Request
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.proposer import BlockDrafterProposer, NgramProposer
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from specdraft.decode.textstream import TextStream
from tests.helpers import EOS, LIMITS, PROMPTS, make_drafter, tiny_tokenizer

SAMPLERS = [Sampler(), Sampler(temperature=1.0), Sampler(temperature=0.7, top_k=8), Sampler(), Sampler(temperature=1.0, top_p=0.8)]


def alone(model, proposer, prompt, limit, sampler, seed, num_draft):
    """One request through the batch-1 loop (the reference)."""
    session = CausalSession(model, proposer.feature_layers)
    config = GenerateConfig(sampler, limit, num_draft, EOS)
    return speculative_generate(session, prompt, proposer.clone(), config,
                                generator=torch.Generator().manual_seed(seed)).output_ids


def drive(engine: BatchEngine, late: list[Request] = ()) -> dict[int, list[int]]:
    """Step until idle; `late` requests are submitted one per step after the first (joining a running batch)."""
    outputs, late = {}, list(late)
    while not engine.idle or late:
        if late and engine.running:
            engine.submit(late.pop(0))
        for event in engine.step():
            if event.finished and not event.cancelled:
                outputs[event.rid] = list(event.result.output_ids)
    return outputs


@pytest.mark.parametrize("kind", ["dspark", "ngram"])
def test_mixed_samplers_and_arms_in_one_batch_equal_batch1(kind):
    target, drafter = make_drafter("dspark")
    proposer = BlockDrafterProposer(drafter, (1, 2)) if kind == "dspark" else NgramProposer(3)
    engine = BatchEngine(target, proposer, Sampler(), 3, EOS, max_concurrency=3)
    requests = [Request(p, n, torch.Generator().manual_seed(10 + i), SAMPLERS[i], speculate=i % 2 == 0)
                for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    first, late = requests[:2], requests[2:]
    for request in first:
        engine.submit(request)
    outputs = drive(engine, late)
    for i, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        # the plain arm (odd requests) decodes as num_draft=0 would; both give the target's own tokens
        assert outputs[i] == alone(target, proposer, prompt, limit, SAMPLERS[i], 10 + i, 3 if i % 2 == 0 else 0), i


def test_cancelling_frees_the_row_and_the_kv_memory():
    target, drafter = make_drafter("dspark")
    engine = BatchEngine(target, BlockDrafterProposer(drafter, (1, 2)), Sampler(), 3, EOS, max_concurrency=2)
    rids = [engine.submit(Request(p, 40)) for p in PROMPTS[:3]]
    engine.step()
    assert engine.running == 2 and engine.waiting == 1 and engine.kv_bytes() > 0
    assert engine.cancel(rids[2])  # still queued: gone at once
    assert engine.waiting == 0
    assert engine.cancel(rids[0])
    events = engine.step()
    assert any(e.rid == rids[0] and e.cancelled for e in events) and engine.running == 1
    assert not engine.cancel(rids[0])  # already gone
    engine.cancel(rids[1])
    engine.step()
    assert engine.idle and engine.kv_bytes() == 0
    # the engine serves on after cancellations: a new request equals its batch-1 output
    rid = engine.submit(Request(PROMPTS[0], 9))
    assert drive(engine)[rid] == alone(target, BlockDrafterProposer(drafter, (1, 2)), PROMPTS[0], 9, Sampler(), 0, 3)


def test_submit_refuses_an_empty_prompt_or_no_tokens():
    target, _ = make_drafter("dspark")
    engine = BatchEngine(target, NgramProposer(3), Sampler(), 3, EOS)
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.submit(Request([], 4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request([1, 2], 0))


class _Words:
    """A tokenizer whose tokens decode to fixed strings (to place stop strings across tokens)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(self.pieces[t] for t in tokens)


def test_text_stream_ends_before_a_stop_string_split_across_tokens():
    words = _Words(["Hel", "lo", " wor", "ld", "!", " again"])
    stream = TextStream(words, ["world"])
    assert stream.push([0, 1]) == "Hello"
    assert stream.push([2]) == " "  # "wor" could begin "world": held back
    assert stream.push([3, 4, 5]) == ""  # "world" appeared: the text ends before it
    assert stream.stopped and stream.text == "Hello " and len(stream.tokens) == 4  # tokens up to "ld"
    assert stream.push([4]) == "" and stream.finish() == ""


def test_text_stream_releases_held_text_that_did_not_become_a_stop_string():
    stream = TextStream(_Words(["a", " wo", "rm", "\ufffd"]), ["world", "###"])
    assert stream.push([0, 1]) == "a "  # "wo" could begin "world": held back
    assert stream.push([2]) == "worm"  # no longer a prefix of "world"
    assert stream.push([3]) == ""  # an unfinished character is held back
    assert stream.finish() == "\ufffd" and not stream.stopped


def test_text_stream_holds_back_every_pending_byte_of_a_character():
    """Byte-fallback tokenizers decode each pending byte of a character as one U+FFFD."""
    stream = TextStream(_Emoji())
    assert stream.push([0, 1]) == "a"
    assert stream.push([2]) == ""  # three bytes pending: "a" + 3 x U+FFFD, nothing more to send
    assert stream.push([3]) == "\U0001F600b" and stream.finish() == ""


class _Emoji:
    """Decodes like a byte-fallback tokenizer: the emoji's four bytes show as U+FFFD until the last one."""

    def decode(self, tokens, skip_special_tokens=True):
        text, pending = "", 0
        for token in tokens:
            if token == 0:
                text += "a"
            elif token in (1, 2):
                pending += 2 if token == 2 else 1
            else:
                text, pending = text + "\U0001F600b", 0
        return text + "\ufffd" * pending


def test_text_stream_with_a_real_tokenizer_matches_decoding_at_once():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("w1 w2 w3 w4 w5")["input_ids"]
    stream = TextStream(tokenizer)
    pieces = [stream.push(ids[i : i + 2]) for i in range(0, len(ids), 2)] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
