"""bench/mla_kv_bytes.py's table: the bytes come from the shards and the pool spec, and DP attention
holds the ranks' count times the tokens plain TP holds with MLA's replicated latent."""
from __future__ import annotations

import torch

from bench.mla_kv_bytes import rows


def test_dp_attention_holds_ranks_times_the_tokens_of_tp_with_a_replicated_latent():
    table = {r["layout"]: r for r in rows(8, 40 << 30, torch.bfloat16)}
    tp, dp = table["DeepSeek-V3, MLA latent, plain TP"], table["DeepSeek-V3, MLA latent, DP attention"]
    assert tp["bytes_per_token_per_rank"] == dp["bytes_per_token_per_rank"] == 61 * (512 + 64) * 2
    assert tp["bytes_per_token_group"] == 8 * dp["bytes_per_token_group"]
    assert dp["group_tokens"] // tp["group_tokens"] == 8
    expanded = table["DeepSeek-V3, heads expanded (K, V per head), TP"]
    assert expanded["bytes_per_token_group"] == 61 * 128 * (192 + 128) * 2
    assert table["Llama-3-70B, GQA 8 KV heads, TP"]["bytes_per_token_per_rank"] == 80 * 1 * 128 * 2 * 2
