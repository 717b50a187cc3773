"""Build a `tokenizers.Tokenizer` from a GGUF file's `tokenizer.*` metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, merges, token types and special ids under
llama.cpp's keys. We rebuild the same byte-level BPE that transformers builds for such a file
(`transformers.integrations.gguf`), so token ids agree with `AutoTokenizer.from_pretrained(...,
gguf_file=...)` exactly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from services.common.gguf_reader import FastGGUFReader

# Split regexes for `tokenizer.ggml.pre` values, as llama.cpp defines them. A `pre` that is not
# listed (gpt2, smollm, ...) gets GPT-2's own regex inside ByteLevel, which is what transformers
# does too. Note llama.cpp's `smollm` additionally splits digits one by one; transformers does not,
# and for SmolLM2's vocabulary (no multi-digit tokens) both give the same ids.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2),
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What a GGUF says about its tokenizer, beyond the `tokenizers.Tokenizer` itself."""

    tokenizer: Tokenizer
    special_tokens: dict[str, str]  # {"bos_token": "<|im_start|>", "eos_token": ..., ...} for templates
    bos_token_id: int | None
    eos_token_ids: list[int]  # eos plus eot/eom when the file names them
    chat_template: str | None
    add_bos: bool


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies are spelled in.

    Printable Latin-1 bytes map to themselves; the 68 others (controls, space, ...) are shifted to
    U+0100 onwards in byte order, so the vocabulary never contains whitespace or control characters.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(mapping.items()))


def load_gguf_tokenizer_parts(path: str) -> GGUFTokenizerParts:
    """Read `path`'s tokenizer metadata and build the tokenizer.

    Raises FileNotFoundError for a missing file and ValueError when the file has no tokenizer or one
    of a kind other than byte-level BPE (`tokenizer.ggml.model` == "gpt2").
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        fields = FastGGUFReader(path).fields
    except ValueError as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e

    def meta(key: str, default: Any = None) -> Any:
        field = fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    kind = meta("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = meta("ggml.tokens")
    token_types: list[int] = meta("ggml.token_type") or []
    merges: list[str] | None = meta("ggml.merges")
    if not tokens or merges is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens/merges are missing")

    tok = Tokenizer(_bpe_model(tokens, merges))
    split = PRE_TOKENIZER_SPLITS.get(meta("ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # the Split does the regex, ByteLevel only maps bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(tok, tokens, token_types)

    special = {name: tokens[i] for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                                  ("unk_token", "unknown"), ("pad_token", "padding"))
               if (i := meta(f"ggml.{key}_token_id")) is not None and 0 <= i < len(tokens)}
    # The named special tokens must be atomic even when the file typed them as normal tokens.
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    named = [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special.values()) if t not in added]
    if named:
        tok.add_special_tokens(named)
    bos_id = meta("ggml.bos_token_id")
    add_bos = bool(meta("ggml.add_bos_token", False)) and "bos_token" in special
    add_eos = bool(meta("ggml.add_eos_token", False)) and "eos_token" in special
    tok.post_processor = _post_processor(special, tok, add_bos, add_eos)
    eos_ids = [meta(f"ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return GGUFTokenizerParts(
        tokenizer=tok,
        special_tokens=special,
        bos_token_id=None if bos_id is None else int(bos_id),
        eos_token_ids=list(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        chat_template=meta("chat_template"),
        add_bos=add_bos,
    )


def _bpe_model(tokens: list[str], merges: list[str]) -> models.BPE:
    # Byte-level vocabularies are spelled in GPT-2's byte alphabet; a token written with other
    # characters (a raw space, say) is respelled so that lookups after ByteLevel find it.
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    return models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False)


def _add_gguf_added_tokens(tok: Tokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Both must be matched whole in the input, or `<|im_start|>` would be cut into pieces. A control
    token spelled outside the byte alphabet is a llama.cpp mislabel and adding it would grow the
    vocabulary past the model's, so it is skipped (transformers does the same).
    """
    alphabet = set(byte_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def _post_processor(special: dict[str, str], tok: Tokenizer, add_bos: bool, add_eos: bool) -> Any:
    """The BOS/EOS template llama.cpp applies per `add_bos_token`/`add_eos_token`."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
