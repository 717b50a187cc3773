"""The model's vocabulary for a grammar backend: each id's bytes, from the model's tokenizer."""
from __future__ import annotations

from services.common.grammar.backend import GrammarVocab


def grammar_vocab(model_path: str, vocab_size: int, stop_token_ids: list[int]) -> GrammarVocab:
    """Every id below `vocab_size` (the logits' width) as the bytes it adds to the output;
    special tokens and ids past the tokenizer's vocabulary as b"" (never text). The stop ids: the
    model's and its tokenizer's."""
    from services.tokenizer.text_tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    special = {i for i, added in tok.raw.get_added_tokens_decoder().items() if added.special}
    known = tok.vocab_size
    token_bytes = [b"" if i in special or i >= known else tok.token_text(i)[1] for i in range(vocab_size)]
    return GrammarVocab(token_bytes, sorted(set(stop_token_ids) | set(tok.eos_token_ids)))
