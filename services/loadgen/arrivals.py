"""When each conversation starts, in seconds from the start of a run."""
from __future__ import annotations

import math
import random


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """n start times: a Poisson process of `rate` per second (exponential gaps, seeded; the first
    arrives at 0), or all at 0 when rate is inf."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times
