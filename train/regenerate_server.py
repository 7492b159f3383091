"""Regeneration through any OpenAI-compatible server (vLLM, SGLang, TGI, ...), as clusters do it.

Each process takes every W-th prompt (`rank` of `world`) and keeps `concurrency` chat-completion requests in
flight; every finished response is appended to its own `responses-r{R}.jsonl` (flushed and fsynced), so
processes never share a file and a killed run resumes where it stopped (ids already present in any shard,
or in the local regeneration's `responses.jsonl`, are skipped). The server returns text: it is tokenized
with the target's tokenizer, and a response the server ended itself (`finish_reason: stop`) is closed with
EOS, as local regeneration records it.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdraft.train.regenerate import read_done


def read_all_done(out_dir: Path) -> dict[str, dict]:
    """Completed records of a regeneration folder: the local file and every process's shard."""
    done = {}
    for path in sorted(Path(out_dir).glob("responses*.jsonl")):
        done.update(read_done(path))
    return done


def _ask(client, model: str, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> tuple[str, str]:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


def regenerate_via_server(base_url: str, model: str, tokenizer, prompts: list[dict], out_dir: str | Path,
                          max_new_tokens: int = 256, temperature: float = 0.0, concurrency: int = 8, seed: int = 0,
                          rank: int = 0, world: int = 1, api_key: str | None = None, timeout_s: float = 600.0) -> Path:
    """Write this process's share of the responses to `out_dir/responses-r{rank}.jsonl`, resuming."""
    from openai import OpenAI

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"responses-r{rank}.jsonl"
    done = read_all_done(out_dir)
    # A prompt's seed is seed + its place among all the prompts, so a resumed run asks with the same seeds.
    todo = [(i, p) for i, p in enumerate(prompts) if i % world == rank and p["id"] not in done]
    client = OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"), timeout=timeout_s)
    with path.open("a", encoding="utf-8") as sink, ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [(item, pool.submit(_ask, client, model, item["prompt"], max_new_tokens, temperature, seed + i))
                   for i, item in todo]
        for item, future in futures:  # in submission order, each written as soon as it and those before it are done
            try:
                text, finish = future.result()
            except Exception as err:  # the openai client raises many types (connection, status, timeout)
                raise RuntimeError(f"regeneration server {base_url} failed on prompt {item['id']!r} ({type(err).__name__}: "
                                   f"{err}); {len(read_done(path))} responses of this process are saved, rerun to resume") from err
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if finish == "stop":
                ids.append(tokenizer.eos_token_id)
            sink.write(json.dumps({"id": item["id"], "prompt": item["prompt"], "response_ids": ids, "source": base_url}) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
    return path
