"""`radixmesh generate`: run the in-process Engine on prompts from the command line."""
from __future__ import annotations

import argparse
import json
import logging
import time

from services.common.config import config_from_args, flags_from_dataclass
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine, EngineConfig


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixmesh generate", description=__doc__)
    parser.add_argument("prompts", nargs="+", help="prompts, run as one batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--no-speculative", action="store_true",
                        help="these prompts never speculate, even when the worker drafts (the per-request opt-out)")
    flags_from_dataclass(EngineConfig, parser)
    return parser


def build_engine(cfg: EngineConfig) -> Engine:
    """Every flag group reaches the Engine: worker, scheduler and hicache (host tier, kvstore)."""
    return Engine(worker=cfg.worker, scheduler=cfg.scheduler, hicache=cfg.hicache)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(EngineConfig, args)
    engine = build_engine(cfg)
    spec = engine.runner.kv_spec
    logging.info("KV cache: %d KV pages x %d tokens = %d tokens of %s KV (%d bytes per token)", spec.num_pages,
                 spec.page_size, spec.capacity_tokens, spec.dtype_name, spec.bytes_per_token)
    logging.info("weights: --quantization %s, %d bytes resident", cfg.worker.quantization, engine.runner.weight_bytes)
    if engine.limits.host_pages or engine.kvstore is not None:
        logging.info("hicache: %d host KV pages (%d on the device), kvstore %s", engine.limits.host_pages,
                     engine.limits.num_pages, cfg.hicache.kvstore_addr or "none")
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        speculative=not args.no_speculative)
    ids = [engine.prompt_ids(messages=[{"role": "user", "content": p}]) if args.chat else engine.prompt_ids(p)
           for p in args.prompts]
    t0 = time.perf_counter()
    outputs = engine.generate_batch(ids, sp)
    dt = time.perf_counter() - t0
    for prompt, out in zip(args.prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                              "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
                              "spec_verify_steps": out.spec_verify_steps, "spec_draft_tokens": out.spec_draft_tokens,
                              "spec_accepted_tokens": out.spec_accepted_tokens}))
        else:
            spec = (f", {out.spec_verify_steps} verify steps, {out.spec_accepted_tokens}/{out.spec_draft_tokens} "
                    "drafted tokens accepted" if out.spec_verify_steps else "")
            print(f"=== {prompt!r}\n{out.text}\n[{out.finish_reason}, {out.completion_tokens} tokens{spec}]")
    total = sum(o.completion_tokens for o in outputs)
    logging.info("%d tokens in %.2fs (%.1f tok/s)", total, dt, total / dt)
    engine.shutdown()
    return 0
