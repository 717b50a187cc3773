"""Which replicas a pool admits: a replica's disaggregation mode (its tokenizer's Info) must be
its pool's role.

A co-located fleet (role "") admits replicas that report no mode; a disaggregated fleet has a
"prefill" pool and a "decode" pool, each admitting only replicas that report that mode, and a
prefill replica must also advertise its scheduler's bootstrap address (which the router hands
the decode side of every pair). A replica in the wrong pool would hang its requests: a decode
replica waits for KV that never comes; a prefill replica stops after the first token.
"""
from __future__ import annotations

from protos.radixmesh.v1 import tokenizer_pb2 as pb

COLOCATED, PREFILL, DECODE = "", "prefill", "decode"


def refusal(role: str, info: pb.InfoResponse | None, info_error: str = "") -> str | None:
    """Why a replica whose Info answered `info` (None: it failed with `info_error`) may not join
    the pool of `role`; None when it may. A co-located pool admits a replica whose Info failed
    (as before modes existed: health checks alone decide); a disaggregated pool must know."""
    if info is None:
        if role == COLOCATED:
            return None
        return f"its Info did not answer ({info_error}), so its disaggregation mode is unknown"
    mode = "" if info.disaggregation_mode == "null" else info.disaggregation_mode  # the services' flag value
    if mode != role:
        if role == COLOCATED:
            return (f"it is a disaggregated {mode} replica (its Info reports disaggregation_mode {mode!r}); "
                    "route it with --prefill/--decode")
        return f"its Info reports disaggregation_mode {mode!r}, not {role!r}"
    if role == PREFILL and not info.bootstrap_address:
        return ("its Info reports no bootstrap_address: a prefill replica's scheduler must advertise its "
                "PrefillBootstrap (--bootstrap-address)")
    return None
