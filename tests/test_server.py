"""The OpenAI-compatible server (decode/serve.py), driven as a user would: uvicorn on a free loopback port and
the real `openai` client with base_url. Text at T=0 equals target-only greedy decoding (HF generate), stop
strings and max_tokens end where OpenAI's API ends them, bad requests get 4xx bodies while the server keeps
serving, a bounded load test of 32 streaming clients, disconnects free their slots, the A/B split."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import statistics
import time

import httpx
import openai
import pytest

from specdraft.decode.config import ServeConfig, ServerSettings
from specdraft.decode.serve import build_runtime
from specdraft.io.config import TargetConfig
from specdraft.io.target import load_target
from tests.helpers import hf_greedy, serving

PROMPTS = ["w1 w2 w3 w1 w2", "w7 w8 w9 w7 w8 w9 w7", "w20 w21", "w3 w3 w3 w3", "w11 w12 w13 w14 w11 w12"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, max_body_bytes=20_000) as served:
        yield served


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Target-only greedy text of a chat prompt or a completion prompt: HF generate on the same weights."""
    target = load_target(tiny_model_dir, "float32")
    eos = target.tokenizer.eos_token_id

    def text(prompt: str, max_tokens: int, chat: bool = True) -> tuple[str, list[int]]:
        if chat:
            ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = target.tokenizer(prompt)["input_ids"]
        out = hf_greedy(target.model, list(ids), max_tokens, [eos])
        return target.tokenizer.decode(out, skip_special_tokens=True), out

    return text


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def metric(base: str, name: str, **labels) -> float:
    """One sample of /metrics (0 when absent)."""
    text = httpx.get(f"{base}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_chat_and_completion_streamed_and_not_equal_greedy_decoding(server, reference):
    base, runtime = server
    api = client(base)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    for prompt in PROMPTS[:3]:
        expected, tokens = reference(prompt, 16)
        reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                                            temperature=0)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == len(tokens)
        assert reply.choices[0].finish_reason == ("stop" if len(tokens) < 16 else "length")
        stream = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=16,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == len(tokens)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason

        expected, tokens = reference(prompt, 12, chat=False)
        done = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert done.choices[0].text == expected and done.usage.completion_tokens == len(tokens)
        streamed = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected
    drafted = metric(base, "specdraft_drafted_tokens_total", arm="spec")
    assert drafted > 0 and metric(base, "specdraft_accepted_tokens_total", arm="spec") > 0  # it did speculate


def test_stop_strings_and_max_tokens_end_generation_as_openai_does(server, reference):
    base, _ = server
    api = client(base)
    prompt = PROMPTS[1]
    full, tokens = reference(prompt, 20)
    words = full.split(" ")
    stop = words[3]  # a word of the output: the text ends before its first occurrence
    cut = full[: full.index(stop)]
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0,
                      stop=[stop, "never-generated"])
        if stream:
            chunks = list(api.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            reply = api.chat.completions.create(**kwargs)
            text, finish, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
        assert text == cut and finish == "stop"
        assert usage.completion_tokens == full.split(" ").index(stop) + 1  # tokens up to the one that completed it
    reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=5,
                                        temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    assert reply.choices[0].message.content == reference(prompt, 5)[0]


def test_seeded_sampling_repeats_and_arms_can_be_forced(server, reference):
    base, _ = server
    api = client(base)
    ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=1.0, seed=7)
    first = api.chat.completions.create(**ask).choices[0].message.content
    assert api.chat.completions.create(**ask).choices[0].message.content == first
    plain = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12,
                                        temperature=0, extra_body={"specdraft_arm": "plain"})
    assert plain.model_extra["specdraft"]["arm"] == "plain"
    assert plain.choices[0].message.content == reference(PROMPTS[0], 12)[0]


@pytest.mark.parametrize("case", ["invalid_json", "not_an_object", "missing_messages", "unknown_model", "missing_model",
                                  "negative_temperature", "top_p_zero", "top_p_above_one", "max_tokens_beyond_limit",
                                  "prompt_beyond_context", "oversized_body", "bad_stop", "n_two", "logprobs",
                                  "bad_role", "bad_arm", "zero_max_tokens", "unknown_route", "blank_prompt",
                                  "wrong_method"])
def test_bad_requests_get_clean_4xx_answers_and_the_server_keeps_serving(server, case):
    base, _ = server
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4}
    long_prompt = " ".join(["w5"] * 600)  # 600 words > the tiny target's 512 positions
    cases = {
        "invalid_json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "invalid_json"),
        "not_an_object": ("/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
        "missing_messages": ("/v1/chat/completions", {"model": "tiny"}, 400, None),
        "unknown_model": ("/v1/chat/completions", {**chat, "model": "gpt-5"}, 404, "model_not_found"),
        "missing_model": ("/v1/completions", {"prompt": "w1"}, 400, None),
        "negative_temperature": ("/v1/chat/completions", {**chat, "temperature": -0.5}, 400, None),
        "top_p_zero": ("/v1/chat/completions", {**chat, "top_p": 0}, 400, None),
        "top_p_above_one": ("/v1/chat/completions", {**chat, "top_p": 1.5}, 400, None),
        "max_tokens_beyond_limit": ("/v1/chat/completions", {**chat, "max_tokens": 100_000}, 400, "context_length_exceeded"),
        "prompt_beyond_context": ("/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 4}, 400,
                                  "context_length_exceeded"),
        "oversized_body": ("/v1/completions", {"model": "tiny", "prompt": "w1 " * 10_000}, 413, "request_too_large"),
        "bad_stop": ("/v1/chat/completions", {**chat, "stop": ["a", "b", "c", "d", "e"]}, 400, None),
        "n_two": ("/v1/chat/completions", {**chat, "n": 2}, 400, "unsupported_parameter"),
        "logprobs": ("/v1/chat/completions", {**chat, "logprobs": True}, 400, "unsupported_parameter"),
        "bad_role": ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        "bad_arm": ("/v1/chat/completions", {**chat, "specdraft_arm": "both"}, 400, None),
        "zero_max_tokens": ("/v1/chat/completions", {**chat, "max_tokens": 0}, 400, None),
        "unknown_route": ("/v1/embeddings", {"model": "tiny", "input": "x"}, 404, "not_found"),
        "blank_prompt": ("/v1/completions", {"model": "tiny", "prompt": "   "}, 400, None),  # encodes to no tokens
        "wrong_method": ("/health", {}, 405, None),
    }
    path, body, status, code = cases[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["type"]
    if code:
        assert error["code"] == code
    # The server keeps serving, and the refused request left nothing running.
    assert client(base).completions.create(model="tiny", prompt="w1 w2", max_tokens=3, temperature=0).choices[0].text
    assert httpx.get(f"{base}/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_openai_client_raises_its_own_error_types(server):
    base, _ = server
    api = client(base)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], temperature=-1)


async def _load(base: str, prompts: list[str], max_tokens: int) -> tuple[list[str], list[float], float]:
    api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        start = time.perf_counter()
        stream = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=max_tokens, temperature=0, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        return text, time.perf_counter() - start

    start = time.perf_counter()
    done = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=240)
    await api.close()
    return [t for t, _ in done], [s for _, s in done], time.perf_counter() - start


def test_32_concurrent_streaming_clients_each_get_their_own_greedy_output(tiny_model_dir, reference):
    prompts = [" ".join(f"w{(i * 7 + j * (i % 5 + 1)) % 50 + 1}" for j in range(3 + i % 6)) for i in range(32)]
    expected = [reference(p, 24)[0] for p in prompts]
    with serving(tiny_model_dir, max_concurrency=8, max_queue=32) as (base, runtime):
        texts, latencies, seconds = asyncio.run(_load(base, prompts, 24))
        assert texts == expected  # none lost, none mixed up with another
        tokens = metric(base, "specdraft_generation_tokens_total", arm="spec")
        ordered = sorted(latencies)
        print(f"\nload test: 32 streaming clients, p50 {statistics.median(latencies):.2f} s, "
              f"p99 {ordered[min(31, int(0.99 * 32))]:.2f} s, {tokens / seconds:.0f} tokens/s")
        assert metric(base, "specdraft_requests_total", arm="spec", finish_reason="length") + \
            metric(base, "specdraft_requests_total", arm="spec", finish_reason="stop") == 32
        assert metric(base, "specdraft_step_batch_rows_count") > 0 and metric(base, "specdraft_running_requests") == 0


def slow_steps(runtime, seconds: float) -> None:
    """Every engine step takes at least `seconds` more (the tiny target decodes faster than a test can act)."""
    step = runtime.worker.engine.step

    def slowed():
        time.sleep(seconds)
        return step()

    runtime.worker.engine.step = slowed


def open_stream(base: str, body: dict):
    """A streaming request left open: (client, response, line iterator)."""
    http = httpx.Client(timeout=30)
    response = http.send(http.build_request("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}),
                         stream=True)
    return http, response, response.iter_lines()


def test_clients_that_disconnect_mid_stream_free_their_slots_and_kv_memory(tiny_model_dir):
    with serving(tiny_model_dir, max_concurrency=4, max_queue=8) as (base, runtime):
        assert metric(base, "specdraft_memory_bytes", part="kv_cache") == 0
        slow_steps(runtime, 0.02)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 400, "temperature": 0}
        streams = [open_stream(base, body) for _ in range(6)]  # 4 run, 2 wait: both kinds must be freed
        for _, _, lines in streams[:2]:
            assert next(line for line in lines if line.startswith("data:"))  # the first chunk came
        # The last requests may reach the worker after a step began: the engine admits them at its next step.
        deadline = time.time() + 10
        while runtime.worker.load() != (2, 4):
            assert time.time() < deadline, f"expected 2 waiting and 4 running, got {runtime.worker.load()}"
            time.sleep(0.01)
        seen_kv = metric(base, "specdraft_memory_bytes", part="kv_cache")
        for http, response, _ in streams:
            response.close()
            http.close()
        deadline = time.time() + 60
        while runtime.worker.load() != (0, 0) or metric(base, "specdraft_memory_bytes", part="kv_cache") != 0:
            assert time.time() < deadline, f"slots not freed: {runtime.worker.load()}"
            time.sleep(0.1)
        assert seen_kv > 0  # the running requests held KV memory, and it went back to the idle size
        assert metric(base, "specdraft_requests_total", arm="spec", finish_reason="cancelled") == 6
        assert metric(base, "specdraft_running_requests") == 0 and metric(base, "specdraft_queue_depth") == 0
        # A client of a non-streamed request that gives up frees its slot too (steps slowed to a second: the
        # request would run for seconds, the client leaves after half of one).
        slow_steps(runtime, 1.0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.time() + 60
        while runtime.worker.load() != (0, 0):
            assert time.time() < deadline, f"slot not freed: {runtime.worker.load()}"
            time.sleep(0.1)
        assert metric(base, "specdraft_requests_total", arm="spec", finish_reason="cancelled") == 7
        assert client(base).completions.create(model="tiny", prompt="w1", max_tokens=2).choices[0].text


def test_a_full_server_answers_429_and_requests_past_the_timeout_end_with_504(tiny_model_dir):
    with serving(tiny_model_dir, max_concurrency=1, max_queue=0, request_timeout_s=1.5) as (base, runtime):
        slow_steps(runtime, 0.02)  # 400 tokens take >= 100 steps, 2 s: past the timeout
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 400, "temperature": 0}
        http, response, lines = open_stream(base, body)
        next(line for line in lines if line.startswith("data:"))
        with pytest.raises(openai.RateLimitError, match="busy"):
            client(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w2"}], max_tokens=2)
        events = [line for line in lines if line.startswith("data:")]
        response.close()
        http.close()
        assert json.loads(events[-1][5:])["error"]["type"] == "timeout_error"  # the stream ends with the error
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "timeout_error"
        assert metric(base, "specdraft_requests_total", arm="spec", finish_reason="timeout") == 2
        assert metric(base, "specdraft_request_errors_total", status="429") == 1


def test_ab_split_serves_both_arms_and_reports_their_tpot(tiny_model_dir, reference):
    with serving(tiny_model_dir, ab_fraction=0.5, ab_seed=3, max_concurrency=8) as (base, _):
        api = client(base)
        for i in range(40):
            prompt = PROMPTS[i % len(PROMPTS)]
            reply = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8,
                                                temperature=0)
            assert reply.choices[0].message.content == reference(prompt, 8)[0]  # lossless in both arms
        spec = metric(base, "specdraft_tpot_seconds_count", arm="spec")
        plain = metric(base, "specdraft_tpot_seconds_count", arm="plain")
        assert spec > 0 and plain > 0 and spec + plain <= 40
        assert metric(base, "specdraft_drafted_tokens_total", arm="plain") == 0  # the plain arm never drafts
        summary = httpx.get(f"{base}/v1/specdraft/ab").json()
        assert summary["spec"]["requests"] + summary["plain"]["requests"] == 40
        assert summary["spec"]["tpot_s_mean"] > 0 and summary["plain"]["tpot_s_mean"] > 0


def test_engine_failure_in_one_request_ends_only_that_request(server):
    """A request whose output handling raises gets a 500 error; the batch and the next requests go on."""
    base, runtime = server
    worker = runtime.worker
    original = worker._deliver
    broken = []

    def deliver(job, event):
        if job.stream.stop == ["w-boom"]:
            broken.append(job)
            raise RuntimeError("boom")
        return original(job, event)

    worker._deliver = deliver
    try:
        with pytest.raises(openai.InternalServerError, match="boom"):
            client(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=4,
                                                 stop=["w-boom"])
        reply = client(base).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                                     max_tokens=4)
        assert reply.usage.completion_tokens == 4
    finally:
        worker._deliver = original
    assert broken and httpx.get(f"{base}/health").json()["running"] == 0


def test_serve_script_runs_under_hydra_and_stops_cleanly(tiny_model_dir, tmp_path):
    """`python decode/serve.py ...` as a user starts it: serves a request, and on SIGINT stops with the A/B line."""
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, str(REPO / "decode" / "serve.py"), f"target.name_or_path={tiny_model_dir}",
           "target.dtype=float32", f"server.port={port}", "server.model_name=tiny", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.time() < deadline, "the server did not come up"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        reply = client(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1 w2 w3"}], max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    assert f"on http://127.0.0.1:{port}/v1" in out and "A/B spec: 1 requests" in out


def test_server_settings_are_checked(tiny_model_dir):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from specdraft import conf_dir
    from specdraft.decode.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        with pytest.raises(ConfigCompositionException, match="server.prot"):
            compose("serve", overrides=["server.prot=9000"])  # a typo is refused, not ignored
        cfg = compose("serve", overrides=["server.ab_fraction=0.25", "proposer=ngram"])
        assert cfg.server.ab_fraction == 0.25 and cfg.server.host == "127.0.0.1"
    with pytest.raises(ValueError, match="ab_fraction"):
        build_runtime(ServeConfig(target=TargetConfig(name_or_path=tiny_model_dir, dtype="float32"),
                                  server=ServerSettings(ab_fraction=1.5)))
