"""`radixmesh up` in a subprocess for the mesh tests: start, wait until ready, stop, check for leftovers."""
from __future__ import annotations

import contextlib

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from protos.radixmesh.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

REPO = Path(__file__).resolve().parents[2]
# A small KV pool keeps start-up and memory low; room for 16 requests of ~40 tokens.
# float32: tests compare token ids and logprobs with an in-process Engine, and only float32
# makes them independent of how requests were batched (bfloat16 is the default on AMX CPUs).
SMALL_MESH = ["--dtype", "float32", "--kv-cache-bytes", str(32 << 20), "--max-requests", "16", "--max-running-requests", "16",
              "--check-invariants"]


def otlp_env(endpoint: str) -> dict[str, str]:
    """Every service exports its spans to an OTLP/gRPC receiver at `endpoint`, promptly."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}


def gateway_url_and_metrics(mesh: "Mesh", services) -> tuple[str, dict[str, str]]:
    """A mesh started with --metrics-port 0 and the gateway: its HTTP URL and each named
    service's /metrics URL (the ports each logged as `listening`)."""
    listening = {e["service"]: e for e in mesh.log if e.get("msg") == "listening"}
    url = f"http://127.0.0.1:{listening['gateway']['http_port']}"
    metrics = {name: f"http://127.0.0.1:{listening[name]['metrics_port']}/metrics"
               for name in services if name != "gateway"}
    return url, metrics


class Mesh:
    """The launcher with its stderr (JSON lines of every service) collected by a reader thread."""

    def __init__(self, *flags: str, drain_timeout_s: float = 10.0, gateway: bool = False,
                 env: dict[str, str] | None = None, cpus: str | None = None) -> None:
        """env: variables added to this process's environment (e.g. OTEL_*) for every service;
        cpus: the CPUs every process of the mesh runs on (taskset's list, e.g. "0" or "0,1")."""
        gateway_flags = ["--http-port", "0"] if gateway else ["--no-gateway"]
        pinned = ["taskset", "-c", cpus] if cpus else []
        self.proc = subprocess.Popen(
            [*pinned, sys.executable, "-m", "services.cli", "up", *gateway_flags, "--drain-timeout-s", str(drain_timeout_s),
             *flags], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env} if env else None)
        self.events: queue.Queue[dict] = queue.Queue()
        self.log: list[dict] = []
        self.stdout: list[str] = []
        self.raw_stderr: list[str] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=lambda: self.stdout.extend(self.proc.stdout), daemon=True).start()
        self.addresses: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self._channels: list[grpc.Channel] = []
        self._url: str | None = None  # the gateway's, once asked (url)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.raw_stderr.append(line)
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass

    def wait_log(self, match, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    break
                continue
            self.log.append(event)
            if match(event):
                return event
        tail = "".join(self.raw_stderr[-30:])
        raise AssertionError(f"no matching log line (launcher exit {self.proc.poll()}); stderr tail:\n{tail}")

    def wait_ready(self, timeout: float = 300) -> "Mesh":  # below pytest's own 600 s
        ready = self.wait_log(lambda e: e.get("service") == "launcher" and e.get("msg") == "ready", timeout)
        self.addresses, self.pids = ready["addresses"], {k: int(v) for k, v in ready["pids"].items()}
        return self

    @property
    def url(self) -> str:
        """The gateway's base URL (a mesh started with gateway=True, once it logged listening), unless
        a test set another."""
        if self._url is None:
            listening = next(e for e in self.log if e.get("service") == "gateway" and e.get("msg") == "listening")
            self._url = f"http://127.0.0.1:{listening['http_port']}"
        return self._url

    @url.setter
    def url(self, value: str) -> None:
        self._url = value

    def channel(self, service: str) -> grpc.Channel:
        ch = grpc.insecure_channel(self.addresses[service])
        self._channels.append(ch)
        return ch

    def tokenizer(self) -> tokenizer_pb2_grpc.TokenizerStub:
        return tokenizer_pb2_grpc.TokenizerStub(self.channel("tokenizer"))

    def scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self.channel("scheduler"))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        for ch in self._channels:
            ch.close()
        return code

    def kill_all(self) -> None:
        """Last-resort cleanup after a failed test: nothing may outlive it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for ch in self._channels:
            ch.close()

    def leftover_children(self, timeout: float = 10) -> list[int]:
        """Service pids still alive (zombies excluded) after `timeout` seconds."""
        end = time.monotonic() + timeout
        while True:
            alive = [pid for pid in self.pids.values() if _alive(pid)]
            if not alive or time.monotonic() > end:
                return alive
            time.sleep(0.1)


@contextlib.contextmanager
def gateway_mesh(*flags: str, timeout: float = 240):
    """A mesh with its gateway, ready; stopped cleanly (exit 0) after, killed if anything failed."""
    m = Mesh(*flags, gateway=True)
    try:
        m.wait_ready(timeout=timeout)
        yield m
        assert m.stop() == 0
    finally:
        m.kill_all()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def greedy(max_new_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"temperature": 0.0, "max_new_tokens": max_new_tokens, **kw})


def chat(content: str) -> tokenizer_pb2.Conversation:
    return tokenizer_pb2.Conversation(messages=[tokenizer_pb2.ChatMessage(role="user", content=content)])


def collect(events) -> dict[int, dict]:
    """Per sequence index: text, token_ids, logprobs, last usage, finish; plus '_error'."""
    seqs: dict[int, dict] = {}
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "error":
            seqs.setdefault(-1, {})["error"] = (ev.error.code, ev.error.message)
            continue
        msg = getattr(ev, kind)
        s = seqs.setdefault(msg.index, {"text": "", "token_ids": [], "logprobs": [], "finish": None,
                                        "finishes": 0, "usage": None})
        if kind == "chunk":
            assert s["finish"] is None, f"chunk after the finish of index {msg.index}"
            s["text"] += msg.text
            s["token_ids"] += list(msg.token_ids)
            s["logprobs"] += list(msg.logprobs)
            s["usage"] = (msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)
        else:
            s["finish"] = msg
            s["finishes"] += 1
    return seqs


def finish_reason(finish: common_pb2.Finish) -> str:
    return common_pb2.FinishReason.Name(finish.finish_reason).removeprefix("FINISH_REASON_").lower()


def stats(mesh: Mesh) -> scheduler_pb2.SchedulerStats:
    return mesh.scheduler().GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


class Service:
    """One `radixmesh serve <name>` process (no launcher), its port read from its `listening` line."""

    def __init__(self, name: str, *flags: str, listen: str = "127.0.0.1:0") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", name, "--listen", listen, *flags],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._port: queue.Queue[int] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.port = self._port.get(timeout=120)
        except queue.Empty:
            self.stop()
            raise AssertionError(f"{name} never listened:\n{''.join(self.lines[-20:])}") from None
        self.address = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if '"listening"' in line:
                self._port.put(int(json.loads(line)["port"]))

    def wait_serving(self, timeout: float = 300) -> "Service":
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                assert self.proc.poll() is None, f"{self.name} exited:\n{''.join(self.lines[-20:])}"
                assert time.monotonic() < end, f"{self.name} not SERVING after {timeout}s"
                time.sleep(0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
