"""The thread that steps the batched engine for the server (continuous batching).

HTTP handlers run on uvicorn's event loop; the engine (decode/engine.py) runs here, on one thread, so torch
never runs two forwards at once. Handlers hand in Jobs and cancellations under a lock; between steps the
worker lets new requests join and cancelled ones leave (their row and KV slots go at that step), runs one
step for the whole batch, and passes each request's new text (decode/textstream.py: stop strings, held-back
partial characters) back to its handler's asyncio queue. A failure while handling one request's output ends
that request alone; a failure inside a batch step ends the requests of that step with a server error and
the engine is rebuilt, so the server keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from specdraft.decode.engine import BatchEngine, Request
from specdraft.decode.server_metrics import ServerMetrics
from specdraft.decode.textstream import TextStream


class QueueFull(Exception):
    """Every slot and queue place is taken (HTTP 429)."""


class WorkerDown(Exception):
    """The engine worker has stopped (HTTP 503); /health says so too."""


@dataclass
class Job:
    """One HTTP request's generation, as the worker and its handler share it."""

    request: Request
    stream: TextStream
    arm: str  # "spec" or "plain"
    prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    timeout_s: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    rid: int | None = None
    first_at: float | None = None
    finish_reason: str | None = None
    closed: bool = False  # the client went away (or the handler gave up)

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.tokens)

    def send(self, *item) -> None:
        """Hand ("text", piece), ("done", finish_reason) or ("error", status, message) to the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            pass


class EngineWorker:
    """Owns the engine; `submit` and `cancel` may be called from any thread."""

    def __init__(self, make_engine: Callable[[], BatchEngine], metrics: ServerMetrics, max_queue: int,
                 eos_ids: set[int], log=print):
        self.make_engine, self.metrics, self.max_queue, self.eos, self.log = make_engine, metrics, max_queue, eos_ids, log
        self.engine = make_engine()
        self.jobs: dict[int, Job] = {}  # by engine request id: joined the engine, not finished
        self._inbox: list[Job] = []
        self._cancels: list[Job] = []
        self._alive = 0  # submitted and not finished (queued here, in the engine's queue, or running)
        self._cond = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # set if the worker thread itself died
        self.thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.thread.join(timeout=30)

    @property
    def capacity(self) -> int:
        return self.engine.max_concurrency + self.max_queue

    def submit(self, job: Job) -> None:
        with self._cond:
            if self.failure is not None or self._stopping:
                raise WorkerDown("the engine worker has stopped; see the server log")
            if self._alive >= self.capacity:
                raise QueueFull(f"all {self.engine.max_concurrency} slots and {self.max_queue} queue places are taken")
            self._alive += 1
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left or gave up: free its slot at the next step (a finished job is left alone)."""
        with self._cond:
            if job.finish_reason is None and not job.closed:
                job.closed = True
                self._cancels.append(job)
                self._cond.notify()

    def load(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        with self._cond:
            return self._alive - len(self.jobs) + self.engine.waiting, self.engine.running

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._cancels or self._stopping or not self.engine.idle):
                        self._cond.wait(timeout=1.0)
                    if self._stopping:
                        return
                    new, self._inbox = self._inbox, []
                    gone, self._cancels = self._cancels, []
                for job in new:
                    self._admit(job)
                for job in gone:
                    self._drop(job, "cancelled", notify=False)
                self._expire()
                if not self.engine.idle:
                    self._step()
                self._gauges()
        except BaseException:  # the worker must not die silently: /health reports it, submit refuses
            with self._cond:
                self.failure = traceback.format_exc()
                waiting, self._inbox = self._inbox, []
            self.log(f"engine worker stopped: {self.failure}")
            for job in list(self.jobs.values()) + waiting:
                job.send("error", 500, "the engine worker stopped; see the server log")

    def _admit(self, job: Job) -> None:
        """Hand a job to the engine's queue; a request the engine refuses ends alone with a 400."""
        if job.closed:
            self._end(job, "cancelled", notify=False)
            return
        try:
            job.rid = self.engine.submit(job.request)
        except ValueError as err:
            job.send("error", 400, str(err))
            self._end(job, "error", notify=False)
            return
        self.jobs[job.rid] = job

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as err:  # a step serves every running request: end them, rebuild, go on serving
            running = [job for job in self.jobs.values() if job.first_at is not None]
            queued = [job for job in self.jobs.values() if job.first_at is None]  # never joined: they go on
            self.log(f"engine step failed ({type(err).__name__}: {err}); ending its {len(running)} running requests")
            for job in running:
                job.send("error", 500, f"the decoding step failed: {type(err).__name__}: {err}")
                self._end(job, "error", notify=False)
            next_rid, self.engine = self.engine.next_rid, self.make_engine()
            self.engine.next_rid = next_rid
            self.jobs.clear()
            for job in queued:
                job.rid = None
                self._admit(job)
            return
        verified = [event for event in events if not (event.joined or event.cancelled)]
        if verified:
            self.metrics.engine_step(len(verified), sum(event.drafted for event in verified))
        for event in events:
            job = self.jobs.get(event.rid)
            if job is None or event.cancelled:
                continue
            try:
                self._deliver(job, event)
            except Exception as err:  # this request's output handling failed: end it alone
                self.log(f"request {event.rid} failed: {type(err).__name__}: {err}")
                job.send("error", 500, f"{type(err).__name__}: {err}")
                self._drop(job, "error", notify=False)

    def _deliver(self, job: Job, event) -> None:
        before = len(job.stream.tokens)
        piece = job.stream.push(event.new_tokens)
        kept = len(job.stream.tokens) - before  # a stop string keeps only the tokens up to it
        if event.joined:  # the prefill's token
            job.first_at = time.perf_counter()
            self.metrics.first_token(job.arm)
        else:
            self.metrics.step(job.arm, event.drafted, event.accepted, kept, job.request.speculate)
        if piece:
            job.send("text", piece)
        if job.stream.stopped:
            self._drop(job, "stop")  # a stop string: the engine may still hold the request
        elif event.finished:
            rest = job.stream.finish()
            if rest:
                job.send("text", rest)
            self._end(job, "stop" if event.result.output_ids[-1] in self.eos else "length")

    def _expire(self) -> None:
        now = time.perf_counter()
        for job in list(self.jobs.values()):
            if now - job.arrived > job.timeout_s:
                job.send("error", 504, f"the request ran past the server's timeout of {job.timeout_s:g} s")
                self._drop(job, "timeout", notify=False)

    def _drop(self, job: Job, reason: str, notify: bool = True) -> None:
        """End a job the engine may still run: cancel it there (its slot goes at the next step)."""
        if job.finish_reason is not None:
            return  # ended already (its engine id may belong to another request by now)
        if job.rid is not None:
            self.engine.cancel(job.rid)
        self._end(job, reason, notify)

    def _end(self, job: Job, reason: str, notify: bool = True) -> None:
        if job.finish_reason is not None:
            return
        job.finish_reason = reason
        if job.rid is not None:
            self.jobs.pop(job.rid, None)
        with self._cond:
            self._alive -= 1
        first = None if job.first_at is None else job.first_at - job.arrived
        self.metrics.finished(job.arm, reason, job.prompt_tokens, job.completion_tokens, first,
                              time.perf_counter() - job.arrived)
        if notify:
            job.send("done", reason)

    def _gauges(self) -> None:
        waiting, running = self.load()
        self.metrics.set_load(waiting, running)
        self.metrics.set_memory("kv_cache", self.engine.kv_bytes())
