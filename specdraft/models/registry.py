"""Every drafter kind, registered once with what the rest of the code asks of it.

Code elsewhere looks a kind up (`kind(name)`) and reads its properties; it never compares mode strings.
Adding a kind is one entry here plus its model class.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterKind:
    name: str
    block: bool = False  # a parallel block drafter (BlockDrafter: all γ positions in one pass over mask tokens)
    unrolled: bool = False  # an autoregressive head trained by training-time test (Eagle-3)
    standalone: bool = False  # a truncated target with LoRA adapters: a plain causal LM with the target's tokenizer
    markov_head: bool = False  # logits_k + W2(W1[x_{k-1}]): the previous drafted token shapes the next
    confidence_head: bool = False  # scores each drafted position: schedulers can price its steps

    @property
    def proposer(self) -> str:
        """The decode proposer that runs it (decode/factory.py): model for standalone, drafter otherwise."""
        return "model" if self.standalone else "drafter"

    @property
    def speculators(self) -> bool:
        """Exported in vLLM's speculators format (a standalone drafter is a plain HF model folder)."""
        return not self.standalone


KINDS = {k.name: k for k in (
    DrafterKind("dspark", block=True, markov_head=True, confidence_head=True),
    DrafterKind("dflash", block=True),
    DrafterKind("eagle3", unrolled=True),
    DrafterKind("standalone", standalone=True),
)}
BLOCK_MODES = tuple(name for name, k in KINDS.items() if k.block)


def kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"drafter.mode={name!r} is unknown; choose one of {list(KINDS)} (or drafter=NAME)")
    return KINDS[name]
