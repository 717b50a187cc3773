"""KV bytes per token and per rank: MLA's latent pool under plain tensor parallelism against
data-parallel attention, beside the same model's heads expanded and a GQA model, in one table.

Every number comes from the code that sizes the pools: each rank's model config from the shard
that builds it (TensorShard for TP, DpAttentionShard for DP attention), then
KVPoolSpec.for_model(...).bytes_per_token. The configurations are the published config.json
fields (no weights are loaded). Columns: the bytes a token takes on a rank that holds it; over
the whole group (under TP a GQA token is split over the ranks' heads, but MLA's one latent head
cannot be: every rank holds every token's whole row; under DP attention a token lives on its
request's rank only); and the tokens the group holds with --budget-gib of KV on each rank.

    .venv/bin/python bench/mla_kv_bytes.py [--ranks 8] [--budget-gib 40] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.worker.kv_pool import KVPoolSpec  # noqa: E402
from services.worker.model.config import ModelConfig  # noqa: E402
from services.worker.model.deepseek import deepseek_v3_fields  # noqa: E402
from services.worker.parallel.dp_attention import DpAttentionShard  # noqa: E402
from services.worker.parallel.tensor_parallel import TensorShard  # noqa: E402

DEEPSEEK_V3 = dict(  # deepseek-ai/DeepSeek-V3 config.json, the fields the pool and the shards read
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
    hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, topk_method="noaux_tc",
    rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1})
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)  # GQA: 8 KV heads of 128


def deepseek() -> ModelConfig:
    fields = deepseek_v3_fields(DEEPSEEK_V3)
    base = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "rope_scaling": None}, "DeepSeek-V3")
    return ModelConfig(**{**base.__dict__, **fields, "architecture": "DeepseekV3ForCausalLM"})


def per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return KVPoolSpec.for_model(config, 1, 1, dtype).bytes_per_token


def rows(ranks: int, budget: int, dtype: torch.dtype) -> list[dict]:
    ds = deepseek()
    elem = torch.empty((), dtype=dtype).element_size()
    expanded = ds.num_hidden_layers * ds.num_attention_heads * (
        ds.qk_nope_head_dim + ds.qk_rope_head_dim + ds.v_head_dim) * elem  # K and V per head, not absorbed
    llama = ModelConfig(**LLAMA3_70B, head_dim=128)
    tp_rank = TensorShard(ds, 0, ranks).config
    dp_rank = DpAttentionShard(ds, 0, ranks).config
    llama_rank = TensorShard(llama, 0, ranks).config
    # (layout, bytes a token takes on each rank that holds part of it, the ranks that do)
    table = [
        ("DeepSeek-V3, heads expanded (K, V per head), TP", expanded // ranks, ranks),  # a share of the heads each
        ("DeepSeek-V3, MLA latent, plain TP", per_token(tp_rank, dtype), ranks),  # the whole row on every rank
        ("DeepSeek-V3, MLA latent, DP attention", per_token(dp_rank, dtype), 1),  # on its request's rank only
        ("Llama-3-70B, GQA 8 KV heads, TP", per_token(llama_rank, dtype), ranks),
    ]
    return [{"layout": name, "bytes_per_token_per_rank": b, "bytes_per_token_group": b * holders,
             "group_tokens": ranks * budget // (b * holders)} for name, b, holders in table]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--budget-gib", type=float, default=40.0, help="KV bytes each rank holds")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    table = rows(args.ranks, int(args.budget_gib * 2**30), dtype)
    print(f"{args.ranks} ranks, {args.budget_gib:g} GiB of {args.dtype} KV per rank")
    print(f"{'layout':<50} {'B/token/rank':>13} {'B/token, group':>15} {'group tokens':>13}")
    for r in table:
        print(f"{r['layout']:<50} {r['bytes_per_token_per_rank']:>13,} {r['bytes_per_token_group']:>15,} "
              f"{r['group_tokens']:>13,}")
    latent, expanded = table[1]["bytes_per_token_per_rank"], table[0]["bytes_per_token_per_rank"] * args.ranks
    print(f"a PD transfer moves the latent row: {expanded / latent:.1f}x fewer bytes a token than the expanded heads")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "budget_gib": args.budget_gib,
                                               "dtype": args.dtype, "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
