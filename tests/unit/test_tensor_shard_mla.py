"""TensorShard on DeepSeek-V3 (services/worker/parallel/tensor_parallel.py): MLA split by heads, the
shared experts like a dense MLP (or, under expert parallelism, whole and run on the rank's own
tokens), the router and the latent pool replicated. No processes: every rank's part is checked
against the full tensors, through the model's own fuse_hf, and by summing the ranks' partials."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from services.worker.kv_pool import KVPoolSpec
from services.worker.model.config import ModelConfig
from services.worker.model.layer_ops import TorchLayerOps
from services.worker.model.llama import MLP
from services.worker.model.mla import MLAttention
from services.worker.parallel.tensor_parallel import TensorShard, tp_refusal

# 4 heads of q 8 + 4 (nope + rope) and v 6; latent 16; 8 experts of 8, two shared; layer 0 dense.
DS = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=4, kv_lora_rank=16, q_lora_rank=10, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=8, n_shared_experts=2, mlp_only_layers=(0,),
                 architecture="DeepseekV3ForCausalLM")
A, M = "model.layers.1.self_attn.", "model.layers.1.mlp."


def _tensors(mc: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, H, R, qk = mc.hidden_size, mc.num_attention_heads, mc.kv_lora_rank, mc.qk_nope_head_dim + mc.qk_rope_head_dim
    shared, E = mc.moe_intermediate_size * mc.n_shared_experts, mc.num_experts
    q = ({A + "q_a_proj.weight": (mc.q_lora_rank, h), A + "q_a_layernorm.weight": (mc.q_lora_rank,),
          A + "q_b_proj.weight": (H * qk, mc.q_lora_rank)} if mc.q_lora_rank else {A + "q_proj.weight": (H * qk, h)})
    shapes = {**q, A + "kv_a_proj_with_mqa.weight": (R + mc.qk_rope_head_dim, h), A + "kv_a_layernorm.weight": (R,),
              A + "kv_b_proj.weight": (H * (mc.qk_nope_head_dim + mc.v_head_dim), R),
              A + "o_proj.weight": (h, H * mc.v_head_dim),
              M + "gate.weight": (E, h), M + "gate.e_score_correction_bias": (E,),
              M + "shared_experts.gate_proj.weight": (shared, h), M + "shared_experts.up_proj.weight": (shared, h),
              M + "shared_experts.down_proj.weight": (h, shared)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_mla_sizes_the_heads_refuse_and_the_kv_heads_do_not():
    assert "does not divide the model's 4 attention heads" in tp_refusal(DS, 3)
    twelve = dataclasses.replace(DS, num_attention_heads=12, num_key_value_heads=4, moe_intermediate_size=12)
    assert "neither divides the model's 4 KV heads" in tp_refusal(dataclasses.replace(twelve, kv_lora_rank=0), 6)
    assert tp_refusal(twelve, 6) is None  # MLA reads no KV heads: only its query heads are split


@pytest.mark.parametrize("tp", [2, 4])
def test_the_rank_config_holds_its_heads_and_the_whole_latent_pool(tp):
    local = TensorShard(DS, 1, tp).config
    assert (local.num_attention_heads, local.num_key_value_heads, local.moe_intermediate_size) == (4 // tp, 4 // tp,
                                                                                                  8 // tp)
    assert (local.kv_lora_rank, local.q_lora_rank, local.qk_nope_head_dim, local.qk_rope_head_dim, local.v_head_dim,
            local.head_dim, local.attention_scale) == (16, 10, 8, 4, 6, 4, None)
    assert KVPoolSpec.for_model(local, 2, 4, torch.float32) == KVPoolSpec.for_model(DS, 2, 4, torch.float32)


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_heads_are_the_full_models_head_blocks_after_fuse_hf(tp, q_lora):
    """Each rank's q rows, w_kc and w_vc (fuse_hf on its slice of kv_b_proj, the RoPE rows reordered)
    are its heads' blocks of the full model's; the LoRA down-projections and norms are whole."""
    mc = DS if q_lora else dataclasses.replace(DS, q_lora_rank=None)
    full = _tensors(mc)
    q = A + ("q_b_proj" if q_lora else "q_proj") + ".weight"
    ref = dict(full)
    ref.update(MLAttention(mc, 1).fuse_hf(ref, A, rope_interleave=True))  # [H, nope, R], [H, v, R]
    for r in range(tp):
        shard = TensorShard(mc, r, tp)
        part = shard.tensors(full)
        part.update(MLAttention(shard.config, 1).fuse_hf(part, A, rope_interleave=True))
        heads = slice(r * 4 // tp, (r + 1) * 4 // tp)
        assert torch.equal(part[q].view(4 // tp, 12, -1), ref[q].view(4, 12, -1)[heads])
        assert torch.equal(part[A + "w_kc"], ref[A + "w_kc"][heads])
        assert torch.equal(part[A + "w_vc"], ref[A + "w_vc"][heads])
        assert torch.equal(part[A + "o_proj.weight"].T.reshape(4 // tp, 6, -1),
                           full[A + "o_proj.weight"].T.reshape(4, 6, -1)[heads])
        for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
                     "kv_a_layernorm.weight"):
            assert (A + name not in full) or torch.equal(part[A + name], ref[A + name])  # ref: RoPE rows reordered


@pytest.mark.parametrize("tp", [2, 4])
def test_the_ranks_o_proj_partials_sum_to_the_full_output(tp):
    """o_proj is row-parallel over heads of v_head_dim: the attention block's all-reduce adds them."""
    full = _tensors(DS)
    ref = dict(full)
    ref.update(MLAttention(DS, 1).fuse_hf(ref, A, rope_interleave=False))
    latent = torch.randn(3, 4, 16)  # attention's output in the latent space [T, H, R]

    def out(w_vc, o, lat):  # [T, h, R] → [T, hidden]
        return torch.einsum("thr,hvr->thv", lat, w_vc).flatten(1) @ o.T

    want = out(ref[A + "w_vc"], full[A + "o_proj.weight"], latent)
    got = 0
    for r in range(tp):
        shard = TensorShard(DS, r, tp)
        part = shard.tensors(full)
        w_vc = MLAttention(shard.config, 1).fuse_hf(part, A, rope_interleave=False)[A + "w_vc"]
        got = got + out(w_vc, part[A + "o_proj.weight"], latent[:, r * 4 // tp:(r + 1) * 4 // tp])
    torch.testing.assert_close(got, want)


def _shared_mlp(mc: ModelConfig, tensors: dict[str, torch.Tensor]) -> MLP:
    mlp = MLP(mc, intermediate=mc.moe_intermediate_size * mc.n_shared_experts)
    fused = {k.removeprefix(M + "shared_experts."): v for k, v in tensors.items() if ".shared_experts." in k}
    fused.update(MLP.fuse_hf(fused, ""))
    mlp.load_state_dict(fused)
    return mlp


@pytest.mark.parametrize("ep", [False, True])
def test_the_shared_experts_sum_once_over_the_group_and_the_router_is_whole(ep):
    """TP: each rank holds its share of the shared MLP (n_shared_experts * moe_intermediate_size);
    EP: each holds it whole and, once installed, runs it on the tokens it owns in the dispatch."""
    from services.worker.parallel.tensor_parallel import _on_owned_tokens
    tp, full, ops = 2, _tensors(DS), TorchLayerOps()
    slots = ((), (0, 1, 2, 3)) if ep else ()
    x = torch.randn(5, 16)
    with torch.no_grad():
        want = _shared_mlp(DS, full)(x, ops)
        got = 0
        for r in range(tp):
            shard = TensorShard(DS, r, tp, slots)
            part = shard.tensors(full)
            assert torch.equal(part[M + "gate.weight"], full[M + "gate.weight"])
            assert torch.equal(part[M + "gate.e_score_correction_bias"], full[M + "gate.e_score_correction_bias"])
            mlp = _shared_mlp(shard.config, part)
            if ep:
                down = M + "shared_experts.down_proj.weight"
                assert torch.equal(part[down], full[down])
                _on_owned_tokens(mlp, r, tp)
            got = got + mlp(x, ops)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # partial sums: float32 rounding


def test_o_proj_blocks_are_cut_in_heads_of_v_head_dim():
    wide = dataclasses.replace(DS, num_attention_heads=8, num_key_value_heads=8, v_head_dim=16, intermediate_size=64,
                               moe_intermediate_size=64)
    assert TensorShard(wide, 0, 2).blocks_refusal() is None  # 4 heads x 16 = 64 columns: two groups of 32
    assert "o_proj (32 columns per rank)" not in (TensorShard(wide, 0, 4).blocks_refusal() or "")
    assert "o_proj (16 columns per rank)" in TensorShard(wide, 0, 8).blocks_refusal()


@pytest.mark.parametrize("slots", [(), ((), (0, 1, 2, 3))])
def test_the_mtp_layer_past_the_decoder_is_left_out(slots):
    """DeepSeek's MTP layer (layers.{num_hidden_layers}): never loaded by the decoder, and under EP
    no layer of the placement, so it is dropped rather than split."""
    full = {**_tensors(DS), "model.layers.2.mlp.experts.0.gate_proj.weight": torch.zeros(8, 16),
            "model.layers.2.eh_proj.weight": torch.zeros(16, 32)}
    part = TensorShard(DS, 1, 2, slots).tensors(full)
    assert not any(name.startswith("model.layers.2.") for name in part) and A + "o_proj.weight" in part
