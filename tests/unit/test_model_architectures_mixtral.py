"""Mixtral beyond the shared logits / greedy checks of test_model_architectures.py (whose CONFIGS
hold it): both checkpoint formats load (the original block_sparse_moe / w1 w2 w3 names, written
here by hand, and transformers' stacked in-memory names), a window is honoured, each worker group
rank's slice is cut after the renaming, and what is not computed is refused by name."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.mixtral import mixtral_hf_name
from services.worker.parallel.rank_part import RankPart
from tests.unit.tiny_models import BASE, BATCHES, assert_logits_match, logits_by_position, runner, save_tiny, sequences


def _legacy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory Mixtral state dict → the Hub's original names: the router as
    block_sparse_moe.gate, each expert's w1 (gate) / w3 (up) rows of gate_up_proj and w2 (down)."""
    out = {}
    for name, t in state.items():
        base = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: [gate; up] rows per expert
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[base.replace("gate_up_proj", f"{e}.w1.weight")] = gate.contiguous()
                out[base.replace("gate_up_proj", f"{e}.w3.weight")] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e, down in enumerate(t):
                out[base.replace("down_proj", f"{e}.w2.weight")] = down.contiguous()
        else:
            out[base] = t.contiguous()
    return out


def _keys(path: str) -> set[str]:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return set(f.keys())


def _assert_prefix_logits(path: str, hf) -> None:
    seqs = {"a": sequences("two")["a"][:30]}
    ours = logits_by_position(runner(path, 4, "torch", False), seqs, {"a": [17]}, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([seqs["a"]])).logits[0]
    for p, row in ours["a"]:
        torch.testing.assert_close(row, ref[p], atol=2e-4, rtol=1e-4, msg=lambda m: f"position {p}: {m}")


def test_a_checkpoint_with_the_original_block_sparse_moe_names_loads(tmp_path):
    """Written by hand from the model's state dict (w1 = gate, w3 = up, w2 = down), so the test
    does not depend on which names save_pretrained happens to write."""
    hf_dir, hf = save_tiny(tmp_path / "hf", "mixtral")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    save_file(_legacy_names(hf.state_dict()), str(legacy / "model.safetensors"), metadata={"format": "pt"})
    (legacy / "config.json").write_text(open(f"{hf_dir}/config.json").read())
    names = _keys(str(legacy))
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names and not any(".mlp." in n for n in names)
    _assert_prefix_logits(str(legacy), hf)


def test_a_checkpoint_with_stacked_experts_loads(tmp_path):
    """save_original_format=False keeps transformers' in-memory names (mlp.experts.gate_up_proj [E, 2I, H])."""
    _, hf = save_tiny(tmp_path / "orig", "mixtral")
    hf.save_pretrained(tmp_path / "stacked", safe_serialization=True, save_original_format=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _keys(str(tmp_path / "stacked"))
    _assert_prefix_logits(str(tmp_path / "stacked"), hf)


def test_save_pretrained_writes_the_original_names_by_default(tmp_path):
    """transformers 5 reverts its conversion on save: the CONFIGS tests load the original names."""
    path, _ = save_tiny(tmp_path, "mixtral")
    names = _keys(path)
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert not any(".mlp." in n for n in names)


def test_original_names_map_to_the_per_expert_names():
    p = "model.layers.12.block_sparse_moe."
    assert mixtral_hf_name(f"{p}experts.3.w1.weight") == "model.layers.12.mlp.experts.3.gate_proj.weight"
    assert mixtral_hf_name(f"{p}experts.3.w3.weight") == "model.layers.12.mlp.experts.3.up_proj.weight"
    assert mixtral_hf_name(f"{p}experts.30.w2.weight") == "model.layers.12.mlp.experts.30.down_proj.weight"
    assert mixtral_hf_name(f"{p}gate.weight") == "model.layers.12.mlp.gate.weight"
    for same in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_proj.weight",
                 "lm_head.weight"):
        assert mixtral_hf_name(same) == same


def test_a_sliding_window_is_honoured(tmp_path):
    path, hf = save_tiny(tmp_path, "mixtral", sliding_window=8)
    ours = runner(path, 4, "cpu", True)
    assert ours.model.config.sliding_window == 8
    chunks = {rid: c for rid, (_, c) in BATCHES["two"].items()}
    assert_logits_match(ours, hf, sequences("two"), chunks, 4, "mixtral window 8")


def test_each_tp_rank_cuts_the_renamed_experts(tmp_path):
    """The loader renames before a rank's slice: rank r of TP 2 holds rows [16 r, 16 r + 16) of each
    expert's w1 / w3 and those columns of its w2, under the per-expert names, and the whole router."""
    path, hf = save_tiny(tmp_path, "mixtral")  # intermediate_size 32
    legacy = _legacy_names(hf.state_dict())
    p = "model.layers.1.block_sparse_moe."
    for rank in (0, 1):
        loaded = load_checkpoint(path, part=lambda full, r=rank: RankPart(full, r, 2, 1)).tensors
        rows = slice(16 * rank, 16 * rank + 16)
        got = {proj: loaded[f"model.layers.1.mlp.experts.5.{proj}_proj.weight"] for proj in ("gate", "up", "down")}
        assert torch.equal(got["gate"], legacy[f"{p}experts.5.w1.weight"][rows])
        assert torch.equal(got["up"], legacy[f"{p}experts.5.w3.weight"][rows])
        assert torch.equal(got["down"], legacy[f"{p}experts.5.w2.weight"][:, rows])
        assert torch.equal(loaded["model.layers.1.mlp.gate.weight"], legacy[f"{p}gate.weight"])
        assert not any("block_sparse_moe" in n for n in loaded)


def _edit_config(path: str, drop: tuple[str, ...] = (), **changes) -> None:
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    for key in drop:
        raw.pop(key, None)
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)


def test_mixtral_defaults_apply_where_config_json_omits_them(tmp_path):
    """MixtralConfig's rope_theta 1e6 and 128k context, not the Llama defaults (10000, 4096)."""
    path, _ = save_tiny(tmp_path, "mixtral")
    _edit_config(path, drop=("rope_parameters", "rope_theta", "max_position_embeddings"))
    c = load_checkpoint(path).config
    assert (c.rope_theta, c.max_position_embeddings, c.norm_topk_prob) == (1e6, 131072, True)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)


@pytest.mark.parametrize("changes,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
])
def test_mixtral_variants_it_does_not_compute_are_refused(tmp_path, changes, message):
    path, _ = save_tiny(tmp_path, "mixtral")
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_a_gguf_mixtral_is_refused_by_name(tmp_path):
    """llama.cpp writes Mixtral as `llama` with expert metadata and a router per layer."""
    path = str(tmp_path / "mixtral.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_expert_count(8)
    w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((BASE["vocab_size"], 32), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"llama GGUF with experts \(Mixtral; expert_count=8\)"):
        load_checkpoint(path)
