"""The decoder a user holds: a target with a proposer and a verify-length scheduler, generating lossless text.

`SpecDecoder` is what the library API exports (specdraft/api.py) and what `specdraft-bench` decodes with
(decode/bench.py), so both run one code path: the target loader (specdraft.io.target), the proposer factory
(decode/factory.py), the verify loop (decode/generate.py).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specdraft.decode.backend import build_backend
from specdraft.decode.config import ProposerConfig
from specdraft.decode.factory import attach_calibration, make_proposer, proposer_modules
from specdraft.decode.generate import GenerateConfig, Generation, speculative_generate
from specdraft.decode.sampling import Sampler
from specdraft.decode.scheduler import SCHEDULERS, build_scheduler
from specdraft.decode.session import CausalSession
from specdraft.decode.tree import side_rows
from specdraft.io import assets
from specdraft.io.data import chat_prompt_ids
from specdraft.io.target import Target, eos_ids, load_target, target_modules
from specdraft.models.export import recorded_target

DEFAULT_TARGET = "smollm2-135m-instruct"  # the embedded default (specdraft.io.target.EMBEDDED_ALIASES)


class _Stopped(Exception):
    """Raised inside a stream's generation when its consumer stopped reading."""


@dataclass
class SamplingParams:
    """Hugging Face semantics: temperature 0 is greedy; top_k 0 and top_p 1.0 are off."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # request i of a generate() call samples with seed + i


@dataclass
class Output:
    text: str
    token_ids: list[int]
    # tau (tokens per verify step), steps, drafted, accepted, ttft_s, total_s, tokens_per_s, finish_reason
    stats: dict = field(default_factory=dict)


def output_stats(gen: Generation, stop: set[int]) -> dict:
    steps = len(gen.drafted)
    decoded = len(gen.output_ids) - 1  # the first token comes from the prefill, not a verify step
    return {"tau": decoded / steps if steps else None, "steps": steps, "drafted": sum(gen.drafted),
            "accepted": sum(gen.accepted), "ttft_s": gen.ttft_s, "total_s": gen.total_s,
            "tokens_per_s": len(gen.output_ids) / gen.total_s if gen.total_s > 0 else None,
            "finish_reason": "stop" if gen.output_ids and gen.output_ids[-1] in stop else "length"}


class SpecDecoder:
    """A target with a proposer and a verify-length scheduler; `generate` is lossless (the output is
    distributed as the target's own decoding; at T=0 in float32 it equals HF `generate`)."""

    def __init__(self, target: Target, proposer, scheduler=None, num_draft: int = 4, backend="auto"):
        """backend: a name (auto, fast, hf) or a built backend (decode/backend.py) to share between decoders."""
        self.target, self.proposer, self.scheduler, self.num_draft = target, proposer, scheduler, num_draft
        self.backend = build_backend(target.model, backend) if isinstance(backend, str) else backend
        self.stop = set(eos_ids(target))
        # one session for every call (each generation resets its cache); plain decoding gathers no features
        self.session = CausalSession(self.backend, self.proposer.feature_layers)

    @classmethod
    def from_pretrained(cls, target: str | None = None, drafter: str | None = None,
                        proposer: str | None = None, scheduler: str = "fixed", num_draft: int | None = None,
                        dtype: str = "auto", backend: str = "auto", threads: int | None = None,
                        device: str = "auto", calibration: str = "auto", kernel: str = "auto",
                        branches: int | None = None, side_length: int = 1) -> "SpecDecoder":
        """target: an alias, folder or HF id (None: the target a drafter export records, else the embedded
        default); drafter: an export folder (DIR/export of a distill run), refused for another target.
        proposer: drafter (the default with a drafter), ngram (prompt lookup, the default without),
        hybrid (lookup where it matches, the drafter elsewhere), model (a standalone causal LM at
        `drafter`), none (plain decoding). scheduler: fixed, threshold or cost (priced on this machine's
        cost profile, measured once and cached). num_draft: tokens drafted per step (default: the
        drafter's block size, else 4). kernel: the fast backend's linear kernels (target.kernel). branches:
        greedy first-position candidates verified as a token tree (proposer.branches; 1: one chain; None: the
        proposer's default, decode/factory.py DEFAULT_BRANCHES);
        side_length: prompt lookup's side branches' most tokens (proposer.side_length)."""
        proposer = proposer or ("drafter" if drafter else "ngram")
        if target is None:
            target = recorded_target(drafter) if drafter and proposer in ("drafter", "hybrid") else DEFAULT_TARGET
        if scheduler not in SCHEDULERS or scheduler == "load":
            raise ValueError(f"scheduler={scheduler!r}; choose fixed, threshold or cost (load is the batched engine's)")
        assets.ensure(target_modules(target) + proposer_modules(proposer), "SpecDecoder")
        loaded = load_target(target, dtype, threads, device)
        made, _ = make_proposer(ProposerConfig(name=proposer, path=drafter, branches=branches, side_length=side_length),
                                loaded, target, backend, kernel)
        attach_calibration(made, drafter, calibration)
        num_draft = num_draft if num_draft is not None else (4 if made.max_draft is None else made.max_draft)
        decoder = cls(loaded, made, None, num_draft, build_backend(loaded.model, backend, kernel=kernel))
        decoder.scheduler = decoder._rule(scheduler, target, drafter)
        return decoder

    def _rule(self, name: str, target_name: str, drafter: str | None):
        profile = None
        if name == "cost":
            from specdraft.decode.profile import load_or_measure

            profile, _, _ = load_or_measure(target_name, self.backend, self.proposer, drafter,
                                            self.proposer.max_draft or self.num_draft, [1], contexts=[64, 1024],
                                            tree_rows=side_rows(self.proposer, greedy=True))  # greedy calls' trees
        return build_scheduler(name, profile=profile)

    def encode(self, prompt) -> list[int]:
        """A string is one user turn under the target's chat template; a list of {role, content} messages
        is a conversation; a list of ints is taken as token ids."""
        if isinstance(prompt, str):
            return chat_prompt_ids(self.target.tokenizer, prompt)
        if not isinstance(prompt, (list, tuple)):
            raise TypeError("a prompt is a string, a list of {'role', 'content'} messages, or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty: give a string, messages, or at least one token id")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.target.model.config.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"the prompt holds token ids outside the target's vocabulary (0..{vocab - 1})")
            return list(prompt)
        if all(isinstance(m, dict) and "role" in m for m in prompt):
            ids = self.target.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        raise TypeError("a prompt is a string, a list of {'role', 'content'} messages, or a list of token ids")

    def run(self, ids: list[int], sampler: Sampler, max_new_tokens: int, generator: torch.Generator | None = None,
            on_tokens=None) -> Generation:
        """One request as token ids, with its per-step statistics (what `generate` and the benchmark build on)."""
        config = GenerateConfig(sampler, max_new_tokens, self.num_draft, self.stop, self.scheduler)
        return speculative_generate(self.session, ids, self.proposer, config, generator=generator, on_tokens=on_tokens)

    def _run(self, ids: list[int], params: SamplingParams, index: int, on_tokens=None) -> Generation:
        sampler = Sampler(params.temperature, params.top_k, params.top_p)
        generator = torch.Generator(device=self.target.model.device).manual_seed(params.seed + index)
        return self.run(ids, sampler, params.max_new_tokens, generator, on_tokens)

    def generate(self, prompts, params: SamplingParams | None = None) -> list[Output]:
        """One Output per prompt (a single prompt or a list of them; see `encode` for the forms)."""
        params = params or SamplingParams()
        many = isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (str, list, tuple))
        outputs = []
        for index, prompt in enumerate(prompts if many else [prompts]):
            gen = self._run(self.encode(prompt), params, index)
            text = self.target.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            outputs.append(Output(text, gen.output_ids, output_stats(gen, self.stop)))
        return outputs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """The text of one prompt's output as it is accepted, piece by piece (joined: generate()'s text).
        Closing the iterator early stops the generation (the decoder is then free for the next call)."""
        params, pieces, tokens, shown = params or SamplingParams(), queue.Queue(), [], ""
        failure, stop = [], threading.Event()

        def forward(new: list[int]) -> None:
            if stop.is_set():
                raise _Stopped
            pieces.put(new)

        def work():
            try:
                self._run(self.encode(prompt), params, 0, on_tokens=forward)
            except _Stopped:
                pass
            except BaseException as err:  # re-raised in the caller's thread
                failure.append(err)
            finally:
                pieces.put(None)

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        try:
            while (new := pieces.get()) is not None:
                tokens.extend(new)
                # Decode the whole output each time: a token can complete a character the previous one began,
                # and until it does the text ends in U+FFFD, which is held back.
                text = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
                if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
                    yield text[len(shown):]
                    shown = text
        finally:
            stop.set()
            worker.join()
        if failure:
            raise failure[0]
        final = self.target.tokenizer.decode(tokens, skip_special_tokens=True)
        if final.startswith(shown) and len(final) > len(shown):  # what was held back at the end
            yield final[len(shown):]
