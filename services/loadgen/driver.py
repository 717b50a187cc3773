"""Run a workload against one server: conversations start at their arrival times, each turn
waits for a --max-concurrency slot, and a chat conversation's next turn resends the history
with the server's actual answers. A progress bar counts finished requests."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from services.loadgen.client import RequestResult, request_body, send
from services.loadgen.config import BenchConfig
from services.loadgen.datasets import Conversation


@dataclass(frozen=True)
class Target:
    """A server to measure: its root URL and the `model` it serves."""
    url: str
    model: str


@dataclass
class RunOutput:
    results: list[RequestResult] = field(default_factory=list)
    t0: float = 0.0       # perf_counter at the start of the run (arrival time 0)
    wall_s: float = 0.0   # from t0 until the last request ended


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def _progress(total: int, enabled: bool, label: str):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


async def _conversation(session: aiohttp.ClientSession, target: Target, conv: Conversation, index: int,
                        delay: float, gate, cfg: BenchConfig, extra: dict, sink: list, bar) -> None:
    await asyncio.sleep(delay)
    history: list[dict] = []
    for k, turn in enumerate(conv.turns):
        if conv.chat:
            history.append({"role": "user", "content": turn.text})
        body = request_body(target.model, prompt=None if conv.chat else turn.text,
                            messages=list(history) if conv.chat else None, max_tokens=turn.output_len,
                            temperature=cfg.temperature, ignore_eos=cfg.ignore_eos, extra=extra)
        async with gate:
            res = await send(session, target.url, body, cfg.timeout_s)
        res.conversation, res.turn, res.expected_input_len = index, k, turn.input_len
        sink.append(res)
        if bar is not None:
            bar.update(1)
        if not res.ok and conv.chat:  # the history is broken: the later turns are not sent
            for j in range(k + 1, len(conv.turns)):
                now = time.perf_counter()
                sink.append(RequestResult(start=now, end=now, error="not sent: an earlier turn failed",
                                          conversation=index, turn=j))
                if bar is not None:
                    bar.update(1)
            return
        if conv.chat:
            history.append({"role": "assistant", "content": res.text})


async def run_workload(session: aiohttp.ClientSession, target: Target, convs: list[Conversation],
                       arrivals: list[float], cfg: BenchConfig, extra: dict, label: str = "") -> RunOutput:
    """Every conversation of `convs`, started at `arrivals` (seconds from now)."""
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
    bar = _progress(sum(len(c.turns) for c in convs), cfg.progress, label or target.url)
    out = RunOutput(t0=time.perf_counter())
    try:
        await asyncio.gather(*(
            _conversation(session, target, conv, i, arrivals[i], gate, cfg, extra, out.results, bar)
            for i, conv in enumerate(convs)))
    finally:
        if bar is not None:
            bar.close()
    out.wall_s = max([r.end for r in out.results] + [out.t0]) - out.t0
    out.results.sort(key=lambda r: (r.conversation, r.turn))
    return out


async def warm_up(session: aiohttp.ClientSession, target: Target, prompt: str, n: int, timeout_s: float) -> None:
    """n short unmeasured requests, one after another (loads lazy paths, opens connections)."""
    for _ in range(n):
        await send(session, target.url, request_body(target.model, prompt=prompt, max_tokens=4, temperature=0.0,
                                                     ignore_eos=True), timeout_s)
