"""Load a running specdraft server (`python decode/serve.py`) with concurrent streaming OpenAI clients and report,
per concurrency and A/B arm, tokens/s, TTFT and TPOT as clients see them, beside the server's own A/B summary.

    python decode/serve.py proposer=drafter proposer.path=RUN/export server.max_concurrency=16 &
    python scripts/serve_load.py --url http://127.0.0.1:8000 --clients 1 4 16 --arms spec plain --out OUT

Each concurrency level runs each arm on its own (every request forces the arm: "separate runs"); `--arms ab`
leaves the arm to the server's `server.ab_fraction` split (the arms share the batch; rows `ab:spec`, `ab:plain`,
each arm's tokens over the level's wall time). Prompts: MT-bench or
held-out ShareGPT under the target's chat template (the server applies it), as decode/bench.py reads them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.io.data import load_prompts  # noqa: E402


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


async def one(api, model: str, prompt: str, max_tokens: int, arm: str | None) -> dict:
    start = time.perf_counter()
    extra = {"specdraft_arm": arm} if arm else {}
    stream = await api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)
    first = last = None
    tokens, served = 0, arm
    async for chunk in stream:
        served = (chunk.model_extra or {}).get("specdraft", {}).get("arm", served)
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first, last = first or end, last or end
    return {"ttft_s": first - start, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "seconds": end - start, "arm": served}


async def level(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
                arm: str | None) -> dict:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    todo = list(range(requests))
    results = []

    async def client():
        while todo:
            index = todo.pop(0)
            results.append(await one(api, model, prompts[index % len(prompts)], max_tokens, arm))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    await api.close()
    if arm:
        return [row(clients, arm, results, wall)]
    # the server's split: one row per arm it chose (tokens/s: each arm's tokens over the shared wall time)
    return [row(clients, f"ab:{a}", [r for r in results if r["arm"] == a], wall) for a in ("spec", "plain")]


def row(clients: int, arm: str, results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    return {"clients": clients, "arm": arm, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_s_p50": quantile([r["ttft_s"] for r in results], 0.5),
            "ttft_s_p99": quantile([r["ttft_s"] for r in results], 0.99), "tpot_s_p50": quantile(tpots, 0.5),
            "tpot_s_p99": quantile(tpots, 0.99), "tpot_s_mean": statistics.fmean(tpots) if tpots else None}


def table(rows: list[dict]) -> str:
    lines = ["| clients | arm | requests | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    ms = lambda v: f"{1000 * v:.0f}" if v is not None else "-"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['clients']} | {r['arm']} | {r['requests']} | {r['tokens_per_s']:.1f} | {ms(r['ttft_s_p50'])} | "
                     f"{ms(r['ttft_s_p99'])} | {ms(r['tpot_s_p50'])} | {ms(r['tpot_s_p99'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="the served model id (default: the one /v1/models lists)")
    parser.add_argument("--data", default="sharegpt_heldout", help="mtbench | sharegpt_heldout")
    parser.add_argument("--categories", nargs="*", default=None, help="only these MT-bench categories (coding, math, ...)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=None, help="requests per level and arm (default: 2 x clients, at least 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--arms", nargs="+", default=["spec", "plain"], choices=["spec", "plain", "ab"])
    parser.add_argument("--out", default=None, help="a folder for serve_load.json and serve_load.md")
    args = parser.parse_args()

    model = args.model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    prompts = [p["prompt"] for p in load_prompts(args.data, None, None, 0, args.categories)]
    rows = []
    for clients in args.clients:
        requests = args.requests or max(8, 2 * clients)
        for arm in args.arms:
            new = asyncio.run(level(args.url, model, prompts, clients, requests, args.max_tokens,
                                    None if arm == "ab" else arm))
            rows += new
            print("\n".join(table(new).splitlines()[2:]), flush=True)
    server = httpx.get(f"{args.url}/v1/specdraft/ab").json()
    report = f"{table(rows)}\n\nserver A/B summary (all levels): {json.dumps(server)}\n"
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_load.json").write_text(json.dumps({"rows": rows, "server_ab": server, "args": vars(args)}, indent=1))
        (out / "serve_load.md").write_text(report)


if __name__ == "__main__":
    main()
