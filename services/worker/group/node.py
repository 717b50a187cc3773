"""A worker group's node other than node 0: `radixmesh serve worker --nnodes N --node-rank K`.

It serves no gRPC: node 0's worker serves the scheduler for the whole group. Node K's process is
its first rank (global rank K · ranks_per_node): it starts the node's other ranks as followers
(follower.py), joins the group (world.py: the same settings as every other rank, or the group
fails naming the flags), builds its shard, and then runs what the leader sends it over the
nodes' control group, handing each command to its own followers first. It exits when the leader
says stop, or with an error when the leader or a rank is gone (a collective or the control
group's broadcast fails).
"""
from __future__ import annotations

import logging

from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)


def _exit(why: str) -> None:
    """A follower of this node died: the group cannot step; the leader hears it at its next collective."""
    import os
    log.error("worker group broken: %s; exiting", why)
    os._exit(1)


def run_node(config: WorkerConfig) -> int:
    """Node config.node_rank (> 0) of a worker group, until the leader stops it → exit status."""
    from services.common.model_path import resolve_model_path
    from services.worker.group.follower import run_command
    from services.worker.group.leader import WorkerGroup, load_rank_checkpoint, receive_from_leader
    from services.worker.model_runner import ModelRunner
    if config.node_rank == 0:
        raise ValueError("node 0's worker is the group's leader: run it without --node-rank (or 0) as usual")
    source = resolve_model_path(config.model)
    group = WorkerGroup(config, source, hidden=0, on_lost=_exit)  # across nodes the all-reduce is gloo's: no probe
    runner = None
    try:
        checkpoint = load_rank_checkpoint(config, source, config.node_rank * config.ranks_per_node)  # its part only
        runner = ModelRunner(group.config, checkpoint, comm=group.joined.comm, pipe=group.joined.pipe)
        group.wait_ready(config.dist_timeout_s + 600)
        log.info("node ready", extra={"node_rank": config.node_rank, "ranks": config.ranks_per_node})
        while True:
            command = receive_from_leader(group.nodes)
            group.send(command)  # this node's followers, in the leader's order
            if not run_command(runner, command):
                log.info("the leader stopped the group")
                return 0
    finally:
        group.close()
        if runner is not None:
            runner.close()
