"""Helpers shared by the test modules: tiny random models, drafters, profiles and oracles built in the test.

Test modules import from here (or use conftest fixtures), never from one another.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from scipy.stats import chisquare
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from specdraft.decode.batch_generate import Request, batched_generate
from specdraft.decode.generate import GenerateConfig, speculative_generate
from specdraft.decode.config import register_configs
from specdraft.decode.profile import CostProfile
from specdraft.decode.sampling import Sampler
from specdraft.decode.session import CausalSession
from specdraft.models.drafter import BlockDrafter
from specdraft.models.eagle3 import Eagle3Drafter
from specdraft.train.config import TrackingConfig, TrainerConfig
from specdraft.train.step import Batch
from specdraft.train.trainer import TrainJob, train

REPO = Path(__file__).resolve().parents[1]


def tiny_llama(seed: int, vocab_size: int = 64, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    """A random 2-layer Llama in float32 eval mode, deterministic for a seed."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    # Scale the output layer up so argmaxes are far from ties, as in a trained model.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model



def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """The oracle: HF generate, greedy, generated tokens only (EOS included when generated)."""
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None, pad_token_id=0
    )
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()



def save_tiny_model(path, seed: int = 0, vocab_size: int = 64, layers: int = 2, shift: int = 0) -> str:
    """A tiny Llama + tokenizer saved as a model folder, EOS = <|im_end|>."""
    model = tiny_llama(seed, vocab_size=vocab_size, layers=layers)
    tokenizer = tiny_tokenizer(vocab_size, shift)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def make_drafter(mode="dspark", layers=2):
    target = tiny_llama(0)
    torch.manual_seed(3)
    drafter = BlockDrafter(target.config, num_layers=layers, num_feature_layers=2, block_size=4, mask_token_id=1,
                           mode=mode, markov_rank=8).eval()
    drafter.copy_target_weights(target)
    return target, drafter



def greedy_block_and_training_pass(target, drafter, prompt=(4, 9, 2, 7, 7, 1), first=13):
    """Greedy inference's 4 drafted tokens after prompt + [first], and the training pass's output for
    the block anchored at `first` over the same target features."""
    from specdraft.decode.proposer import BlockDrafterProposer
    from specdraft.decode.sampling import Sampler
    from specdraft.decode.session import CausalSession

    prompt = list(prompt)
    _, features = CausalSession(target, (1, 2)).forward(prompt, last_only=True)
    proposer = BlockDrafterProposer(drafter, (1, 2))
    proposer.start(prompt + [first], features)
    drafted = proposer.propose(prompt + [first], 4, Sampler(), None).tokens
    with torch.no_grad():
        out = drafter.forward_packed(drafter.project_context(features[None])[0], torch.tensor([len(prompt)]),
                                     torch.tensor([first]))
    return drafted, out, first


def make_eagle(steps=4, vocab=None):
    target = tiny_llama(0)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(target.config, num_feature_layers=2, steps=steps, draft_vocab_ids=vocab).eval()
    drafter.copy_target_weights(target)
    return target, drafter


PROMPTS = [[2, 7, 1, 8, 2, 8], [3, 1], [4, 1, 5, 9, 2, 6, 5, 3, 5], [9, 9, 8], [5, 6, 7, 1]]



LIMITS = [14, 9, 20, 1, 12]  # one request stops after its first token; the others leave at different steps



EOS = [13]



def synthetic_profile(rows=(1, 2, 4), length=5, per_token=0.002) -> CostProfile:
    """Verify time grows with tokens (rows × length); drafting costs a little per position."""
    table = {str(r): [0.010 + per_token * r * n for n in range(1, length + 1)] for r in rows}
    return CostProfile(fingerprint={}, verify={"single": {"1": table["1"]}, "batched": table},
                       draft=[0.003 + 0.001 * n for n in range(length)], context_length=16)



def cheap_profile(rows=(1, 2, 4), length=5) -> CostProfile:
    """Drafting and one more verified position both cheap: load admission has to beat plain decoding
    (drafting included) and often does."""
    profile = synthetic_profile(rows=rows, length=length, per_token=0.00002)
    profile.draft_batched = {"1": [1e-5] * length, str(max(rows)): [1e-5] * length}
    return profile



def dear_profile(rows=(1, 2, 4), length=5) -> CostProfile:
    """A compute-bound engine: a verified token costs as much as a whole plain step's share, and drafting
    is dear, so no draft could pay even if every position survived."""
    profile = synthetic_profile(rows=rows, length=length, per_token=0.02)
    profile.draft = [0.2] * length
    profile.draft_batched = {"1": [0.05] * length, str(max(rows)): [0.2] * length}
    return profile



def context_profile(length=5) -> CostProfile:
    """synthetic_profile at context 2, plus one-request curves at context 12 where a step costs more
    but one more verified position costs much less (attention dominates a long context's step)."""
    profile = synthetic_profile(length=length, per_token=0.004)
    profile.context_length = 2
    profile.by_context = {"12": {"verify": [0.030 + 0.0005 * n for n in range(1, length + 1)],
                                 "draft": [0.003 + 0.001 * n for n in range(length)]}}
    return profile



def batch1(model, proposer, sampler, num_draft, rule=None, seed=0):
    session = CausalSession(model, proposer.feature_layers)
    outs = []
    for i, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        generator = torch.Generator().manual_seed(seed + i)
        config = GenerateConfig(sampler, limit, num_draft, EOS, rule)
        outs.append(speculative_generate(session, prompt, proposer.clone(), config, generator=generator).output_ids)
    return outs



def batched(model, proposer, sampler, num_draft, rule=None, seed=0, concurrency=3, load=None):
    requests = [Request(p, n, torch.Generator().manual_seed(seed + i)) for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    gens = batched_generate(model, requests, proposer, sampler, num_draft, EOS, rule, load, concurrency)
    return [g.output_ids for g in gens], gens


def examples(n=6, length=20):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(2, 64, (length,), generator=gen).tolist()
        rows.append({"input_ids": ids, "loss_mask": [False] * 6 + [True] * (length - 6)})
    return rows



def fresh_drafter(target):
    torch.manual_seed(1)
    drafter = BlockDrafter(target.config, num_layers=1, num_feature_layers=2, block_size=4, mask_token_id=1, markov_rank=8)
    drafter.copy_target_weights(target)
    return drafter



def run(target, run_dir, **overrides):
    settings = {"steps": 6, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 2, "eval_every": 3,
                **overrides}
    cfg = TrainerConfig(**settings)
    drafter = fresh_drafter(target)
    summary = train(TrainJob(drafter, target, examples(), examples(2), (1, 2), 4, 0, run_dir), cfg,
                    TrackingConfig(wandb_mode="disabled"))
    return drafter, summary


def toy_batch(seed=0, batch=2, length=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 64, (batch, length), generator=gen)
    loss_mask = torch.zeros(batch, length, dtype=torch.bool)
    loss_mask[:, 8:] = True  # prompt of 8 tokens, then the response
    return Batch(ids, torch.ones_like(ids), loss_mask, torch.arange(batch) + 100 * seed)


def bench_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return OmegaConf.to_object(compose("bench", overrides=overrides))


VOCAB = 8



START = 0



def markov_tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and drafter logits tables (V, V): row = previous token. The drafter is far from the target."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    drafter = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
    return target, drafter



def goodness_of_fit(samples: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of sequences (N, L) against expected cell probabilities (V**L,)."""
    cells = np.ravel_multi_index(samples.T, (VOCAB,) * samples.shape[1])
    observed = np.bincount(cells, minlength=expected.size).astype(float)
    n = len(samples)
    if observed[expected == 0].sum() > 0:
        return 0.0  # a sequence the target can never produce
    # Pool every cell with an expected count under 5 (and, if the pool itself is under 5, the next
    # smallest cells too) so the chi-square approximation holds.
    order = [c for c in np.argsort(expected) if expected[c] > 0]
    cut = 0
    while cut < len(order) and (expected[order[cut]] * n < 5 or expected[order[:cut]].sum() * n < 5):
        cut += 1
    small, big = np.array(order[:cut], dtype=int), np.array(order[cut:], dtype=int)
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum()) * n
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)



class MarkovSession:
    """Stands in for CausalSession: logits at a position are the fed token's table row plus a
    bias of that position, which the session knows only from its own cache length."""

    feature_layers = ()
    context_window = None

    def __init__(self, table: torch.Tensor):
        self.table, self.length = table, 0

    def reset(self):
        self.length = 0

    def forward(self, token_ids, last_only=False):
        bias = POSITION_BIAS[self.length : self.length + len(token_ids)]  # (T, V)
        self.length += len(token_ids)
        logits = self.table[torch.tensor(token_ids)] + bias  # (T, V)
        return (logits[-1:] if last_only else logits), None

    def rollback(self, length):
        self.length = min(self.length, length)



def expected_loop_joint(s: Sampler) -> np.ndarray:
    """The target's own distribution of the first three tokens, positions included."""
    table = markov_tables()[0]
    joint = np.zeros((VOCAB,) * 3)
    for seq in itertools.product(range(VOCAB), repeat=3):
        prob, prev = 1.0, START
        for position, token in enumerate(seq):
            prob *= float(reference_probs(table[prev] + POSITION_BIAS[position], s)[token])
            prev = token
        joint[seq] = prob
    return joint.ravel()


def tiny_tokenizer(vocab_size: int = 64, shift: int = 0):
    """A word-level tokenizer with a chat template: specials, role names, then words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    words = [f"w{i + shift}" for i in range(vocab_size - len(specials))]
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def reference_probs(logits: torch.Tensor, s: Sampler) -> torch.Tensor:
    """Independent reference of temperature -> top-k -> top-p (HF semantics) for one row of logits."""
    scores = logits.double() / s.temperature
    if s.top_k:
        kth = scores.sort(descending=True).values[min(s.top_k, len(scores)) - 1]
        scores = torch.where(scores < kth, torch.tensor(-float("inf"), dtype=scores.dtype), scores)
    probs = torch.softmax(scores, dim=-1)
    if s.top_p < 1:
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        mass = 0.0
        for token in order.tolist():  # keep the smallest top set whose mass reaches top_p
            keep[token] = True
            mass += float(probs[token])
            if mass >= s.top_p:
                break
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs



# A logit offset per position, so a wrong cache length changes the distribution. (64 positions, V)
POSITION_BIAS = torch.stack([torch.linspace(-1.5, 1.5, VOCAB).roll(i) for i in range(64)])


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@contextlib.contextmanager
def serving(model_dir: str, kernel: str = "auto", **server):
    """A server on a target folder or alias (float32, prompt lookup) at a free loopback port; yields (base_url,
    runtime). kernel: target.kernel (a fixed one spares a real target the minute-long measurement of auto)."""
    import socket
    import threading
    import time

    import uvicorn

    from specdraft.decode.config import DecodeConfig, ProposerConfig, ServeConfig, ServerSettings
    from specdraft.decode.serve import build_runtime
    from specdraft.decode.server import make_app
    from specdraft.io.config import TargetConfig

    proposer = server.pop("proposer", ProposerConfig(name="ngram"))
    cfg = ServeConfig(target=TargetConfig(name_or_path=model_dir, dtype="float32", kernel=kernel), proposer=proposer,
                      decode=DecodeConfig(num_draft=3), server=ServerSettings(**{"model_name": "tiny", **server}))
    runtime = build_runtime(cfg, log=lambda *a: None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    instance = uvicorn.Server(uvicorn.Config(make_app(runtime), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not instance.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", runtime
    finally:
        instance.should_exit = True
        thread.join(timeout=10)
        runtime.worker.stop()


def frozen(body, *args) -> None:
    """body(*args) in a child forked from a fork server, with what it inherited frozen out of the garbage collector:
    the server's imports (speculators pulls in torch's inductor) are some 600,000 objects, and walking them in
    every full collection more than doubled a training child's time."""
    import gc

    gc.freeze()
    body(*args)


def die_in_training(where: str, n: int, die) -> None:
    """Make this training process call die() at a chosen point: "step" inside the loss's n-th call (training steps
    and held-out evaluation both compute it), "checkpoint" after step n's checkpoint wrote its weights and before
    its meta.json (rank 0 writes both)."""
    from safetensors.torch import save_file

    from specdraft.train import checkpoint, trainer

    if where == "step":
        real_step, calls = trainer.distill_step, []

        def dying_step(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                die()
            return real_step(*args, **kwargs)

        trainer.distill_step = dying_step
    if where == "checkpoint":
        real_write = checkpoint.write_checkpoint_files

        def dying_write(folder, step, weights, trainer_state, meta):
            if step == n:
                save_file(checkpoint.trainable_state(weights), str(folder / "drafter.safetensors"))
                die()
            return real_write(folder, step, weights, trainer_state, meta)

        checkpoint.write_checkpoint_files = dying_write


def kill_tree(root: int) -> None:
    """SIGKILL a process and all its descendants, as when the machine goes: an `accelerate launch` and its ranks
    (torch's launcher starts each rank in a session of its own, so no process group holds them all). The caller
    is killed last when it is one of them."""
    import os
    import signal

    import psutil

    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        if process.pid != os.getpid():
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
    if any(process.pid == os.getpid() for process in tree):
        os.kill(os.getpid(), signal.SIGKILL)


def killable_training(run_dir: str, out: str, kill: tuple[str, int] | None = None) -> None:
    """The body of one training process of the kill-anywhere test (tests/test_kill_resume.py): `run()`'s tiny run
    with a checkpoint after every step and resume=auto; at the end the final weights and the losses of the steps
    this process ran go to `out` (.safetensors, .json). kill=(where, n): the process SIGKILLs itself there
    (`die_in_training`)."""
    import json
    import os
    import signal

    from safetensors.torch import save_file

    if kill:
        die_in_training(*kill, die=lambda: os.kill(os.getpid(), signal.SIGKILL))
    drafter, summary = run(tiny_llama(0), run_dir, checkpoint_every=1)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, out + ".safetensors")
    Path(out + ".json").write_text(json.dumps({"loss_history": summary["loss_history"], "steps": summary["steps"]}))


def export_drafter(target_model, seed: int) -> BlockDrafter:
    """A small dspark drafter of the tiny target, its weights fixed by `seed` (the kill-anywhere export test)."""
    torch.manual_seed(seed)
    drafter = BlockDrafter(target_model.config, 1, 2, block_size=3, mask_token_id=0, markov_rank=8)
    drafter.copy_target_weights(target_model)
    return drafter


# What an export mutates on disk, as Python's audit events name it: files opened for writing, folders made,
# files and folders removed or renamed (os.replace raises os.rename). Safetensors' own writes (Rust) raise none.
MUTATIONS = {"os.mkdir", "os.remove", "os.rmdir", "os.rename", "shutil.rmtree"}


def is_mutation(event: str, args: tuple, root: Path) -> bool:
    """Whether an audit event changes something under `root` (a folder, resolved)."""
    import os

    if event == "open":
        path, _, flags = args
        writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        return writing and isinstance(path, (str, Path)) and Path(path).resolve().is_relative_to(root)
    if event not in MUTATIONS:
        return False
    path = args[0]  # rmtree removes by names relative to a folder it holds open: those are ours too
    return not isinstance(path, (str, Path)) or not Path(path).is_absolute() or Path(path).resolve().is_relative_to(root)


def killable_export(target_dir: str, out: str, seed: int, kill_at: int | None, signals: str) -> None:
    """The body of one export process of the kill-anywhere test: save_drafter(export_drafter(seed)) to `out`.
    kill_at=k SIGKILLs the process just before the k-th file-system mutation under out's parent folder (an audit
    hook sees each before it happens). signals/: `started` just before the export, then `events.json` (how many
    mutations it made, its seconds) when it is done."""
    import json
    import os
    import signal
    import sys
    import time

    from specdraft.io.target import load_target
    from specdraft.models.export import save_drafter

    target = load_target(target_dir, "float32")
    drafter = export_drafter(target.model, seed)
    root, events = Path(out).parent.resolve(), []

    def hook(event, args):
        if is_mutation(event, args, root):
            events.append(event)
            if len(events) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    Path(signals, "started").write_text("")
    began = time.perf_counter()
    sys.addaudithook(hook)  # after the marker: that write is not the export's
    save_drafter(Path(out), drafter, (1, 2), target.model, target_dir, target_dir)
    seconds = time.perf_counter() - began
    Path(signals, "events.json").write_text(json.dumps({"events": len(events), "seconds": seconds}))


class TearingSink:
    """Stands in for regeneration's output file: its n-th line is written halfway, everything before it reaches
    the disk, then the process SIGKILLs itself (a kill while the OS wrote part of a buffered batch)."""

    def __init__(self, sink, n: int):
        self.sink, self.n, self.lines = sink, n, 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        if self.lines >= self.n:
            import os
            import signal

            self.sink.write(text[: len(text) // 2])
            self.sink.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return self.sink.write(text)

    def flush(self) -> None:
        self.sink.flush()

    def fileno(self) -> int:
        return self.sink.fileno()


def killable_regeneration(target_dir: str, out_dir: str, prompts: list[dict], settings: dict,
                          tear: int | None = None) -> None:
    """The body of one regeneration process of the kill-anywhere test: regenerate() with `settings`
    (engine: the decode engine's generator as the distill pipeline builds it, else HF generate). tear=n: the n-th
    record this process appends is cut halfway and the process SIGKILLs itself (`TearingSink`)."""
    from specdraft.io.target import load_target
    from specdraft.pipeline import engine_generator
    from specdraft.train import regenerate

    settings = dict(settings)
    target = load_target(target_dir, "float32")
    generate = engine_generator(target, "auto", settings["batch_size"]) if settings.pop("engine") else None
    if tear:
        append, tearing = regenerate._append, {}

        def tearing_append(sink, chunk, responses):  # one file for the whole run: one count of its lines
            append(tearing.setdefault("sink", TearingSink(sink, tear)), chunk, responses)

        regenerate._append = tearing_append
    regenerate.regenerate(target.model, target.tokenizer, prompts, out_dir, generate=generate, **settings)


def every_kernel_plan(dtype: torch.dtype, device: torch.device):
    """A KernelPlan that runs every candidate kernel of this machine at some width, without measuring: each
    kernel packed for a row count at that count, the others at the widths left of 1, 2, 3, 4, 5, 6, 8, 12 and 16 rows
    and past 16 (the prefill), cycled where there are fewer kernels than widths. Raises where the machine has
    more kernels than widths, so that a test using it cannot silently leave one out."""
    from specdraft.decode.linear_kernels import KERNELS, KernelPlan, candidates

    names = candidates(dtype, device)
    slots = ["1", "2", "3", "4", "5", "6", "8", "12", "16", "wide"]
    picks: dict[str, str] = {}
    for name in (n for n in names if KERNELS[n].rows is not None):
        free = [s for s in slots[:-1] if s not in picks and int(s) <= KERNELS[name].rows]
        if free:
            picks[free[-1]] = name
    general = itertools.cycle([n for n in names if KERNELS[n].rows is None])
    for slot in (s for s in slots if s not in picks):
        picks[slot] = next(general)
    missing = set(names) - set(picks.values())
    if missing:
        raise AssertionError(f"every_kernel_plan has {len(slots)} widths for {len(names)} kernels; "
                             f"{sorted(missing)} would not run: add a width")
    return KernelPlan(picks["1"], picks["wide"], "config", by_rows={s: picks[s] for s in slots[1:-1]})


def threads_for_tests() -> int:
    """Threads for a test that runs the real target: both cores when it has the machine to itself, one when
    pytest-xdist runs another worker beside it (two threads against a busy core more than tripled these tests)."""
    import os

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else min(2, os.cpu_count() or 1)
