"""The worker service: the model and the KV pool behind one Step stream.

`Step` is the scheduler ↔ worker contract on the wire (protos/radixmesh/v1/
worker.proto): a StepResult answers each StepPlan, in order. Each step runs on
one dedicated thread, so the event loop keeps answering health checks and
GetInfo while torch computes, and two steps never overlap.

One scheduler at a time: a new Step stream starts from an empty request table
(the scheduler that opens it has no requests on this worker), so a scheduler
that reconnects after a broken stream finds no stale state. A stream waits a
few seconds for the previous one to be torn down, then is refused.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import grpc

from protos.radixmesh.v1 import worker_pb2 as pb
from protos.radixmesh.v1 import worker_pb2_grpc
from services.common.model_path import resolve_model_path
from services.worker.config import WorkerConfig
from services.worker.convert import plan_from_proto, result_to_proto

log = logging.getLogger(__name__)

STREAM_TAKEOVER_S = 10.0  # how long a new Step stream waits for the previous one to end


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runner = None  # a ModelRunner once start() returned
        self.info: pb.WorkerInfo | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="worker-step")
        self._stream_lock = asyncio.Lock()

    async def start(self) -> None:
        """Load the model on the step thread (health stays NOT_SERVING meanwhile)."""
        loop = asyncio.get_running_loop()
        self.runner, eos = await loop.run_in_executor(self._executor, self._load)
        self.info = worker_info(self.runner, eos)

    def _load(self):
        # torch is imported here, not at module level: `radixmesh serve` of the
        # other services imports this package's siblings without paying for it.
        from services.worker.loader.checkpoint import load_checkpoint
        from services.worker.model_runner import ModelRunner

        path = resolve_model_path(self.config.model)
        runner = ModelRunner(self.config, load_checkpoint(path))
        return runner, stop_ids(path, runner.model_config.eos_token_ids)

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        return self.info

    async def Step(self, request_iterator: AsyncIterator[pb.StepPlan],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StepResult]:
        try:
            await asyncio.wait_for(self._stream_lock.acquire(), STREAM_TAKEOVER_S)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "another scheduler holds this worker's Step stream")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._reset)
            log.info("step stream opened", extra={"peer": context.peer()})
            async for msg in request_iterator:
                try:
                    result = await loop.run_in_executor(self._executor, self._step, msg)
                except Exception as exc:  # the scheduler fails the step's requests and reconnects
                    log.exception("step %d failed", msg.step_id)
                    await context.abort(grpc.StatusCode.INTERNAL, f"worker step {msg.step_id} failed: {exc}")
                yield result
            log.info("step stream closed by the scheduler")
        finally:
            self._stream_lock.release()

    def _step(self, msg: pb.StepPlan) -> pb.StepResult:
        return result_to_proto(self.runner.execute(plan_from_proto(msg)))

    def _reset(self) -> None:
        """Drop every request's state: a new stream's scheduler knows none of them."""
        n = len(self.runner.requests)
        if n:
            self.runner.reset()
            log.info("dropped state of %d requests of a previous stream", n)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def stop_ids(path: str, model_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end generation: the model's and its tokenizer's (as the Engine does)."""
    from services.tokenizer.text_tokenizer import load_tokenizer

    eos = set(model_eos)
    try:
        eos |= set(load_tokenizer(path).eos_token_ids)
    except (FileNotFoundError, ValueError) as e:  # weights without a tokenizer: the model's ids only
        log.warning("no tokenizer eos ids", extra={"error": str(e)})
    return tuple(sorted(eos))


def worker_info(runner, eos_token_ids: tuple[int, ...]) -> pb.WorkerInfo:
    mc, spec, cfg = runner.model_config, runner.kv_spec, runner.config
    return pb.WorkerInfo(
        model=pb.ModelConfig(
            vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
            num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
            num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
            rope_theta=mc.rope_theta, rope_scaling_json=json.dumps(mc.rope_scaling) if mc.rope_scaling else "",
            max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=mc.tie_word_embeddings,
            attention_bias=mc.attention_bias, bos_token_id=mc.bos_token_id,
            eos_token_ids=list(eos_token_ids), name=mc.name),
        num_kv_pages=spec.num_pages, page_size=spec.page_size, dtype=cfg.dtype, kv_dtype=cfg.dtype,
        tp_size=1, weights_version="0", max_requests=cfg.max_requests)
