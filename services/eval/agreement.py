"""Greedy agreement: how many leading tokens a configuration's greedy output shares with a
reference's (float32 by default) over the bundled prompt set."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.sampling_params import SamplingParams
from services.eval.corpus import load_prompts


@dataclass(frozen=True)
class AgreementResult:
    matched: tuple[int, ...]  # per prompt: identical tokens before the first divergence
    new_tokens: int  # tokens generated per prompt

    @property
    def mean_fraction(self) -> float:
        return sum(self.matched) / (len(self.matched) * self.new_tokens)

    @property
    def exact(self) -> int:
        """Prompts whose whole output matched."""
        return sum(m == self.new_tokens for m in self.matched)

    def as_dict(self) -> dict:
        return {"mean_fraction": self.mean_fraction, "exact": self.exact, "prompts": len(self.matched),
                "new_tokens": self.new_tokens, "matched": list(self.matched)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list[list[int]], candidate: list[list[int]], new_tokens: int) -> AgreementResult:
    """Per-prompt greedy outputs (each new_tokens long) → AgreementResult."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs but {len(candidate)} candidate outputs")
    return AgreementResult(tuple(common_prefix(r, c) for r, c in zip(reference, candidate)), new_tokens)


def prompt_ids(engine) -> list[list[int]]:
    """The bundled prompts as token ids: chat prompts through the model's chat template, text as is."""
    chat, text = load_prompts()
    return ([engine.prompt_ids(messages=[{"role": "user", "content": p}]) for p in chat]
            + [engine.prompt_ids(p) for p in text])


def greedy_outputs(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, exactly new_tokens each (eos ignored), run as one batch."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate_batch(prompts, sp)]
