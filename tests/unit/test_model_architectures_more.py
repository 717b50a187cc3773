"""Gemma 2 and Qwen3-MoE beyond the shared logits / greedy checks of test_model_architectures.py
(whose CONFIGS hold them): what each refuses, how the layers are laid out, the MoE block against a
token-by-token reference and a checkpoint with stacked experts, and `radixmesh generate` end to end
(every architecture; the configs are tests/unit/tiny_models.py's)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.layer_ops import TorchLayerOps
from services.worker.model.moe import SparseMoeBlock
from tests.unit.tiny_models import (END_TO_END, greedy_continuation, logits_by_position, runner, save_for_generation,
                                    save_tiny, sequences)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _edit_config(path: str, **changes) -> None:
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)


def test_gemma2_layer_types_default_to_even_layers_sliding(tmp_path):
    """transformers' Gemma2Config: layer i slides when (i + 1) % 2 == 1, i.e. layers 0, 2, ..."""
    path, _ = save_tiny(tmp_path, "gemma2")
    c = load_checkpoint(path).config
    assert [c.layer_window(i) for i in range(c.num_hidden_layers)] == [8, None]
    assert (c.query_pre_attn_scalar, c.attn_logit_softcapping, c.final_logit_softcapping) == (24.0, 3.0, 4.0)
    assert c.tie_word_embeddings


@pytest.mark.parametrize("changes,message", [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"tie_word_embeddings": False}, "untied LM head"),
    ({"layer_types": ["sliding_attention"]}, "must name 2 layers"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "must name 2 layers"),
])
def test_gemma2_variants_it_does_not_compute_are_refused(tmp_path, changes, message):
    path, _ = save_tiny(tmp_path, "gemma2")
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_qwen3_moe_variants_it_does_not_compute_are_refused(tmp_path, changes, message):
    path, _ = save_tiny(tmp_path, "qwen3_moe")
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_qwen3_moe_sparse_and_dense_layers_follow_transformers(tmp_path):
    path, hf = save_tiny(tmp_path, "qwen3_moe_norm_topk_dense_layer")
    ours = runner(path, 4, "torch", False)
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"]
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["SparseMoeBlock", "MLP"]


def test_qwen3_moe_checkpoint_with_stacked_experts_loads(tmp_path):
    """save_original_format=False keeps transformers' in-memory names (experts.gate_up_proj [E, 2I, H]);
    the Hub's per-expert names are what save_pretrained writes by default (the CONFIGS tests)."""
    _, hf = save_tiny(tmp_path / "orig", "qwen3_moe")
    hf.save_pretrained(tmp_path / "stacked", safe_serialization=True, save_original_format=False)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "stacked" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    stacked = runner(str(tmp_path / "stacked"), 4, "torch", False)
    seqs = {"a": sequences("two")["a"][:30]}
    ours = logits_by_position(stacked, seqs, {"a": [17]}, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([seqs["a"]])).logits[0]
    for p, row in ours["a"]:
        torch.testing.assert_close(row, ref[p], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_grouped_experts_equal_a_token_by_token_loop(norm_topk):
    """The sorted, one-matmul-per-expert block equals routing each token through its k experts alone."""
    torch.manual_seed(0)
    E, k, H, inter, T = 6, 2, 16, 24, 11
    block = SparseMoeBlock(H, inter, E, k, norm_topk)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(T, H)
    with torch.no_grad():
        out = block(x, TorchLayerOps())
        probs = torch.softmax(F.linear(x, block.gate.weight), -1)
        for t in range(T):
            w, ex = torch.topk(probs[t], k)
            w = w / w.sum() if norm_topk else w
            want = torch.zeros(H)
            for wi, e in zip(w, ex.tolist()):
                gate, up = F.linear(x[t], block.experts.gate_up_proj[e]).chunk(2)
                want += wi * F.linear(F.silu(gate) * up, block.experts.down_proj[e])
            torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", END_TO_END)
def test_radixmesh_generate_prints_transformers_greedy_tokens(tmp_path, name):
    """`radixmesh generate --model DIR` on a saved random model of each architecture (word-level
    tokenizer, no EOS): greedy, float32, a 16-token prompt past every window, and the printed
    text's token ids are transformers' greedy continuation."""
    path, hf = save_for_generation(tmp_path, name)
    prompt_ids, n_new = sequences("two")["a"][:16], 12
    prompt = " ".join(f"t{i}" for i in prompt_ids)
    cmd = [sys.executable, "-m", "services.cli", "generate", "--model", path, "--dtype", "float32",
           "--kv-cache-bytes", str(8 << 20), "--max-new-tokens", str(n_new), "--temperature", "0", "--json", prompt]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [int(m) for m in re.findall(r"t(\d+)", out["text"])]
    assert ours == greedy_continuation(hf, prompt_ids, n_new), (out, done.stderr[-2000:])
    assert (out["completion_tokens"], out["finish_reason"]) == (n_new, "length")
