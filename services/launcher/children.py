"""Child service processes of `radixmesh up`: spawn, watch stderr, stop.

Each child runs `python -m services.cli serve <name> ...` in its own session
(process group), so a Ctrl-C in the terminal reaches only the launcher, which
stops the children in order. PR_SET_PDEATHSIG makes the kernel send SIGTERM
to a child whose launcher died without stopping it (even by SIGKILL): it
drains and exits like on any SIGTERM, so nothing is left orphaned.

A child's stderr (JSON log lines) is read line by line: relayed to the
launcher's stderr or a log file, the last lines kept for the message when it
dies, and its `listening` line parsed for the port it bound.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import os
import signal
import sys
from typing import IO

import services

_PR_SET_PDEATHSIG = 1
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(services.__file__)))


# Resolved in the parent: between fork and exec the child must not dlopen (another
# thread of the launcher may have held the loader's lock at fork time).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent(parent_pid: int, cpus: set[int] | None = None):
    def preexec() -> None:  # runs in the child between fork and exec
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(1)
        if cpus:  # before any of its threads exist: they all inherit it
            os.sched_setaffinity(0, cpus)
    return preexec


class Child:
    def __init__(self, name: str, argv: list[str], log_to: IO[str], tail_lines: int = 40,
                 service: str | None = None, cpus: set[int] | None = None) -> None:
        self.name, self.argv, self.cpus = name, argv, cpus  # cpus: where it may run (None: anywhere)
        self.service = service or name  # what `radixmesh serve` runs; name is unique per child (worker-1)
        self.proc: asyncio.subprocess.Process | None = None
        self.port: int | None = None
        self.listen_event: dict = {}  # the child's `listening` log line
        self.listening = asyncio.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log_to = log_to
        self._reader: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PROJECT_ROOT, env.get("PYTHONPATH")]))
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", "serve", self.service, *self.argv,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid(), self.cpus), env=env, limit=1 << 20)
        self._reader = asyncio.create_task(self._read(), name=f"{self.name}-stderr")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while True:
            try:
                line = await self.proc.stderr.readline()
            except ValueError:  # a line over the limit: it was dropped, read on
                continue
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(text)
            if self.port is None and '"listening"' in text:
                try:
                    event = json.loads(text)
                    if event.get("msg") == "listening":
                        self.port, self.listen_event = int(event["port"]), event
                        self.listening.set()
                except (ValueError, KeyError, TypeError):
                    pass
            self._log_to.write(text + "\n")
            self._log_to.flush()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.running:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (anything it spawned too)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        if self._reader is not None:  # collect its last words before anyone reports them
            await asyncio.wait({self._reader}, timeout=2)
        return code

    def describe_exit(self) -> str:
        code = self.proc.returncode if self.proc else None
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name} (exit code {code})"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def last_lines(self, n: int = 10) -> str:
        return "\n".join(list(self.tail)[-n:])
