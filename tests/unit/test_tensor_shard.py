"""TensorShard (services/worker/parallel/tensor_parallel.py): which part of each checkpoint tensor
a rank holds, and the TP sizes a model cannot take. No processes: the slices are checked by
reassembling the full tensors from every rank's parts, and by computing a layer from them."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.worker.model.config import ModelConfig
from services.worker.parallel.tensor_parallel import TensorShard, tp_refusal

# The default model's attention: 9 query heads, 3 KV heads (head_dim 64).
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64)
SMOL_9 = dataclasses.replace(SMOL, intermediate_size=9 * 172)  # an MLP 9 ranks can split
TINY = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=12, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=4)


@pytest.mark.parametrize("tp, expected", [
    (2, "does not divide the model's 9 attention heads"),
    (4, "does not divide the model's 9 attention heads"),
    (0, "--tp-size must be >= 1"),
])
def test_a_tp_size_the_heads_cannot_take_is_refused_by_name(tp, expected):
    assert expected in tp_refusal(SMOL, tp)
    with pytest.raises(ValueError, match=expected):
        TensorShard(SMOL, 0, tp)


def test_kv_heads_split_or_replicate_evenly_or_are_refused():
    assert tp_refusal(SMOL, 3) is None and tp_refusal(SMOL_9, 9) is None  # 1 KV head each; 3 ranks per KV head
    six_kv = dataclasses.replace(TINY, num_attention_heads=12, num_key_value_heads=6, intermediate_size=24)
    assert "neither divides the model's 6 KV heads" in tp_refusal(six_kv, 4)
    assert "intermediate size 10" in tp_refusal(dataclasses.replace(TINY, intermediate_size=10), 4)


def test_the_rank_config_holds_its_share():
    local = TensorShard(SMOL, 1, 3).config
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size, local.vocab_size) == (
        3, 1, 512, 16384)
    assert local.hidden_size == SMOL.hidden_size and local.head_dim == SMOL.head_dim


def test_replicated_kv_heads_are_the_ones_each_ranks_queries_read():
    # 9 query heads over 9 ranks, 3 per KV head: ranks 0-2 read KV head 0, 3-5 head 1, 6-8 head 2.
    assert [TensorShard(SMOL_9, r, 9).first_kv_head for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [TensorShard(SMOL, r, 3).first_kv_head for r in range(3)] == [0, 1, 2]


def _tensors(mc: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, q, kv, i = mc.hidden_size, mc.q_size, mc.kv_size, mc.intermediate_size
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, h), "lm_head.weight": (mc.vocab_size, h),
              "model.layers.0.self_attn.q_proj.weight": (q, h), "model.layers.0.self_attn.q_proj.bias": (q,),
              "model.layers.0.self_attn.k_proj.weight": (kv, h), "model.layers.0.self_attn.v_proj.weight": (kv, h),
              "model.layers.0.self_attn.o_proj.weight": (h, q), "model.layers.0.self_attn.o_proj.bias": (h,),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i), "model.norm.weight": (h,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_parallel_parts_reassemble_the_layer(tp):
    """Summing the ranks' o(attention-free q) and down(up) partials gives the full layer's output."""
    full = _tensors(TINY)
    parts = [TensorShard(TINY, r, tp).tensors(full) for r in range(tp)]
    L = "model.layers.0."
    x = torch.randn(3, TINY.hidden_size)
    ref_q = x @ full[L + "self_attn.q_proj.weight"].T + full[L + "self_attn.q_proj.bias"]
    ref_o = ref_q @ full[L + "self_attn.o_proj.weight"].T + full[L + "self_attn.o_proj.bias"]
    o = sum((x @ p[L + "self_attn.q_proj.weight"].T + p[L + "self_attn.q_proj.bias"]) @ p[L + "self_attn.o_proj.weight"].T
            + p[L + "self_attn.o_proj.bias"] for p in parts)
    torch.testing.assert_close(o, ref_o)
    act = torch.nn.functional.silu
    ref_mlp = (act(x @ full[L + "mlp.gate_proj.weight"].T) * (x @ full[L + "mlp.up_proj.weight"].T)) @ full[
        L + "mlp.down_proj.weight"].T
    mlp = sum((act(x @ p[L + "mlp.gate_proj.weight"].T) * (x @ p[L + "mlp.up_proj.weight"].T))
              @ p[L + "mlp.down_proj.weight"].T for p in parts)
    torch.testing.assert_close(mlp, ref_mlp)
    assert all(torch.equal(p["model.norm.weight"], full["model.norm.weight"]) for p in parts)  # replicated


def test_vocabulary_rows_are_split_and_the_last_shard_padded():
    full = _tensors(TINY)  # vocab 50 over 4 ranks: 13 rows each, the last holds 11 and 2 zero rows
    parts = [TensorShard(TINY, r, 4).tensors(full)["model.embed_tokens.weight"] for r in range(4)]
    assert [p.shape[0] for p in parts] == [13] * 4
    assert torch.equal(torch.cat(parts)[:50], full["model.embed_tokens.weight"])
    assert not parts[-1][11:].any()


def test_phi3_fused_qkv_and_gate_up_split_by_head_and_half():
    full = _tensors(TINY)
    L = "model.layers.0."
    fused = {k: v for k, v in full.items() if ".self_attn.q_proj." not in k and "k_proj" not in k
             and "v_proj" not in k and "gate_proj" not in k and "up_proj" not in k}
    fused[L + "self_attn.qkv_proj.weight"] = torch.cat([full[L + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    fused[L + "mlp.gate_up_proj.weight"] = torch.cat([full[L + "mlp.gate_proj.weight"], full[L + "mlp.up_proj.weight"]])
    for r in range(2):
        split, ref = TensorShard(TINY, r, 2).tensors(fused), TensorShard(TINY, r, 2).tensors(full)
        for n in "qkv":
            assert torch.equal(split[L + f"self_attn.{n}_proj.weight"], ref[L + f"self_attn.{n}_proj.weight"])
        assert torch.equal(split[L + "mlp.gate_up_proj.weight"],
                           torch.cat([ref[L + "mlp.gate_proj.weight"], ref[L + "mlp.up_proj.weight"]]))


# --- pipeline stages (services/worker/parallel/pipeline.py) ---------------------------------------

def test_stages_split_the_layers_evenly_the_earlier_ones_taking_the_extra():
    from services.worker.parallel.pipeline import PipelineStage
    assert [PipelineStage(SMOL, s, 4).layers for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23),
                                                                     range(23, 30)]
    with pytest.raises(ValueError, match="--pp-size 31 exceeds the model's 30 layers"):
        PipelineStage(SMOL, 0, 31)


def test_a_stage_keeps_its_layers_renumbered_and_their_kinds():
    from services.worker.parallel.pipeline import PipelineStage
    gemma = dataclasses.replace(TINY, num_hidden_layers=4,
                                layer_types=("sliding_attention", "full_attention") * 2, sliding_window=8)
    stage = PipelineStage(gemma, 1, 2)
    assert stage.config.num_hidden_layers == 2 and stage.config.layer_types == ("sliding_attention", "full_attention")
    moe = dataclasses.replace(TINY, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, decoder_sparse_step=2)  # layers 1 and 3 sparse
    local = PipelineStage(moe, 1, 2).config  # layers 2 (dense) and 3 (sparse) → 0 and 1
    assert [local.is_moe_layer(i) for i in range(2)] == [False, True]
    tensors = {"model.layers.0.a": torch.zeros(1), "model.layers.2.a": torch.ones(1),
               "model.layers.3.b": torch.ones(2), "model.norm.weight": torch.ones(3)}
    assert sorted(PipelineStage(moe, 1, 2).tensors(tensors)) == ["model.layers.0.a", "model.layers.1.b",
                                                                 "model.norm.weight"]
