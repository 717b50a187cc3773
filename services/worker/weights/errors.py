"""The one error a failed weight update raises.

Every failure (a path that does not exist, a file of another architecture, a missing, unknown
or misshapen tensor, a dtype that is not a float, a trainer that died mid-broadcast) is raised
before anything touched the live parameters, so the old weights keep serving, bit-identical,
and the version stays. It is a ValueError (the admin RPCs map it to INVALID_ARGUMENT).
"""
from __future__ import annotations


class WeightUpdateError(ValueError):
    """A weight update was refused; the message says what was wrong. The old weights serve on."""
