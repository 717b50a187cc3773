"""A worker group: one replica's model over `--tp-size` × `--pp-size` processes joined by
torch.distributed (placement.py says which rank is which).

The leader (the worker service's process, or the Engine's) is rank 0. It starts the other ranks
of its node as child processes (follower.py), joins the group with them (world.py), and builds
its own shard; on a group of several machines each other node's first rank does the same for its
node (node.py) and takes the leader's commands over the nodes' control group. From
then on everything that changes a rank's state goes to every rank, in the same order: each
step's plan is sent to the followers (a pipe each, pickled) just before the leader runs it, so
all ranks run the same batch and meet at the same collectives. Only the leader answers the
scheduler; a follower's result is dropped (every rank samples the same tokens from the same
gathered logits).

Faults: a watchdog notices a follower that exits within `WATCH_S` and reports it by rank
(`on_lost`); a collective with a dead or hung peer fails within the group's timeout
(`--dist-timeout-s`) instead of hanging. Followers die with their leader (their command pipe
closes, and PR_SET_PDEATHSIG).

Cores: with at least as many CPUs as ranks, rank r runs on its own contiguous share of them
(`--cpu-cores` picks the set), with one thread per core; with fewer, every rank runs one thread
and the kernel spreads them.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Callable

from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

WATCH_S = 0.25  # how often the watchdog looks at the followers
READY_POLL_S = 0.2


@dataclass(frozen=True)
class RankSetup:
    """What a follower needs to become rank `rank`: sent over its command pipe first."""
    rank: int
    world_size: int
    init_method: str  # tcp://host:port, the group's rendezvous
    config: WorkerConfig  # the leader's, as each rank runs it (threads and cores its own)
    source: str  # the checkpoint's path; each rank loads it and keeps its shard
    cpus: tuple[int, ...]  # () = no pinning
    group_id: str  # names the group's shared-memory segment (one per group on a host)
    hidden: int  # the model's hidden size: the all-reduce probes' width


def group_refusal(config: WorkerConfig, hicache=None) -> str | None:
    """Why this configuration cannot run as a group yet, or None."""
    if config.world_size == 1:
        return None
    what = f"--tp-size {config.tp_size} --pp-size {config.pp_size}"
    if config.on_cuda:
        import torch
        why = cuda_refusal(config, torch.cuda.device_count())
        if why is not None:
            return why
    if config.quantization in ("int8", "fp8"):  # REQUANTIZED: made from each rank's slice at load
        return (f"{what} with --quantization {config.quantization} is not supported: each rank would quantize "
                "its own slice, with other scales than one rank's; use --quantization gguf, auto or none")
    if config.speculative_algorithm not in (None, "", "NGRAM"):  # a draft model would need a group of its own
        return f"{what} with --speculative-algorithm {config.speculative_algorithm} is not supported yet (NGRAM is)"
    if hicache is not None and (hicache.host_kv_ratio or hicache.kvstore_addr):
        return f"{what} with a host KV tier or a kvstore is not supported yet"
    if config.pp_size > 1 and config.lora_paths:
        return f"{what}: LoRA adapters under pipeline parallelism are not supported yet"
    return None


def rank_cpus(tp: int, allowed: list[int] | None = None) -> list[tuple[int, ...]]:
    """Each rank's CPUs: contiguous equal shares when there are at least tp CPUs, else none (())."""
    cpus = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
    if len(cpus) < tp:
        return [()] * tp
    share = len(cpus) // tp
    return [tuple(cpus[r * share:(r + 1) * share]) for r in range(tp)]


def rank_config(config: WorkerConfig, cpus: tuple[int, ...], local_rank: int = 0) -> WorkerConfig:
    """The config a rank runs: a thread per CPU of its own (one when it has none); no LoRA slots
    under pipeline parallelism (an adapter's layers would need renumbering per stage). On CUDA,
    local rank r of a node runs on its GPU r, eagerly (no decode graphs: a captured step would
    hold the group's collectives and sends). No lead CPU (--lead-cpu, which `radixmesh up` gives a
    one-replica worker): the group gives each rank CPUs of its own instead."""
    return replace(config, num_threads=config.num_threads or max(1, len(cpus)), lead_cpu=None,
                   max_loras=config.max_loras if config.pp_size == 1 else 0,
                   device=f"cuda:{local_rank}" if config.on_cuda else config.device,
                   disable_cuda_graph=config.disable_cuda_graph or config.on_cuda)


def cuda_refusal(config: WorkerConfig, gpus: int) -> str | None:
    """Why a CUDA group cannot run on a node with `gpus` GPUs, or None: one GPU per local rank."""
    if not config.on_cuda:
        return None
    if gpus < config.ranks_per_node:
        return (f"--tp-size {config.tp_size} --pp-size {config.pp_size} on --device cuda runs one rank per GPU: "
                f"{config.ranks_per_node} on each node, and this one has {gpus}")
    return None


def free_init_method(host: str = "127.0.0.1") -> str:
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


class Follower:
    """One follower process and its pipes (commands in, one 'ready' or error out)."""

    def __init__(self, setup: RankSetup) -> None:
        self.rank = setup.rank
        cmd_read, cmd_write = os.pipe()
        reply_read, reply_write = os.pipe()
        argv = [sys.executable, "-m", "services.worker.group.follower",
                "--cmd-fd", str(cmd_read), "--reply-fd", str(reply_write)]
        self.proc = subprocess.Popen(argv, pass_fds=(cmd_read, reply_write), start_new_session=False)
        os.close(cmd_read)
        os.close(reply_write)
        self.commands = Connection(cmd_write, readable=False)
        self.replies = Connection(reply_read, writable=False)
        self.commands.send(setup)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.replies.poll(READY_POLL_S):
                kind, detail = self._reply()
                if kind == "ready":
                    return
                raise RuntimeError(f"worker rank {self.rank} failed to start: {detail}")
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker rank {self.rank} (pid {self.proc.pid}) exited with code "
                                   f"{self.proc.returncode} while starting")
        raise TimeoutError(f"worker rank {self.rank} (pid {self.proc.pid}) was not ready in time")

    def _reply(self) -> tuple[str, str]:
        try:
            return self.replies.recv()
        except EOFError:
            return "error", "it closed its reply pipe"

    def receive_result(self, timeout_s: float):
        """The StepResult (or None) of this rank's last dp_execute; RuntimeError naming the rank when
        it is gone or silent for timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.replies.poll(READY_POLL_S):
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker rank {self.rank} (pid {self.proc.pid}) exited with code "
                                   f"{self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker rank {self.rank} (pid {self.proc.pid}) sent no step result in "
                                   f"{timeout_s:.0f} s")
        kind, detail = self._reply()
        if kind != "result":
            raise RuntimeError(f"worker rank {self.rank} (pid {self.proc.pid}) failed its step: {detail}")
        return detail

    def send(self, payload: bytes) -> None:
        """A command pickled once by the group (WorkerGroup.send) for all its followers."""
        try:
            self.commands.send_bytes(payload)
        except (BrokenPipeError, OSError) as exc:
            raise RuntimeError(f"worker rank {self.rank} (pid {self.proc.pid}) is gone: {exc}") from None

    def ask_to_stop(self) -> None:
        try:
            self.commands.send(("stop",))
        except OSError:
            pass

    def wait_stopped(self, timeout_s: float) -> None:
        """After ask_to_stop: its exit, or a kill after timeout_s; then its pipes are closed."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.commands.close()
        self.replies.close()


def send_to_nodes(nodes, command: tuple) -> None:
    """The leader's command to every other node's first rank (node.py), over the control group."""
    import torch.distributed as dist
    dist.broadcast_object_list([command], src=0, group=nodes)


def receive_from_leader(nodes) -> tuple:
    """On a node's first rank: the leader's next command (waits as long as the group is idle)."""
    import torch.distributed as dist
    box = [None]
    dist.broadcast_object_list(box, src=0, group=nodes)
    return box[0]


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()


class GroupLost(RuntimeError):
    """A rank of the group is gone: the group cannot step any more."""


class WorkerGroup:
    """The leader's side: its followers, started and watched."""

    def __init__(self, config: WorkerConfig, source: str, hidden: int,
                 on_lost: Callable[[str], None] | None = None) -> None:
        """Node `config.node_rank`'s first rank (global rank node_rank · ranks_per_node) and the
        followers it starts: the group's leader on node 0, a node's agent (node.py) elsewhere."""
        from services.worker.group.world import join_world
        world, per = config.world_size, config.ranks_per_node
        first = config.node_rank * per
        self.init_method = config.dist_init_addr and f"tcp://{config.dist_init_addr}" or free_init_method()
        self.cpus = rank_cpus(per, list(config.cpu_cores) or None)
        self.group_id = f"{os.getpid()}-{self.init_method.rsplit(':', 1)[-1]}"
        self.hidden = hidden
        self.config = rank_config(config, self.cpus[0], 0)
        self.on_lost = on_lost or (lambda why: log.error("worker group lost a rank", extra={"error": why}))
        self.followers: list[Follower] = []
        # The calling thread's CPUs and the process's torch threads, given back on close: the
        # Engine's step thread (or a test's) outlives the group.
        self._restore = (os.sched_getaffinity(0), _torch_threads())
        self.nodes = None  # the nodes' control group (several nodes)
        self.lost: str | None = None  # why the group broke, once a rank is gone
        self._closing = False
        try:
            for local in range(1, per):
                self.followers.append(Follower(RankSetup(
                    first + local, world, self.init_method, rank_config(config, self.cpus[local], local), source,
                    self.cpus[local], self.group_id, hidden)))
            if self.cpus[0]:
                os.sched_setaffinity(0, self.cpus[0])  # this (the step) thread; its OpenMP team inherits it
            self.joined = join_world(first, self.config, self.init_method, source, self.group_id, hidden)
            self.nodes = self.joined.nodes
        except BaseException:
            self.close()
            raise
        self._watch = threading.Thread(target=self._watchdog, name="worker-group-watch", daemon=True)

    def wait_ready(self, timeout_s: float) -> None:
        """After this rank built its own shard: every local follower built its own, and with several
        nodes every node did (a monitored barrier names the nodes that did not arrive)."""
        import torch.distributed as dist
        deadline = time.monotonic() + timeout_s
        for f in self.followers:
            f.wait_ready(deadline)
        if self.nodes is not None:
            remaining = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            dist.monitored_barrier(group=self.nodes, timeout=remaining, wait_all_ranks=True)
        self._watch.start()
        log.info("worker group ready", extra={"tp_size": self.config.tp_size, "pp_size": self.config.pp_size,
                                               "init_method": self.init_method,
                                               "cpus": [list(c) for c in self.cpus]})

    def send(self, command: tuple) -> None:
        if self.lost is not None:
            raise GroupLost(f"the worker group is broken: {self.lost}")
        try:
            payload = pickle.dumps(command)  # once per step, not once per follower; recv() unpickles it
            for f in self.followers:
                f.send(payload)
            if self.nodes is not None and self.config.node_rank == 0:
                try:
                    send_to_nodes(self.nodes, command)
                except RuntimeError as exc:  # gloo: "Connection closed by peer" when a node is gone
                    raise RuntimeError(f"a node of the worker group is gone: {exc}") from None
        except RuntimeError as exc:
            first = self.lost is None and not self._closing
            self.lost = self.lost or str(exc)
            if first:  # the watchdog sees local followers only: a node lost here is reported here, once,
                # off the step thread so that this step's error still reaches the scheduler
                self._closing = True
                threading.Thread(target=self.on_lost, args=(self.lost,), name="worker-group-lost", daemon=True).start()
            raise GroupLost(f"the worker group is broken: {self.lost}") from None

    def send_each(self, commands: list[tuple]) -> None:
        """Command i to follower i (data-parallel attention: each rank its own plan)."""
        if self.lost is not None:
            raise GroupLost(f"the worker group is broken: {self.lost}")
        try:
            for f, command in zip(self.followers, commands, strict=True):
                f.send(pickle.dumps(command))
        except RuntimeError as exc:
            self.lost = self.lost or str(exc)
            raise GroupLost(f"the worker group is broken: {self.lost}") from None

    def results(self) -> list:
        """Every follower's reply to the send_each just made, rank order."""
        try:
            return [f.receive_result(self.config.dist_timeout_s) for f in self.followers]
        except RuntimeError as exc:
            self.lost = self.lost or str(exc)
            raise GroupLost(f"the worker group is broken: {self.lost}") from None

    def _watchdog(self) -> None:
        while not self._closing:
            for f in self.followers:
                code = f.proc.poll()
                if code is not None and not self._closing:
                    self._closing = True
                    self.lost = f"worker rank {f.rank} (pid {f.proc.pid}) exited with code {code}"
                    self.on_lost(self.lost)
                    return
            time.sleep(WATCH_S)

    def close(self, timeout_s: float = 10.0) -> None:
        from services.worker.parallel.communicator import leave_group
        if self.nodes is not None and self.config.node_rank == 0 and self.lost is None and not self._closing:
            try:
                send_to_nodes(self.nodes, ("stop",))
            except RuntimeError:  # a node is gone already
                pass
        self._closing = True
        for f in self.followers:  # every rank tears down at once: a rank's exit takes most of a second
            f.ask_to_stop()
        for f in self.followers:
            f.wait_stopped(timeout_s)
        self.followers = []
        leave_group()
        cpus, threads = self._restore
        os.sched_setaffinity(0, cpus)
        import torch
        torch.set_num_threads(threads)


class GroupRunner:
    """The leader's ModelRunner, whose state-changing calls run on every rank in the same order.
    Everything else (the pool's facts, the model config, hooks the worker sets) is the leader's."""

    def __init__(self, runner, group: WorkerGroup) -> None:
        object.__setattr__(self, "runner", runner)
        object.__setattr__(self, "group", group)

    def execute(self, plan, defer: bool = False):
        if self.dp_size > 1:  # one scheduler's plan: rank 0's requests, the other ranks idle
            return self.execute_round([plan] + [None] * (self.dp_size - 1))[0]
        self.group.send(("execute", plan))
        return self.runner.execute(plan, defer)

    def compute_logits(self, plan):
        """A plan's forward without sampling (the architecture tests' path)."""
        if self.dp_size > 1:
            return self.execute_round([plan] + [None] * (self.dp_size - 1), "compute_logits")[0]
        self.group.send(("compute_logits", plan))
        return self.runner.compute_logits(plan)

    def execute_round(self, plans: list, method: str = "execute") -> list:
        """Data-parallel attention: plans[r] on rank r (None: nothing for it this round), all ranks
        at once → each rank's StepResult (None where it had no plan; method "compute_logits": its
        (logits, sampled)). When any rank computes, every rank without tokens runs its idle pass,
        so the MoE layers' collectives meet."""
        from services.worker.group.follower import run_dp_step
        computes = [plan is not None and bool(plan.items) for plan in plans]
        idle = [any(computes) and not c for c in computes]
        self.group.send_each([("dp_execute", plan, i, method) for plan, i in zip(plans[1:], idle[1:], strict=True)])
        try:
            own = run_dp_step(self.runner, plans[0], idle[0], method)
        except Exception as exc:  # a collective with a rank that is gone: say which, once the watchdog knows
            time.sleep(2 * WATCH_S)
            raise GroupLost(f"the worker group is broken: {self.group.lost or exc}") from exc
        return [own, *self.group.results()]

    @property
    def dp_size(self) -> int:
        return self.group.config.dp_size if self.group.config.enable_dp_attention else 1

    def reset(self) -> None:
        self.group.send(("reset",))
        self.runner.reset()

    def reset_rank(self, rank: int) -> None:
        """Data-parallel attention: drop rank `rank`'s requests only (a new stream of its scheduler)."""
        if rank == 0:
            self.runner.reset()
        else:
            self.group.followers[rank - 1].send(pickle.dumps(("reset",)))

    def rebalance_experts(self) -> dict | None:
        """EPLB now, on every rank (between two steps)."""
        self.group.send(("rebalance_experts",))
        return self.runner.rebalance_experts()

    def close(self) -> None:
        try:
            self.group.close()
        finally:
            self.runner.close()

    def _no_weight_updates(self, *_args, **_kwargs):
        """Each rank holds its own slice of every weight: an update would have to reach every rank,
        sliced; until it does, it is refused before any weight changes."""
        from services.worker.weights.errors import WeightUpdateError
        raise WeightUpdateError(f"weight updates are not supported on a worker group (--tp-size "
                                f"{self.group.config.tp_size} --pp-size {self.group.config.pp_size}) yet; "
                                "restart the worker with the new weights")

    update_weights_from_disk = update_weights_from_tensor = _no_weight_updates
    init_weights_update_group = update_weights_from_distributed = _no_weight_updates

    @property
    def loras(self):
        """The leader's adapters, whose loads and unloads every rank repeats."""
        return None if self.runner.loras is None else GroupLoras(self.runner.loras, self.group)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.runner, name, value)


class GroupLoras:
    """A LoraManager whose load and unload run on every rank, the leader's first: an adapter the
    leader refuses (AdapterError) never reaches the followers, and what it accepts they accept.
    Called between steps (the admin holds the model lock), so each rank sees them in step order."""

    def __init__(self, loras, group: WorkerGroup) -> None:
        self._loras, self._group = loras, group

    def load(self, name: str, path: str):
        info = self._loras.load(name, path)
        self._group.send(("lora_load", name, path))
        return info

    def unload(self, name: str) -> None:
        self._loras.unload(name)
        self._group.send(("lora_unload", name))

    def __contains__(self, name: str) -> bool:
        return name in self._loras

    def __getattr__(self, name: str):
        return getattr(self._loras, name)


def load_rank_checkpoint(config: WorkerConfig, source: str, rank: int = 0):
    """The checkpoint global rank `rank` of config's group holds: only its part (rank_part.py),
    each tensor cut as it is read; the whole checkpoint for a group of one."""
    from services.worker.loader.checkpoint import load_checkpoint
    if config.world_size == 1:
        return load_checkpoint(source, config.quantization)
    from services.worker.parallel.moe_parallel import rank_expert_slots
    from services.worker.parallel.rank_part import RankPart
    return load_checkpoint(source, config.quantization, part=lambda full: RankPart(
        full, rank, config.tp_size, config.pp_size, rank_expert_slots(config, full, rank),
        config.enable_dp_attention))


def create_runner(config: WorkerConfig, checkpoint, hicache=None, on_lost: Callable[[str], None] | None = None):
    """The worker's runner: a plain ModelRunner for a group of one, else the leader of a group
    (the followers started, joined and loaded). Call on the thread that will run the steps."""
    from services.worker.model_runner import ModelRunner
    if config.world_size == 1:
        return ModelRunner(config, checkpoint)
    if config.node_rank != 0:
        raise ValueError(f"--node-rank {config.node_rank}: a node other than 0 serves no requests; run it as "
                         "`radixmesh serve worker --nnodes N --node-rank K ...` (services/worker/group/node.py)")
    why = group_refusal(config, hicache)
    if why is not None:
        raise ValueError(why)
    from services.worker.parallel.pipeline import PipelineStage
    from services.worker.parallel.tensor_parallel import TensorShard
    # Sizes the model cannot take: refused before any rank starts.
    from services.worker.parallel.moe_parallel import rank_expert_slots
    stage = PipelineStage(checkpoint.config, 0, config.pp_size)
    if config.enable_dp_attention:
        from services.worker.parallel.dp_attention import DpAttentionShard
        shard = DpAttentionShard(stage.config, 0, config.tp_size, rank_expert_slots(config, stage.config, 0))
    else:
        shard = TensorShard(stage.config, 0, config.tp_size, rank_expert_slots(config, stage.config, 0))
    why = shard.blocks_refusal() if checkpoint.quantized else None
    if why is not None:
        raise ValueError(why)
    group = WorkerGroup(config, checkpoint.source, checkpoint.config.hidden_size, on_lost)
    try:
        runner = ModelRunner(group.config, checkpoint, comm=group.joined.comm, pipe=group.joined.pipe)
        group.wait_ready(config.dist_timeout_s + 600)
    except BaseException:
        group.close()
        raise
    return GroupRunner(runner, group)
