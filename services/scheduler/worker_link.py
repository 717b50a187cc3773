"""What the step driver needs of a worker: take a plan, answer the oldest one.

A link runs plans in the order they were sent and answers them in that order,
so a plan sent while another runs (overlapped scheduling) is queued behind it.
Three links: the gRPC Step stream (services/scheduler/grpc_link.py), a
ModelRunner in this process (services/engine/runner_link.py), and the tests'
fake worker (tests/doubles/fake_link.py).
"""
from __future__ import annotations

import asyncio
from typing import Protocol

from services.common.grammar.constraint import Constraint
from services.step.contract import StepPlan, StepResult


class WorkerLost(Exception):
    """The worker will not answer the plans in flight: its stream broke, a step failed,
    or it went away. The message says why (it ends every open request)."""


class WorkerLink(Protocol):
    async def send(self, plan: StepPlan) -> None:
        """Queue `plan` at the worker; returns without waiting for its result."""

    async def receive(self, plan: StepPlan, started: float) -> StepResult:
        """The result of `plan`, the oldest plan sent and not answered yet, which the
        worker started at `started` (time.monotonic()). Raises WorkerLost."""

    async def idle(self, wake: asyncio.Event) -> None:
        """Nothing is in flight: return once `wake` is set. Raises WorkerLost when the
        worker goes away meanwhile."""

    async def prepare_grammar(self, constraint: Constraint) -> None:
        """Have the worker compile `constraint`'s grammar, off its step thread (raises what
        the compile raised: InvalidRequest for one that does not compile)."""

    def close(self) -> None:
        """Give up on the plans in flight (after a failure, or at shutdown)."""
