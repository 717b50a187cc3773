"""The text <-> token-id boundary of the runtime: one `TextTokenizer`, loaded from a GGUF file or a
Hugging Face directory."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer, decoders

from services.common.model_path import resolve_model_path
from services.tokenizer.chat_template import ChatTemplate


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the model facts the runtime needs around it.

    Ids are those of the model's vocabulary; BOS is added by `encode` only when the model asks
    for it (its post-processor), and `add_special_tokens=False` turns that off. Special tokens
    written in the text (`<|im_start|>`) always encode to their single id.
    """

    def __init__(self, tokenizer: Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tokenizer
        self._bos_token_id = bos_token_id
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self._special_tokens = dict(special_tokens or {})
        self._template = ChatTemplate(chat_template) if chat_template else None
        self._token_texts: dict[int, tuple[str, bytes]] = {}  # token_text's cache (bounded by the vocabulary)
        self._added_ids: frozenset[int] | None = None
        self._byte_of: dict[str, int] | None = None

    # -- encoding -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Same ids as `encode` per text; tokenizers runs the batch on its own thread pool."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes of an incomplete UTF-8 sequence decode to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """Prompt text for `messages`, rendered with the model's own template (see ChatTemplate).

        Raises ValueError when the model ships no chat template.
        """
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     special_tokens=self._special_tokens, **extra)

    # -- vocabulary facts -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (eos, plus eot/eom or generation_config's list)."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def chat_template(self) -> str | None:
        return None if self._template is None else self._template.source

    @property
    def special_tokens(self) -> dict[str, str]:
        """{"bos_token": ..., "eos_token": ..., "unk_token": ..., "pad_token": ...} where known."""
        return dict(self._special_tokens)

    def token_text(self, i: int) -> tuple[str, bytes]:
        """Id `i` on its own as OpenAI reports a token in logprobs: (its text, its bytes).

        The bytes are the token's share of the UTF-8 output (byte-level vocabularies map their
        spelling back to bytes; `<0xNN>` pieces are that byte; added and special tokens are their
        content). The text is those bytes decoded, or, for a piece of a multi-byte character,
        OpenAI's `bytes:\\xNN...` spelling. Cached: logprobs ask for many ids per token."""
        hit = self._token_texts.get(i)
        if hit is None:
            raw = self._token_bytes(i)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._token_texts[i] = (text, raw)
        return hit

    def _token_bytes(self, i: int) -> bytes:
        piece = self._tok.id_to_token(i)
        if piece is None:
            return b""
        if self._added_ids is None:
            self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
        if i in self._added_ids:
            return self._tok.decode([i], skip_special_tokens=False).encode("utf-8")
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            from services.tokenizer.gguf_tokenizer import byte_to_unicode
            if self._byte_of is None:
                self._byte_of = {c: b for b, c in byte_to_unicode().items()}
            if all(c in self._byte_of for c in piece):
                return bytes(self._byte_of[c] for c in piece)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)  # sentencepiece byte fallback
        if byte:
            return bytes([int(byte.group(1), 16)])
        text = self._tok.decode([i], skip_special_tokens=False)
        if piece.startswith("\u2581") and not text.startswith(" "):  # a word start decoded alone loses its space
            text = " " + text
        return text.encode("utf-8")

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary spelling of id `i` (byte-level: `Ġ` for a leading space), None if out of range."""
        return self._tok.id_to_token(i)

    @property
    def raw(self) -> Tokenizer:
        return self._tok


def load_tokenizer(model_path: str | None) -> TextTokenizer:
    """Tokenizer of a `.gguf` file or a HF directory (None / "default" = the default model).

    Raises FileNotFoundError for a missing path or a directory without tokenizer.json, and
    ValueError for a file that is not GGUF or a tokenizer kind we cannot build.
    """
    path = resolve_model_path(model_path)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    from services.tokenizer.gguf_tokenizer import load_gguf_tokenizer_parts

    parts = load_gguf_tokenizer_parts(path)
    return TextTokenizer(parts.tokenizer, bos_token_id=parts.bos_token_id, eos_token_ids=parts.eos_token_ids,
                         chat_template=parts.chat_template, special_tokens=parts.special_tokens)


def _load_hf_dir(path: str) -> TextTokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    tok = Tokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    special = {name: _token_content(config[name]) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if config.get(name) is not None}

    eos_ids: list[int] = []
    if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
        eos_ids.append(tok.token_to_id(special["eos_token"]))
    # Chat models often stop on more than one id (Llama-3: <|eot_id|>, <|eom_id|>, <|end_of_text|>).
    gen_eos = _read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")
    eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
    bos_id = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
    return TextTokenizer(tok, bos_token_id=bos_id, eos_token_ids=eos_ids,
                         chat_template=_hf_chat_template(path, config), special_tokens=special)


def _hf_chat_template(path: str, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config; older ones inline it, possibly
    # as a list of named templates of which "default" is the chat one.
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template") or config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _token_content(value: str | dict[str, Any]) -> str:
    return value["content"] if isinstance(value, dict) else value


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)
