"""The expert distribution recording on the wire: ExpertDump (services/worker/model/expert_load.py)
to radixmesh.v1.ExpertDistribution and back to the dump's JSON fields, in this one place.

The JSON side is a plain dict with exactly ExpertDump's fields (layers, logical_count, forwards,
seconds, recording), so that what the gateway answers, saved to a file, is what
`--init-expert-location` loads, and `ExpertDump(**to_dict(msg))` rebuilds the dump. No torch here:
the gateway imports this module.
"""
from __future__ import annotations

from protos.radixmesh.v1 import admin_pb2 as apb

ACTIONS = {"start": apb.EXPERT_DISTRIBUTION_START, "stop": apb.EXPERT_DISTRIBUTION_STOP,
           "dump": apb.EXPERT_DISTRIBUTION_DUMP}


def to_proto(dump) -> apb.ExpertDistribution:
    """An ExpertDump (or anything with its fields) as the message ModelState carries."""
    return apb.ExpertDistribution(layers=list(dump.layers),
                                  logical_count=[apb.ExpertCounts(counts=row) for row in dump.logical_count],
                                  forwards=dump.forwards, seconds=dump.seconds, recording=dump.recording)


def to_dict(msg: apb.ExpertDistribution) -> dict:
    """ExpertDump's fields, JSON-ready (ints stay ints, unlike MessageToDict's uint64 strings)."""
    return {"layers": list(msg.layers), "logical_count": [list(row.counts) for row in msg.logical_count],
            "forwards": msg.forwards, "seconds": msg.seconds, "recording": msg.recording}


def merged(dumps: list[dict]) -> dict:
    """Several replicas' recordings of one model as one: counts and forwards added, the longest
    time, recording while any records. Raises ValueError when their layers or expert counts differ."""
    first = dumps[0]
    shape = (first["layers"], [len(row) for row in first["logical_count"]])
    for d in dumps[1:]:
        if (d["layers"], [len(row) for row in d["logical_count"]]) != shape:
            raise ValueError("the replicas' recordings differ in their MoE layers or experts: "
                             "they serve different models")
    counts = [[sum(col) for col in zip(*rows)] for rows in zip(*(d["logical_count"] for d in dumps))]
    return {"layers": list(first["layers"]), "logical_count": counts,
            "forwards": sum(d["forwards"] for d in dumps), "seconds": max(d["seconds"] for d in dumps),
            "recording": any(d["recording"] for d in dumps)}
