"""Per-request limits that every front door enforces the same way.

The gateway (HTTP) states them in its JSON schemas (services/gateway/schemas.py reads the
constants here) and calls `check_request_limits` as the last word; the tokenizer's gRPC
Generate, the other door into a replica, calls it before tokenizing. Both answer with the
InvalidRequest's message (HTTP 400 / INVALID_ARGUMENT). What SamplingParams.validate checks
(value ranges) is not repeated here; this is about sizes that cost the mesh work.
"""
from __future__ import annotations

from services.common.sampling_params import InvalidRequest, SamplingParams

MAX_N = 16  # sequences of one prompt
MAX_STOP = 16  # stop strings
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_LOGPROBS = 20  # SamplingParams.validate enforces it
MAX_REPETITION_PENALTY = 10
MAX_RID_CHARS = 128


def check_request_limits(sampling: SamplingParams, n: int = 1, rid: str = "") -> None:
    """Raise InvalidRequest naming the first limit `sampling`, `n` or `rid` exceeds."""
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {n}")
    if len(sampling.stop) > MAX_STOP:
        raise InvalidRequest(f"stop must have at most {MAX_STOP} strings, got {len(sampling.stop)}")
    if any(not s for s in sampling.stop):
        raise InvalidRequest("stop strings must not be empty")
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(sampling.stop_token_ids)}")
    if sampling.repetition_penalty > MAX_REPETITION_PENALTY:
        raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {sampling.repetition_penalty}")
    if len(rid) > MAX_RID_CHARS:
        raise InvalidRequest(f"rid must have at most {MAX_RID_CHARS} characters, got {len(rid)}")
