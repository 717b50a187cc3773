"""TextTokenizer built from the default GGUF must encode, decode and render chats exactly as
transformers' GGUF tokenizer does."""
from __future__ import annotations

import os

import pytest
from jinja2.exceptions import SecurityError, TemplateError

from services.tokenizer.chat_template import ChatTemplate
from services.tokenizer.text_tokenizer import TextTokenizer, load_tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "It's a dog's life; they'll say we're fine, I'd think, you've seen, I'm sure.",
    "IT'S LOUD AND SHE'LL SHOUT",
    "  leading spaces and trailing spaces   ",
    "multiple     internal      spaces",
    "line one\nline two\n\nline four\r\nwindows line\rcarriage",
    "\n\n\n",
    " \t \t mixed whitespace \u00a0 nbsp \u2003 em-space",
    "def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
    "for (let i = 0; i < n; i++) {\n  console.log(`item ${i}`);\n}",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    "<html><body><p class=\"x\">Hi &amp; bye</p></body></html>",
    "{\"key\": \"value\", \"list\": [1, 2.5, null, true]}",
    "12345678901234567890",
    "3.14159265358979 and 2.718281828, 1e-10, 0xFF, 1,000,000",
    "Call 555-0123 on 2024-11-29 at 13:45:07.",
    "v1.2.3-rc4 build#9876",
    "😀 emoji 🎉🎉 party",
    "👨‍👩‍👧‍👦 family ZWJ, 👩🏽‍💻 technologist, 🏳️‍🌈 flag",
    "👍🏻👍🏼👍🏽👍🏾👍🏿 skin tones",
    "🇫🇷🇯🇵 flags",
    "日本語のテキストです。東京は大きい。",
    "中文文本，包括标点符号！",
    "한국어 텍스트입니다",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "Привет, мир! Ёжик.",
    "Ελληνικά κείμενα",
    "हिन्दी पाठ ٣٤٥ ४५६",
    "naïve café résumé façade Ångström",
    "e\u0301 combining accent vs \u00e9 precomposed",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "almost special <|im_start and im_end|> tokens",
    "<repo_name>radixmesh<file_sep>main.py",
    "tabs\t\t\tand\ttabs",
    "camelCaseIdentifier and XMLHttpRequest getHTTPResponseCode",
    "!!!??? ... --- ___ *** ~~~",
    "a" * 200,
    "Mr. O'Neil's 'quoted' \"double\" `backtick` «guillemets» „low“",
    "\u200b zero width \ufeff bom \u2028 line sep",
    "control \x00\x01\x7f chars",
]


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))


def test_corpus_is_varied() -> None:
    assert len(CORPUS) >= 40 and len(set(CORPUS)) == len(CORPUS)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tokenizer: TextTokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_encode_batch_equals_encode(tokenizer: TextTokenizer) -> None:
    assert tokenizer.encode_batch(CORPUS) == [tokenizer.encode(t) for t in CORPUS]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trips_and_matches_transformers(tokenizer: TextTokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_vocabulary_facts(tokenizer: TextTokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, [2])
    assert [tokenizer.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.encode("<|im_start|>") == [1]  # special tokens in text stay whole; no BOS added
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    assert tokenizer.raw.get_vocab_size() == 49152


def test_token_text_names_a_token_as_openai_does(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode(" Paris café <|im_end|>", add_special_tokens=False)
    assert [tokenizer.token_text(i) for i in ids] == [
        (" Paris", b" Paris"), (" caf\u00e9", " café".encode()), (" ", b" "), ("<|im_end|>", b"<|im_end|>")]
    # pieces of a character: their own bytes, and OpenAI's bytes:\xNN spelling for the text
    text = "東京 😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_text(i) for i in ids]
    assert b"".join(raw for _, raw in pieces) == text.encode()
    partial = [t for t, raw in pieces if len(raw) == 1 and raw[0] >= 0x80]
    assert partial and all(t == f"bytes:\\x{t[-2:]}" for t in partial), pieces
    assert tokenizer.token_text(10 ** 6) == ("", b"")


def test_an_unset_max_new_tokens_fills_the_room_left() -> None:
    from services.common.sampling_params import InvalidRequest
    from services.tokenizer.service import fill_max_new_tokens

    room = (1024, "the model's context length of 1024 tokens")
    assert fill_max_new_tokens(924, room, None) == 100
    assert fill_max_new_tokens(924, room, 16) == 16 and fill_max_new_tokens(1000, room, 64) == 24
    with pytest.raises(InvalidRequest, match=r"the prompt \(1024 tokens\) leaves no room for output within "
                                             r"the model's context length of 1024 tokens"):
        fill_max_new_tokens(1024, room, None)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Write `print(1)` in Python.\n"}],
    [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "héllo 😀"},
     {"role": "assistant", "content": "Hi there"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer: TextTokenizer, hf_tokenizer, messages,
                                            add_generation_prompt: bool) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert tokenizer.encode(ours) == hf_tokenizer.encode(ref)


def test_chat_template_default_system_prompt(tokenizer: TextTokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_hf_directory_tokenizer_matches_gguf(tokenizer: TextTokenizer, hf_tokenizer, tmp_path) -> None:
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = load_tokenizer(str(tmp_path))
    assert [from_dir.encode(t) for t in CORPUS] == [tokenizer.encode(t) for t in CORPUS]
    assert from_dir.apply_chat_template(CONVERSATIONS[2]) == tokenizer.apply_chat_template(CONVERSATIONS[2])
    assert (from_dir.bos_token_id, from_dir.eos_token_ids, from_dir.vocab_size) == (1, [2], 49152)


def test_template_environment_is_hf_compatible_and_sandboxed() -> None:
    t = ChatTemplate("{% for m in messages %}{{ m.content | tojson }}{% if loop.last %}{% break %}{% endif %}"
                     "{% endfor %}{% generation %}{{ bos_token }}{% endgeneration %}")
    assert t.render([{"role": "user", "content": "é<b>"}], special_tokens={"bos_token": "<s>"}) == '"é<b>"<s>'
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    assert ChatTemplate("  {% if true %}\nx\n  {% endif %}\n").render([]) == "x\n"
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])
    with pytest.raises(SecurityError):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_missing_template_and_paths_are_clear_errors(tokenizer: TextTokenizer, tmp_path) -> None:
    bare = TextTokenizer(tokenizer.raw)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="missing.gguf' does not exist"):
        load_tokenizer(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


# -- other pre-tokenizers: part of SmolLM2's vocabulary re-labelled as another family's ------------
@pytest.fixture(scope="module")
def small_vocab(model_path: str) -> tuple[list[str], list[str], list[int]]:
    """SmolLM2's first 4000 tokens (specials, all 256 bytes, early merges) and the merges among them.

    Small, so that transformers reads the relabelled files in a second rather than in ~20 s.
    """
    from services.worker.loader.gguf_loader import FastGGUFReader

    fields = FastGGUFReader(model_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()[:4000]
    known = set(tokens)
    merges = [m for m in fields["tokenizer.ggml.merges"].contents()
              if (a := m.split(" "))[0] in known and a[1] in known and a[0] + a[1] in known]
    # SmolLM2 has no multi-digit tokens, which would hide llama-bpe's \p{N}{1,3} vs qwen2's \p{N}.
    tokens += ["12", "123"]
    merges += ["1 2", "12 3"]
    return tokens, merges, fields["tokenizer.ggml.token_type"].contents()[:4000] + [1, 1]


def _relabelled_gguf(dst: str, vocab: tuple[list[str], list[str], list[int]], pre: str, add_bos: bool) -> None:
    """A GGUF holding `vocab` as a tokenizer with `tokenizer.ggml.pre` = `pre`; no real weights."""
    import gguf
    import numpy as np

    tokens, merges, types = vocab
    w = gguf.GGUFWriter(dst, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 32),
                       ("feed_forward_length", 32), ("attention.head_count", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre,add_bos", [("smollm", False), ("gpt2", False), ("llama-bpe", True), ("qwen2", False)])
def test_other_pre_tokenizers_match_transformers(small_vocab, tmp_path, pre: str, add_bos: bool) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / f"{pre}.gguf"
    _relabelled_gguf(str(path), small_vocab, pre, add_bos)
    ours = load_tokenizer(str(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert [ours.encode(t) for t in CORPUS] == [ref.encode(t) for t in CORPUS]
    assert (ours.encode("hi")[0] == 1) == add_bos
