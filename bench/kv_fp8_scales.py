"""Which FP8 KV scale and rotation (docs/quantization.md, FP8 KV cache): the real model's
log-likelihood of a text through chunked prefill (each chunk attends over the KV the earlier
chunks left in the pool), with the pool's K/V rounded through FP8 under each scale scheme.

    .venv/bin/python bench/kv_fp8_scales.py [--tokens 1024] [--chunk 128] [--text FILE]

Schemes: one scale for every layer (the pool stores fp8(x / scale)) at 1, 1/4, 1/16, and
per-token-per-head scales (amax / the format's max, which would cost 4 bytes per head per
token beside the page); then some of them with each row Hadamard-rotated before rounding and
rotated back after (what the worker stores: kernels/kv_fp8.py). The rounding is simulated on a bfloat16 pool (quantize then widen),
so every scheme runs the same kernels. Then the worker's own FP8 pools (--kv-cache-dtype),
which must reproduce their rotated scheme's number. Prints perplexity and its change against
bfloat16 KV, and the largest |K|, |V| seen.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch

from kernels.kv_fp8 import hadamard_rotate
from services.engine.engine import Engine
from services.worker.attention.batch_layout import BatchLayout
from services.worker.config import WorkerConfig
from services.worker.kv_pool import KVPool

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_original_write = KVPool.write
amax = {"k": 0.0, "v": 0.0}


def fake_write(fmt: torch.dtype | None, per_token: bool, scale: float = 1.0, rotated: bool = False):
    def write(self, layer, slots, k, v):
        amax["k"] = max(amax["k"], float(k.abs().max()))
        amax["v"] = max(amax["v"], float(v.abs().max()))
        if fmt is not None and rotated:
            k, v = (hadamard_rotate(round_trip(hadamard_rotate(x.float()), fmt, per_token, scale)) for x in (k, v))
        elif fmt is not None:
            k, v = (round_trip(x.float(), fmt, per_token, scale) for x in (k, v))
        _original_write(self, layer, slots, k, v)
    return write


def round_trip(x: torch.Tensor, fmt: torch.dtype, per_token: bool, scale: float) -> torch.Tensor:
    """x [T, Hkv, D] through fp8 and back (float32)."""
    if not per_token:
        return (x / scale).to(fmt).float() * scale
    scale = (x.abs().amax(-1, keepdim=True) / torch.finfo(fmt).max).clamp_min(1e-12)  # [T, Hkv, 1]
    return (x / scale).to(fmt).float() * scale


def perplexity(engine: Engine, ids: list[int], chunk: int) -> float:
    runner = engine.runner
    ps = runner.kv_spec.page_size
    pages = torch.arange(-(-len(ids) // ps), dtype=torch.int64)[None, :]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:start + chunk]
            layout = BatchLayout.build([len(piece)], [start], pages, ps)
            runner.backend.prepare(layout, runner.pool)
            meta = type("Meta", (), {"positions": layout.positions, "attention": runner.backend.forward})()
            logits = runner.model(torch.tensor(piece), meta, torch.arange(len(piece))).float()  # [n, V]
            targets = ids[start + 1:start + 1 + len(piece)]
            logp = torch.log_softmax(logits[:len(targets)], -1)
            nll -= float(logp[torch.arange(len(targets)), torch.tensor(targets)].sum())
            count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--text", default=None, help="default: docs/*.md and README.md")
    args = ap.parse_args()
    text = Path(args.text).read_text() if args.text else "\n".join(
        p.read_text() for p in sorted(Path("docs").glob("*.md")) + [Path("README.md")])
    config = WorkerConfig(dtype="bfloat16", attention_backend="torch", kv_cache_bytes=256 << 20)
    engine = Engine(worker=config)
    ids = engine.tokenizer.encode(text)[:args.tokens]
    base = None
    for name, fmt, per_token, scale, rotated in [
            ("bfloat16 KV", None, False, 1.0, False),
            ("e4m3, one scale 1", "e4m3", False, 1.0, False), ("e4m3, one scale 1/4", "e4m3", False, 0.25, False),
            ("e4m3, one scale 1/16", "e4m3", False, 1 / 16, False),
            ("e4m3, per-token/head scale", "e4m3", True, 1.0, False),
            ("e4m3, rotated, one scale 1/4", "e4m3", False, 0.25, True),
            ("e4m3, rotated, one scale 1/16", "e4m3", False, 1 / 16, True),
            ("e4m3, rotated, per-token/head", "e4m3", True, 1.0, True),
            ("e5m2, one scale 1", "e5m2", False, 1.0, False), ("e5m2, per-token/head scale", "e5m2", True, 1.0, False),
            ("e5m2, rotated, one scale 1", "e5m2", False, 1.0, True)]:
        KVPool.write = fake_write(FORMATS.get(fmt), per_token, scale, rotated)
        ppl = perplexity(engine, ids, args.chunk)
        base = base or ppl
        print(f"{name:34s} ppl {ppl:9.4f}  {100 * (ppl / base - 1):+.3f}%", flush=True)
    KVPool.write = _original_write
    print(f"largest |K| {amax['k']:.1f}, |V| {amax['v']:.1f} over {len(ids)} tokens")
    engine.shutdown()
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        engine = Engine(worker=replace(config, kv_cache_dtype=kv))
        ppl = perplexity(engine, ids, args.chunk)
        print(f"{'--kv-cache-dtype ' + kv:34s} ppl {ppl:9.4f}  {100 * (ppl / base - 1):+.3f}%", flush=True)
        engine.shutdown()


if __name__ == "__main__":
    main()
