"""`radixmesh up --prefill N --decode M`: the flags that make a replica one side of a
disaggregated fleet (docs/router.md, "Routing a disaggregated fleet").

Each of the N + M replicas is whole (worker, scheduler, detokenizer, tokenizer); only its worker
and scheduler learn its role, `--disaggregation-mode prefill|decode`, and its worker how the KV
crosses to the decode side, `--disaggregation-transfer-backend` (up's `--transfer-backend`). A
prefill scheduler serves the decode schedulers' PrefillBootstrap on its own gRPC port and
advertises it with `--bootstrap-address`: the launcher picks that port before the scheduler
starts (a free loopback port, bound and released), because the address must be known to the
flags that start it. The router gets the tokenizers as `--prefill ...` and `--decode ...`.
"""
from __future__ import annotations

import socket

PREFILL, DECODE = "prefill", "decode"
TRANSFER_BACKENDS = ("grpc", "shm", "mooncake")
# Flags up sets itself with --prefill/--decode (a user's copy would contradict the plan). Without
# them they pass through like any service flag: `radixmesh up --disaggregation-mode prefill` runs
# one replica of that mode, for a router (or a test) elsewhere to pair.
SET_BY_LAUNCHER = ("--disaggregation-mode", "--disaggregation-transfer-backend", "--bootstrap-address")


def check_counts(prefill: int, decode: int, replicas: int) -> None:
    """ValueError unless --prefill/--decode make a fleet (both > 0) or none (both 0, then --replicas rules)."""
    if prefill < 0 or decode < 0:
        raise ValueError(f"--prefill and --decode must be >= 0, got {prefill} and {decode}")
    if not (prefill or decode):
        return
    if not (prefill and decode):
        raise ValueError("--prefill and --decode go together: a disaggregated fleet needs both kinds of replica "
                         f"(got --prefill {prefill} --decode {decode})")
    if replicas != 1:
        raise ValueError("--prefill/--decode replace --replicas (a disaggregated fleet's replicas are its prefill "
                         "and decode replicas)")


def refuse_owned(extra: list[str]) -> None:
    """ValueError when the flags up forwards hold one it sets for a disaggregated fleet."""
    for token in extra:
        flag = token.split("=", 1)[0]
        if flag in SET_BY_LAUNCHER:
            hint = " (use --transfer-backend)" if flag == "--disaggregation-transfer-backend" else ""
            raise ValueError(f"{flag} is set by radixmesh up --prefill/--decode{hint}")


def pd_replicas(prefill: int, decode: int) -> list[tuple[str, str]]:
    """(child-name suffix, role) per replica: -prefill-0 ..., then -decode-0 ..."""
    return ([(f"-{PREFILL}-{i}", PREFILL) for i in range(prefill)]
            + [(f"-{DECODE}-{i}", DECODE) for i in range(decode)])


def disaggregation_flags(service: str, role: str, transfer_backend: str, own_address: str) -> list[str]:
    """The flags of `service` in a replica of `role` ("" = co-located: none). `own_address` is
    the child's own --listen address (a prefill scheduler advertises it)."""
    if not role or service not in ("worker", "scheduler"):
        return []
    flags = ["--disaggregation-mode", role]
    if service == "worker":
        flags += ["--disaggregation-transfer-backend", transfer_backend]
    elif role == PREFILL:
        flags += ["--bootstrap-address", own_address]
    return flags


def needs_known_port(service: str, role: str) -> bool:
    """Whether the child must listen on a port known before it starts (it advertises it)."""
    return service == "scheduler" and role == PREFILL


def free_loopback_port() -> int:
    """A loopback port free now (the kernel's pick for port 0, released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
