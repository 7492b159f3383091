"""The cost profile the schedulers plan with, measured on this machine, cached by fingerprint.

Two curves (DSpark's SPS(B)): the target's verify-step seconds as a function of the step's shape
(rows × tokens per row, on the engine that will run it: `single` = the batch-1 session, `batched` =
the ragged batched session), and the drafter's seconds as a function of drafted length (backbone
pass plus per-position LM head / Markov / confidence steps) and, for block drafters, of the number
of requests drafting together in one batched pass. Measured once per fingerprint of the
machine (CPU model, threads, torch), dtype, target and drafter, then read from
~/.cache/specdraft/profiles/<hash>.json (SPECDRAFT_PROFILE_DIR moves it); the bench records which profile it used.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdraft.io.files import write_text_atomically
from specdraft.decode.backend import as_backend
from specdraft.decode.batch_draft import propose_blocks
from specdraft.decode.batch_session import BatchedSession
from specdraft.decode.proposer import BlockDrafterProposer
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from specdraft.io.hardware import cpu_model, native_bf16

CACHE_DIR = Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft")) / "profiles"


@dataclass
class CostProfile:
    """Measured seconds. verify[engine][str(rows)][length-1] = seconds for rows × length tokens;
    draft[ℓ] = seconds to draft ℓ positions for one request (ℓ = 0: the backbone pass alone);
    draft_batched[str(rows)][ℓ-1] = seconds to draft ℓ positions for each of `rows` requests in one
    batched pass (block drafters only; None for proposers that draft request by request);
    by_context[str(C)] = {"verify": [...], "draft": [...]}: the one-request curves again at further
    context lengths C (attention grows with the context, so the price of one more verified position
    relative to the step does too); None for profiles measured at one context only."""

    fingerprint: dict
    verify: dict
    draft: list[float]
    context_length: int
    draft_batched: dict | None = None
    by_context: dict | None = None

    def verify_s(self, rows: int, length: int, engine: str = "single", context: int | None = None) -> float:
        """Seconds of a verify step of `rows` rows × `length` tokens (linear between measured row counts);
        for one request on the single engine at a given context, linear between measured contexts.

        Every curve is priced non-decreasing in length (`suffix_min`): a step of fewer tokens does less of the
        same work, and drafting fewer positions is a prefix of drafting more, so where a measured point exceeds
        a longer step's the excess is noise that only adds time (a shared host; measured here 36.0 / 38.8 /
        34.7 ms for 1 / 2 / 3 tokens). The fields keep the measurement as it was."""
        if context is not None and rows == 1 and engine == "single" and self.by_context:
            curve = self._at_context("verify", context)
            return curve[min(max(length, 1), len(curve)) - 1]
        table = self._priced(("table", engine), lambda: {
            int(r): suffix_min(seconds) for r, seconds in (self.verify.get(engine) or self.verify["batched"]).items()})
        length = min(max(length, 1), min(len(seconds) for seconds in table.values()))
        return by_rows({r: seconds[length - 1] for r, seconds in table.items()}, rows)

    def draft_s(self, length: int, context: int | None = None) -> float:
        if context is not None and self.by_context:
            curve = self._at_context("draft", context)
        else:
            curve = self._priced(("draft",), lambda: suffix_min(self.draft))
        return curve[min(max(length, 0), len(curve) - 1)]

    def _curves(self, kind: str) -> dict[int, list[float]]:
        """The one-request `kind` curve at every measured context, the base context included."""
        base = self.verify["single"]["1"] if kind == "verify" else self.draft
        return {self.context_length: base, **{int(c): curves[kind] for c, curves in self.by_context.items()}}

    def _at_context(self, kind: str, context: int) -> list[float]:
        """The priced one-request `kind` curve at `context`, linear between the measured contexts."""
        def interpolate():
            curves = self._priced(("curves", kind), lambda: {c: suffix_min(s) for c, s in self._curves(kind).items()})
            points = min(len(s) for s in curves.values())
            return [by_context({c: s[i] for c, s in curves.items()}, context) for i in range(points)]
        return self._priced((kind, context), interpolate)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        self.__dict__.pop("_memo", None)  # a replaced curve is priced anew (curves are replaced, never edited in place)

    def _priced(self, key: tuple, compute):
        """Memoized priced curves: a scheduler asks for a step's prices a dozen times (each position, each
        candidate length, every request of a batched step), and recomputing them from the fields showed in a
        sweep as a few percent of a step. Bounded, as a server's steps visit every context length."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            if len(memo) > 4096:
                memo.clear()
            memo[key] = compute()
        return memo[key]

    def draft_rows_s(self, lengths: list[int]) -> float:
        """Seconds the batched engine spends drafting for requests that draft these lengths this step:
        one batched pass as long as the longest (linear between measured row counts) when measured,
        else one draft per request."""
        if not self.draft_batched or not lengths:
            return sum(self.draft_s(length) for length in lengths)
        curves = self._priced(("draft_batched",), lambda: {
            int(r): suffix_min(seconds) for r, seconds in self.draft_batched.items()})
        longest = max(lengths)
        return by_rows({r: seconds[min(max(longest, 1), len(seconds)) - 1] for r, seconds in curves.items()},
                       len(lengths))

    def to_json(self) -> dict:
        return asdict(self)


def suffix_min(seconds: list[float]) -> list[float]:
    """seconds[i] lowered to the least of seconds[i:]: the cheapest longer step bounds a shorter one."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def by_rows(seconds: dict[int, float], rows: int) -> float:
    """Seconds at `rows` from seconds measured at some row counts: linear between them, proportional to
    rows below the smallest and beyond the largest."""
    measured = sorted(seconds)
    if rows <= measured[0]:
        return seconds[measured[0]] * rows / measured[0]
    for low, high in zip(measured, measured[1:]):
        if rows <= high:
            w = (rows - low) / (high - low)
            return (1 - w) * seconds[low] + w * seconds[high]
    return seconds[measured[-1]] * rows / measured[-1]


def machine_fingerprint() -> dict:
    """What a profile's numbers depend on in the machine."""
    device = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    # The model name alone does not tell an AVX2 EPYC from an AVX512-BF16 one, whose bf16 cost curves differ
    # several-fold (train/hardware.py): the ISA and the bf16 kernel path are part of the machine.
    return {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": native_bf16(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": device}


def profile_fingerprint(target_name: str, target_model, drafter_path: str | None, dtype: torch.dtype,
                        block_size: int, batch_sizes: list[int], context_length: int,
                        contexts: list[int] = (), drafter_dtype: torch.dtype | None = None) -> dict:
    """What the profile's numbers depend on."""
    drafter = None
    if drafter_path:
        config = Path(drafter_path) / "config.json"
        drafter = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else str(drafter_path)
    # A drafter in another dtype than the target's (proposer.dtype) drafts at another cost: its own profile.
    other_dtype = {} if drafter_dtype in (None, dtype) else {"drafter_dtype": str(drafter_dtype).replace("torch.", "")}
    return {
        **other_dtype,
        **machine_fingerprint(),
        "dtype": str(dtype).replace("torch.", ""),
        "target": target_name,
        "target_config": hashlib.sha256(target_model.config.to_json_string().encode()).hexdigest()[:16],
        "attention": getattr(target_model.config, "_attn_implementation", None),
        # The backend decides the verify curve (the fast one's is several times flatter): one profile each.
        # Only the name and the kernels chosen: not how the choice was made or what it measured.
        "backend": {key: as_backend(target_model).describe()[key] for key in ("name", "kernel")},
        "drafter": drafter,
        "block_size": block_size,
        "batch_sizes": list(batch_sizes),
        "context_length": context_length,
        "contexts": sorted(contexts),
        "draft_engine": "batched-by-length",  # profiles from before had one batched draft per row count: measure again
        # "rounds": medians of rounds (point by point before that); "rounds-min": fastest of the rounds
        "method": "rounds-min",
        "batched_rows": "ragged",  # profiles from before the one-row fast path measured equal rows: measure again
        "draft_after": "verify",  # one-request drafts timed as the loop meets them (measure_draft); before: warm
    }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # GPU kernels run asynchronously: time them to completion


def by_context(seconds: dict[int, float], context: int) -> float:
    """Seconds at `context` from seconds measured at some context lengths: linear between them and
    beyond them (attention's cost is linear in the context), never below the shortest context's."""
    measured = sorted(seconds)
    if len(measured) == 1 or context <= measured[0]:
        return seconds[measured[0]]
    pairs = list(zip(measured, measured[1:]))
    low, high = next(((a, b) for a, b in pairs if context <= b), pairs[-1])
    w = (context - low) / (high - low)
    return max((1 - w) * seconds[low] + w * seconds[high], seconds[measured[0]])


def _fastest_curve(fns: list, repeats: int, before=None) -> list[float]:
    """Fastest seconds of each of `fns`, measured in rounds (fn 0, 1, ..., then again) after one warm-up
    call each: what a scheduler reads is the ratio between points of a curve, and a machine's speed
    drifts (other processes, clocks), so every point is sampled across the same stretch of time. Each
    point keeps its fastest sample: the work repeats exactly and other processes can only add time, so
    the minimum is the least noisy estimate (timeit's rule; medians kept a contended stretch's share).
    `before`, where given, runs untimed ahead of every timed call (to set up the state the call meets)."""
    for fn in fns:
        fn()  # warm-up: first-call allocations stay out of the figures
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            if before is not None:
                before()
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            samples.append(time.perf_counter() - start)
    return [min(samples) for samples in times]


def _token_source(model, seed: int = 0):
    """tokens(n): n random token ids of the model's vocabulary (a step's cost depends on shapes, not tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist()


def measure_single_verify(model, feature_layers, max_length: int, context_length: int, repeats: int) -> list[float]:
    """Seconds of a batch-1 verify step of 1..max_length tokens after a context of `context_length`."""
    tokens = _token_source(model)
    single = CausalSession(model, feature_layers)
    single.forward(tokens(context_length))

    def one(length):
        single.forward(tokens(length))
        single.rollback(context_length)

    return _fastest_curve([lambda n=n: one(n) for n in range(1, max_length + 1)], repeats)


def measure_verify(model, feature_layers, max_length: int, batch_sizes: list[int], context_length: int,
                   repeats: int) -> dict:
    """Verify-step seconds on both engines: single (rows = 1) and batched (each of batch_sizes)."""
    tokens = _token_source(model)
    table = {"single": {"1": measure_single_verify(model, feature_layers, max_length, context_length, repeats)},
             "batched": {}}
    # Prefilled contexts copied into the rows: the step's cost depends on shapes, not on the tokens. Real
    # concurrent requests differ in length, which makes their steps run with the 4D row mask (one
    # request runs without): rows alternate between two lengths so the measured steps do the same.
    lengths = (context_length, max(context_length - 1, 1))
    prefills = []
    for length in lengths:
        prefill = BatchedSession(model, feature_layers)
        prefill.add(tokens(length))
        prefills.append(prefill)
    for rows in batch_sizes:
        session = BatchedSession(model, feature_layers)
        for r in range(rows):
            session.add_cache(copy.deepcopy(prefills[r % 2].cache), lengths[r % 2])
        feeds = [tokens(max_length) for _ in range(rows)]

        def step(length):
            session.forward([feed[:length] for feed in feeds])
            session.keep([0] * rows)

        table["batched"][str(rows)] = _fastest_curve([lambda n=n: step(n) for n in range(1, max_length + 1)], repeats)
    return table


def measure_draft(proposer, model, context_length: int, max_draft: int, repeats: int) -> list[float]:
    """Seconds to draft ℓ = 0..max_draft positions for one request at a context of `context_length`, as the
    generate loop meets a draft: right after a verify forward (one untimed target step before each sample,
    which streams the target's weights through the caches and evicts the drafter's) and with the last
    step's position committed but not yet taken in (a block drafter projects it inside the timed call).
    Back-to-back drafts found the drafter's weights in cache: on the Zen 4 EPYC that priced a one-token
    draft at 2.4 ms where the loop spent 6 ms, and the cost scheduler verified 4 drafted tokens where
    verifying 1 was faster."""
    if proposer is None or max_draft == 0:
        return [0.0] * (max_draft + 1)
    tokens = _token_source(model)
    context = tokens(context_length)
    session = CausalSession(model, proposer.feature_layers)
    _, features = session.forward(context)
    context.append(tokens(1)[0])  # the pending token: the loop's context holds it, the target's cache does not
    proposer = proposer.clone()
    proposer.start(list(context), features)
    generator = torch.Generator(device=model.device).manual_seed(0)
    sampler = Sampler(1.0)  # sampling costs at least what greedy does (it also builds q)
    # A proposer that reads the target's features takes in the last step's kept position before it drafts; one that
    # does not (prompt lookup, a standalone model) is timed on a fixed context as before (a lookup's commit would
    # feed the drafts of random contexts into the statistics it shares with the real proposer).
    takes_features = bool(proposer.feature_layers)

    class StopAfter:
        needs_confidence = False

        def __init__(self, length):
            self.length = length

        def verify(self, confidences):
            return len(confidences) <= self.length

    def after_verify():
        # A verify step of the target over the pending token (then rolled back), and that position committed with
        # the next token appended, as the loop commits a step that kept none of its drafts (the context grows by one
        # position per sample: a few dozen over the measurement, a negligible drift).
        _, step_features = session.forward([context[-1]])
        session.rollback(context_length)
        if takes_features:
            context.append(tokens(1)[0])
            proposer.commit(list(context), step_features)

    def draft(length):
        # ℓ = 0 still runs the backbone pass (c_1 decides it), so draft one position and stop before sampling it.
        proposer.propose(context, max(length, 1), sampler, generator, StopAfter(length))

    return _fastest_curve([lambda n=n: draft(n) for n in range(0, max_draft + 1)], repeats, before=after_verify)


def measure_draft_batched(proposer, model, context_length: int, max_draft: int, batch_sizes: list[int],
                          repeats: int) -> dict | None:
    """Seconds to draft ℓ = 1..max_draft positions for each of `rows` requests in one batched pass (block
    drafters): the backbone pass is shared, then each position costs a sequential LM-head and Markov step,
    so a step that drafts 3 of a 7-token block costs well under the whole block."""
    if max_draft == 0 or not isinstance(proposer, BlockDrafterProposer):
        return None
    context = _token_source(model, seed=1)(context_length)
    _, features = CausalSession(model, proposer.feature_layers).forward(context)
    requests = []
    for _ in range(max(batch_sizes)):
        request = proposer.clone()
        request.start(context, features)
        requests.append(request)
    generators = [torch.Generator(device=model.device).manual_seed(r) for r in range(len(requests))]
    sampler = Sampler(1.0)  # sampling costs at least what greedy does (it also builds q)

    def draft(rows, length):
        propose_blocks(requests[:rows], [context] * rows, [length] * rows, sampler, generators[:rows])

    lengths = range(1, max_draft + 1)
    fns = [lambda r=r, n=n: draft(r, n) for r in batch_sizes for n in lengths]
    seconds = _fastest_curve(fns, repeats)  # rows-major: batch_sizes[i]'s curve is seconds[i*max_draft:(i+1)*max_draft]
    return {str(r): seconds[i * max_draft : (i + 1) * max_draft] for i, r in enumerate(batch_sizes)}


def load_or_measure(target_name: str, model, proposer, drafter_path: str | None, block_size: int,
                    batch_sizes: list[int], context_length: int = 256, repeats: int = 5,
                    cache_dir: Path | None = None, contexts: list[int] = (),
                    tree_rows: int = 0) -> tuple[CostProfile, Path, bool]:
    """The profile for this fingerprint: from the cache, else measured now and cached (atomically).
    `contexts`: further context lengths the one-request curves are measured at (the cost scheduler
    then prices each step at its own context). `tree_rows`: the most rows a token tree's side branches add
    to a step (decode/tree.py): verify curves reach 1 + block_size + tree_rows tokens, so a tree step is
    priced on its own width, not the widest chain's. Returns (profile, its file, whether it was measured now)."""
    if any(int(c) < 1 for c in contexts):
        raise ValueError(f"scheduler.profile_contexts={list(contexts)}: context lengths must be >= 1")
    # Contexts a step of this target can reach (prompt + block within its window), the base one apart.
    window = getattr(model.config, "max_position_embeddings", None) or float("inf")
    contexts = sorted({int(c) for c in contexts if int(c) + block_size + 1 <= window} - {context_length})
    trained = getattr(getattr(proposer, "trained", proposer), "drafter", None)  # a hybrid's drafter part too
    fingerprint = profile_fingerprint(target_name, model, drafter_path, model.dtype, block_size, batch_sizes,
                                      context_length, contexts,
                                      None if trained is None else trained.embed_tokens.weight.dtype)
    if tree_rows:
        fingerprint["tree_rows"] = int(tree_rows)
    widest = block_size + 1 + max(int(tree_rows), 0)  # verify tokens: pending + a full block (+ side branches)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_dir or os.environ.get("SPECDRAFT_PROFILE_DIR") or CACHE_DIR) / f"{key}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("fingerprint") == fingerprint:
                return CostProfile(**data), path, False
        except (OSError, ValueError, TypeError):
            pass  # unreadable or stale: measure again and overwrite
    verify = measure_verify(model, proposer.feature_layers if proposer else (), widest, batch_sizes,
                            context_length, repeats)
    # A hybrid's drafting curve is its trained part's: its lookup steps are priced without drafting
    # (CostRule.without_drafting), and a random context could otherwise time a lookup instead.
    drafting = getattr(proposer, "trained", proposer)
    draft = measure_draft(drafting, model, context_length, block_size, repeats)
    draft_batched = measure_draft_batched(drafting, model, context_length, block_size, batch_sizes, repeats)
    feature_layers = proposer.feature_layers if proposer else ()
    by_context = {str(c): {"verify": measure_single_verify(model, feature_layers, widest, c, repeats),
                           "draft": measure_draft(drafting, model, c, block_size, repeats)} for c in contexts} or None
    profile = CostProfile(fingerprint=fingerprint, verify=verify, draft=draft, context_length=context_length,
                          draft_batched=draft_batched, by_context=by_context)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(profile.to_json(), indent=1))
    return profile, path, True
