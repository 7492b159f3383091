"""OpenAI-compatible server with speculative decoding: `python decode/serve.py [key=value ...]`.

Same `target`, `proposer` and `scheduler` groups as decode/bench.py, `decode.*` as the defaults of requests
that leave a setting out, and `server.*` (host, port, limits, the A/B split). Point any OpenAI client at
http://HOST:PORT/v1. What it serves and measures: decode/server.py; how it batches: decode/serve_worker.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]  # run as a file: import the package, not this folder's modules (profile.py!) as top-level names

import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from specdraft import conf_dir  # noqa: E402
from specdraft.decode.backend import build_backend  # noqa: E402
from specdraft.decode.bench_setup import with_verifier  # noqa: E402
from specdraft.decode.config import ServeConfig, register_configs  # noqa: E402
from specdraft.decode.engine import BatchEngine, LoadPolicy  # noqa: E402
from specdraft.decode.factory import attach_calibration, make_proposer, proposer_modules  # noqa: E402
from specdraft.decode.memory import weights_by_part  # noqa: E402
from specdraft.decode.sampling import Sampler  # noqa: E402
from specdraft.decode.scheduler import build_scheduler  # noqa: E402
from specdraft.decode.server import Runtime, make_app  # noqa: E402
from specdraft.decode.server_metrics import ServerMetrics  # noqa: E402
from specdraft.decode.serve_worker import EngineWorker  # noqa: E402
from specdraft.io import assets  # noqa: E402
from specdraft.io.target import eos_ids, load_target, target_modules  # noqa: E402


def build_runtime(cfg: ServeConfig, log=print) -> Runtime:
    """Load the target, proposer and scheduler a ServeConfig names; start the engine worker."""
    cfg = with_verifier(cfg)
    server = cfg.server
    if not 0 <= server.ab_fraction <= 1:
        raise ValueError(f"server.ab_fraction={server.ab_fraction}; it must be in [0, 1] (the share decoded plainly)")
    if server.max_concurrency < 1 or server.max_queue < 0:
        raise ValueError("server.max_concurrency must be >= 1 and server.max_queue >= 0")
    assets.ensure(target_modules(cfg.target.name_or_path) + proposer_modules(cfg.proposer.name), "specdraft-serve")
    target = load_target(cfg.target.name_or_path, cfg.target.dtype, cfg.target.threads, cfg.target.device)
    backend = build_backend(target.model, cfg.target.backend, log=log, kernel=cfg.target.kernel)
    proposer, _ = make_proposer(cfg.proposer, target, cfg.target.name_or_path, cfg.target.backend, cfg.target.kernel)
    attach_calibration(proposer, cfg.proposer.path, cfg.calibration)
    profile = None
    if cfg.scheduler.name in ("cost", "load"):
        from specdraft.decode.profile import load_or_measure

        sizes = sorted({1, 2, 4, 8, 16, server.max_concurrency} & set(range(1, server.max_concurrency + 1)))
        profile, path, measured = load_or_measure(cfg.target.name_or_path, backend, proposer, cfg.proposer.path,
                                                  proposer.max_draft or cfg.decode.num_draft, sizes,
                                                  cfg.scheduler.profile_context, contexts=cfg.scheduler.profile_contexts)
        log(f"cost profile: {path}{' (measured now)' if measured else ''}")
    rule = build_scheduler(cfg.scheduler.name, cfg.scheduler.threshold, profile, cfg.scheduler.max_skip)
    stop = eos_ids(target)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stop[0]
    default = Sampler(cfg.decode.temperature, cfg.decode.top_k, cfg.decode.top_p)

    def make_engine() -> BatchEngine:
        # a server runs for days: keep the latest steps' admissions only
        load = LoadPolicy(profile, rule, admitted=deque(maxlen=10_000)) if cfg.scheduler.name == "load" else None
        return BatchEngine(backend, proposer, default, cfg.decode.num_draft, stop, None if load else rule, load,
                           server.max_concurrency, pad)

    metrics = ServerMetrics()
    for part, size in weights_by_part(target, backend, proposer).items():
        metrics.set_memory(part, size)
    metrics.set_memory("kv_cache", 0)
    worker = EngineWorker(make_engine, metrics, server.max_queue, set(stop), log)
    worker.start()
    window = getattr(target.model.config, "max_position_embeddings", None)
    name = server.model_name or cfg.target.name_or_path
    return Runtime(cfg, target.tokenizer, name, window, worker, metrics, int(time.time()), random.Random(server.ab_seed),
                   target.model.device)


def summary_line(runtime: Runtime) -> str:
    """One log line of both arms: requests, a request's tokens/s after its first token, mean TPOT, p50 TTFT, tau."""
    parts = []
    for arm, s in runtime.metrics.summary().items():
        if s["requests"]:
            rate = f"{s['request_tokens_per_s']:.1f} tok/s per request" if s["request_tokens_per_s"] else "- tok/s"
            tpot = f"{1000 * s['tpot_s_mean']:.1f} ms" if s["tpot_s_mean"] else "-"
            tau = f"{s['tau']:.2f}" if s["tau"] else "-"
            parts.append(f"{arm}: {s['requests']} requests, {rate}, TPOT {tpot}, TTFT p50 {1000 * s['ttft_s_p50']:.0f} ms, "
                         f"tau {tau}")
    return "A/B " + ("; ".join(parts) if parts else "no requests yet")


def _log_summaries(runtime: Runtime, every_s: float, stop: threading.Event) -> None:
    last = None
    while not stop.wait(every_s):
        line = summary_line(runtime)
        if line != last:
            print(line, flush=True)
            last = line


register_configs()


@hydra.main(version_base=None, config_path=conf_dir(), config_name="serve")
def main(config) -> None:
    import uvicorn

    cfg: ServeConfig = OmegaConf.to_object(config)
    runtime = build_runtime(cfg)
    stop = threading.Event()
    if cfg.server.summary_every_s > 0:
        threading.Thread(target=_log_summaries, args=(runtime, cfg.server.summary_every_s, stop), daemon=True).start()
    print(f"serving {runtime.model_name!r} ({cfg.proposer.name} proposer, scheduler={cfg.scheduler.name}, "
          f"A/B plain share {cfg.server.ab_fraction}) on http://{cfg.server.host}:{cfg.server.port}/v1", flush=True)
    try:
        uvicorn.run(make_app(runtime), host=cfg.server.host, port=cfg.server.port, log_level="warning")
    finally:
        stop.set()
        runtime.worker.stop()
        print(summary_line(runtime), flush=True)


if __name__ == "__main__":
    main()
