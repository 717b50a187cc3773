"""`radixmesh quantize` from an HF Llama directory: the GGUF holds what the directory holds (our GGUF
loader gives back the same tensors, the Q/K permutation undone), its vocabulary tokenizes as the
directory's tokenizer.json does, and it re-encodes like a GGUF source."""
from __future__ import annotations

import json

import pytest
import torch

from services.cli import main as cli_main
from services.common.gguf_reader import FastGGUFReader
from services.worker.loader.checkpoint import load_checkpoint

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("hf")
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT * 4], vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": "{{ messages }}"}))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)).eval()
    hf.save_pretrained(path, safe_serialization=True)
    return str(path)


def test_f32_gguf_holds_the_directory(hf_dir, tmp_path):
    out = str(tmp_path / "f32.gguf")
    assert cli_main(["quantize", "--model", hf_dir, "--out", out, "--type", "F32", "--embedding-type", "F32"]) == 0
    ours, theirs = load_checkpoint(out), load_checkpoint(hf_dir)
    assert ours.config.num_key_value_heads == 2 and ours.config.vocab_size == theirs.config.vocab_size
    assert ours.tensors.keys() == theirs.tensors.keys()
    for name, t in theirs.tensors.items():
        assert torch.equal(ours.tensors[name], t), name


def test_vocabulary_tokenizes_as_the_directory(hf_dir, tmp_path):
    from tokenizers import Tokenizer
    from services.tokenizer.text_tokenizer import load_tokenizer
    out = str(tmp_path / "q8.gguf")
    assert cli_main(["quantize", "--model", hf_dir, "--out", out, "--type", "Q8_0"]) == 0
    expected = Tokenizer.from_file(f"{hf_dir}/tokenizer.json").encode(TEXT).ids
    assert load_tokenizer(out).encode(TEXT, add_special_tokens=False) == expected
    fields = FastGGUFReader(out).fields
    assert fields["tokenizer.chat_template"].contents() == "{{ messages }}"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 1


def test_k_quant_from_hf_loads(hf_dir, tmp_path):
    out = str(tmp_path / "q4k.gguf")
    assert cli_main(["quantize", "--model", hf_dir, "--out", out, "--type", "Q4_K"]) == 0
    types = {t.name: t.tensor_type.name for t in FastGGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q8_0"
    assert types["blk.1.ffn_norm.weight"] == "F32"
    assert len(load_checkpoint(out).tensors) > 0


def test_other_architectures_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4}))
    from services.quantize.cli import QuantizeConfig, convert
    with pytest.raises(ValueError, match="plain Llama"):
        convert(QuantizeConfig(model=str(tmp_path), out=str(tmp_path / "o.gguf")))
