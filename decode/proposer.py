"""Drafters behind one interface.

A proposer drafts a block of tokens continuing the context and says, per position, which
distribution q it sampled from (exact rejection sampling needs q; None means deterministic, i.e.
q is one-hot on the drafted token) and optionally a confidence. The generate loop calls
`start` after prefill, `propose` before each verify forward, and `commit` after it with the
context as it now stands and the target's hidden states (at `feature_layers`) of the positions
that entered the target's cache, so a feature-fed drafter (DSpark) grows its context without
recomputation. Rollback of a proposer's own state is its job, keyed on the committed context.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specdraft.decode.backoff import Backoff
from specdraft.decode.calibration import apply_map
from specdraft.decode.sampling import Sampler, sample
from specdraft.decode.session import CausalSession
from specdraft.models.layouts import EXTERNAL, folder_kind


@dataclass
class Proposal:
    """A drafted block: tokens (k,), their draft distributions q (k, V) or None, confidences (k,) or None
    (calibrated, when the export carries a calibration) and the confidence head's raw logits (k,).
    `scheduled`: the proposer already cut the block with the step's rule (the loop does not cut it again).
    `alternatives`: greedy only, sibling branches of `tokens` (each starts with another candidate for position 1
    and is no longer than `tokens`), verified in the same forward as a token tree (decode/tree.py)."""

    tokens: list[int]
    draft_probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    scheduled: bool = False
    alternatives: list[list[int]] = field(default_factory=list)

    def truncate(self, length: int) -> "Proposal":
        """The first `length` positions of the block (of each alternative branch too)."""
        cut = lambda t: None if t is None else t[:length]  # noqa: E731
        alternatives = [branch[:length] for branch in self.alternatives] if length > 0 else []
        return Proposal(self.tokens[:length], cut(self.draft_probs), cut(self.confidence), cut(self.confidence_logits),
                        self.scheduled, alternatives)


class Proposer(Protocol):
    max_draft: int | None  # most tokens one proposal can hold (None: no limit)
    feature_layers: tuple[int, ...]  # target hidden-state indices it wants at commit

    def start(self, context_ids: list[int], features: torch.Tensor | None) -> None: ...  # prompt + first token

    # rule: a scheduler's stopping rule (decode/scheduler.py) a proposer with confidences may apply
    # before sampling each position; others ignore it and the loop cuts their proposal afterwards.
    def propose(self, context_ids: list[int], num_draft: int, sampler: Sampler, generator, rule=None) -> Proposal: ...

    def commit(self, context_ids: list[int], features: torch.Tensor | None) -> None: ...

    def clone(self) -> "Proposer": ...  # same weights, own state: one per concurrent request


def gives_confidence(proposer) -> bool:
    """Whether a proposer's proposals carry confidences (what threshold/cost/load schedulers read)."""
    if isinstance(proposer, NgramProposer):
        return True
    if isinstance(proposer, HybridProposer):
        return gives_confidence(proposer.trained)
    return getattr(getattr(proposer, "drafter", None), "confidence_head", None) is not None


class NoProposer:
    """Drafts nothing: the loop becomes plain one-token-per-step decoding."""

    max_draft = 0
    feature_layers = ()

    def clone(self):
        return self  # stateless

    def start(self, context_ids, features):
        pass

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        return Proposal([])

    def commit(self, context_ids, features):
        pass


def suffix_occurrences(context_ids: list[int], max_ngram: int):
    """(end, n) for each earlier occurrence of the context's last token, most recent first (recent repetitions
    predict the continuation best): `end` its index, n how many tokens ending there equal the context's
    suffix (extended backwards, at most `max_ngram`)."""
    size = len(context_ids)
    last = context_ids[-1]
    for end in range(size - 2, -1, -1):
        if context_ids[end] != last:
            continue
        n = 1
        while n < max_ngram and end - n >= 0 and context_ids[end - n] == context_ids[size - 1 - n]:
            n += 1
        yield end, n


def ngram_match(context_ids: list[int], num_draft: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """The longest suffix of the context (at most `max_ngram` tokens, at least `min_ngram`) that occurred
    earlier, and the tokens that followed its most recent such occurrence: (match length, continuation).
    (0, []) when no suffix of `min_ngram` tokens recurs."""
    if len(context_ids) < 2:
        return 0, []
    best, start = 0, -1
    for end, n in suffix_occurrences(context_ids, max_ngram):
        if n > best:
            best, start = n, end + 1
            if n == max_ngram:
                break
    if best < min_ngram:
        return 0, []
    return best, context_ids[start : start + num_draft]


def ngram_siblings(context_ids: list[int], first: int, count: int, length: int, max_ngram: int) -> list[list[int]]:
    """Up to `count` other continuations of the context's last token, each at most `length` tokens, with first
    tokens distinct from `first` and from each other: what followed its earlier occurrences, those whose
    preceding tokens match the context's suffix longest first, then the most recent. Where the main lookup
    draft's first token is wrong, the text often continued differently elsewhere (a variable used with
    several methods, a list whose items start alike): these are a token tree's side branches (decode/tree.py)."""
    if count < 1 or length < 1 or len(context_ids) < 2:
        return []
    # (-match length, -end: the most recent first among equal matches, continuation)
    found = sorted((-n, -end, context_ids[end + 1 : end + 1 + length])
                   for end, n in suffix_occurrences(context_ids, max_ngram))
    siblings, seen = [], {first}
    for _, _, continuation in found:
        if continuation[0] not in seen:
            seen.add(continuation[0])
            siblings.append(continuation)
            if len(siblings) == count:
                break
    return siblings


def ngram_lookup(context_ids: list[int], num_draft: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the context's longest recurring suffix."""
    return ngram_match(context_ids, num_draft, max_ngram, min_ngram)[1]


class SurvivalStats:
    """Online estimate of a deterministic proposer's confidences: c_j = P(drafted position j is accepted |
    positions < j were), per match length, from the steps verified so far (a Beta(1, 1) prior, so an
    unseen position starts at 0.5). Shared by a proposer and its clones: every request of a process
    teaches it. A step's confidences come from earlier steps only, so schedulers that read them stay
    stopping rules (decode/scheduler.py): the verified set never depends on the tokens being verified."""

    def __init__(self, buckets: int, positions: int = 16):
        self.tries = [[0] * positions for _ in range(buckets + 1)]
        self.hits = [[0] * positions for _ in range(buckets + 1)]
        self.declined = [0] * (buckets + 1)  # proposals of each match length that a rule cut to nothing

    def confidences(self, bucket: int, length: int) -> torch.Tensor:
        """c_1..c_length for a proposal from a match of `bucket` tokens (positions past the tracked ones
        share the last one's estimate)."""
        tries, hits = self.tries[bucket], self.hits[bucket]
        last = len(tries) - 1
        return torch.tensor([(hits[min(j, last)] + 1) / (tries[min(j, last)] + 2) for j in range(length)])

    def observe(self, bucket: int, verified: int, accepted: int) -> None:
        """A verified step: positions 1..min(accepted + 1, verified) were tried, the first `accepted` kept."""
        tries, hits = self.tries[bucket], self.hits[bucket]
        for j in range(min(accepted + 1, verified)):
            tries[min(j, len(tries) - 1)] += 1
            hits[min(j, len(tries) - 1)] += j < accepted


class NgramProposer:
    """Training-free prompt lookup: propose what followed the longest recurring suffix of the context.

    Each proposal carries confidences (SurvivalStats, by match length) learned from the steps verified so
    far, so the threshold and cost schedulers can cut it: a long match is worth verifying far ahead on a
    flat verify curve, a one-token match rarely is. Drafting costs nothing next to a verify step, so no
    scheduler backs off from it (`cheap`). `share_stats`: every request of the process teaches one estimate
    (the default: a server learns from its traffic); False: each request learns alone from the prior, so a
    request's verify lengths, hence at T > 0 its sampled tokens (never their distribution), do not depend
    on which requests ran before or beside it."""

    feature_layers = ()
    cheap = True
    PROBE_EVERY = 8

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int | None = None,
                 share_stats: bool = True, stats: SurvivalStats | None = None, branches: int = 1,
                 side_length: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= proposer.min_ngram ({min_ngram}) <= proposer.max_ngram ({max_ngram})")
        if branches < 1 or side_length < 1:
            raise ValueError(f"proposer.branches={branches} and proposer.side_length={side_length} must be >= 1")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft
        self.share_stats = share_stats
        self.stats = stats or SurvivalStats(max_ngram)
        # greedy token trees: up to branches - 1 side branches of at most side_length tokens (ngram_siblings)
        self.branches, self.side_length = branches, side_length
        # the last proposal: (context length, match length, main-chain tokens verified)
        self.pending: tuple[int, int, list[int]] | None = None

    def clone(self):
        """One per concurrent request: its own pending step; the statistics shared unless share_stats=False."""
        return NgramProposer(self.max_ngram, self.min_ngram, self.max_draft, self.share_stats,
                             self.stats if self.share_stats else None, self.branches, self.side_length)

    def start(self, context_ids, features):
        self.pending = None
        if not self.share_stats:
            self.stats = SurvivalStats(self.max_ngram)

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        self.pending = None
        matched, tokens = ngram_match(context_ids, num_draft, self.max_ngram, self.min_ngram)
        if not tokens:
            return Proposal([])
        confidence = self.stats.confidences(matched, len(tokens))
        keep = len(tokens)
        if rule is not None:  # cut here, so what is remembered is what gets verified
            values = confidence.tolist()
            keep = next((j for j in range(len(values)) if not rule.verify(values[: j + 1])), len(values))
            if keep == 0:
                # A match length the rule keeps declining would never be verified again, so its estimate could
                # never recover (a few early rejections would switch lookup off for it for good): every
                # PROBE_EVERY-th declined proposal of a match length verifies its first position anyway.
                self.stats.declined[matched] += 1
                keep = int(self.stats.declined[matched] % self.PROBE_EVERY == 0)
        self.pending = (len(context_ids), matched, tokens[:keep])
        alternatives = []
        if self.branches > 1 and keep and sampler.greedy:  # a token tree is verified greedily only
            alternatives = ngram_siblings(context_ids, tokens[0], self.branches - 1, min(keep, self.side_length),
                                          self.max_ngram)
        # scheduled: cut by the rule here (a probe included), so the loop must not cut it again
        return Proposal(tokens[:keep], confidence=confidence[:keep], scheduled=rule is not None,
                        alternatives=alternatives)

    def admitted(self, length: int) -> None:
        """scheduler=load cut the last proposal to `length` positions after propose(): only those are verified,
        so only those teach the statistics (counting the cut ones as rejections would teach that lookup never
        pays wherever admission once declined it, and admission would then never try it again)."""
        if self.pending is not None:
            context, matched, drafted = self.pending
            self.pending = (context, matched, drafted[:length])

    def commit(self, context_ids, features):
        # The step kept its accepted drafts and the target's own token after them. What the main chain got
        # right is its common prefix with them: every accepted token of a chain step, none where a side
        # branch of a tree held the target's token (its first token differs from the main chain's).
        if self.pending is not None:
            length, matched, drafted = self.pending
            if drafted:
                self.stats.observe(matched, len(drafted), common_prefix_length(drafted, context_ids[length:]))
        self.pending = None


def common_prefix_length(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of a and b, given that the first `start` tokens agree."""
    end = min(len(a), len(b))
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


class ModelProposer:
    """A standalone causal LM with the target's tokenizer, drafting autoregressively with its own KV cache."""

    max_draft = None
    feature_layers = ()

    def __init__(self, model: torch.nn.Module):
        self.session = CausalSession(model)
        self.cached: list[int] = []  # tokens whose keys/values are in the drafter's cache
        self.agreed = 0  # cached[:agreed] is known to equal the context (it was context last time)

    def clone(self) -> "ModelProposer":
        return ModelProposer(self.session.model)

    def start(self, context_ids, features):
        self.session.reset()
        self.cached, self.agreed = [], 0

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        if num_draft == 0:
            return Proposal([])
        # Roll back to what still agrees with the context; keep >= 1 token to feed for fresh logits.
        keep = min(common_prefix_length(self.cached, context_ids, self.agreed), len(context_ids) - 1)
        self.session.rollback(keep)
        self.cached = self.cached[:keep]
        feed = context_ids[keep:]
        tokens, draft_probs = [], []
        for _ in range(num_draft):
            logits, _ = self.session.forward(feed, last_only=True)  # (1, V)
            self.cached.extend(feed)
            if sampler.greedy:
                token = int(logits[0].argmax())
            else:
                probs = sampler.probs(logits)  # (1, V)
                token = int(sample(probs, generator))
                draft_probs.append(probs[0])
            tokens.append(token)
            feed = [token]
        self.agreed = len(context_ids)
        return Proposal(tokens, torch.stack(draft_probs) if draft_probs else None)

    def commit(self, context_ids, features):
        pass  # rollback happens lazily in propose(), against the committed context


def check_same_vocabulary(target_tokenizer, target_model, drafter_tokenizer, drafter_model, target_name: str, drafter_name: str) -> None:
    """Refuse a drafter whose tokenizer or output vocabulary differs from the target's."""
    target_rows = target_model.get_output_embeddings().weight.shape[0]
    drafter_rows = drafter_model.get_output_embeddings().weight.shape[0]
    if target_rows != drafter_rows:
        raise ValueError(
            f"drafter {drafter_name} has a vocabulary of {drafter_rows} tokens but target {target_name} has {target_rows}; "
            "a standalone drafter must share the target's tokenizer"
        )
    if drafter_tokenizer is not None and drafter_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"drafter {drafter_name} uses a different tokenizer than target {target_name}; "
            "a standalone drafter must share the target's tokenizer"
        )


def _check_causal_lm(path: str) -> None:
    """A trained drafter's folder is not a causal LM: transformers would build one from its config with random
    weights where the drafter's do not fit (a DeepSpec or z-lab config names a plain model_type), and drafting
    would silently accept nothing. Refuse it, naming the proposer that runs it."""
    found = folder_kind(path)
    if found == "speculators" or found in EXTERNAL:
        what = "a speculators drafter export" if found == "speculators" else f"a {EXTERNAL[found]} drafter checkpoint"
        raise ValueError(f"proposer=model takes a standalone causal LM, but {path} is {what}: decode it with "
                         f"proposer=drafter proposer.path={path}")
    if found in ("checkpoint", "run"):
        raise ValueError(f"proposer=model takes a standalone causal LM, but {path} is a training "
                         f"{'checkpoint' if found == 'checkpoint' else 'run folder'}: pass the run's export, RUN/export")


def load_model_proposer(path: str, num_layers: int | None, target) -> tuple[ModelProposer, torch.nn.Module]:
    """A standalone drafter from a folder (or the target's own), optionally cut to its first k layers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _check_causal_lm(path)
    config = AutoConfig.from_pretrained(path)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"proposer.num_layers={num_layers}; {path} has {config.num_hidden_layers} layers")
        config.num_hidden_layers = num_layers
    # The dropped layers' weights are unused on purpose; keep the load quiet about them.
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=target.dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.to(target.model.device).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only folder; the vocabulary size check still applies
    check_same_vocabulary(target.tokenizer, target.model, tokenizer, model, target.path, path)
    return ModelProposer(model), model


def pick_draft_token(logits: torch.Tensor, draft_to_target: torch.Tensor, target_vocab: int, sampler: Sampler, generator):
    """Greedy or sampled token from (1, V_draft) logits: (target id, q over the target vocabulary or None).
    Sampled in float32 whatever the drafter's dtype, so q is the distribution the draw used, to float32's precision."""
    logits = logits.float()
    if sampler.greedy:
        return draft_to_target[logits[0].argmax()], None
    probs = sampler.probs(logits)  # (1, V_draft)
    draft_id = sample(probs, generator)[0]
    # q over the target's vocabulary: draft ids map to target ids, every other token has q = 0.
    full = probs.new_zeros(target_vocab)
    full[draft_to_target] = probs[0]
    return draft_to_target[draft_id], full


class MarkovBiasMemo:
    """A vanilla Markov head's bias W2(W1[x]) per previous token x, kept after its first computation.

    The bias depends on x alone, and a drafted position pays a GEMV over the whole draft vocabulary for it
    (8192 x 256 weights on the default export, 8 MB in fp32, read again for every drafted position). Text
    repeats its tokens, so most positions find theirs here; the tensor is the one computed before, so drafting
    is unchanged bit for bit. Least recently used entries go first past `max_bytes`."""

    def __init__(self, max_bytes: int = 64 << 20):
        self.max_bytes, self.bytes, self.entries = max_bytes, 0, OrderedDict()
        self.hits = self.misses = 0

    def bias(self, heads, token: int, embedding: torch.Tensor) -> torch.Tensor:
        # embedding (1, r) = W1[token] -> (1, V_draft)
        hit = self.entries.get(token)
        if hit is not None:
            self.hits += 1
            self.entries.move_to_end(token)
            return hit
        self.misses += 1
        bias = heads.markov_step(embedding, None, None)[0]
        self.entries[token] = bias
        self.bytes += bias.numel() * bias.element_size()
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        return bias


class BlockDrafterProposer:
    """A DSpark/DFlash block drafter: one backbone pass per block, Markov head sampled left to right.

    Its context is the target's features at `feature_layers` for every token in the target's
    cache, handed over by the generate loop after prefill and after each verify forward; the
    projected features' keys/values are cached per draft layer and cropped like the target's cache.
    """

    def __init__(self, drafter, feature_layers: tuple[int, ...], calibration: dict | None = None,
                 markov_memo: "MarkovBiasMemo | None | bool" = True, branches: int = 1):
        """markov_memo: True (a memo where the head is vanilla), False (none: the reference), or one to share.
        branches: greedy drafting proposes this many candidates for position 1: the main chain's first token
        and the runners-up as one-token sibling branches (`Proposal.alternatives`, verified as a token tree);
        1: one chain."""
        if branches < 1:
            raise ValueError(f"proposer.branches={branches}; it must be >= 1 (1: one drafted chain per step)")
        self.drafter = drafter.eval()
        self.branches = branches
        self.feature_layers = tuple(feature_layers)
        self.max_draft = drafter.block_size
        self.calibration = calibration  # {"greedy"|"sampling": {"scale": [..], "shift": [..]}}, see decode/calibrate.py
        self.cache: list | None = None
        self.length = 0  # context positions in the cache
        self.pending: list[torch.Tensor] = []  # committed features not yet in the cache (see `commit`)
        vanilla = drafter.markov_head is not None and drafter.markov_head.head_type == "vanilla"
        if markov_memo is True:
            markov_memo = MarkovBiasMemo() if vanilla else None
        self.markov_memo = markov_memo if vanilla and markov_memo is not False else None

    def clone(self) -> "BlockDrafterProposer":
        """A proposer with its own (empty) context sharing this one's weights (and Markov memo): one per
        concurrent request."""
        return BlockDrafterProposer(self.drafter, self.feature_layers, self.calibration,
                                    self.markov_memo if self.markov_memo is not None else False, self.branches)

    def calibration_maps(self, sampler: Sampler) -> dict | None:
        """The confidence maps for this sampler's bucket (None: the head as trained)."""
        if not self.calibration:
            return None
        return self.calibration.get("greedy" if sampler.greedy else "sampling")

    @torch.inference_mode()
    def _append(self, features: torch.Tensor) -> None:
        features = features.to(self.drafter.embed_tokens.weight.dtype)  # a drafter may run in another dtype (proposer.dtype)
        new = self.drafter.context_cache(self.drafter.project_context(features[None]), self.length)
        if self.cache is None:
            self.cache = new
        else:
            self.cache = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.cache, new)]
        self.length += features.shape[0]

    def start(self, context_ids, features):
        self.cache, self.length, self.pending = None, 0, []
        self._append(features)

    def commit(self, context_ids, features):
        # Features arrive for exactly the positions the target kept; nothing to roll back here
        # because drafted tokens never enter this cache (they are block slots, recomputed each step).
        # They are projected when the next draft needs them: while a scheduler falls back to plain
        # decoding the drafter is not run, and one projection of several steps' features then
        # replaces a projection per step (which costs ~2% of a 1-token bf16 step here).
        self.pending.append(features)

    def flush(self) -> None:
        """Bring the context cache up to date with every committed position."""
        if self.pending:
            features, self.pending = torch.cat(self.pending), []  # (T_new, L*H)
            self._append(features)

    @torch.inference_mode()
    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        if num_draft == 0:
            return Proposal([])
        self.flush()
        drafter = self.drafter
        anchor = torch.tensor([context_ids[-1]], device=drafter.draft_to_target.device)
        # Hidden states only: the LM head runs below once the first position is drafted, so a step the
        # scheduler ends at c_1 (plain decoding) pays for the backbone and the confidence head alone.
        out = drafter.forward_block(self.cache, self.length, anchor, logits=False)  # hidden (1, γ, H)
        block_logits = None
        heads = drafter.markov_head
        state = heads.initial_state(1, out.hidden[:, 0]) if heads is not None else None
        maps = self.calibration_maps(sampler)
        previous, tokens, draft_probs, confidence, raw = anchor, [], [], [], []
        target_vocab = drafter.embed_tokens.num_embeddings
        for k in range(num_draft):
            hidden = out.hidden[:, k]  # (1, H)
            if heads is not None:
                embedding = heads.markov_w1(previous)  # (1, r)
                # c_k depends on x_{k-1} (through W1) but not on x_k: the rule may stop here, before x_k is drawn.
                z = drafter.confidence_head(torch.cat([hidden, embedding], -1)).float()[0]
                raw.append(z)
                confidence.append(apply_map(z, maps, k))
                if rule is not None and not rule.verify([float(c) for c in confidence]):
                    confidence.pop(), raw.pop()
                    break
                bias, state = self._markov_bias(heads, previous, embedding, hidden, state)
            if block_logits is None:  # the LM head of every position at once: one read of its weights, not k
                block_logits = drafter.lm_head(out.hidden[0, :num_draft])  # (k, V_draft)
            logits = block_logits[k : k + 1]  # (1, V_draft)
            if heads is not None:
                logits = logits + bias
            if k == 0:
                first_logits = logits  # where the alternative branches start
            token, q = pick_draft_token(logits, drafter.draft_to_target, target_vocab, sampler, generator)
            if q is not None:
                draft_probs.append(q)
            tokens.append(int(token))
            previous = token.reshape(1)
        alternatives = []
        if self.branches > 1 and sampler.greedy and tokens:
            alternatives = self._alternatives(first_logits)
        return Proposal(
            tokens,
            torch.stack(draft_probs) if draft_probs else None,
            torch.stack(confidence) if confidence else None,
            torch.stack(raw) if raw else None,
            alternatives=alternatives,
        )

    def _markov_bias(self, heads, previous: torch.Tensor, embedding: torch.Tensor, hidden: torch.Tensor, state):
        """The Markov head's bias for the position after `previous` (its W1 row `embedding`), and its state."""
        if self.markov_memo is not None:
            return self.markov_memo.bias(heads, int(previous), embedding), state
        return heads.markov_step(embedding, hidden, state)

    def _alternatives(self, first_logits: torch.Tensor) -> list[list[int]]:
        """Greedy sibling branches of the main chain: the next-best candidates for position 1 (the main chain
        took the best), one token each. Measured on the default export (held-out ShareGPT, fixed 2): the
        target's token is the drafter's top-1 at 20% of steps and among its top-3 at 35%, while the second
        position of a branch whose first token was a runner-up survives rarely; so the verify rows a tree can
        add at no cost go to more first-position candidates, not to their continuations."""
        ranked = first_logits[0].float().topk(min(self.branches, first_logits.shape[-1])).indices.tolist()
        chosen = int(first_logits[0].float().argmax())  # the main chain's position 1 (pick_draft_token's argmax)
        to_target = self.drafter.draft_to_target
        return [[int(to_target[d])] for d in ranked if d != chosen][: self.branches - 1]


class Eagle3Proposer:
    """The Eagle-3 head: drafts autoregressively, feeding its own hidden state forward.

    Its cache holds the keys/values of every context position computed from the target's features
    (step 0); drafted positions' keys live only inside one `propose` call.
    """

    def __init__(self, drafter, feature_layers: tuple[int, ...]):
        self.drafter = drafter.eval()
        self.feature_layers = tuple(feature_layers)
        self.max_draft = drafter.block_size
        self.cache, self.length, self.last_hidden = None, 0, None

    @torch.inference_mode()
    def _append(self, context_ids, features: torch.Tensor) -> None:
        features = features.to(self.drafter.embed_tokens.weight.dtype)  # a drafter may run in another dtype (proposer.dtype)
        count = features.shape[0]
        device = self.drafter.draft_to_target.device
        next_tokens = torch.tensor(context_ids[self.length + 1 : self.length + 1 + count], device=device)
        out, (k, v) = self.drafter.context_step(features, next_tokens, self.length, self.cache)
        self.cache = (k, v) if self.cache is None else (torch.cat([self.cache[0], k], 2), torch.cat([self.cache[1], v], 2))
        self.length += count
        self.last_hidden = out[:, -1:]  # output at the last context position: predicts the first draft

    def start(self, context_ids, features):
        self.cache, self.length, self.last_hidden = None, 0, None
        self._append(context_ids, features)

    def commit(self, context_ids, features):
        self._append(context_ids, features)

    def clone(self) -> "Eagle3Proposer":
        return Eagle3Proposer(self.drafter, self.feature_layers)

    @torch.inference_mode()
    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        drafter, hidden, prefix = self.drafter, self.last_hidden, self.cache
        position, target_vocab = self.length - 1, drafter.embed_tokens.num_embeddings
        tokens, draft_probs = [], []
        for j in range(num_draft):
            logits = drafter.logits(hidden)[0, -1:]  # (1, V_draft)
            token, q = pick_draft_token(logits, drafter.draft_to_target, target_vocab, sampler, generator)
            if q is not None:
                draft_probs.append(q)
            tokens.append(int(token))
            if j == num_draft - 1:
                break
            position += 1
            hidden, (k, v) = drafter.draft_step(token, hidden, position, prefix)
            prefix = (torch.cat([prefix[0], k], 2), torch.cat([prefix[1], v], 2))
        return Proposal(tokens, torch.stack(draft_probs) if draft_probs else None)


class HybridProposer:
    """Multi-draft: prompt lookup where the context has a match, the trained drafter elsewhere, one verify
    per step. The proposal's q is that of whichever part drafted it (one-hot for lookup), so the acceptance
    rule stays exact. Both parts see every committed step, so the drafter's feature context and the lookup's
    statistics stay in step with the accepted text whichever part drafted.

    With a rule that prices steps (scheduler=cost), a lookup proposal is priced without the drafter's
    drafting time: its drafting is a scan of the context. Where lookup has a match but the rule declines it
    (its confidence is too low to pay), the drafter drafts instead. The loop never backs off from a hybrid
    (`cheap`): it backs off its drafter part itself (the rule's max_skip), and keeps looking up meanwhile.
    The drafter part's backoff also keeps its realized record (`Backoff.settle`): where the steps it drafted
    make fewer tokens than plain decoding would in their time, it stops drafting (probing now and then) and
    the hybrid is prompt lookup with plain steps between, never slower than lookup alone for long.
    Under scheduler=load (batched engine) the rule is batch-wide, so neither backs off, and the hybrid drafts
    request by request (the batched backbone pass serves plain block drafters only)."""

    cheap = True

    def __init__(self, lookup: NgramProposer, trained):
        self.lookup, self.trained = lookup, trained
        self.feature_layers = trained.feature_layers
        self.max_draft = None  # lookup has no block limit; the drafter is cut to its own
        self.last = None  # which part drafted the last proposal: "lookup" | "trained" | None
        self.backoff: Backoff | None = None  # the drafter part's, made from the first rule with a max_skip
        self.pending = None  # the drafter's last step, settled at commit: (rule, context length, positions verified)

    @property
    def calibration(self):
        return getattr(self.trained, "calibration", None)

    @property
    def branches(self) -> int:
        """The drafter part's token-tree width (lookup drafts chains): what a pricing rule prices its steps by."""
        return getattr(self.trained, "branches", 1)

    @calibration.setter
    def calibration(self, value) -> None:
        self.trained.calibration = value

    def clone(self) -> "HybridProposer":
        return HybridProposer(self.lookup.clone(), self.trained.clone())

    def start(self, context_ids, features):
        self.lookup.start(context_ids, features)
        self.trained.start(context_ids, features)
        self.backoff, self.pending = None, None

    def propose(self, context_ids, num_draft, sampler, generator, rule=None):
        lookup_rule = rule.without_drafting() if hasattr(rule, "without_drafting") else rule
        proposal = self.lookup.propose(context_ids, num_draft, sampler, generator, lookup_rule)
        if proposal.tokens:
            self.last = "lookup"
            proposal.scheduled = True  # cut by the lookup's pricing; the loop's rule would price the drafter in
            return proposal
        limit = min(num_draft, self.trained.max_draft or num_draft)
        if self.backoff is None and getattr(rule, "max_skip", 0):
            self.backoff = Backoff(rule.max_skip)
        if not limit or (self.backoff is not None and self.backoff.should_skip()):
            self.last = None
            return Proposal([])
        self.last = "trained"
        proposal = self.trained.propose(context_ids, limit, sampler, generator, rule)
        if self.backoff is not None:  # as decode.scheduler.backoff_count: 0 where the verified positions did not pay
            paid = not hasattr(rule, "pays") or proposal.confidence is None or rule.pays(proposal.confidence.tolist())
            self.backoff.observe(len(proposal.tokens) if proposal.tokens and paid else 0)
            if proposal.scheduled and hasattr(rule, "break_even"):  # its verified positions (0: the drafting was spent)
                self.pending = (rule, len(context_ids), len(proposal.tokens))
        return proposal

    def admitted(self, length: int) -> None:
        """scheduler=load cut the last proposal to `length` positions (see NgramProposer.admitted)."""
        if self.last == "lookup":
            self.lookup.admitted(length)

    def commit(self, context_ids, features):
        if self.pending is not None:
            rule, before, verified = self.pending
            # the context grew by what the step kept: accepted drafts + the target's token
            self.backoff.settle(len(context_ids) - before, rule.break_even(verified), verified)
            self.pending = None
        self.lookup.commit(context_ids, features)
        self.trained.commit(context_ids, features)
