"""The OpenAI-compatible HTTP API over the batched speculative engine (FastAPI on uvicorn).

Endpoints: POST /v1/chat/completions and /v1/completions (streamed over SSE or not), GET /v1/models,
/health, /metrics (Prometheus text) and /v1/specdraft/ab (both A/B arms' figures as JSON). Requests are
checked here, before they reach the engine, so a bad one is answered with an OpenAI-style error body
(4xx) and never disturbs the batch; decode/serve_worker.py runs the engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
import uuid
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specdraft.decode.config import ServeConfig
from specdraft.decode.engine import Request
from specdraft.decode.sampling import Sampler
from specdraft.decode.server_metrics import ARMS, ServerMetrics
from specdraft.decode.serve_worker import EngineWorker, Job, QueueFull, WorkerDown
from specdraft.decode.textstream import TextStream

MAX_STOP_STRINGS = 4  # as OpenAI's API
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that would change the output distribution (lossless decoding samples from the target's own).
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []), "response_format": (None,)}


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, the offending parameter and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                             413: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Runtime:
    """What the app serves with."""

    cfg: ServeConfig
    tokenizer: object
    model_name: str
    context_window: int | None
    worker: EngineWorker
    metrics: ServerMetrics
    created: int
    arm_rng: random.Random
    device: torch.device  # where request generators live (the target's device)

    @property
    def max_prompt_tokens(self) -> int | None:
        return self.cfg.server.max_prompt_tokens or self.context_window


@dataclass
class Parsed:
    prompt_ids: list[int]
    sampler: Sampler
    max_tokens: int
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    arm: str


def make_app(runtime: Runtime) -> FastAPI:
    app = FastAPI(title="specdraft", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = runtime

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        runtime.metrics.errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(404)
    async def not_found(request, err):
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}", code="not_found").body(),
                            status_code=404)

    @app.exception_handler(405)
    async def bad_method(request, err):
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}").body(), status_code=405)

    @app.get("/health")
    async def health():
        waiting, running = runtime.worker.load()
        ok = runtime.worker.failure is None and runtime.worker.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped", "running": running, "waiting": waiting},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": runtime.model_name, "object": "model", "created": runtime.created,
                                            "owned_by": "specdraft", "max_model_len": runtime.context_window}]}

    @app.get("/metrics")
    async def metrics():
        return Response(runtime.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/specdraft/ab")
    async def ab_summary():
        return runtime.metrics.summary()

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await _read_json(request, runtime)
        _check_model(body, runtime)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' is required: a non-empty list of {role, content} objects", "messages")
        ids = _chat_ids(runtime.tokenizer, messages)
        return await _serve(request, runtime, _parse(body, ids, runtime), "chat")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await _read_json(request, runtime)
        _check_model(body, runtime)
        ids = _completion_ids(runtime.tokenizer, body.get("prompt"))
        return await _serve(request, runtime, _parse(body, ids, runtime), "text")

    return app


async def _read_json(request: HTTPRequest, runtime: Runtime) -> dict:
    limit = runtime.cfg.server.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit} "
                            "(server.max_body_bytes)", code="request_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise APIError(413, f"the request body is over {limit} bytes (server.max_body_bytes)", code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _check_model(body: dict, runtime: Runtime) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required (GET /v1/models lists it)", "model")
    if model != runtime.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {runtime.model_name!r}", "model",
                       "model_not_found")


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(400, f"{where}.content must be a string or a list of text parts", where)


def _chat_ids(tokenizer, messages: list) -> list[int]:
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] needs a role among {list(ROLES)} and a content", f"messages[{i}]")
        turns.append({"role": message["role"], "content": _text_of(message.get("content", ""), f"messages[{i}]")})
    try:
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as err:  # the template's own checks (roles must alternate, no system turn, ...)
        raise APIError(400, f"the target's chat template refused these messages: {err}", "messages") from None
    ids = list(encoded["input_ids"])
    if not ids:
        raise APIError(400, "the messages encode to no tokens", "messages")
    return ids


def _completion_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list; several (n prompts per request) are not served
    if isinstance(prompt, str) and prompt:
        ids = list(tokenizer(prompt)["input_ids"])
        if not ids:
            raise APIError(400, f"'prompt' {prompt[:40]!r} encodes to no tokens", "prompt")
        return ids
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < len(tokenizer) for t in prompt):
            raise APIError(400, f"'prompt' holds token ids outside the vocabulary (0..{len(tokenizer) - 1})", "prompt")
        return list(prompt)
    raise APIError(400, "'prompt' is required: a non-empty string, or a list of token ids (one prompt per request)",
                   "prompt")


def _number(body: dict, name: str, default, kind=float):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    return kind(value)


def _parse(body: dict, prompt_ids: list[int], runtime: Runtime) -> Parsed:
    """The request's decoding settings, checked against the server's limits."""
    defaults, server = runtime.cfg.decode, runtime.cfg.server
    for name, allowed in UNSUPPORTED.items():
        if body.get(name, None) not in allowed:
            raise APIError(400, f"'{name}' is not supported: specdraft decodes losslessly from the target's own "
                                "distribution", name, "unsupported_parameter")
    if _number(body, "n", 1, int) != 1:
        raise APIError(400, "'n' must be 1 (send one request per sample)", "n", "unsupported_parameter")
    temperature = _number(body, "temperature", defaults.temperature)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"'temperature' is {temperature}; it must be in [0, 2]", "temperature")
    top_p = _number(body, "top_p", defaults.top_p)
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' is {top_p}; it must be in (0, 1]", "top_p")
    top_k = _number(body, "top_k", defaults.top_k, int)
    if top_k == -1:
        top_k = 0  # vLLM's spelling of "off"
    if top_k < 0:
        raise APIError(400, f"'top_k' is {top_k}; it must be >= 0 (0 or -1: off)", "top_k")

    prompt_limit = runtime.max_prompt_tokens
    if prompt_limit and len(prompt_ids) > prompt_limit:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server takes at most {prompt_limit}",
                       "messages" if "messages" in body else "prompt", "context_length_exceeded")
    room = runtime.context_window - len(prompt_ids) + 1 if runtime.context_window else None  # the newest is never fed
    limit = min(x for x in (room, server.max_tokens) if x is not None) if (room or server.max_tokens) else None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, None, int)
    if max_tokens is None:
        max_tokens = limit if limit is not None else defaults.max_new_tokens
    if max_tokens < 1:
        raise APIError(400, f"'{name}' is {max_tokens}; it must be >= 1", name)
    if limit is not None and max_tokens > limit:
        raise APIError(400, f"'{name}' is {max_tokens}, past this request's limit of {limit} tokens (the context window "
                            f"of {runtime.context_window} minus the prompt's {len(prompt_ids)}, or server.max_tokens)",
                       name, "context_length_exceeded")
    if limit is not None and limit < 1:
        raise APIError(400, f"the prompt's {len(prompt_ids)} tokens fill the context window ({runtime.context_window})",
                       "messages" if "messages" in body else "prompt", "context_length_exceeded")

    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    seed = _number(body, "seed", None, int)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    arm = body.get("specdraft_arm")
    if arm is None:
        arm = "plain" if runtime.arm_rng.random() < server.ab_fraction else "spec"
    elif arm not in ARMS:
        raise APIError(400, f"'specdraft_arm' is {arm!r}; choose one of {list(ARMS)}", "specdraft_arm")
    return Parsed(prompt_ids, Sampler(temperature, top_k, top_p), max_tokens, stop, seed, stream,
                  bool(options.get("include_usage")), arm)


async def _serve(http: HTTPRequest, runtime: Runtime, parsed: Parsed, kind: str):
    seed = parsed.seed if parsed.seed is not None else secrets.randbits(63)
    generator = torch.Generator(device=runtime.device).manual_seed(seed)
    request = Request(parsed.prompt_ids, parsed.max_tokens, generator, parsed.sampler, speculate=parsed.arm == "spec")
    job = Job(request, TextStream(runtime.tokenizer, parsed.stop), parsed.arm, len(parsed.prompt_ids),
              asyncio.get_running_loop(), runtime.cfg.server.request_timeout_s)
    try:
        runtime.worker.submit(job)
    except QueueFull as err:
        raise APIError(429, f"the server is busy: {err}; retry later", code="server_busy") from None
    except WorkerDown as err:
        raise APIError(503, str(err), code="engine_stopped") from None
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if parsed.stream:
        return StreamingResponse(_sse(http, runtime, job, kind, ident, created, parsed.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    pieces = []
    try:
        while True:
            item = await _next_event(http, job)
            if item is None:  # the client left: the slot is freed below
                return Response(status_code=499)
            if item[0] == "text":
                pieces.append(item[1])
            elif item[0] == "error":
                raise APIError(item[1], item[2])
            else:
                break
    finally:
        runtime.worker.cancel(job)  # a no-op once finished; frees the slot if the client left
    text = "".join(pieces)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": job.finish_reason}
              if kind == "chat" else {"index": 0, "text": text, "finish_reason": job.finish_reason, "logprobs": None})
    return {"id": ident, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": runtime.model_name, "choices": [choice], "usage": _usage(job), "specdraft": {"arm": job.arm}}


async def _next_event(http: HTTPRequest, job: Job, poll_s: float = 0.5):
    """The job's next event; None once the client has disconnected (a non-streamed handler is not cancelled
    when its client leaves, so it looks). The worker ends a job past its timeout; past that plus a margin the
    handler gives up itself (a worker that stopped answering)."""
    give_up = job.arrived + job.timeout_s + 30
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=poll_s)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                return None
            if time.perf_counter() > give_up:
                return ("error", 504, f"no answer from the engine within {job.timeout_s:g} s")


def _usage(job: Job) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens}


async def _sse(http: HTTPRequest, runtime: Runtime, job: Job, kind: str, ident: str, created: int, include_usage: bool):
    """OpenAI's stream: chunks as `data: {json}` events, then `data: [DONE]`. A client that disconnects
    cancels this generator; `finally` frees its slot in the engine."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def event(choices: list, **extra) -> str:
        data = {"id": ident, "object": obj, "created": created, "model": runtime.model_name, **extra, "choices": choices}
        return f"data: {json.dumps(data)}\n\n"

    def chunk(delta: str | None, finish: str | None = None, first: bool = False, **extra) -> str:
        if kind == "chat":
            content = {"role": "assistant", "content": ""} if first else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
        return event([choice], **extra, **({"usage": None} if include_usage else {}))

    try:
        if kind == "chat":
            yield chunk(None, first=True)
        while True:
            item = await _next_event(http, job)
            if item is None:
                return
            if item[0] == "text":
                yield chunk(item[1])
            elif item[0] == "error":
                yield f"data: {json.dumps(APIError(item[1], item[2]).body())}\n\n"
                return
            else:
                break
        yield chunk(None, job.finish_reason, specdraft={"arm": job.arm})  # which A/B arm served it
        if include_usage:
            yield event([], usage=_usage(job))
        yield "data: [DONE]\n\n"
    finally:
        runtime.worker.cancel(job)
