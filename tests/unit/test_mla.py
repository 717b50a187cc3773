"""DeepSeek-V3's pieces beyond the shared logits checks of test_model_architectures.py: the latent
KV pool's size and refusals, an FP8 latent pool, and the group-limited router against a brute
force over every allowed expert set."""
from __future__ import annotations

import itertools

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.config import ModelConfig
from services.worker.model.group_router import GroupLimitedRouter
from services.worker.model_runner import ModelRunner
from tests.unit.tiny_models import BATCHES, DEEPSEEK, logits_by_position, save_tiny, sequences


def _mla_config(rank: int = 512, rope: int = 64, layers: int = 61) -> ModelConfig:
    return ModelConfig(vocab_size=1000, hidden_size=7168, intermediate_size=18432, num_hidden_layers=layers,
                       num_attention_heads=128, num_key_value_heads=128, head_dim=rope, kv_lora_rank=rank,
                       qk_rope_head_dim=rope, qk_nope_head_dim=128, v_head_dim=128, architecture="DeepseekV3ForCausalLM")


def test_a_latent_pool_stores_one_row_of_rank_plus_rope_per_token_and_layer():
    spec = KVPoolSpec.for_model(_mla_config(), 4, 16, torch.bfloat16)
    assert (spec.num_kv_heads, spec.head_dim, spec.latent_dim, spec.v_head_dim) == (1, 576, 512, 0)
    assert spec.bytes_per_token == 61 * 576 * 2  # 70,272 B: DeepSeek-V3's latent row, bf16
    pool = KVPool(spec)
    assert pool.k.shape == (61, 64, 1, 576) and pool.v.shape == (61, 64, 1, 0) and pool.tensors == (pool.k,)
    expanded = 2 * 61 * 128 * 192 * 2  # the same model's K (nope + rope) and V (padded to 192) per head
    assert expanded / spec.bytes_per_token > 40


def test_a_latent_pool_reads_v_from_k_and_writes_k_alone():
    spec = KVPoolSpec.for_model(_mla_config(rank=8, rope=4, layers=1), 2, 4, torch.float32)
    pool = KVPool(spec)
    rows = torch.randn(3, 1, 12)
    pool.write(0, torch.tensor([5, 0, 2]), rows, rows[..., :8])
    assert torch.equal(pool.k[0, [5, 0, 2]], rows)
    pool.move_slots(torch.tensor([5]), torch.tensor([7]))
    assert torch.equal(pool.k[0, 7], rows[0])


def test_an_fp8_latent_pool_needs_rotation_blocks_that_keep_v_whole():
    with pytest.raises(ValueError, match="do not divide kv_lora_rank 40"):  # 48 = 3 x 16: V's 40 cuts a block
        KVPoolSpec.for_model(_mla_config(rank=40, rope=8, layers=1), 2, 4, torch.float8_e4m3fn)
    assert KVPoolSpec.for_model(_mla_config(rank=32, rope=16, layers=1), 2, 4, torch.float8_e4m3fn).is_latent


def _logits(path: str, backend: str, kv: str = "auto") -> dict:
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4,
                          attention_backend=backend, kv_cache_dtype=kv)
    runner = ModelRunner(config, load_checkpoint(path))
    seqs = sequences("three_chunked")
    return logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}, 4)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_latent_pool_stays_near_the_float32_logits_on_every_backend(tmp_path, kv):
    """Rows rotated in blocks of 16 (48 = 32 + 16), V's 32 columns two whole blocks: near the exact
    pool's logits, and the torch reference and the cpu backend agree."""
    path = save_tiny(tmp_path, "deepseek_v3")[0]
    exact, cpu, ref = _logits(path, "cpu"), _logits(path, "cpu", kv), _logits(path, "torch", kv)
    worst = 0.0
    for rid, rows in exact.items():
        for (pos, a), (_, b), (_, c) in zip(rows, cpu[rid], ref[rid], strict=True):
            torch.testing.assert_close(b, c, atol=1e-4, rtol=0, msg=lambda m: f"{rid} @{pos}: {m}")
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    # measured 0.10 (e4m3) and 0.11 (e5m2) of the largest logit; V unrotated in the wrong blocks: 1.8
    assert 0 < worst < 0.3, worst


def test_the_group_limited_router_picks_the_best_experts_of_the_best_groups():
    torch.manual_seed(0)
    E, groups, keep, k = 8, 4, 2, 2
    router = GroupLimitedRouter(16, E, k, groups, keep, norm_topk_prob=True, routed_scaling_factor=2.5)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(64, 16)
    experts, weights = router.route(x)
    scores = torch.sigmoid(x @ router.weight.detach().T)
    biased = scores + router.e_score_correction_bias.detach()
    per = E // groups
    for t in range(x.shape[0]):
        group_score = [float(biased[t, g * per:(g + 1) * per].topk(2).values.sum()) for g in range(groups)]
        best_groups = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        allowed = [e for g in best_groups for e in range(g * per, (g + 1) * per)]
        best = max(itertools.combinations(allowed, k), key=lambda c: sum(float(biased[t, e]) for e in c))
        assert sorted(experts[t].tolist()) == sorted(best)
        w = scores[t, experts[t]]
        torch.testing.assert_close(weights[t], w / w.sum() * 2.5)


@pytest.mark.parametrize("fields,message", [
    (dict(n_group=3), "n_group=3 does not divide"), (dict(topk_group=5), "topk_group=5"),
    (dict(num_experts_per_tok=5, topk_group=1), "exceeds")])
def test_router_settings_that_cannot_route_are_refused(fields, message):
    args = dict(experts=8, top_k=2, n_group=4, topk_group=2)
    args.update({"top_k": fields.pop("num_experts_per_tok")} if "num_experts_per_tok" in fields else {})
    args.update(fields)
    with pytest.raises(ValueError, match=message):
        GroupLimitedRouter(16, args["experts"], args["top_k"], args["n_group"], args["topk_group"], True, 1.0)


@pytest.mark.parametrize("changes,message", [({"topk_method": "greedy"}, "topk_method 'greedy'"),
                                             ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
                                             ({"hidden_act": "gelu"}, "hidden_act 'gelu'")])
def test_deepseek_variants_it_does_not_compute_are_refused(tmp_path, changes, message):
    import json
    path = save_tiny(tmp_path, "deepseek_v3")[0]
    with open(f"{path}/config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(path)


def test_the_tiny_config_exercises_groups_shared_experts_and_a_dense_layer():
    assert DEEPSEEK["n_group"] > DEEPSEEK["topk_group"] and DEEPSEEK["n_shared_experts"]
    assert DEEPSEEK["first_k_dense_replace"] == 1 and DEEPSEEK["q_lora_rank"]


def test_the_cpu_backend_decodes_a_latent_pool_through_the_mla_kernel(tmp_path):
    """Pure-decode steps over the latent pool run kernels/mla_decode_cpu.py (counted), and every
    position's logits equal the torch reference backend's."""
    path = save_tiny(tmp_path, "deepseek_v3")[0]
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4, attention_backend="cpu")
    runner = ModelRunner(config, load_checkpoint(path))
    kernel = runner.backend.attention.native_mla
    assert kernel is not None
    calls = []

    class Counted:
        def mla_decode_attention(self, *args):
            calls.append(args[0].shape)
            return kernel.mla_decode_attention(*args)

    runner.backend.attention.native_mla = Counted()
    seqs = sequences("three_chunked")
    ours = logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}, 4)
    ref = _logits(path, "torch")
    assert calls and all(shape[-1] == 32 + 16 for shape in calls)  # q in the latent space: rank + rope
    for rid, rows in ref.items():
        for (pos, a), (_, b) in zip(rows, ours[rid], strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=lambda m: f"{rid} @{pos}: {m}")


def test_the_triton_backend_runs_a_latent_pool_as_transformers_does(tmp_path):
    """Under Triton's interpreter: decode and extend items over the latent pool through
    kernels/triton/mla_decode.py give transformers' logits."""
    import triton
    from tests.unit.tiny_models import assert_logits_match
    path, hf = save_tiny(tmp_path, "deepseek_v3")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        runner = ModelRunner(WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4,
                                          attention_backend="triton", fused_ops=False), load_checkpoint(path))
        chunks = {rid: c for rid, (_, c) in BATCHES["two"].items()}
        assert_logits_match(runner, hf, sequences("two"), chunks, 4, "deepseek_v3 triton")
