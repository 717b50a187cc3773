"""Router and fake replicas (fake_replica.py) as real processes, for tests.

    with Proc.fake_replica("a") as a, Proc.router([a.address]) as router:
        stub = tokenizer_pb2_grpc.TokenizerStub(grpc.insecure_channel(router.address))

Each process logs JSON lines on stderr; `listening` gives its port. `kill()` sends SIGKILL,
`stop()` SIGTERM and waits. `restart()` starts the same command on the same port.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, argv: list[str], name: str, timeout: float = 60.0) -> None:
        self.argv, self.name = argv, name
        self.lines: list[str] = []
        self.port: int | None = None
        self._start(timeout)

    def _start(self, timeout: float) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen([sys.executable, *self.argv], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._listening = threading.Event()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        if not self._listening.wait(timeout):
            self.kill()
            raise RuntimeError(f"{self.name} did not listen within {timeout}s:\n" + "".join(self.lines[-20:]))

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line)
            if not self._listening.is_set() and '"listening"' in line:
                try:
                    self.port = int(json.loads(line)["port"])
                    self._listening.set()
                except (ValueError, KeyError):
                    pass

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def events(self, msg: str) -> list[dict]:
        out = []
        for line in list(self.lines):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("msg") == msg:
                out.append(event)
        return out

    def wait_event(self, msg: str, timeout: float, count: int = 1) -> list[dict]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.events(msg)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no {count}x {msg!r} within {timeout}s:\n" + "".join(self.lines[-20:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def restart(self, timeout: float = 60.0) -> None:
        """The same command, on the port it had (so its address stays valid)."""
        argv = list(self.argv)
        i = argv.index("--listen")
        argv[i + 1] = self.address
        self.argv, self.lines = argv, []
        self._start(timeout)

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            try:
                self.stop(10)
            except subprocess.TimeoutExpired:
                pass

    @classmethod
    def fake_replica(cls, name: str, *flags: str) -> "Proc":
        return cls(["-m", "tests.doubles.fake_replica", "--listen", "127.0.0.1:0", "--name", name,
                    "--drain-timeout-s", "5", *flags], f"replica {name}")

    @classmethod
    def router(cls, replicas: list[str], *flags: str) -> "Proc":
        return cls(["-m", "services.cli", "serve", "router", "--listen", "127.0.0.1:0", "--drain-timeout-s", "5",
                    "--replica-addrs", *replicas, *flags], "router")
