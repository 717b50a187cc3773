"""Prompt text of an exact token count: words that are one token each.

With a byte-level BPE tokenizer (GPT-2 style, as SmolLM2's GGUF has), the pre-tokenizer splits
text into " word" pieces and encodes each piece on its own, so a text made of N pieces " w"
whose " w" is a single vocabulary entry encodes to exactly N tokens. The pool keeps only the
lowercase words for which the local tokenizer confirms that. Without a tokenizer, a built-in list
of common English words is used: most are one token in any modern vocabulary, so counts are
then approximate (documented in docs/bench_tool.md).
"""
from __future__ import annotations

import random
import re
import sys
from dataclasses import dataclass

FALLBACK_WORDS = (
    "the of and to in is was for that with as on by at from his it an were are which this be or "
    "has had not but first one their its new after who they two her she been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made between "
    "team through war american under while part well following second however until game three "
    "season both these including early since film work being played high number called north "
    "south group also around them three life several series water house family music river").split()

_WORD = re.compile(r"^[a-z]{3,12}$")


@dataclass(frozen=True)
class WordPool:
    words: tuple[str, ...]
    exact: bool  # True: every word is verified to be one token under `tokenizer_name`
    tokenizer_name: str

    def text(self, n_tokens: int, rng: random.Random) -> str:
        """n_tokens words, each with its leading space (so texts concatenate at word boundaries)."""
        return "".join(" " + rng.choice(self.words) for _ in range(n_tokens))


def pool_from_tokenizer(encode, vocab: list[str], name: str, limit: int = 4000) -> WordPool:
    """Words w (lowercase letters) for which encode(" " + w) is one token.

    `vocab` is the tokenizer's token strings; byte-level vocabularies spell a leading space "Ġ"
    and sentencepiece ones "▁"; both are tried. Raises ValueError when too few words qualify.
    """
    candidates = sorted({t[1:] for t in vocab if t[:1] in ("Ġ", "▁") and _WORD.match(t[1:])})
    words = [w for w in candidates if len(encode(" " + w)) == 1]
    words = words[:: max(1, len(words) // limit)][:limit]  # spread over the alphabet
    if len(words) < 100:
        raise ValueError(f"only {len(words)} one-token words in {name}'s vocabulary: use --tokenizer none")
    return WordPool(tuple(words), True, name)


def load_pool(tokenizer: str | None) -> WordPool:
    """The pool for --tokenizer: "default" (the default model's GGUF), a path, or None."""
    if tokenizer in (None, "", "none"):
        return WordPool(tuple(FALLBACK_WORDS), False, "none")
    from services.common.model_path import default_model_path
    from services.tokenizer.text_tokenizer import load_tokenizer

    if tokenizer == "default":
        try:
            default_model_path()
        except FileNotFoundError as e:  # the tool also serves machines without our model
            print(f"radixmesh bench: {e}; prompt lengths are approximate (--tokenizer none)", file=sys.stderr)
            return WordPool(tuple(FALLBACK_WORDS), False, "none")

    tok = load_tokenizer(tokenizer)
    raw = tok.raw
    vocab = [raw.id_to_token(i) or "" for i in range(raw.get_vocab_size())]
    return pool_from_tokenizer(lambda s: tok.encode(s, add_special_tokens=False), vocab, tokenizer or "default")
