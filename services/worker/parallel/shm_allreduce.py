"""All-reduce and all-gather through shared memory, for the ranks of one host.

Why: a decode step of the default model does 60 all-reduces (2 per layer × 30 layers) of a few
KB ([batch, 576]). Gloo sends each through loopback TCP: a ring of sends and receives, each a
syscall and a wake-up. Ranks on one host can instead share one mapping: a collective is a copy
into the rank's slot, a counter written, a wait for the others' counters, and a sum (or a
concatenation) over every rank's slot. `choose_communicator` measures both on the group's own
shapes and keeps the faster.

The segment (POSIX shared memory: /dev/shm on Linux), created by rank 0 and named after the
group (`radixmesh-tp-{group_id}-{rank 0's pid}`), is unlinked as soon as every rank has mapped it:
the mapping lives on, and nothing stays in /dev/shm when the group ends, crashed or not. Its
pages are reserved at creation (posix_fallocate), so a /dev/shm too small for it (64 MiB under
Docker's default) fails the constructor instead of killing a rank with SIGBUS later.

    [world_size counters, one int64 per 64-byte line] [2 buffers × world_size slots of max_bytes]

Call number s (1, 2, ...: every rank makes the same calls in the same order, so the numbers agree)
uses buffer s % 2:
  1. rank r copies x into its slot of the buffer and publishes counters[r] = s;
  2. it waits until every counter reached s;
  3. it reads every rank's slot of the buffer (a sum in rank order, or a concatenation).
Two buffers make the reads safe without a second phase: rank r writes into buffer s % 2 again at
call s + 2, which it starts only after finishing call s + 1, that is after every rank published
s + 1, which each did after its reads of call s returned. The counters are int64: they do not wrap.

Memory order: a counter is written after its slot and read before the slots. x86 keeps stores in
order and loads in order (TSO), which is all this needs; weaker ISAs (aarch64) would need fences
that Python cannot issue, so the constructor refuses them (choose_communicator then keeps gloo).

Sums are deterministic and the same on every rank: in rank order, accumulating bfloat16 and
float16 in float32 and rounding once. Waiting spins a little, then yields the core (a group often
has more ranks than cores: the rank waited for may need this one), then sleeps; past timeout_s it
raises TimeoutError naming the ranks that did not arrive, and the communicator is unusable after.
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from services.worker.parallel.communicator import Communicator, DistCommunicator, Solo

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "radixmesh-tp-"
LINE = 64  # bytes: one counter per cache line, slots aligned to lines
TSO_MACHINES = {"x86_64", "amd64", "i386", "i686"}
WIDE_ACCUMULATE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}

VIEW_CACHE = 256  # (parity, dtype, shape) entries: every batch size of a decode step, both buffers
SPIN_POLLS = 16  # polls before the first yield: a peer on its way arrives within microseconds
YIELD_FOR_S = 2e-3  # then sched_yield (the core goes to a runnable peer, if any) this long
SLEEP_S = (50e-6, 1e-3)  # then sleeps, doubling from the first to the second


@dataclass(frozen=True)
class Layout:
    """Where each rank's counter and slots lie in the segment."""

    world_size: int
    slot_bytes: int  # a multiple of LINE

    @property
    def header_bytes(self) -> int:
        return self.world_size * LINE

    @property
    def nbytes(self) -> int:
        return self.header_bytes + 2 * self.world_size * self.slot_bytes

    def counter_index(self, rank: int) -> int:
        """rank's counter in the header viewed as int64."""
        return rank * (LINE // 8)

    def slot_offset(self, parity: int, rank: int) -> int:
        """rank's slot of buffer `parity`, from the end of the header."""
        return (parity * self.world_size + rank) * self.slot_bytes


class ShmCommunicator:
    """The Communicator of the ranks of one host, through one shared segment (module docstring).

    Built collectively by every rank of the default process group. Tensors of more than
    max_bytes (per rank) go to `fallback` (DistCommunicator by default); every rank passes the
    same shape and dtype, so every rank takes the same path. One thread makes the calls."""

    def __init__(self, group_id: str, max_bytes: int = 8 << 20, timeout_s: float = 10.0,
                 fallback: Communicator | None = None) -> None:
        if platform.machine().lower() not in TSO_MACHINES:
            raise RuntimeError(f"the shared-memory all-reduce needs x86's memory order, not {platform.machine()}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group_id, self.max_bytes, self.timeout_s = group_id, max_bytes, timeout_s
        self.fallback = fallback if fallback is not None else DistCommunicator()
        self.layout = Layout(self.world_size, -(-max_bytes // LINE) * LINE)
        self._mapping = open_segment(group_id, self.layout.nbytes)
        header = memoryview(self._mapping)[:self.layout.header_bytes]
        self._counters = header.cast("q")  # int64; rank r's at layout.counter_index(r)
        self._counter_at = [self.layout.counter_index(r) for r in range(self.world_size)]
        with torch.inference_mode(False):  # normal tensors: inference ones could not be written outside inference mode
            self._data = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=self.layout.header_bytes)
        self._views: dict[tuple[int, torch.dtype, torch.Size], list[torch.Tensor]] = {}  # see _slot_views
        self._seq = 0
        self._broken: str | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks in rank order (float32 accumulation for 16-bit floats): a new
        tensor, the same bits on every rank (the fallback may reuse x)."""
        if not self._fits(x):
            return self.fallback.all_reduce(x)
        return sum_in_order(self._exchange(x, "all_reduce"), x.dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank → [..., world_size * n], rank 0's columns first."""
        if not self._fits(x):
            return self.fallback.all_gather(x)
        return torch.cat(self._exchange(x, "all_gather"), dim=-1)

    def close(self) -> None:
        """Unmap the segment (after the group's last collective; later calls raise)."""
        self._broken = self._broken or "closed"
        self._views.clear()
        self._data = None
        self._counters.release()
        try:
            self._mapping.close()
        except BufferError:  # a tensor over it is still alive somewhere: the GC unmaps it with the tensor
            pass

    def _fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.max_bytes

    def _exchange(self, x: torch.Tensor, op: str) -> list[torch.Tensor]:
        """Publish x and wait for the others → every rank's x, rank order: views of the slots,
        valid until this rank's next call."""
        if self._broken:
            raise RuntimeError(f"shm communicator of group {self.group_id} is unusable: {self._broken}")
        self._seq += 1
        parts = self._slot_views(self._seq & 1, x.dtype, x.shape)
        parts[self.rank].copy_(x.detach())  # no autograd through the collective
        self._counters[self._counter_at[self.rank]] = self._seq
        self._wait(self._seq, op)
        return parts

    def _slot_views(self, parity: int, dtype: torch.dtype, shape: torch.Size) -> list[torch.Tensor]:
        """Every rank's slot of buffer `parity` as a tensor of shape and dtype, rank order; cached
        (a decode step's shapes recur), the cache emptied when it grows past VIEW_CACHE."""
        key = (parity, dtype, shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            nbytes = shape.numel() * dtype.itemsize
            with torch.inference_mode(False):
                views = [self._data[off:off + nbytes].view(dtype).view(shape)
                         for off in (self.layout.slot_offset(parity, r) for r in range(self.world_size))]
            self._views[key] = views
        return views

    def _late(self, seq: int, ranks: Sequence[int]) -> list[int]:
        return [r for r in ranks if self._counters[self._counter_at[r]] < seq]

    def _wait(self, seq: int, op: str) -> None:
        """Until every rank published seq: spin, then yield the core, then sleep; TimeoutError past timeout_s."""
        late = self._late(seq, range(self.world_size))
        start, polls, nap = time.monotonic(), 0, SLEEP_S[0]
        while late:
            polls += 1
            if polls > SPIN_POLLS:
                waited = time.monotonic() - start
                if waited > self.timeout_s:
                    self._broken = f"rank(s) {late} did not arrive at {op} #{seq} within {self.timeout_s} s"
                    raise TimeoutError(f"shm {op} of group {self.group_id}: {self._broken}")
                if waited < YIELD_FOR_S:
                    os.sched_yield()
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, SLEEP_S[1])
            late = self._late(seq, late)


def sum_in_order(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """((parts[0] + parts[1]) + parts[2]) ..., in float32 for 16-bit floats, rounded once to dtype;
    a new tensor (never a view of the parts)."""
    if len(parts) == 1:
        return parts[0].clone()
    if len(parts) == 2:
        return torch.add(parts[0], parts[1])  # ATen adds 16-bit floats in float32 and rounds once (tested)
    acc = torch.add(parts[0].to(WIDE_ACCUMULATE.get(dtype, dtype)), parts[1])  # a new tensor
    for p in parts[2:]:
        acc.add_(p)
    return acc.to(dtype)


def open_segment(group_id: str, nbytes: int) -> mmap.mmap:
    """Collective: rank 0 creates the segment, every rank maps it, rank 0 unlinks it once all have;
    the name is gone when any rank returns. Every rank raises OSError if any rank failed (all fail alike)."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", group_id):
        raise ValueError(f"group_id {group_id!r}: letters, digits, '.', '_' and '-' only")
    rank, world = dist.get_rank(), dist.get_world_size()
    name, error = None, None
    if rank == 0:
        try:
            name = create_segment(f"{NAME_PREFIX}{group_id}-{os.getpid()}", nbytes)
        except OSError as e:
            error = f"rank 0 could not create a {nbytes}-byte segment in {SHM_DIR}: {e}"
    sent = [name, error, group_id]
    dist.broadcast_object_list(sent, src=0)
    name, error = sent[0], sent[1]
    if error is None and sent[2] != group_id:
        error = f"rank {rank} has group_id {group_id!r}, rank 0 {sent[2]!r}"
    mapping = None
    if error is None:
        try:
            mapping = map_segment(name, nbytes)
        except OSError as e:
            error = f"rank {rank} could not map {SHM_DIR / name}: {e}"
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error)
    if rank == 0 and name is not None:
        (SHM_DIR / name).unlink(missing_ok=True)
    dist.barrier()  # so that once any rank has returned, the name is gone
    if any(errors):
        if mapping is not None:
            mapping.close()
        raise OSError("; ".join(dict.fromkeys(e for e in errors if e)))
    return mapping


def create_segment(name: str, nbytes: int) -> str:
    """A new zero-filled segment of nbytes, its pages reserved → its name."""
    path = SHM_DIR / name
    path.unlink(missing_ok=True)  # only a crashed process of the same pid can have left one
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return name


def map_segment(name: str, nbytes: int) -> mmap.mmap:
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"segment {name} holds {os.fstat(fd).st_size} bytes, not {nbytes}")
        return mmap.mmap(fd, nbytes)  # MAP_SHARED
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Probe:
    """One probe shape's all-reduce seconds per call, on this rank's clock (rank 0's decide)."""

    shape: tuple[int, ...]
    gloo_s: float
    shm_s: float


def time_all_reduce(comm: Communicator, shape: Sequence[int], dtype: torch.dtype, iters: int,
                    warmup: int = 3) -> float:
    """Collective: seconds per all_reduce of `shape` (mean over iters, after warmup calls and a barrier)."""
    x = torch.zeros(tuple(shape), dtype=dtype)  # gloo sums in place: zeros stay zeros
    for _ in range(warmup):
        comm.all_reduce(x)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(x)
    return (time.perf_counter() - t0) / iters


def choose_communicator(group_id: str, probe_sizes: Sequence[Sequence[int]] = ((1, 576), (64, 576)),
                        dtype: torch.dtype = torch.float32, iters: int = 20, max_bytes: int = 8 << 20,
                        timeout_s: float = 10.0) -> Communicator:
    """Collective: gloo or shared memory, whichever all-reduces the probe shapes faster in total
    (rank 0's measurement, broadcast, so every rank picks the same). Gloo where the segment
    cannot be made; Solo for a group of one."""
    if dist.get_world_size() == 1:
        return Solo()
    gloo = DistCommunicator()
    try:
        shm = ShmCommunicator(group_id, max_bytes, timeout_s, fallback=gloo)
    except (OSError, RuntimeError) as e:  # alike on every rank: the same host, or open_segment's agreement
        log.warning("shared-memory all-reduce unavailable: gloo", extra={"error": str(e)})
        return gloo
    probes = [Probe(tuple(s), time_all_reduce(gloo, s, dtype, iters), time_all_reduce(shm, s, dtype, iters))
              for s in probe_sizes]
    use_shm = torch.tensor([int(sum(p.shm_s for p in probes) < sum(p.gloo_s for p in probes))])
    dist.broadcast(use_shm, src=0)
    chosen = "shm" if use_shm.item() else "gloo"
    log.info("all-reduce backend chosen", extra={
        "chosen": chosen, "group_id": group_id, "rank": dist.get_rank(), "dtype": str(dtype), "decided_by": "rank 0",
        "probes_us": {"x".join(map(str, p.shape)): {"gloo": round(p.gloo_s * 1e6, 1), "shm": round(p.shm_s * 1e6, 1)}
                      for p in probes}})
    if chosen == "shm":
        return shm
    shm.close()
    return gloo
