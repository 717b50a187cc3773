"""What a worker tells its scheduler about itself (radixmesh.v1.WorkerInfo): the model, the KV
pool and its tiers, the limits of a step. The worker service answers GetInfo with it and the
in-process Engine builds its scheduler from the same message (services/scheduler/core_factory.py),
so the two describe a runner alike."""
from __future__ import annotations

import json

from protos.radixmesh.v1 import worker_pb2 as pb


def worker_info(runner, eos_token_ids: tuple[int, ...], tiers: dict | None = None,
                kvstore_addr: str | None = None) -> pb.WorkerInfo:
    """tiers: attach_tiers' facts (services/worker/host_pool.py) when the host tier or the
    kvstore is on; kvstore_addr: the store the scheduler probes."""
    from services.worker.admin import adapter_infos

    mc, spec, cfg = runner.model_config, runner.kv_spec, runner.config
    info = pb.WorkerInfo(
        model=pb.ModelConfig(
            vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
            num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
            rope_theta=mc.rope_theta, rope_scaling_json=json.dumps(mc.rope_scaling) if mc.rope_scaling else "",
            max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
            attention_bias=mc.attention_bias, bos_token_id=mc.bos_token_id,
            eos_token_ids=list(eos_token_ids), name=mc.name),
        num_kv_pages=spec.num_pages, page_size=spec.page_size, dtype=cfg.resolved_dtype, kv_dtype=spec.dtype_name,
        tp_size=1, weights_version=str(runner.weights_version), max_requests=cfg.max_requests,
        max_draft_tokens=runner.max_draft_tokens, verify_max_rows=runner.verify_rows,
        max_loras=runner.max_loras, adapters=adapter_infos(runner))
    sender = getattr(runner, "kv_sender", None)
    if sender is not None:  # disaggregation: this worker's side and where a prefill worker sends
        info.MergeFrom(pb.WorkerInfo(disaggregation_mode=sender.mode, kv_transfer_backend=sender.backend,
                                     kv_descriptor=sender.descriptor()))
    if tiers is not None:
        info.MergeFrom(pb.WorkerInfo(num_host_pages=tiers["host_pages"], page_bytes=tiers["page_bytes"],
                                     model_identity=tiers["model_identity"], kv_layout=tiers["kv_layout"],
                                     kvstore_addr=kvstore_addr or ""))
    return info
