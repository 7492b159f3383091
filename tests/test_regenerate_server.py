"""Regeneration through an OpenAI-compatible server: a small one (starlette + uvicorn, on loopback) serves the
tiny target; two processes' shares together equal local regeneration token for token, a rerun resumes
without asking again, and a failing server gives a clear error that keeps what was saved."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from specdraft.train.regenerate import regenerate
from specdraft.train.regenerate_server import read_all_done, regenerate_via_server
from specdraft.io.target import load_target


def make_app(model, tokenizer, log: list):
    """/v1/chat/completions over an HF model: the chat template, greedy (or sampled) generation, text back."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    eos = tokenizer.eos_token_id

    async def chat(request):
        body = await request.json()
        log.append(body)
        if body.get("model") != "tiny":
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not served"}}, status_code=404)
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([list(ids)]), max_new_tokens=body["max_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        finish = "stop" if eos in out else "length"
        out = out[: out.index(eos)] if eos in out else out
        message = {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)}
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": "tiny",
                             "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                             "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    import uvicorn

    target = load_target(tiny_model_dir, "float32")
    log: list = []
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    instance = uvicorn.Server(uvicorn.Config(make_app(target.model, target.tokenizer, log), host="127.0.0.1", port=port,
                                             log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", target, log
    instance.should_exit = True
    thread.join(timeout=10)


PROMPTS = [{"id": f"p{i}", "prompt": " ".join(f"w{(3 * i + j) % 40}" for j in range(3 + i % 4))} for i in range(7)]


def test_server_regeneration_equals_local_and_resumes(tmp_path, server):
    url, target, log = server
    local = read_all_done(regenerate(target.model, target.tokenizer, PROMPTS, tmp_path / "local", max_new_tokens=6,
                                     batch_size=1).parent)
    for rank in (0, 1):  # two processes' shares, as under accelerate launch
        regenerate_via_server(url, "tiny", target.tokenizer, PROMPTS, tmp_path / "served", max_new_tokens=6,
                              concurrency=3, rank=rank, world=2)
    served = read_all_done(tmp_path / "served")
    assert sorted((tmp_path / "served").glob("responses-r*.jsonl")) == [tmp_path / "served" / f"responses-r{r}.jsonl" for r in (0, 1)]
    assert {k: v["response_ids"] for k, v in served.items()} == {k: v["response_ids"] for k, v in local.items()}
    assert any(v["response_ids"][-1] == target.tokenizer.eos_token_id for v in served.values()) or all(
        len(v["response_ids"]) == 6 for v in served.values())
    asked = len(log)
    regenerate_via_server(url, "tiny", target.tokenizer, PROMPTS, tmp_path / "served", max_new_tokens=6, rank=0, world=2)
    assert len(log) == asked  # everything was done: nothing asked again


def test_server_failure_is_clear_and_keeps_progress(tmp_path, server):
    url, target, _ = server
    with pytest.raises(RuntimeError, match=r"regeneration server .* failed on prompt 'p0' \(NotFoundError"):
        regenerate_via_server(url, "no-such-model", target.tokenizer, PROMPTS[:2], tmp_path, max_new_tokens=4)
    assert read_all_done(tmp_path) == {}


def test_server_resume_asks_with_the_uninterrupted_runs_seeds(tmp_path, server):
    url, target, log = server

    def seeds_asked(out_dir, rank, world):
        before = len(log)
        regenerate_via_server(url, "tiny", target.tokenizer, PROMPTS, out_dir, max_new_tokens=2, temperature=0.7,
                              concurrency=1, seed=5, rank=rank, world=world)
        return {body["messages"][0]["content"]: body["seed"] for body in log[before:]}

    full = seeds_asked(tmp_path / "full", rank=1, world=2)
    assert full == {p["prompt"]: 5 + i for i, p in enumerate(PROMPTS) if i % 2 == 1}  # a prompt's place among all
    shard = (tmp_path / "full" / "responses-r1.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "responses-r1.jsonl").write_text("".join(shard[:1]))  # killed after its first record
    resumed = seeds_asked(tmp_path / "cut", rank=1, world=2)
    assert resumed == {prompt: seed for prompt, seed in full.items() if prompt != PROMPTS[1]["prompt"]}
