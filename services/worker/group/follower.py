"""A follower rank of a worker group (leader.py): it runs what its leader sends, in order.

Started by the leader with two pipe descriptors: commands in (a RankSetup first, then
("execute", plan), ("compute_logits", plan), ("lora_load", name, path),
("lora_unload", name), ("reset",), ("rebalance_experts",), ("dp_execute", plan or None, idle), ("stop",)), and
replies out: ("ready", "") once its shard is built, or ("error", why); under data-parallel attention
("result", StepResult or None) after each dp_execute, its own requests' result. It joins the group's process group before loading, so the leader's join
does not wait for a load. Any failure ends the process: the leader's watchdog names the rank,
and the leader's next collective fails instead of hanging.

    python -m services.worker.group.follower --cmd-fd N --reply-fd M
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

log = logging.getLogger("services.worker.group.follower")

_PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.worker.group.follower", description=__doc__)
    p.add_argument("--cmd-fd", type=int, required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args(argv)
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # the leader's death ends it
    commands = Connection(args.cmd_fd, writable=False)
    replies = Connection(args.reply_fd, readable=False)
    setup = commands.recv()
    from services.common.logging import setup_logging
    setup_logging(f"worker-rank{setup.rank}")
    try:
        runner = _build(setup)
    except Exception as exc:
        log.exception("rank %d failed to start", setup.rank)
        replies.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    replies.send(("ready", ""))
    try:
        return _follow(commands, replies, runner)
    finally:
        runner.close()
        from services.worker.parallel.communicator import leave_group
        leave_group()


def _build(setup):
    """On the main thread, which runs every step (load_checkpoint reads on a thread of its own)."""
    from services.worker.group.leader import load_rank_checkpoint
    from services.worker.group.world import join_world
    from services.worker.model_runner import ModelRunner
    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)
    joined = join_world(setup.rank, setup.config, setup.init_method, setup.source, setup.group_id, setup.hidden)
    checkpoint = load_rank_checkpoint(setup.config, setup.source, setup.rank)  # its part only
    return ModelRunner(setup.config, checkpoint, comm=joined.comm, pipe=joined.pipe)


def _follow(commands: Connection, replies: Connection, runner) -> int:
    """Run the leader's commands until it says stop or goes away."""
    while True:
        try:
            command = commands.recv()
        except EOFError:
            log.info("the leader closed the group's pipe: exiting")
            return 0
        if command[0] == "dp_execute":
            # plain pickle: a Connection's own pickler would share tensors by file descriptor
            replies.send_bytes(pickle.dumps(("result", run_dp_step(runner, *command[1:]))))
        elif not run_command(runner, command):
            return 0


def run_dp_step(runner, plan, idle: bool, method: str = "execute"):
    """Data-parallel attention: this rank's own plan (None: none this round) through the runner's
    `method` (execute, or compute_logits: the architecture tests'), then, when `idle`, its part
    of the group's pass (another rank computes and this one has no tokens) → what the method
    returned, or None."""
    if plan is None:
        result = None
    else:  # a plan with no items only admits or releases requests: execute's part
        result = getattr(runner, method if plan.items else "execute")(plan)
    if idle:
        runner.model.dp_tokens.idle()
    return result


def run_command(runner, command: tuple) -> bool:
    """One of the leader's commands on this rank's runner; False for stop."""
    kind = command[0]
    if kind == "execute":
        runner.execute(command[1])  # the leader answers; every rank sampled the same tokens
    elif kind == "compute_logits":
        runner.compute_logits(command[1])
    elif kind == "lora_load":
        runner.loras.load(command[1], command[2])
    elif kind == "lora_unload":
        runner.loras.unload(command[1])
    elif kind == "reset":
        runner.reset()
    elif kind == "rebalance_experts":
        runner.rebalance_experts()
    elif kind == "stop":
        return False
    else:
        raise ValueError(f"unknown worker group command {kind!r}")
    return True


if __name__ == "__main__":
    sys.exit(main())
