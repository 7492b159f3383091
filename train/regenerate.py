"""Regeneration: responses written by the target itself, so the drafter learns the target's own
distribution rather than another model's text (DSpark/DFlash practice).

Batched generation: by default HF `generate` with left padding; the distill pipeline hands in the decode
engine's continuous batching on the fast target backend instead (`generate=`), which runs the same
greedy decoding several times faster on a CPU. Every finished batch is appended to
`responses.jsonl` (one JSON line per prompt: id, prompt, response_ids), flushed and fsynced, so a
killed run resumes where it stopped: ids already present are skipped, and a torn last line from a
kill mid-write is dropped. The finished file loads as a `datasets.Dataset`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft.io.data import chat_prompt_ids


def read_done(path: Path) -> dict[str, dict]:
    """Completed records by id; drops a torn final line left by an interrupted write."""
    if not path.is_file():
        return {}
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # keep whole lines only
        os.truncate(path, len(text.encode("utf-8")))  # cut the torn tail in place; never rewrite what is done
    done = {}
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            done[record["id"]] = record
    return done


def _strip(row: torch.Tensor, eos_ids: set[int]) -> list[int]:
    """Generated ids up to and including the first EOS (padding after it removed)."""
    out = []
    for token in row.tolist():
        out.append(token)
        if token in eos_ids:
            break
    return out


@torch.inference_mode()
def regenerate(
    model,
    tokenizer,
    prompts: list[dict],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    generate=None,
) -> Path:
    """Write the target's responses to `out_dir/responses.jsonl`, resuming a previous run.

    `generate(prompts_ids, max_new_tokens, temperature, eos_ids, seed) -> [response ids]` replaces HF
    `generate` for each batch (responses end at their first EOS, which they include)."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "responses.jsonl"
    done = read_done(path)
    # Similar lengths batched together: less left padding to push through the target. Batches are cut from the
    # order of all the prompts, not of those left, and each keeps its seed (seed + its first position): a resumed
    # run meets the same batches, and a batch a kill cut mid-write is generated again whole (same rows, padding
    # and seed, so the same samples, also for HF's batch-wide sampling) and only its missing records are appended.
    order = sorted(prompts, key=lambda p: len(p["prompt"]))
    batches = [(start, order[start : start + batch_size]) for start in range(0, len(order), batch_size)]
    batches = [(start, chunk) for start, chunk in batches if any(item["id"] not in done for item in chunk)]
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [tokenizer.eos_token_id])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {"do_sample": False}
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=pad_id, **sampling)
    with path.open("a", encoding="utf-8") as sink:
        for start, chunk in tqdm(batches, desc="regenerate", mininterval=5):
            encoded = [chat_prompt_ids(tokenizer, item["prompt"]) for item in chunk]
            if generate is not None:
                responses = generate(encoded, max_new_tokens, temperature, sorted(eos_ids), seed + start)
            else:
                width = max(map(len, encoded))
                # Left padding keeps every prompt's last token at the same column for batched generation.
                ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded], device=model.device)
                mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=model.device)
                torch.manual_seed(seed + start)
                generated = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
                responses = [_strip(row, eos_ids) for row in generated]
            missing = [(item, response) for item, response in zip(chunk, responses) if item["id"] not in done]
            _append(sink, [item for item, _ in missing], [response for _, response in missing])
    return path


def _append(sink, chunk: list[dict], responses: list[list[int]]) -> None:
    """One finished batch, appended and fsynced (a kill loses at most the batch in flight)."""
    for item, response in zip(chunk, responses):
        sink.write(json.dumps({"id": item["id"], "prompt": item["prompt"], "response_ids": response}) + "\n")
    sink.flush()
    os.fsync(sink.fileno())


def load_regenerated(path: str | Path):
    """The regenerated responses as a `datasets.Dataset` (local JSON, nothing from a hub)."""
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train")
