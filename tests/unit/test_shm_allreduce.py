"""The shared-memory all-reduce (services/worker/parallel/shm_allreduce.py) in real processes.

One group of 2 ranks and one of 3 run at once on this host (spawned processes, gloo over a
loopback port, different group ids); every rank runs every check and reports each one's outcome,
which the tests below assert. A check that fails on one rank leaves the others' collectives
unanswered: they fail by the shm timeout or gloo's, never hang (the whole run is bounded too).
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import pytest
import torch
import torch.distributed as dist

from services.worker.parallel.communicator import DistCommunicator, init_group, leave_group
from services.worker.parallel.shm_allreduce import NAME_PREFIX, SHM_DIR, ShmCommunicator, choose_communicator

pytestmark = pytest.mark.slow  # real processes joined by gloo: the full suite, not the fast lane

WORLDS = (2, 3)
MAX_BYTES = 64 * 576 * 4  # a decode step's float32 all-reduce at batch 64; one element more goes to the fallback
SHM_TIMEOUT_S = 10.0  # generous: five ranks share two cores
DEAD_RANK_TIMEOUT_S = 0.5  # the communicator whose last rank never arrives
GLOO_TIMEOUT_S = 30.0
TOGETHER_TIMEOUT_S = 30.0  # waiting for the other group (it may have crashed)
RUN_TIMEOUT_S = 90.0  # every rank of both groups reports within this
REPEATS = 200


class CountingFallback(DistCommunicator):
    """Gloo, counting the calls it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().all_gather(x)


@dataclass
class Rank:
    """What a rank's checks need: its group, its communicators, and how to regenerate any rank's input."""

    rank: int
    world: int
    group_id: str
    shm: ShmCommunicator
    fallback: CountingFallback
    gloo: DistCommunicator = field(default_factory=DistCommunicator)

    def inputs(self, seed: int, shape: tuple[int, ...], dtype: torch.dtype,
               integers: bool = True) -> list[torch.Tensor]:
        """Every rank's input for call `seed` (rank order); the seed includes the world, so the
        two groups' inputs differ and crosstalk between them would show."""
        out = []
        for r in range(self.world):
            g = torch.Generator().manual_seed(((seed * 10 + self.world) * 10) + r)
            x = torch.randint(-50, 50, shape, generator=g).float() if integers else torch.randn(shape, generator=g)
            out.append(x.to(dtype))
        return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(t))
    return len(set(digests)) == 1


def check_segment_unlinked(ctx: Rank) -> None:
    left = sorted(p.name for p in SHM_DIR.glob(f"{NAME_PREFIX}{ctx.group_id}*"))
    assert not left, f"still in {SHM_DIR} after every rank mapped it: {left}"


def check_all_reduce_exact(ctx: Rank) -> None:
    """Integer-valued inputs: every order of summation is exact, so shm, gloo and the float32 sum agree."""
    for seed, dtype in enumerate((torch.float32, torch.bfloat16)):
        xs = ctx.inputs(seed, (3, 576), dtype)
        expected = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
        got = ctx.shm.all_reduce(xs[ctx.rank].clone())
        assert got.dtype == dtype and got.shape == expected.shape
        assert torch.equal(got, expected), f"{dtype}: shm sum differs from the float32 sum"
        assert torch.equal(ctx.gloo.all_reduce(xs[ctx.rank].clone()), expected), f"{dtype}: gloo differs"


def check_all_reduce_rank_order(ctx: Rank) -> None:
    """Random inputs: the result is the rank-order float32 sum rounded once, bit for bit, on every rank."""
    for seed, dtype in enumerate((torch.float32, torch.bfloat16), start=10):
        xs = ctx.inputs(seed, (64, 576), dtype, integers=False)
        acc = xs[0].float()
        for x in xs[1:]:
            acc = acc + x.float()
        got = ctx.shm.all_reduce(xs[ctx.rank])
        assert torch.equal(got, acc.to(dtype)), f"{dtype}: not the rank-order float32 sum"
        assert _same_on_every_rank(got), f"{dtype}: results differ across ranks"


def check_all_gather_order(ctx: Rank) -> None:
    for seed, (shape, dtype) in enumerate([((5,), torch.float32), ((2, 3), torch.bfloat16),
                                           ((2, 2, 4), torch.float32)], start=20):
        xs = ctx.inputs(seed, shape, dtype)
        got = ctx.shm.all_gather(xs[ctx.rank])
        assert torch.equal(got, torch.cat(xs, dim=-1)), f"{shape} {dtype}: not rank 0's columns first"
        assert torch.equal(got, ctx.gloo.all_gather(xs[ctx.rank])), f"{shape} {dtype}: differs from gloo"


def check_repeated(ctx: Rank) -> None:
    """Many calls, both buffers in turn, shapes and dtypes changing, in and out of inference mode
    (the model's forward runs in it), each result right."""
    calls_before = ctx.fallback.calls
    for i in range(REPEATS):
        shape, dtype = (1 + i % 7, 8 + i % 3), (torch.float32, torch.bfloat16)[i // 2 % 2]
        xs = ctx.inputs(100 + i, shape, dtype)
        with torch.inference_mode(i % 5 < 2):
            if i % 2:
                assert torch.equal(ctx.shm.all_gather(xs[ctx.rank]), torch.cat(xs, dim=-1)), f"call {i}: all_gather"
            else:
                expected = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
                assert torch.equal(ctx.shm.all_reduce(xs[ctx.rank]), expected), f"call {i}: all_reduce"
    assert ctx.fallback.calls == calls_before, "small tensors went to the fallback"


def check_fallback(ctx: Rank) -> None:
    """Up to max_bytes through the slots; one element more through the fallback, still right."""
    for seed, (numel, via_fallback) in enumerate([(MAX_BYTES // 4, False), (MAX_BYTES // 4 + 1, True)], start=500):
        xs = ctx.inputs(seed, (numel,), torch.float32)
        calls = ctx.fallback.calls
        assert torch.equal(ctx.shm.all_reduce(xs[ctx.rank].clone()), torch.stack(xs).sum(0))
        assert torch.equal(ctx.shm.all_gather(xs[ctx.rank]), torch.cat(xs))
        assert ctx.fallback.calls - calls == (2 if via_fallback else 0), f"{numel} floats: fallback calls"


def check_choose_communicator(ctx: Rank) -> None:
    """Every rank gets the same kind of communicator (rank 0 decides), and it sums right."""
    comm = choose_communicator(f"{ctx.group_id}-choose", [(1, 576), (8, 576)], iters=3, max_bytes=MAX_BYTES)
    kinds: list[str | None] = [None] * ctx.world
    dist.all_gather_object(kinds, type(comm).__name__)
    assert len(set(kinds)) == 1, f"the ranks chose differently: {kinds}"
    xs = ctx.inputs(700, (2, 576), torch.bfloat16)
    assert torch.equal(comm.all_reduce(xs[ctx.rank].clone()), torch.stack([x.float() for x in xs]).sum(0).bfloat16())
    if isinstance(comm, ShmCommunicator):
        comm.close()


def check_dead_rank_times_out(ctx: Rank) -> None:
    """The last rank never arrives: the others raise TimeoutError naming it, within the timeout."""
    comm = ShmCommunicator(f"{ctx.group_id}-dead", MAX_BYTES, DEAD_RANK_TIMEOUT_S, fallback=ctx.fallback)
    try:
        if ctx.rank == ctx.world - 1:
            return
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"\[{ctx.world - 1}\] did not arrive"):
            comm.all_reduce(torch.ones(4))
        waited = time.monotonic() - t0
        assert DEAD_RANK_TIMEOUT_S <= waited < DEAD_RANK_TIMEOUT_S + 2, f"raised after {waited:.2f} s"
        with pytest.raises(RuntimeError, match="unusable"):
            comm.all_reduce(torch.ones(4))
    finally:
        comm.close()


CHECKS: dict[str, Callable[[Rank], None]] = {
    "segment_unlinked": check_segment_unlinked,
    "all_reduce_exact": check_all_reduce_exact,
    "all_reduce_rank_order": check_all_reduce_rank_order,
    "all_gather_order": check_all_gather_order,
    "repeated": check_repeated,
    "fallback": check_fallback,
    "choose_communicator": check_choose_communicator,
    "dead_rank_times_out": check_dead_rank_times_out,
}


def _outcome(check: Callable[[Rank], None], ctx: Rank) -> str | None:
    try:
        check(ctx)
        return None
    except BaseException:
        return traceback.format_exc()


def _rank_main(rank: int, world: int, port: int, group_id: str, together: Barrier, out: Queue) -> None:
    """One rank: every check; each outcome (None, or the traceback) and time span → out."""
    report: dict[str, object] = {}
    try:
        torch.set_num_threads(1)
        init_group(f"tcp://127.0.0.1:{port}", rank, world, GLOO_TIMEOUT_S)
        fallback = CountingFallback()
        together.wait(TOGETHER_TIMEOUT_S)  # both groups make their segments at once
        ctx = Rank(rank, world, group_id, ShmCommunicator(group_id, MAX_BYTES, SHM_TIMEOUT_S, fallback), fallback)
        report["segments"] = _mapped_segments()
        for name, check in CHECKS.items():
            if name == "repeated":
                together.wait(TOGETHER_TIMEOUT_S)  # both groups start their loops at once
            start = time.time()
            report[name] = _outcome(check, ctx)
            report[f"{name}_span"] = (start, time.time())
        ctx.shm.close()
    except BaseException:
        report["crash"] = traceback.format_exc()
    finally:
        out.put((world, rank, report))
        leave_group()


def _mapped_segments() -> list[tuple[str, str]]:
    """The (inode, path) of each segment this process maps (/proc/self/maps; unlinked ones end in "(deleted)")."""
    with open("/proc/self/maps") as f:
        rows = [line.split(maxsplit=5) for line in f if NAME_PREFIX in line]
    return sorted({(row[4], row[5].strip()) for row in rows})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    group_ids: dict[int, str]  # world → group id
    reports: dict[int, dict[int, dict]]  # world → rank → {check: None or traceback, check_span: (start, end), ...}


@pytest.fixture(scope="module")
def run() -> Run:
    ctx = mp.get_context("spawn")
    out, together = ctx.Queue(), ctx.Barrier(sum(WORLDS))
    group_ids = {w: f"test-{os.getpid()}-w{w}" for w in WORLDS}
    procs = []
    for world in WORLDS:
        port = _free_port()
        for rank in range(world):
            procs.append(ctx.Process(target=_rank_main, args=(rank, world, port, group_ids[world], together, out),
                                     daemon=True))
            procs[-1].start()
    reports: dict[int, dict[int, dict]] = {w: {} for w in WORLDS}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for _ in procs:
            world, rank, report = out.get(timeout=max(0.1, deadline - time.monotonic()))
            reports[world][rank] = report
    except Exception:
        pass  # the missing ranks fail the tests below
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    return Run(group_ids, reports)


def _assert_passed(run: Run, world: int, check: str) -> None:
    reports = run.reports[world]
    assert sorted(reports) == list(range(world)), f"world {world}: only ranks {sorted(reports)} reported"
    for rank, report in sorted(reports.items()):
        assert check in report, f"world {world} rank {rank} did not get to {check}:\n{report.get('crash')}"
        assert report[check] is None, f"world {world} rank {rank}, {check}:\n{report[check]}"


@pytest.mark.parametrize("world", WORLDS)
def test_segment_unlinked_once_mapped(run: Run, world: int) -> None:
    _assert_passed(run, world, "segment_unlinked")


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_is_the_exact_sum_and_gloos(run: Run, world: int) -> None:
    _assert_passed(run, world, "all_reduce_exact")


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_is_the_rank_order_sum_on_every_rank(run: Run, world: int) -> None:
    _assert_passed(run, world, "all_reduce_rank_order")


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_puts_rank_0_first(run: Run, world: int) -> None:
    _assert_passed(run, world, "all_gather_order")


@pytest.mark.parametrize("world", WORLDS)
def test_repeated_calls_reuse_the_buffers_safely(run: Run, world: int) -> None:
    _assert_passed(run, world, "repeated")


@pytest.mark.parametrize("world", WORLDS)
def test_larger_than_max_bytes_goes_to_the_fallback(run: Run, world: int) -> None:
    _assert_passed(run, world, "fallback")


@pytest.mark.parametrize("world", WORLDS)
def test_choose_communicator_picks_the_same_on_every_rank(run: Run, world: int) -> None:
    _assert_passed(run, world, "choose_communicator")


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_never_arrives_times_the_others_out(run: Run, world: int) -> None:
    _assert_passed(run, world, "dead_rank_times_out")


def test_two_groups_at_once_do_not_interfere(run: Run) -> None:
    """Both groups made their segments and ran their repeated calls at the same time: each group's
    ranks share one segment named after the group, not the other's, and every result was right."""
    inodes = set()
    for world in WORLDS:
        _assert_passed(run, world, "repeated")
        segments = {tuple(r["segments"]) for r in run.reports[world].values()}
        assert len(segments) == 1, f"world {world}: the ranks map different segments: {segments}"
        [(inode, path)] = segments.pop()
        assert f"{NAME_PREFIX}{run.group_ids[world]}-" in path, path
        inodes.add(inode)
    assert len(inodes) == len(WORLDS), "the groups share a segment"
    spans = [r["repeated_span"] for w in WORLDS for r in run.reports[w].values()]
    assert max(start for start, _ in spans) < min(end for _, end in spans), f"the loops did not overlap: {spans}"


def test_every_rank_ran_to_the_end(run: Run) -> None:
    for world in WORLDS:
        for rank, report in sorted(run.reports[world].items()):
            assert "crash" not in report, f"world {world} rank {rank}:\n{report['crash']}"


def test_nothing_left_in_dev_shm(run: Run) -> None:
    left = [p.name for gid in run.group_ids.values() for p in SHM_DIR.glob(f"{NAME_PREFIX}{gid}*")]
    assert not left, f"left in {SHM_DIR}: {left}"
